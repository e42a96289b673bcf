"""The trainer benchmark's own parts (train/apps/bench/trainer_*.py): rows cut to a budget, each trainer's features from
one forward at the right layers, the run records (skip, resume, fresh start) with stub trainers, the commands and
configs handed to each framework, and the report. The peers themselves run only in the slow test, which needs
`make peers`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from train_fixtures import char_tokenizer, conversations, write_messages

from heads.eagle3.config import default_feature_layers
from train.apps.bench import trainer_frameworks as frameworks
from train.apps.bench import trainers
from train.apps.bench.trainer_data import capture, layouts, prepare_rows, speculators_train_ratio, write_rows
from train.apps.bench.trainer_report import run_row, summary, to_markdown
from train.apps.bench.trainer_runs import Runner, read_run, run
from train.apps.bench.trainers import check_manifest
from train.data import load_rows, read_conversations, samples_fingerprint, tokenize_conversations
from train.features import FeatureCache

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def rows_file(tmp_path):
    return write_messages(tmp_path / "rows.jsonl", conversations(24))


def test_rows_stop_at_the_budget_of_assistant_tokens(rows_file):
    tok = char_tokenizer()
    rows = prepare_rows(rows_file, tok, budget=60, max_length=64)
    counts = [sum(s.loss_mask) for s in rows.samples]
    assert rows.assistant_tokens == sum(counts) >= 60 > sum(counts[:-1])  # the row that reaches it is the last
    assert rows.tokens == sum(len(s.input_ids) for s in rows.samples)
    assert [c.id for c in rows.conversations] == [f"c{i}" for i in range(len(rows.samples))]  # file order


def test_rows_are_cut_at_max_length_as_selfspec_cuts_them(rows_file, tmp_path):
    """selfspec's run reads rows.jsonl back and tokenizes it: the same ids and masks as every peer gets."""
    tok = char_tokenizer()
    rows = prepare_rows(rows_file, tok, budget=60, max_length=45)
    assert max(len(s.input_ids) for s in rows.samples) == 45
    again, _ = tokenize_conversations(*read_conversations(load_rows(str(write_rows(rows, tmp_path / "out")))), tok, 45)
    assert samples_fingerprint(again) == rows.fingerprint


def test_a_budget_larger_than_the_data_is_refused(rows_file):
    with pytest.raises(ValueError, match="fewer than the budget"):
        prepare_rows(rows_file, char_tokenizer(), budget=10**6, max_length=64)
    with pytest.raises(ValueError, match="budget"):
        prepare_rows(rows_file, char_tokenizer(), budget=0, max_length=64)


@pytest.fixture
def captured(rows_file, tmp_path):
    target = tiny_model("llama", num_hidden_layers=8)
    rows = prepare_rows(rows_file, char_tokenizer(), budget=40, max_length=64)
    where = layouts(tmp_path / "work", target, "tiny", rows)
    assert capture(target, rows, where, progress=False) == dict.fromkeys(("speculators", "specforge", "selfspec"),
                                                                         "captured")
    return target, rows, where


def reference(target, ids: list[int]):
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


def test_every_layout_holds_the_same_layers_of_one_forward(captured):
    from safetensors.torch import load_file

    target, rows, where = captured
    n = target.config.num_hidden_layers
    aux = [2, n // 2, n - 3]  # speculators' target_layer_ids; specforge's [1, n//2-1, n-4] + 1
    assert default_feature_layers(n) == aux
    for i, sample in enumerate(rows.samples):
        hidden = reference(target, sample.input_ids)
        length, width = len(sample.input_ids), target.config.hidden_size
        spec = load_file(where.speculators / "hidden_states" / f"hs_{i}.safetensors")
        assert spec["token_ids"].tolist() == sample.input_ids
        assert spec["hidden_states"].shape == (length, 4, width) and spec["hidden_states"].dtype == torch.bfloat16
        torch.testing.assert_close(spec["hidden_states"][:, 1].float(), hidden[aux[1]], atol=2e-2, rtol=2e-2)
        # the last: before the final norm, whose output is hidden_states[-1]
        torch.testing.assert_close(target.model.norm(spec["hidden_states"][:, 3].float()), hidden[n], atol=5e-2,
                                   rtol=5e-2)
        sf = torch.load(where.specforge / f"data_{i:07d}.ckpt")
        assert sf["input_ids"].tolist() == sample.input_ids and sf["loss_mask"].tolist() == sample.loss_mask
        assert sf["aux_hidden_state"].shape == (1, length, 3 * width)
        torch.testing.assert_close(sf["aux_hidden_state"][0, :, 2 * width:].float(), hidden[aux[2]], atol=2e-2,
                                   rtol=2e-2)
        torch.testing.assert_close(sf["hidden_state"][0].float(), hidden[n], atol=2e-2, rtol=2e-2)
    cache = FeatureCache(where.selfspec)
    assert cache.layers == tuple(aux) and cache.lengths == [len(s.input_ids) for s in rows.samples]
    last = len(rows.samples) - 1
    got = cache.get([last], len(rows.samples[last].input_ids))
    torch.testing.assert_close(got[aux[0]][0], reference(target, rows.samples[last].input_ids)[aux[0]])


def test_speculators_trains_every_row_once_and_validates_on_a_copy_of_the_last(captured):
    import datasets

    _, rows, where = captured
    table = datasets.load_from_disk(str(where.speculators))
    n = len(rows.samples)
    assert len(table) == n + 1 and table[n]["input_ids"].tolist() == table[n - 1]["input_ids"].tolist()
    assert table[0]["loss_mask"].tolist() == rows.samples[0].loss_mask  # speculators reads it as torch tensors
    assert int(len(table) * speculators_train_ratio(n)) == n  # speculators' split index
    assert (where.speculators / "hidden_states" / f"hs_{n}.safetensors").is_file()
    freq = torch.load(where.speculators / "token_freq.pt")
    assert sum(freq.values()) == rows.assistant_tokens


def test_selfspec_finds_the_cache_under_its_own_key(captured, tmp_path):
    """train_heads.make_features keys the cache by the target's name and fingerprint, the samples, the layers."""
    from train.features import cache_key, needed_layers
    from train.target import target_fingerprint

    target, rows, where = captured

    class Drafter:
        feature_layers = default_feature_layers(target.config.num_hidden_layers)

    layers = needed_layers(Drafter, target.config.num_hidden_layers, soft=False)
    assert where.selfspec_key == cache_key(f"tiny:{target_fingerprint(target)}", rows.samples, layers, "float32")


def test_a_soft_variant_gets_the_last_layer_in_a_cache_of_its_own(captured, tmp_path):
    """`loss=soft` (or `both`) reads the target's last layer for its distribution: that cache is keyed as
    train_heads.make_features keys it with soft targets, in its own root; the peers' layouts are kept."""
    from train.apps.bench.trainers import soft_variant
    from train.features import cache_key, needed_layers
    from train.target import target_fingerprint

    target, rows, hard = captured
    n = target.config.num_hidden_layers
    assert soft_variant(["loss=soft"]) and soft_variant(["loss=hard", "loss=both"])
    with pytest.raises(ValueError, match="unknown config key 'lss'"):
        soft_variant(["lss=soft"])
    assert not soft_variant([]) and not soft_variant(["loss=soft", "loss=hard"]) and not soft_variant(["lr=1e-4"])

    class Drafter:
        feature_layers = default_feature_layers(n)

    where = layouts(tmp_path / "work", target, "tiny", rows, soft=True)
    assert where.selfspec_layers == needed_layers(Drafter, n, soft=True) and n in where.selfspec_layers
    assert where.selfspec_key == cache_key(f"tiny:{target_fingerprint(target)}", rows.samples, where.selfspec_layers,
                                           "float32")
    assert where.selfspec_root != hard.selfspec_root
    assert capture(target, rows, where, progress=False) == {"speculators": "kept", "specforge": "kept",
                                                            "selfspec": "captured"}
    cache = FeatureCache(where.selfspec)
    assert cache.layers == where.selfspec_layers
    last = len(rows.samples) - 1
    got = cache.get([last], len(rows.samples[last].input_ids))
    torch.testing.assert_close(got[n][0], reference(target, rows.samples[last].input_ids)[n])


def test_capture_keeps_finished_layouts_and_redoes_a_torn_one(captured):
    target, rows, where = captured
    (where.specforge / "done.json").unlink()  # killed before its end
    assert capture(target, rows, where, progress=False) == {"speculators": "kept", "specforge": "captured",
                                                            "selfspec": "kept"}


# ---- runs: skip, resume, fresh start (stub trainers) ------------------------------------------------------------
STUB = """
import json, sys
from pathlib import Path
folder, resume, fail_at = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
ckpt = folder / "ckpt.json"
step = json.loads(ckpt.read_text())["step"] if resume else 0
(folder / "log.txt").open("a").write(f"start {step}\\n")
while step < 4:
    step += 1
    ckpt.write_text(json.dumps({"step": step}))
    if step == fail_at:
        sys.exit(3)
(folder / "drafter").mkdir()
"""


def stub_runner(tmp_path, fail_at: int = 0, export_fails: bool = False) -> Runner:
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    fresh_calls = []

    def train(folder, resume):
        return [sys.executable, str(script), str(folder), "1" if resume else "0", str(fail_at)]

    exports = (lambda folder: [[sys.executable, "-c", "raise SystemExit(5)"]]) if export_fails else \
        (lambda folder: [[sys.executable, "-c", f"open({str(folder / 'exported')!r}, 'w')"]])
    runner = Runner("stub", train, lambda folder: (folder / "ckpt.json").is_file(), lambda folder: folder / "drafter",
                    exports=exports, fresh=lambda folder: fresh_calls.append(folder))
    runner.fresh_calls = fresh_calls
    return runner


def test_a_finished_run_is_kept(tmp_path):
    folder = tmp_path / "run"
    record = run(stub_runner(tmp_path), folder, {"seed": 0})
    assert record["status"] == "done" and len(record["attempts"]) == 1 and (folder / "exported").is_file()
    assert record["wall_seconds"] >= 0 and record["peak_rss_mb"] > 0 and record["seed"] == 0
    again = run(stub_runner(tmp_path), folder)
    assert again["kept"] and len(again["attempts"]) == 1
    assert (folder / "log.txt").read_text() == "start 0\n"


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(RuntimeError, match="exited with 3"):
        run(stub_runner(tmp_path, fail_at=2), folder)
    assert read_run(folder)["status"] == "training"
    record = run(stub_runner(tmp_path), folder)
    assert [a["resumed"] for a in record["attempts"]] == [False, True]
    assert (folder / "log.txt").read_text() == "start 0\nstart 2\n"  # went on from step 2
    assert record["wall_seconds"] == pytest.approx(sum(a["wall_seconds"] for a in record["attempts"]), abs=0.2)


def test_a_run_killed_before_its_first_checkpoint_starts_fresh(tmp_path):
    folder = tmp_path / "run"
    runner = stub_runner(tmp_path)
    run(runner, folder)
    assert runner.fresh_calls == [folder]


def test_a_failed_export_is_retried_without_training_again(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(RuntimeError, match="export"):
        run(stub_runner(tmp_path, export_fails=True), folder)
    assert read_run(folder)["status"] == "trained"
    record = run(stub_runner(tmp_path), folder)
    assert record["status"] == "done" and len(record["attempts"]) == 1


def test_a_training_that_fails_its_check_is_not_measured(tmp_path):
    runner = stub_runner(tmp_path)
    runner.verify = lambda folder: "it trained on other ids"
    with pytest.raises(RuntimeError, match="other ids"):
        run(runner, tmp_path / "run")
    assert read_run(tmp_path / "run")["status"] == "failed"


def test_selfspec_is_refused_where_it_built_a_cache_of_its_own(setup):
    setup.layouts.selfspec.mkdir(parents=True)
    assert frameworks.selfspec_used_the_capture(setup, setup.work) is None
    (setup.layouts.selfspec_root / "0123").mkdir()
    assert "tokenized the rows otherwise" in frameworks.selfspec_used_the_capture(setup, setup.work)


def test_a_work_folder_keeps_one_set_of_rows(tmp_path):
    check_manifest(tmp_path, {"budget": 10, "samples": "a"})
    check_manifest(tmp_path, {"budget": 10, "samples": "a"})
    with pytest.raises(SystemExit, match="budget"):
        check_manifest(tmp_path, {"budget": 20, "samples": "a"})


# ---- what each framework is handed ------------------------------------------------------------------------------
SMOLLM2_CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "vocab_size": 49152,
                  "num_hidden_layers": 30, "rope_parameters": {"rope_theta": 100000.0}, "tie_word_embeddings": True}


@pytest.fixture
def setup(tmp_path):
    from train.apps.bench.trainer_data import Layouts

    return frameworks.Setup(work=tmp_path, rows_file=tmp_path / "rows.jsonl", rows=100,
                            layouts=Layouts(tmp_path / "spec", tmp_path / "sf", tmp_path / "feat", "key", (2, 4, 5)),
                            target_name="smollm2-135m-instruct", peer_target=tmp_path / "target",
                            target_config=SMOLLM2_CONFIG, max_length=384, threads=2,
                            peers_python=Path("/peers/python"), speculators_seq_len=2048)


def test_every_framework_trains_at_ttt_depth_seven_on_one_epoch(setup, tmp_path):
    folder = tmp_path / "run"
    ours = frameworks.runner("selfspec", setup, 1).train(folder, False)
    assert "ttt_steps=7" in ours and "epochs=1" in ours and "eval_fraction=0" in ours and "seed=1" in ours
    assert f"feature_cache_dir={setup.layouts.selfspec_root}" in ours and "--resume" not in ours
    assert frameworks.runner("selfspec", setup, 1).train(folder, True)[-1] == "--resume"
    sf = frameworks.runner("specforge", setup, 1).train(folder, True)
    assert sf[0] == "/peers/python" and sf[-1] == f"training.resume_from={folder / 'out'}"
    config = json.loads((folder / "run.yaml").read_text())
    assert config["training"]["ttt_length"] == 7 and config["training"]["num_epochs"] == 1
    assert config["model"]["lm_head_key"] == "model.embed_tokens.weight"  # a tied target
    draft = json.loads((folder / "draft.json").read_text())
    assert draft["rope_theta"] == 100000.0 and draft["draft_vocab_size"] == 8192 and draft["num_hidden_layers"] == 1
    for name in ("speculators", "speculators-paper"):
        argv = frameworks.runner(name, setup, 1).train(folder, False)
        assert argv[argv.index("--ttt-steps") + 1] == "7" and argv[argv.index("--epochs") + 1] == "1"
        assert ("--no-norm-before-fc" in argv) == (name == "speculators-paper")
    with pytest.raises(ValueError, match="unknown framework"):
        frameworks.runner("medusa", setup, 0)


def test_a_variant_of_selfspecs_recipe_comes_after_the_recipe_and_is_named_by_it(setup, tmp_path):
    import dataclasses

    variant = dataclasses.replace(setup, selfspec_overrides=("batch_size=2", "mixed_precision=bf16"))
    argv = frameworks.runner("selfspec", variant, 0).train(tmp_path / "run", False)
    assert argv[-2:] == ["batch_size=2", "mixed_precision=bf16"]  # after the recipe's own settings: they win
    assert "save_every=5" in argv  # 100 rows in steps of 2: a tenth of its 50 steps
    assert frameworks.selfspec_label(variant.selfspec_overrides) == "selfspec[batch_size=2,mixed_precision=bf16]"
    assert frameworks.selfspec_label(()) == "selfspec"
    with pytest.raises(SystemExit):
        trainers.main(["--selfspec-set", "batch_size", "--no-measure", "--frameworks", "selfspec"])


def test_speculators_drafter_is_its_newest_numbered_checkpoint(tmp_path):
    out = tmp_path / "out"
    for name in ("0", "2", "10", "interrupted"):
        (out / name).mkdir(parents=True)
    (out / "checkpoint_best").symlink_to("2")
    assert frameworks.last_checkpoint(out) == out / "10"
    assert frameworks.last_checkpoint(tmp_path / "none") is None


# ---- measurement ------------------------------------------------------------------------------------------------
def test_every_drafter_is_measured_at_every_tree_and_kept(tmp_path):
    """tau counts the decoding steps after the prefill; a measurement is read back; an unreadable checkpoint is
    recorded as an import error, not raised."""
    import heads
    from train.apps.bench.trainer_eval import SETTINGS, TREES, measure

    target, tok = tiny_model("llama"), char_tokenizer()
    heads.build("eagle3", target, tokenizer=tok).save_pretrained(tmp_path / "drafter")
    sets = {"mt_bench": [torch.tensor([[5, 6, 7, 8]])], "alpaca_heldout": [torch.tensor([[9, 10, 11]])]}
    out = tmp_path / "tau.json"
    result = measure(tmp_path / "drafter", target, tok, sets, [torch.tensor([[12, 13, 14]])], 6, out)
    assert set(result["tau"]) == set(SETTINGS) and result["trees"]["chain7"] == TREES["chain7"]
    for setting in SETTINGS:
        for name in sets:
            r = result["tau"][setting][name]
            assert r["tokens"] == 5 and 1 <= r["steps"] <= 5 and r["tau"] == pytest.approx(5 / r["steps"], abs=1e-4)
    out.write_text(out.read_text().replace('"tokens": 5', '"tokens": 5, "kept": true', 1))
    calibration = [torch.tensor([[12, 13, 14]])]
    assert "kept" in json.dumps(measure(tmp_path / "drafter", target, tok, sets, calibration, 6, out))
    assert "kept" not in json.dumps(measure(tmp_path / "drafter", target, tok, sets, calibration, 4, out))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    assert "import_error" in measure(tmp_path / "broken", target, tok, sets, [], 6, tmp_path / "broken.json")


def test_a_measurement_of_some_trees_is_kept_apart_from_one_of_all(tmp_path):
    """`only` measures the trees named; its file is not read back for a measurement of every tree, nor the other
    way; drafters in folders of the same name get files of their own."""
    import heads
    from train.apps.bench.trainer_eval import SETTINGS, measure, tau_file_name

    target, tok = tiny_model("llama"), char_tokenizer()
    for folder in ("a", "b"):
        heads.build("eagle3", target, tokenizer=tok).save_pretrained(tmp_path / folder / "drafter")
    assert tau_file_name(str(tmp_path / "a" / "drafter")) != tau_file_name(str(tmp_path / "b" / "drafter"))
    assert tau_file_name("smollm2-135m-instruct-eagle3") == "tau-smollm2-135m-instruct-eagle3.json"
    sets, calibration = {"alpaca_heldout": [torch.tensor([[9, 10, 11]])]}, [torch.tensor([[12, 13, 14]])]
    out = tmp_path / "tau.json"
    some = measure(tmp_path / "a" / "drafter", target, tok, sets, calibration, 6, out, only=("chain7",))
    assert set(some["tau"]) == {"chain7"} and set(some["trees"]) == {"chain7"}
    every = measure(tmp_path / "a" / "drafter", target, tok, sets, calibration, 6, out)
    assert set(every["tau"]) == set(SETTINGS)
    assert set(measure(tmp_path / "a" / "drafter", target, tok, sets, calibration, 6, out,
                       only=("chain7",))["tau"]) == {"chain7"}


# ---- the report ----------------------------------------------------------------------------------------------------
def test_the_report_has_a_row_per_run_and_the_mean_and_spread_per_framework():
    def measured(value):
        return {"tau": {s: {"mt_bench": {"tau": value}, "alpaca_heldout": {"tau": value + 0.5}}
                        for s in ("chain7", "tree60", "calibrated")}, "trees": {"calibrated": {"depth": 1}}}

    record = {"status": "done", "wall_seconds": 100.0, "peak_rss_mb": 900.0, "attempts": [{"resumed": False}]}
    rows = [run_row("selfspec", 0, record, measured(2.0), tokens=1000),
            run_row("selfspec", 1, record, measured(2.2), tokens=1000),
            run_row("speculators", 0, record, {"import_error": "ValueError: norm_before_fc"}, tokens=1000)]
    assert rows[0]["train_tokens_per_s"] == 10.0 and rows[0]["tau/chain7/alpaca_heldout"] == 2.5
    mean = summary(rows)[0]
    assert mean["tau/tree60/mt_bench"] == pytest.approx(2.1) and mean["spread/tau/tree60/mt_bench"] == pytest.approx(0.2)
    text = to_markdown(rows, ["a note"])
    assert text.count("\n| selfspec |") == 2 and "**selfspec** (mean, ± spread)" in text and "2.10 ± 0.20" in text
    assert "- a note" in text and "speculators seed 0: ValueError: norm_before_fc" in text


# ---- the whole command, with the peers' environment ---------------------------------------------------------------
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PYTHON.is_file(), reason="the peers' environment is not built (make peers)")
def test_the_whole_benchmark_at_a_minimal_budget(tmp_path):
    """Every framework trains a few steps on the real target, is imported and measured; the table is written."""
    work = tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_trainers.py"), "--work", str(work), "--budget", "300",
           "--seeds", "0", "--prompts", "1", "--calibration-prompts", "1", "--max-new-tokens", "16",
           "--speculators-seq-len", "512"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    results = json.loads((work / "results.json").read_text())
    runs = {r["framework"]: r for r in results["runs"]}
    assert set(runs) == set(frameworks.FRAMEWORKS), done.stderr[-3000:]
    for name in ("selfspec", "specforge", "speculators-paper"):
        assert runs[name]["status"] == "done" and runs[name]["tau/chain7/mt_bench"] >= 1.0, runs[name]
    assert (work / "results.md").read_text().count("| speculators") >= 2
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert again.stdout.count(": kept,") == len(frameworks.FRAMEWORKS)  # nothing trained twice
