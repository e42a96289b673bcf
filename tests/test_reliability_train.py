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
