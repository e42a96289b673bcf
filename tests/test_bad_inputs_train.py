"""Bad inputs to training, training data, drafter loading and the Hub push script (issue 11).

One table: each row is an input, the error type it must raise and a fragment of the message, which names
the problem and the fix. Training rows use a target that does not exist, so a row passes only if its
check runs before the target would load (anything expensive fails with another message).
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_model
from train_fixtures import char_tokenizer, conversations, save_tiny_target, write_messages

import heads
from heads import publish
from infer.loading import resolve_target
from train.config import TrainConfig, load_config
from train.data import build_samples, load_rows
from train.train_heads import parse_args, train

MISSING_TARGET = "/nonexistent/selfspec-target"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tiny target, a dataset, a run halted after its checkpoint at step 2, and a saved drafter."""
    root = tmp_path_factory.mktemp("bad_inputs")
    target = save_tiny_target(root / "target")
    data = write_messages(root / "data.jsonl", conversations(24))
    run_config = {"target": target, "data": data, "output_dir": str(root / "run"), "drafter": "eagle",
                  "batch_size": 8, "lr": 3e-3, "max_steps": 4, "save_every": 2, "halt_after_steps": 2,
                  "eval_fraction": 0.2, "progress_bar": False, "log_every": 0}
    assert train(load_config(None, run_config))["halted"]
    drafter = root / "run" / "drafter_saved"
    heads.build("medusa", tiny_model("llama")).save_pretrained(drafter)
    return {"root": root, "target": target, "data": data, "run": run_config, "drafter": drafter}


class Ctx:
    """What a row's call may use: a fresh folder, the shared artefacts and monkeypatch."""

    def __init__(self, tmp: Path, shared: dict, monkeypatch):
        self.tmp, self.shared, self.monkeypatch = tmp, shared, monkeypatch

    def config(self, **values):
        return load_config(None, {"data": "d.jsonl", **values})

    def train(self, **values):
        """train() on the shared data with a target that does not exist."""
        base = {"target": MISSING_TARGET, "data": self.shared["data"], "output_dir": str(self.tmp / "out"),
                "progress_bar": False}
        return train(load_config(None, {**base, **values}))

    def resume(self, **changes):
        """Resume the shared halted run with `changes` to its settings."""
        return train(load_config(None, {**self.shared["run"], "halt_after_steps": 0, "resume": True, **changes}))

    def write(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)

    def jsonl(self, *rows, name: str = "d.jsonl") -> str:
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows))

    def samples(self, path: str):
        return build_samples(load_rows(path), char_tokenizer(), 512)

    def used(self, marker: str) -> str:
        """An output_dir holding one file or folder of an earlier run."""
        out = self.tmp / "used"
        out.mkdir()
        if "." in marker:
            (out / marker).write_text("{}\n")
        else:
            (out / marker).mkdir()
        return str(out)

    def torn_copy(self) -> str:
        """A copy of the shared run whose every checkpoint lost its manifest (killed during its save)."""
        out = self.tmp / "torn"
        shutil.copytree(self.shared["run"]["output_dir"], out)
        for manifest in out.glob("checkpoints/*/checkpoint.json"):
            manifest.unlink()
        return str(out)

    def drafter_copy(self) -> Path:
        out = self.tmp / "drafter"
        shutil.copytree(self.shared["drafter"], out)
        return out

    def push(self, *argv) -> int:
        return publish.main([str(a) for a in argv])

    def offline(self) -> None:
        import huggingface_hub.constants

        self.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        self.monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _run_folder_without_drafter_config(c: Ctx) -> Path:
    (c.tmp / "run" / "drafter").mkdir(parents=True)
    (c.tmp / "run" / "drafter" / "config.json").write_text("{}")
    return c.tmp / "run"


def _hub_id_shaped_missing_path(c: Ctx):
    c.offline()
    return heads.load("runs-that-do-not-exist/drafter")


def _in_a_folder_with_models(c: Ctx) -> None:
    """Work in c.tmp, which holds a folder models/ (but no models/my-target), offline."""
    (c.tmp / "models").mkdir()
    c.monkeypatch.chdir(c.tmp)
    c.offline()


def _missing_target(c: Ctx, name: str, **values):
    """train() on the shared data with `name` as its target, from c.tmp (which holds models/)."""
    _in_a_folder_with_models(c)
    return c.train(target=name, **values)


def _drafter_whose_target_is_missing(c: Ctx):
    from infer import SelfSpecModel

    drafter = heads.load(c.shared["drafter"])
    drafter.config.base_model_name_or_path = str(c.tmp / "models" / "my-target")
    drafter.save_pretrained(c.tmp / "drafter")
    return SelfSpecModel.from_pretrained(str(c.tmp / "drafter"))


def _regenerate(c: Ctx, *argv):
    """train.regenerate's command, which must refuse before the target loads (loading it fails the row)."""
    import train.target
    from train.regenerate import main

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the input was refused")

    c.monkeypatch.setattr(train.target, "load_target", loaded)
    return main(["--target", c.shared["target"], "--data", c.shared["data"], "--out", str(c.tmp / "o.jsonl"),
                 *map(str, argv)])


def _regenerate_onto(c: Ctx, answers: str, settings: str | None = None, *argv):
    """train.regenerate resuming onto an output holding `answers` (and `settings` beside it)."""
    c.write("o.jsonl", answers)
    if settings is not None:
        c.write("o.jsonl.settings.json", settings)
    return _regenerate(c, *argv)


def _target_without_tokenizer(c: Ctx) -> str:
    """A copy of the shared target folder with its tokenizer files removed (a model saved without one)."""
    folder = c.tmp / "target"
    shutil.copytree(c.shared["target"], folder)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            path.unlink()
    return str(folder)


def _without_gpus(c: Ctx) -> None:
    import torch

    c.monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    c.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _write_bytes(c: Ctx, name: str, data: bytes) -> str:
    (c.tmp / name).write_bytes(data)
    return str(c.tmp / name)


def _cut_parquet(c: Ctx) -> str:
    import datasets

    path = c.tmp / "d.parquet"
    datasets.Dataset.from_list([{"messages": [USER, ASSISTANT]}] * 50).to_parquet(str(path))
    return _write_bytes(c, "d.parquet", path.read_bytes()[: path.stat().st_size // 2])


def _synthesize(c: Ctx, *argv):
    from train.synthesize_prompts import main

    return main(["--target", c.shared["target"], "--out", str(c.tmp / "p.jsonl"), "--count", "2", *map(str, argv)])


def _long_conversation(c: Ctx) -> str:
    return c.jsonl({"messages": [USER, {"role": "assistant", "content": "yo " * 100}]},
                   {"messages": [USER, ASSISTANT]})


def _hub(c: Ctx, token: str | None = "hf_test", whoami=None, offline: bool = False):
    """The Hub as a row needs it, without the network: a token (or none) and whoami's answer or error (or
    HF_HUB_OFFLINE and huggingface_hub's own whoami); any upload raises, so a check that comes too late fails
    the row."""
    import huggingface_hub
    from huggingface_hub import HfApi

    def answer(self, *args, **kwargs):
        if isinstance(whoami, Exception):
            raise whoami
        return whoami or {"name": "me", "orgs": [{"name": "team"}]}

    def no_upload(self, *args, **kwargs):
        raise AssertionError("uploaded before the Hub was checked")

    c.monkeypatch.setattr(huggingface_hub, "get_token", lambda: token)
    if offline:
        c.offline()
    else:
        c.monkeypatch.setattr(HfApi, "whoami", answer)
    c.monkeypatch.setattr(HfApi, "create_repo", no_upload)
    c.monkeypatch.setattr(HfApi, "upload_folder", no_upload)


def _unreachable():
    from huggingface_hub.errors import HTTPError

    return HTTPError("[Errno -2] Name or service not known")


def _yaml(c: Ctx, content: str | bytes) -> Path:
    path = c.tmp / "run.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}

# id: (call, error type, message fragment)
CASES = {
    # ---- settings: refused by load_config, before anything runs -----------------------------------------
    "lr zero": (lambda c: c.config(lr=0), ValueError, "'lr' must be > 0, got 0.0"),
    "lr negative": (lambda c: c.config(lr=-1e-3), ValueError, "'lr' must be > 0"),
    "lr nan": (lambda c: c.config(lr=".nan"), ValueError, "'lr' must be a finite number, got nan"),
    "warmup negative": (lambda c: c.config(warmup_steps=-5), ValueError, "'warmup_steps' must be >= 0"),
    "feature noise negative": (lambda c: c.config(feature_noise=-1), ValueError, "'feature_noise' must be >= 0"),
    "max_steps negative": (lambda c: c.config(max_steps=-5), ValueError,
                           "'max_steps' must be >= 0 (0 = derived from epochs), got -5"),
    "keep_checkpoints zero": (lambda c: c.config(keep_checkpoints=0), ValueError,
                              "'keep_checkpoints' must be >= 1, got 0"),
    "save_every negative": (lambda c: c.config(save_every=-1), ValueError, "'save_every' must be >= 0"),
    "eval_every negative": (lambda c: c.config(eval_every=-2), ValueError, "'eval_every' must be >= 0"),
    "log_every negative": (lambda c: c.config(log_every=-1), ValueError, "'log_every' must be >= 0"),
    "weight_decay negative": (lambda c: c.config(weight_decay=-0.1), ValueError, "'weight_decay' must be >= 0"),
    "max_grad_norm negative": (lambda c: c.config(max_grad_norm=-1), ValueError, "'max_grad_norm' must be >= 0"),
    "max_samples negative": (lambda c: c.config(max_samples=-1), ValueError, "'max_samples' must be >= 0"),
    "halt_after_steps negative": (lambda c: c.config(halt_after_steps=-1), ValueError,
                                  "'halt_after_steps' must be >= 0"),
    "max_train_minutes negative": (lambda c: c.config(max_train_minutes=-1.0), ValueError,
                                  "'max_train_minutes' must be >= 0"),
    "head_decay zero": (lambda c: c.config(head_decay=0), ValueError, "'head_decay' must be > 0"),
    "ttt_decay negative": (lambda c: c.config(ttt_decay=-0.5), ValueError, "'ttt_decay' must be > 0"),
    "token loss weight negative": (lambda c: c.config(token_loss_weight=-1), ValueError,
                                   "'token_loss_weight' must be >= 0"),
    "lora_dropout one": (lambda c: c.config(lora_dropout=1.0), ValueError, "'lora_dropout' must be in [0, 1)"),
    "lora_alpha zero": (lambda c: c.config(drafter="medusa", lora_r=4, lora_alpha=0), ValueError,
                        "'lora_alpha' must be > 0 with lora_r > 0"),
    "lora on eagle": (lambda c: c.config(lora_r=4), ValueError, "only supported with drafter: medusa"),
    "epochs zero": (lambda c: c.config(epochs=0), ValueError, "'epochs' must be >= 1"),
    "batch_size zero": (lambda c: c.config(batch_size=0), ValueError, "'batch_size' must be >= 1"),
    "eval_fraction one": (lambda c: c.config(eval_fraction=1.0), ValueError, "'eval_fraction' must be in [0, 1)"),
    "unknown drafter kind": (lambda c: c.config(drafter="hydra"), ValueError, "'drafter' must be one of"),
    "unknown loss": (lambda c: c.config(loss="mse"), ValueError, "'loss' must be one of"),
    "empty data": (lambda c: c.config(data=""), ValueError, "'data' is empty"),
    "empty output_dir": (lambda c: c.config(output_dir=""), ValueError, "'output_dir' is empty"),
    "resume and overwrite": (lambda c: c.config(resume=True, overwrite=True), ValueError, "contradict"),
    "cli resume and overwrite": (lambda c: parse_args(["data=d.jsonl", "--resume", "--overwrite"]), ValueError,
                                 "contradict"),
    "push_to_hub not a repo id": (lambda c: c.config(push_to_hub="not a valid id!!"), ValueError,
                                  "'push_to_hub' must be a Hub repo id"),
    "lr not a number": (lambda c: c.config(lr="fast"), TypeError, "'lr' in overrides expects float"),
    "max_steps not an int": (lambda c: c.config(max_steps=1.5), TypeError, "'max_steps' in overrides expects int"),
    "misspelt key": (lambda c: load_config(None, ["data=d.jsonl", "batchsize=3"]), ValueError,
                     "unknown config key 'batchsize' in overrides; did you mean 'batch_size'"),
    "TrainConfig built in Python": (lambda c: train(TrainConfig(data=c.shared["data"], lr=0.0)), ValueError,
                                    "'lr' must be > 0"),
    "missing config file": (lambda c: load_config(c.tmp / "nope.yaml"), ValueError, "does not exist"),
    "config file badly indented": (lambda c: load_config(_yaml(c, "drafter: eagle\n  lr: 3e-3\n")), ValueError,
                                   "run.yaml' is not valid YAML at line 2, column 5: mapping values are not allowed"),
    "config file with a tab": (lambda c: load_config(_yaml(c, "drafter: eagle\n\tlr: 3e-3\n")), ValueError,
                               "run.yaml' is not valid YAML at line 2, column 1: found character '\\t'"),
    "config file binary": (lambda c: load_config(_yaml(c, b"\x89PNG\r\n\x1a\n\xff\xfe")), ValueError,
                           "run.yaml' is not UTF-8 text (it holds the byte 0x89); give the YAML file of overrides"),
    "config file with a NUL": (lambda c: load_config(_yaml(c, "lr: 1\0\n")), ValueError,
                               "run.yaml' holds the character '\\x00', which YAML does not allow"),
    "config file is a folder": (lambda c: load_config(c.tmp), ValueError,
                                "is a folder; give the YAML file of overrides"),
    "override not YAML": (lambda c: load_config(None, ["data=d.jsonl", "lora_target_modules=[q_proj"]), ValueError,
                          "config key 'lora_target_modules' in overrides: '[q_proj' is not a YAML value"),
    "keep_best with nothing held out": (lambda c: c.config(keep_best=True, eval_every=5, eval_fraction=0.0),
                                        ValueError, "keep_best=true keeps the drafter of the best held-out "
                                                    "evaluation, but eval_fraction=0 holds nothing out"),
    "keep_best by default, evaluations with nothing held out": (
        lambda c: c.config(eval_every=5, eval_fraction=0.0), ValueError,
        "eval_every=5 evaluates nothing and no best/ is written: set eval_fraction > 0, or keep_best: false"),
    "keep_best asked for without evaluations": (lambda c: c.config(keep_best=True, eval_fraction=0.0), ValueError,
                                                "eval_every=0 and eval_fraction=0.0 make no evaluation during the run"),
    "lr past what AdamW can step": (lambda c: c.config(lr=1e38), ValueError, "'lr' must be <= 1e+37, got 1e+38"),
    "lr infinite": (lambda c: c.config(lr=".inf"), ValueError, "'lr' must be a finite number, got inf"),
    "loss weight infinite": (lambda c: c.config(feature_loss_weight=".inf"), ValueError,
                             "'feature_loss_weight' must be a finite number"),
    "seed negative": (lambda c: c.config(seed=-1), ValueError, "'seed' must be in [0, 2**32), got -1"),
    "seed too large": (lambda c: c.config(seed=2**32), ValueError, "'seed' must be in [0, 2**32)"),
    "empty target": (lambda c: c.config(target=""), ValueError, "'target' is empty: give a local folder"),
    "empty data_split": (lambda c: c.config(data_split=""), ValueError, "'data_split' is empty"),
    "offline features without a cache folder": (lambda c: c.config(features="offline", feature_cache_dir=""),
                                                ValueError, "'feature_cache_dir' is empty with features: offline"),
    "ttt_steps absurd": (lambda c: c.config(ttt_steps=1000), ValueError, "'ttt_steps' must be <= 64, got 1000"),
    "eval_steps_depth absurd": (lambda c: c.config(eval_steps_depth=10**5), ValueError,
                                "'eval_steps_depth' must be <= 64"),
    "tree given as a list": (lambda c: c.config(drafter_options={"tree": [4, 6]}), TypeError,
                             "'drafter_options' gives tree as list [4, 6]; it is a mapping of tree settings"),
    "tree given as a string": (lambda c: c.config(drafter_options={"tree": "top_k=4"}), TypeError,
                               "gives tree as str"),
    "drafter option misspelt, at the door": (
        lambda c: c.config(drafter="medusa", drafter_options={"num_head": 2}), ValueError,
        "unknown medusa options ['num_head']; did you mean 'num_heads'"),
    "drafter option of the wrong type": (lambda c: heads.build("eagle3", tiny_model("llama"), draft_vocab_size="48"),
                                         TypeError, "config field 'draft_vocab_size' must be int | None, got str"),
    "drafter option a string for a list": (lambda c: heads.build("dflash", tiny_model("llama"), feature_layers="2,4"),
                                           TypeError, "config field 'feature_layers' must be list[int] | None"),
    "medusa num_heads absurd": (lambda c: heads.build("medusa", tiny_model("llama"), num_heads=10**4), ValueError,
                                "Medusa num_heads must be <= 64"),
    "dflash block_size absurd": (lambda c: heads.build("dflash", tiny_model("llama"), block_size=10**6), ValueError,
                                 "DFlash block_size must be <= 65"),
    "lora_target_modules not names": (lambda c: c.config(drafter="medusa", lora_r=2, lora_target_modules=[1]),
                                      ValueError, "'lora_target_modules' must list the names"),
    "lora_target_modules empty": (lambda c: c.config(drafter="medusa", lora_r=2, lora_target_modules=[]),
                                  ValueError, "'lora_target_modules' must list the names"),
    "lora_target_modules naming no module": (
        lambda c: c.train(target=c.shared["target"], drafter="medusa", lora_r=2, lora_target_modules=["qproj"]),
        ValueError, "names ['qproj'], which match no module of the target; its linear layers are"),
    "TrainConfig built in Python with a wrong type": (lambda c: train(TrainConfig(data="d.jsonl", lr="fast")),
                                                      TypeError, "config key 'lr' expects float, got 'fast'"),
    "TrainConfig built in Python with options as a string": (
        lambda c: train(TrainConfig(data="d.jsonl", drafter_options="num_heads=2")), TypeError,
        "config key 'drafter_options' expects dict"),
    "samples longer than the target's context": (
        lambda c: c.train(target=c.shared["target"], data=_long_conversation(c)), ValueError,
        "are longer than the target's context of 256 tokens (max_position_embeddings); set max_length <= 256"),

    # ---- data files: named by file and line, rows by position and id ------------------------------------
    "malformed jsonl line": (
        lambda c: load_rows(c.write("d.jsonl", '{"messages": []}\n{"messages": []}\n{"messages": [}\n')),
        ValueError, "d.jsonl: line 3 is not valid JSON"),
    "jsonl line not an object": (lambda c: load_rows(c.write("d.jsonl", '{"messages": []}\n[1, 2]\n')),
                                 ValueError, "line 2 is a JSON list, not an object"),
    "malformed json array": (lambda c: load_rows(c.write("d.json", '[\n {"a": 1},\n {"a": 2},\n {"a" 3}\n]\n')),
                             ValueError, "d.json: line 4 is not valid JSON"),
    "json array of non-objects": (lambda c: load_rows(c.write("d.json", '[{"a": 1}, 2]')), ValueError,
                                  "d.json: element 1 of the array is a JSON int, not an object"),
    "missing data file": (lambda c: load_rows(str(c.tmp / "none.jsonl")), ValueError, "does not exist"),
    "empty data file": (lambda c: load_rows(c.write("d.jsonl", "\n")), ValueError, "is empty"),
    "folder as data": (lambda c: load_rows(str(c.tmp)), ValueError, "local data must be a .json, .jsonl"),
    "unknown columns": (lambda c: c.samples(c.jsonl({"prompt": "a", "completion": "b"})), ValueError,
                        "cannot tell the data format"),
    "role human": (lambda c: c.samples(c.jsonl({"id": "a", "messages": [USER, ASSISTANT]},
                                               {"id": "b", "messages": [{"role": "human", "content": "hi"},
                                                                        ASSISTANT]})),
                   ValueError, "row 1 (id 'b'): message 0 has role 'human'; roles must be one of "
                               "['system', 'developer', 'user', 'assistant', 'tool'] ('human' is a ShareGPT speaker name: rename it "
                               "to 'user'"),
    "role bot": (lambda c: c.samples(c.jsonl({"messages": [USER, {"role": "bot", "content": "yo"}]})),
                 ValueError, "row 0: message 1 has role 'bot'; roles must be one of"),
    "null assistant content": (lambda c: c.samples(c.jsonl({"id": "x", "messages": [
        USER, {"role": "assistant", "content": None}]})), ValueError,
        "row 0 (id 'x'): message 1 (assistant) has content None, not text; fill in the reply"),
    "null user content": (lambda c: c.samples(c.jsonl({"messages": [{"role": "user", "content": None},
                                                                    ASSISTANT]})),
                          ValueError, "row 0: message 0 (user) has content None"),
    "messages not a list": (lambda c: c.samples(c.jsonl({"messages": "hi"})), ValueError,
                            "row 0: 'messages' must be a list of objects"),
    "sharegpt unknown speaker": (
        lambda c: c.samples(c.jsonl({"conversations": [{"from": "human", "value": "hi"},
                                                       {"from": "robot", "value": "yo"}]})),
        ValueError, "row 0: ShareGPT turn 1 has unknown 'from' value 'robot'; known values"),
    "sharegpt null reply": (
        lambda c: c.samples(c.jsonl({"id": 7, "conversations": [{"from": "human", "value": "hi"},
                                                                {"from": "gpt", "value": None}]})),
        ValueError, "row 0 (id 7): message 1 (assistant) has content None"),
    "alpaca null output": (lambda c: c.samples(c.jsonl({"instruction": "say", "input": "", "output": None})),
                           ValueError, "row 0: Alpaca field 'output' is None, not text"),
    "assistant first": (lambda c: c.samples(c.jsonl({"messages": [ASSISTANT, USER, ASSISTANT]})), ValueError,
                        "row 0: the conversation starts with an assistant turn"),
    "no assistant anywhere": (lambda c: c.samples(c.jsonl({"messages": [USER]}, {"messages": [USER]})),
                              ValueError, "none of the 2 conversations has an assistant turn"),
    "one ShareGPT row among messages rows": (
        lambda c: c.samples(c.jsonl({"messages": [USER, ASSISTANT]}, {"messages": [USER, ASSISTANT]},
                                    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                                    {"messages": [USER, ASSISTANT]})),
        ValueError, "row 2 is a ShareGPT row ('conversations'), not OpenAI messages ('messages') as the file is read"),
    "user content as a list of parts": (
        lambda c: c.samples(c.jsonl({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                                  ASSISTANT]})),
        ValueError, "row 0: message 0 (user) has content as a list of 1 parts, not text; give its text as one string"),
    "jsonl.gz cut short": (
        lambda c: load_rows(_write_bytes(c, "d.jsonl.gz", gzip.compress(b'{"messages": []}\n' * 50)[:-30])),
        ValueError, "d.jsonl.gz is damaged gzip"),
    "hub dataset unreachable": (lambda c: (c.monkeypatch.setenv("HF_DATASETS_OFFLINE", "1"),
                                           load_rows("no-such-owner/no-such-dataset"))[1], ValueError,
                                "could not be loaded as a Hugging Face dataset"),
    ".gz that is not gzip": (lambda c: load_rows(_write_bytes(c, "d.jsonl.gz", b'{"messages": []}\n')), ValueError,
                             "d.jsonl.gz is not gzip-compressed although its name ends in .gz"),
    "parquet that is not parquet": (lambda c: load_rows(_write_bytes(c, "d.parquet", b"PAR1 but no more")),
                                    ValueError, "d.parquet' is not a readable parquet file"),
    "parquet cut short": (lambda c: load_rows(_cut_parquet(c)), ValueError, "d.parquet' is not a readable parquet"),
    "latin-1 bytes in a jsonl file": (
        lambda c: load_rows(_write_bytes(c, "d.jsonl", '{"messages": []}\n{"messages": "caf\xe9"}\n'.encode("latin-1"))),
        ValueError, "d.jsonl: line 2 is not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    "train on bad data checks it before the target": (
        lambda c: c.train(data=c.jsonl({"messages": [USER, {"role": "bot", "content": "yo"}]})),
        ValueError, "message 1 has role 'bot'"),
    "train on a malformed file": (lambda c: c.train(data=c.write("d.jsonl", '{"messages": [USER]}\n')),
                                  ValueError, "line 1 is not valid JSON"),

    # ---- a target that is not there: named as a missing folder, not as a hub id or connection error -------
    "train: missing absolute target folder": (lambda c: c.train(target=str(c.tmp / "models" / "my-target")),
                                              FileNotFoundError, "no such folder: "),
    "train: missing ./ target folder": (lambda c: _missing_target(c, "./models/my-target"), FileNotFoundError,
                                        "no such folder: './models/my-target' (the target; looked for"),
    "train: missing target folder beside its parent": (
        lambda c: _missing_target(c, "models/my-target"), FileNotFoundError,
        "no such folder: 'models/my-target' (the target; looked for"),
    "train: missing nested target folder": (lambda c: _missing_target(c, "models/org/my-target"), FileNotFoundError,
                                            "no such folder: 'models/org/my-target'"),
    "train: target is a file": (lambda c: c.train(target=c.write("target.gguf", "x")), ValueError,
                                "target.gguf' is a file, not a folder; give a folder holding the target"),
    "train: missing drafter_init, before the target loads": (
        lambda c: c.train(drafter_init=str(c.tmp / "runs" / "old" / "drafter")), FileNotFoundError,
        "no such folder"),
    "resolve_target: missing ./ folder": (lambda c: resolve_target("./no-such-models/my-target"), FileNotFoundError,
                                          "no such folder: './no-such-models/my-target'"),
    "resolve_target: missing folder as a Path": (lambda c: resolve_target(c.tmp / "my-target"), FileNotFoundError,
                                                 "no such folder"),
    "regenerate: missing target folder": (lambda c: _regenerate(c, "--target", "./models/my-target"),
                                          FileNotFoundError, "no such folder: './models/my-target' (--target"),
    "synthesize_prompts: missing target folder": (lambda c: _synthesize(c, "--target", c.tmp / "my-target"),
                                                  FileNotFoundError, "no such folder"),

    # ---- generation settings of train.regenerate and train.synthesize_prompts, before the target loads -------
    "regenerate: top_p above one": (lambda c: _regenerate(c, "--temperature", 0.7, "--top_p", 5), ValueError,
                                    "top_p must be in (0, 1] (1 = off), got 5.0"),
    "regenerate: temperature nan": (lambda c: _regenerate(c, "--temperature", "nan"), ValueError,
                                    "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    "regenerate: temperature negative": (lambda c: _regenerate(c, "--temperature", -1), ValueError,
                                         "temperature must be a finite number >= 0"),
    "regenerate: batch_size zero": (lambda c: _regenerate(c, "--batch_size", 0), ValueError,
                                    "batch_size must be an int >= 1, got 0"),
    "regenerate: max_new_tokens zero": (lambda c: _regenerate(c, "--max_new_tokens", 0), ValueError,
                                        "max_new_tokens must be an int >= 1"),
    "regenerate: max_samples negative": (lambda c: _regenerate(c, "--max_samples", -3), ValueError,
                                         "max_samples must be an int >= 0"),
    "regenerate: --out a folder": (lambda c: _regenerate(c, "--out", c.tmp), ValueError,
                                   "is a folder; give the .jsonl file to write"),
    "regenerate: --out under a file": (lambda c: _regenerate(c, "--out", c.write("f", "x") + "/o.jsonl"), ValueError,
                                       "cannot be created: "),
    "regenerate: an output line without an id": (lambda c: _regenerate_onto(c, '{"messages": []}\n'), ValueError,
                                                 "o.jsonl: line 1 has no 'id', so it is not an answer"),
    "regenerate: an output line a JSON list": (lambda c: _regenerate_onto(c, '{"id": "0", "messages": []}\n[1, 2]\n'), ValueError,
                                               "o.jsonl: line 2 is a JSON list, so it is not an answer"),
    "regenerate: a damaged settings file": (lambda c: _regenerate_onto(c, '{"id": "0", "messages": []}\n', '{"target": '), ValueError,
                                            "o.jsonl.settings.json is damaged (not JSON"),
    "regenerate: a settings file holding a list": (lambda c: _regenerate_onto(c, '{"id": "0", "messages": []}\n', "[]"), ValueError,
                                                   "o.jsonl.settings.json is damaged (a JSON list, not an object)"),
    "regenerate: data changed since the answers": (
        lambda c: _regenerate_onto(c, '{"id": "0", "messages": []}\n', '{"data_fingerprint": "3 rows, sha256 0123456789abcdef"}'),
        ValueError, "o.jsonl holds answers to other rows than"),
    "regenerate: a row with no messages": (
        lambda c: _regenerate(c, "--data", c.jsonl({"id": "a", "messages": [USER]}, {"id": "e", "messages": []})),
        ValueError, "row 1 (id 'e') has no messages, so no prompt to answer"),
    "regenerate: --device cuda without a GPU": (lambda c: (_without_gpus(c), _regenerate(c, "--device", "cuda")),
                                                ValueError, "--device cuda: this machine has 0 CUDA GPU(s)"),
    "regenerate: --device not a device": (lambda c: _regenerate(c, "--device", "gpu0"), ValueError,
                                          "--device 'gpu0' is not a device"),
    "regenerate: --out a file of other records with ids": (
        lambda c: _regenerate_onto(c, '{"id": "c0", "score": 3}\n'), ValueError,
        "o.jsonl: line 1 has neither 'messages' nor 'conversations', so it is not an answer this command wrote"),
    "regenerate: --out is the --data file": (lambda c: _regenerate(c, "--out", c.shared["data"]), ValueError,
                                             "is the --data file: the answers would be appended to the prompts"),
    "regenerate: --split on a local file": (lambda c: _regenerate(c, "--split", "test"), ValueError,
                                            "split 'test' names a split of a hub dataset, but"),
    "train: data_split on a local file": (lambda c: c.train(data_split="validation"), ValueError,
                                          "split 'validation' names a split of a hub dataset, but"),
    "a target folder without its tokenizer": (lambda c: resolve_target(_target_without_tokenizer(c)), ValueError,
                                              "holds no tokenizer that transformers can load"),
    "data: a jsonl file starting with a byte-order mark": (
        lambda c: load_rows(_write_bytes(c, "d.jsonl", b"\xef\xbb\xbf" + b'{"messages": []}\n')), ValueError,
        "d.jsonl starts with a UTF-8 byte-order mark"),
    "config: a key given twice in the YAML file": (lambda c: load_config(_yaml(c, "lr: 0.001\nmax_steps: 3\nlr: 0.5\n")),
                                                   ValueError, "sets 'lr' twice (lines 1 and 3)"),
    "config: eval_every with no held-out samples allowed": (
        lambda c: c.config(eval_every=5, max_eval_samples=0), ValueError,
        "eval_every=5 evaluates on held-out samples, but max_eval_samples=0 holds none out"),
    "train: eval_every on data too small to hold a sample out": (
        lambda c: c.train(target=c.shared["target"], data=c.jsonl({"messages": [USER, ASSISTANT]}), eval_every=1,
                          max_steps=2),
        ValueError, "eval_every=1 evaluates on held-out samples, but the 1 training sample leaves none to hold out"),
    "synthesize_prompts: temperature nan": (lambda c: _synthesize(c, "--temperature", "nan"), ValueError,
                                            "temperature must be a finite number >= 0"),
    "synthesize_prompts: top_p zero": (lambda c: _synthesize(c, "--top_p", 0), ValueError, "top_p must be in (0, 1]"),
    "synthesize_prompts: count zero": (lambda c: _synthesize(c, "--count", 0), ValueError,
                                       "count must be an int >= 1, got 0"),
    "SelfSpecModel.from_pretrained: the recorded target folder is gone": (
        _drafter_whose_target_is_missing, FileNotFoundError, "no such folder"),

    # ---- output_dir, resume and overwrite: checked before the target loads ------------------------------
    "output_dir is a file": (lambda c: c.train(output_dir=c.write("out.txt", "x")), ValueError,
                             "is a file, not a folder; choose another output_dir"),
    "output_dir under a file": (lambda c: c.train(output_dir=c.write("f", "x") + "/run"), ValueError,
                                "cannot be created"),
    "used output_dir: checkpoints": (lambda c: c.train(output_dir=c.used("checkpoints")), ValueError,
                                     "already holds a run (checkpoints): continue it with resume=true (--resume), "
                                     "replace it with overwrite=true (--overwrite)"),
    "used output_dir: drafter": (lambda c: c.train(output_dir=c.used("drafter")), ValueError,
                                 "already holds a run (drafter)"),
    "used output_dir: history": (lambda c: c.train(output_dir=c.used("history.jsonl")), ValueError,
                                 "already holds a run (history.jsonl)"),
    "resume without checkpoint": (lambda c: c.train(resume=True), ValueError, "resume=true but no checkpoint"),
    "resume with every checkpoint torn": (lambda c: c.train(output_dir=c.torn_copy(), resume=True), ValueError,
                                          "no intact checkpoint"),
    "resume with another seed": (lambda c: c.resume(seed=1), ValueError,
                                 "settings differ from the run saved in"),
    "resume names the changed lr": (lambda c: c.resume(lr=1e-2), ValueError, "lr: 0.003 -> 0.01"),
    "resume with another batch size": (lambda c: c.resume(batch_size=4), ValueError, "batch_size: 8 -> 4"),
    "resume with another drafter kind": (lambda c: c.resume(drafter="medusa"), ValueError,
                                         "drafter: 'eagle' -> 'medusa'"),
    "resume with another target": (lambda c: c.resume(target=MISSING_TARGET), ValueError,
                                   f"-> {MISSING_TARGET!r}"),

    # ---- loading a drafter -------------------------------------------------------------------------------
    "load a missing folder": (lambda c: heads.load(c.tmp / "nope" / "drafter"), FileNotFoundError,
                              "no drafter at"),
    "load a missing relative path": (lambda c: heads.load("no/such/run/drafter"), FileNotFoundError,
                                     "no drafter at no/such/run/drafter: no such folder"),
    "load a missing ./ path": (lambda c: heads.load("./runs/drafter"), FileNotFoundError,
                               "no drafter at ./runs/drafter: no such folder"),
    "load a missing folder beside its parent": (
        lambda c: (_in_a_folder_with_models(c), heads.load("models/drafter")), FileNotFoundError,
        "no drafter at models/drafter: no such folder"),
    "load a folder without config.json": (lambda c: heads.load(c.tmp), ValueError,
                                          "is a folder without config.json, so not a saved drafter"),
    "load a run folder": (lambda c: heads.load(_run_folder_without_drafter_config(c)), ValueError,
                          "Its subfolders ['drafter'] hold one"),
    "load a file": (lambda c: heads.load(c.write("x.safetensors", "x")), ValueError, "is a file; a drafter is a folder"),
    "load a target folder": (lambda c: heads.load(c.shared["target"]), ValueError,
                             "holds model_type 'llama', not a selfspec drafter"),
    "load a hub-id-shaped missing path offline": (_hub_id_shaped_missing_path, OSError,
                                                  "no drafter at runs-that-do-not-exist/drafter: not a local folder"),

    # ---- scripts/push_to_hub.py: refused before staging or any network ----------------------------------
    "push: stage-dir is the drafter folder": (
        lambda c: c.push(c.drafter_copy(), "--repo-id", "me/x", "--dry-run", "--stage-dir", c.tmp / "drafter"),
        ValueError, "overlaps the drafter folder"),
    "push: stage-dir inside the drafter folder": (
        lambda c: c.push(c.drafter_copy(), "--repo-id", "me/x", "--dry-run", "--stage-dir", c.tmp / "drafter" / "s"),
        ValueError, "would rewrite its files; pick a separate folder"),
    "push: stage-dir holds the drafter folder": (
        lambda c: c.push(c.drafter_copy(), "--repo-id", "me/x", "--dry-run", "--stage-dir", c.tmp),
        ValueError, "overlaps the drafter folder"),
    "push: invalid repo id": (
        lambda c: c.push(c.drafter_copy(), "--repo-id", "not a valid id!!", "--dry-run"),
        ValueError, "--repo-id 'not a valid id!!' is not a Hub repo id"),
    "push: repo id with two slashes": (lambda c: c.push(c.drafter_copy(), "--repo-id", "a/b/c", "--dry-run"),
                                       ValueError, "is not a Hub repo id (owner/name)"),
    "push: no drafter in the run folder": (lambda c: c.push(c.tmp, "--repo-id", "me/x", "--dry-run"),
                                           FileNotFoundError, "holds no saved drafter"),
    "push: the Hub unreachable": (lambda c: (_hub(c, whoami=_unreachable()), c.push(c.drafter_copy(), "--repo-id",
                                                                                   "me/x")),
                                  ValueError, "--repo-id=me/x: the Hugging Face Hub cannot be reached"),

    # ---- push_to_hub in training: the Hub checked before the target loads (and before the run's hours) ------
    "train push_to_hub: the Hub unreachable": (
        lambda c: (_hub(c, whoami=_unreachable()), c.train(push_to_hub="me/drafter")), ValueError,
        "push_to_hub=me/drafter: the Hugging Face Hub cannot be reached (HTTPError: [Errno -2] Name or service "
        "not known); check the network"),
    "train push_to_hub: no token": (lambda c: (_hub(c, token=None), c.train(push_to_hub="me/drafter")), ValueError,
                                    "push_to_hub=me/drafter: no Hugging Face token found; log in with `hf auth login`"),
    "train push_to_hub: offline": (lambda c: (_hub(c, offline=True), c.train(push_to_hub="me/drafter")), ValueError,
                                   "push_to_hub=me/drafter, but HF_HUB_OFFLINE is set"),
    "train push_to_hub: another owner's repo": (
        lambda c: (_hub(c), c.train(push_to_hub="someone/drafter")), ValueError,
        "the token belongs to 'me', who can create repos only under 'me', 'team', not 'someone'"),
    "train push_to_hub: a read-only token": (
        lambda c: (_hub(c, whoami={"name": "me", "auth": {"accessToken": {"role": "read"}}}),
                   c.train(push_to_hub="me/drafter")), ValueError, "the token of 'me' is read-only"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_a_clear_error(case, tmp_path, shared, monkeypatch):
    call, error, fragment = CASES[case]
    with pytest.raises(error) as info:
        call(Ctx(tmp_path, shared, monkeypatch))
    assert fragment in str(info.value), f"{case}: {info.value}"


def test_refused_stage_dir_leaves_the_drafter_untouched(tmp_path, shared, monkeypatch):
    c = Ctx(tmp_path, shared, monkeypatch)
    source = c.drafter_copy()
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    with pytest.raises(ValueError, match="overlaps"):
        c.push(source, "--repo-id", "me/x", "--dry-run", "--stage-dir", source)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_the_table_is_big_enough():
    assert len(CASES) >= 60
