"""Training never loses a run and never resumes on other inputs (issue #47): overwrite=true keeps the old run
until the new one has saved something, and --resume refuses data, target weights or a tokenizer that changed
in place since its checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from train_fixtures import conversations, save_tiny_target, write_messages

import heads
from train.config import load_config
from train.target import target_fingerprint
from train.train_heads import MANIFEST, PREVIOUS_RUN, train


@pytest.fixture
def ws(tmp_path):
    return {"root": tmp_path, "target": save_tiny_target(tmp_path / "target"),
            "data": write_messages(tmp_path / "data.jsonl", conversations(24))}


def run(ws, **overrides) -> dict:
    values = {"target": ws["target"], "data": ws["data"], "output_dir": str(ws["root"] / "run"), "drafter": "eagle",
              "batch_size": 8, "lr": 3e-3, "eval_fraction": 0.2, "progress_bar": False, "log_every": 0,
              "eval_steps_depth": 2, "max_steps": 4, "save_every": 2, "halt_after_steps": 2}
    return train(load_config(None, {**values, **overrides}))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run(ws) -> dict[str, bytes]:
    """A finished run (checkpoints, history, drafter, result) in ws/run; its files' bytes."""
    run(ws, halt_after_steps=0)
    before = snapshot(ws["root"] / "run")
    assert {"drafter/model.safetensors", "result.json", "history.jsonl"} <= set(before)
    assert any(name.startswith("checkpoints/") for name in before)
    return before


# ---- overwrite=true ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, error, fragment", [
    ({"data": "missing.jsonl"}, ValueError, "data file 'missing.jsonl' does not exist"),
    ({"target": "./models/my-target"}, FileNotFoundError, "no such folder: './models/my-target'"),
    ({"drafter_init": "./runs/old/drafter"}, FileNotFoundError, "no such folder"),
    ({"drafter_options": {"num_layers": 2}}, ValueError, "unknown eagle options ['num_layers']"),
])
def test_overwrite_with_a_bad_input_leaves_the_old_run_as_it_was(ws, monkeypatch, bad, error, fragment):
    monkeypatch.chdir(ws["root"])
    before = finished_run(ws)
    with pytest.raises(error) as info:
        run(ws, overwrite=True, halt_after_steps=0, **bad)
    assert fragment in str(info.value)
    assert snapshot(ws["root"] / "run") == before


def test_overwrite_keeps_the_old_run_aside_until_the_new_one_saves(ws):
    before = finished_run(ws)
    out = ws["root"] / "run"
    # The new run stops before its first checkpoint (as a crash would): the old run waits in previous_run/.
    run(ws, overwrite=True, lr=1e-3, save_every=0, halt_after_steps=1)
    assert snapshot(out / PREVIOUS_RUN) == before
    assert not (out / "checkpoints").exists() and not (out / "drafter").exists()
    # Another overwrite that saves nothing keeps that same old run, not the empty attempt.
    run(ws, overwrite=True, lr=1e-3, save_every=0, halt_after_steps=1)
    assert snapshot(out / PREVIOUS_RUN) == before
    # A resume finds no checkpoint of the new run and points at the old one.
    with pytest.raises(ValueError, match=r"no checkpoint in .*previous_run holds the run that overwrite=true replaced"):
        run(ws, resume=True)
    # A plain new run there is refused, naming what is in the way.
    with pytest.raises(ValueError, match=r"already holds a run \(history.jsonl, previous_run\)"):
        run(ws)
    # The new run's first checkpoint replaces the old run for good.
    run(ws, overwrite=True, lr=1e-3)
    assert not (out / PREVIOUS_RUN).exists()
    assert (out / "checkpoints" / "step_00000002" / MANIFEST).is_file()


def test_overwrite_that_finishes_leaves_only_the_new_run(ws):
    finished_run(ws)
    result = run(ws, overwrite=True, lr=1e-3, save_every=0, halt_after_steps=0)
    out = ws["root"] / "run"
    assert not (out / PREVIOUS_RUN).exists() and not (out / "checkpoints").exists()
    assert heads.load(result["drafter_dir"]).config.training["train_config"]["lr"] == 1e-3


# ---- resume after inputs changed in place -------------------------------------------------------------------

def test_resume_refuses_data_changed_in_place(ws):
    run(ws)
    write_messages(ws["data"], conversations(43))
    with pytest.raises(ValueError) as info:
        run(ws, resume=True, halt_after_steps=0)
    message = str(info.value)
    assert f"the data {ws['data']!r} changed since" in message
    assert "data: 24 conversations" in message and "-> 43 conversations" in message
    assert "Restore the data the run started with, or start a new run" in message


def test_resume_refuses_target_weights_changed_in_place(ws):
    run(ws)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(ws["target"])
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight[3, 5] += 1.0  # one weight of one layer
    target.save_pretrained(ws["target"])
    with pytest.raises(ValueError, match=r"the target .* has other weights or config since .*Restore the target"):
        run(ws, resume=True, halt_after_steps=0)


def test_resume_refuses_a_chat_template_changed_in_place(ws):
    run(ws)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ws["target"])
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>\n", "<|im_end|>\n\n")
    tokenizer.save_pretrained(ws["target"])
    with pytest.raises(ValueError, match="tokenize differently: the target .*'s tokenizer or chat template changed"):
        run(ws, resume=True, halt_after_steps=0)


def test_resume_on_unchanged_inputs_checks_and_continues(ws):
    run(ws)
    manifest = json.loads((ws["root"] / "run" / "checkpoints" / "step_00000002" / MANIFEST).read_text())
    assert set(manifest["inputs"]) == {"data", "target", "samples"}
    assert run(ws, resume=True, halt_after_steps=0)["step"] == 4


def test_a_checkpoint_without_fingerprints_resumes_with_a_warning(ws):
    run(ws)
    path = ws["root"] / "run" / "checkpoints" / "step_00000002" / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["inputs"]  # as checkpoints were saved before they held fingerprints
    path.write_text(json.dumps(manifest))
    write_messages(ws["data"], conversations(24)[:20] + conversations(24)[:4])  # cannot be noticed
    with pytest.warns(UserWarning, match="saved without fingerprints of its data and target"):
        assert run(ws, resume=True, halt_after_steps=0)["step"] == 4


def test_target_fingerprint_sees_one_changed_weight_and_not_a_copy(tmp_path):
    from conftest import tiny_model

    model = tiny_model("llama")
    same = target_fingerprint(model)
    copy = tmp_path / "copy"
    model.save_pretrained(copy)
    from transformers import AutoModelForCausalLM

    assert target_fingerprint(AutoModelForCausalLM.from_pretrained(copy)) == same
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 0] += 1e-3
    assert target_fingerprint(model) != same


def test_resumed_run_in_a_copied_folder_still_matches(ws):
    # Fingerprints are of contents, not paths or times: a copied target folder is the same target.
    run(ws)
    moved = ws["root"] / "target_copy"
    shutil.copytree(ws["target"], moved)
    shutil.rmtree(ws["target"])
    moved.rename(ws["target"])
    assert run(ws, resume=True, halt_after_steps=0)["step"] == 4


def test_target_fingerprint_samples_large_tensors_and_sees_a_fine_tune(monkeypatch):
    from conftest import tiny_model

    import train.target

    monkeypatch.setattr(train.target, "SAMPLED_VALUES", 16)  # every weight of the tiny target is sampled
    model = tiny_model("llama")
    same = target_fingerprint(model)
    with torch.no_grad():
        weight = model.model.layers[0].self_attn.q_proj.weight
        weight += 1e-4 * torch.randn_like(weight)  # as a fine-tune or a merged adapter changes a whole matrix
    assert target_fingerprint(model) != same


# ---- a run that diverges, a full disk, an unreachable Hub (issue #55) ---------------------------------------

def intact_checkpoints(out: Path) -> list[str]:
    from train.train_heads import torn_reason

    return [p.name for p in sorted((out / "checkpoints").iterdir()) if torn_reason(p) is None]


def all_finite(path: Path) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(w).all() for w in load_file(path).values())


@pytest.mark.parametrize("kind, lr", [("eagle", 1e9), ("medusa", 1e30)])
def test_a_non_finite_loss_stops_the_run_at_its_step_keeping_the_last_checkpoint(ws, kind, lr):
    """lr far too high: the weights after step 1 overflow the next forward. The run stops at step 2, before
    applying it, and saves nothing after the last good checkpoint: no NaN checkpoint, drafter or best/."""
    out = ws["root"] / "run"
    with pytest.raises(FloatingPointError) as info:
        run(ws, drafter=kind, lr=lr, max_steps=6, save_every=1, keep_checkpoints=10, halt_after_steps=0,
            eval_every=2)
    message = str(info.value)
    assert message.startswith("training stopped at step 2: the loss is nan and the gradient norm nan (not finite)")
    assert f"the last checkpoint, {out / 'checkpoints' / 'step_00000001'}, is as it was" in message
    assert f"lower lr (now {lr})" in message and "overwrite=true" in message
    assert intact_checkpoints(out) == ["step_00000001"]
    assert all_finite(out / "checkpoints" / "step_00000001" / "model.safetensors")
    assert not any((out / name).exists() for name in ("drafter", "best", "result.json"))
    assert len((out / "history.jsonl").read_text().splitlines()) == 1  # the good step only


def poison_after_step(monkeypatch, at_step: int) -> None:
    """The optimizer leaves a NaN weight after step `at_step`, from a finite loss and gradient (as an overflowing
    update would): only the check of the weights before a save can see it."""
    steps = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        steps.append(1)
        if len(steps) == at_step:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def nan_eval_loss(monkeypatch) -> None:
    import train.train_heads

    evaluate = train.train_heads.evaluate
    monkeypatch.setattr(train.train_heads, "evaluate", lambda *a, **k: {**evaluate(*a, **k), "eval_loss": float("nan")})


@pytest.mark.parametrize("fault, fragment", [
    (lambda mp: poison_after_step(mp, 2), "training stopped at step 2: some of the drafter's weights are NaN or inf "
                                          "after the optimizer step (not finite); nothing of it was saved"),
    (nan_eval_loss, "training stopped at step 2: the held-out eval_loss is nan (not finite); this evaluation's "
                    "drafter was not kept"),
])
def test_non_finite_weights_or_eval_loss_are_never_saved_or_reported_as_fine(ws, monkeypatch, fault, fragment):
    fault(monkeypatch)
    out = ws["root"] / "run"
    with pytest.raises(FloatingPointError) as info:
        run(ws, max_steps=4, save_every=1, keep_checkpoints=10, eval_every=2, halt_after_steps=0)
    assert fragment in str(info.value) and "step_00000001, is as it was" in str(info.value)
    assert intact_checkpoints(out) == ["step_00000001"]
    assert not any((out / name).exists() for name in ("drafter", "best", "result.json"))


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4048"),
    OSError(28, "No space left on device"),
])
def test_a_full_disk_during_a_checkpoint_says_so_and_keeps_the_previous_one(ws, monkeypatch, error):
    from accelerate import Accelerator

    out = ws["root"] / "run"
    save_state, calls = Accelerator.save_state, []

    def full_on_the_second(self, folder, *args, **kwargs):
        calls.append(folder)
        if len(calls) < 2:
            return save_state(self, folder, *args, **kwargs)
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 100)  # what the write got out before the disk filled
        raise error

    monkeypatch.setattr(Accelerator, "save_state", full_on_the_second)
    with pytest.raises(OSError) as info:
        run(ws, halt_after_steps=0)
    message = str(info.value)
    assert info.value.errno == 28 and "the disk is full" in message
    assert f"writing the checkpoint of step 4 into {out / 'checkpoints' / 'step_00000004'} failed" in message
    assert f"The newest intact checkpoint is {out / 'checkpoints' / 'step_00000002'}" in message
    assert "resume=true" in message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]  # the partial one removed
    assert intact_checkpoints(out) == ["step_00000002"]


def test_a_push_that_fails_after_training_keeps_the_results_and_says_how_to_upload(ws, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HTTPError

    def unreachable(*args, **kwargs):
        raise HTTPError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "me", "orgs": []})
    monkeypatch.setattr(HfApi, "create_repo", unreachable)  # the network went down during training
    monkeypatch.setattr(HfApi, "upload_folder", unreachable)
    out = ws["root"] / "run"
    with pytest.raises(RuntimeError) as info:
        run(ws, halt_after_steps=0, push_to_hub="me/drafter")
    message = str(info.value)
    assert f"training finished and its drafter is saved in {out / 'drafter'}" in message
    assert "uploading it to the Hub repo me/drafter failed: HTTPError: [Errno -2] Name or service not known" in message
    assert f"python scripts/push_to_hub.py {out} --repo-id me/drafter" in message
    result = json.loads((out / "result.json").read_text())
    assert result["step"] == 4 and result["eval"]["eval_loss"] > 0
    assert result["push_to_hub"] == {"repo_id": "me/drafter",
                                     "error": "HTTPError: [Errno -2] Name or service not known"}
    assert heads.load(out / "drafter").config.training["steps"] == 4


def test_a_push_that_succeeds_is_recorded_in_result_json(ws, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi

    pushed = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "me", "orgs": [{"name": "team"}]})
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **k: type("Repo", (), {"repo_id": repo_id}))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **k: pushed.append(k) or "https://hub/commit/1")
    out = ws["root"] / "run"
    run(ws, halt_after_steps=0, push_to_hub="team/drafter")
    assert pushed[0]["repo_id"] == "team/drafter"
    assert json.loads((out / "result.json").read_text())["push_to_hub"] == {
        "repo_id": "team/drafter", "commit": "https://hub/commit/1"}
