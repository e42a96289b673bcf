"""Drafters by name, seeds and export folders: what a user reaches by name does what it says, every time.

- A seeded sample is the same on every call of one SelfSpecModel, whatever the drafter carried over from
  earlier calls (calibration, measured costs, earlier responses) and however long its steps took.
- An export never writes into a folder of the user's: a target's folder, the drafter's own folder, any
  non-empty folder that is not an earlier export of ours is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from train_fixtures import save_tiny_target

import heads
from heads import publish
from infer import SelfSpecModel
from infer.drafters import DRAFTERS
from infer.drafters.draft_model import DraftModelDrafter
from train.apps import serve

PROMPT = torch.tensor([[5, 9, 14, 5, 9, 20, 5, 9, 14, 5, 9, 31, 7, 5, 9, 14]])

# A spec for every registered name that builds on the tiny llama (the argument where one is needed), and a few
# more that combine them. `gguf` needs the GGUF of the target itself: test_gguf.py's real model (below, slow).
NEEDS_ARGUMENT = {"early_exit": "early_exit:2", "staged": "staged:int8+ngram"}
SPECS = [NEEDS_ARGUMENT.get(name, name) for name in DRAFTERS if name != "gguf"]
SPECS += ["suffix:int8", "suffix:early_exit:2", "layerskip:0.25", "lookahead:5,4,5", "ngram:5"]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def sampled(model, seed: int = 0, tokens: int = 40) -> list[int]:
    out = model.generate(PROMPT, max_new_tokens=tokens, do_sample=True, eos_token_id=[],
                         generator=torch.Generator().manual_seed(seed))
    return out[0, PROMPT.shape[1]:].tolist()


# ---- a seed gives one sample -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_a_seeded_sample_is_the_same_on_every_call(target, spec):
    """Three calls of one model, a greedy call between them, and a new model: one sample. Before, the adaptive
    drafters' draft lengths followed wall-clock costs and acceptance carried over from earlier calls, and
    suffix drafted from the earlier calls' responses; the sample followed the drafts."""
    model = SelfSpecModel(target, spec)
    first = sampled(model)
    again = [sampled(model) for _ in range(2)]
    model.generate(PROMPT, max_new_tokens=30, eos_token_id=[])  # greedy: measures the drafter's costs
    again.append(sampled(model))
    again.append(sampled(SelfSpecModel(target, spec)))
    assert all(run == first for run in again), f"{spec}: {first} then {again}"


def test_an_earlier_response_drafts_and_changes_no_sample(target):
    """suffix keeps earlier responses and drafts from them (the test above would pass with a drafter that drafts
    nothing): here the repeated call's drafts are accepted, and the sample is still the one without drafts."""
    model = SelfSpecModel(target, "suffix")
    first = sampled(model, tokens=60)
    again = sampled(model, tokens=60)
    assert model.last_stats["mean_accepted_length"] > 3  # the first response drafted, nearly whole
    assert again == first == sampled(SelfSpecModel(target, "none"), tokens=60)


def test_adaptive_drafting_under_sampling_reads_no_clock(target, monkeypatch):
    """Draft lengths under sampling come from acceptance and the drafter's modelled cost, not from timings: with a
    clock that jumps at random the sample is unchanged (with the clock, before, the lengths changed with it)."""
    model = SelfSpecModel(target, "int8")
    first = sampled(model)
    jumps = torch.Generator().manual_seed(1)
    monkeypatch.setattr("infer.drafters.adaptive.time.perf_counter",
                        lambda: float(torch.rand((), generator=jumps)) * 1e3)
    assert sampled(model) == first
    assert isinstance(model.drafter, DraftModelDrafter) and model.drafter.length.cost is not None


def test_greedy_drafting_still_adapts_to_measured_costs(target):
    """The timed calibration of greedy calls is kept across calls as before (it never changes greedy output)."""
    model = SelfSpecModel(target, "int8")
    model.generate(PROMPT, max_new_tokens=30, eos_token_id=[])
    timed = model.drafter.length
    assert timed.cost is None and timed.draft_cost is not None and timed.judged_steps > 0
    model.generate(PROMPT, max_new_tokens=30, eos_token_id=[])
    assert model.drafter.length is timed


@pytest.mark.slow
def test_gguf_seeded_sample_is_the_same_on_every_call(smollm2):
    pytest.importorskip("llama_cpp", reason="the gguf drafter needs llama-cpp-python")
    target, tokenizer = smollm2
    model = SelfSpecModel(target, "gguf", tokenizer=tokenizer)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. The quick brown", return_tensors="pt").input_ids

    def run():
        return model.generate(ids, max_new_tokens=24, do_sample=True, eos_token_id=[],
                              generator=torch.Generator().manual_seed(0)).tolist()

    assert run() == run() == run()


# ---- drafter names and their arguments ---------------------------------------------------------------------


def test_ngram_argument_is_the_longest_ngram_matched(target):
    drafter = SelfSpecModel(target, "ngram:5").drafter
    assert (drafter.max_ngram, drafter.min_ngram) == (5, 1)


@pytest.mark.parametrize("spec, words", [
    ("ngram:0", "ngram:<longest n-gram>"), ("ngram:two", "ngram:<longest n-gram>"), ("ngram:-1", "ngram:<longest"),
    ("none:3", "'none' takes no argument"), ("bf16:", "nothing after ':'"), ("ngram:", "nothing after ':'"),
])
def test_drafter_arguments_are_parsed_or_refused(target, spec, words):
    with pytest.raises(ValueError) as info:
        SelfSpecModel(target, spec)
    assert words in str(info.value)


def test_every_drafter_without_an_argument_refuses_one(target):
    """Every registered name whose usage takes no argument refuses one by name, as 'bf16' always did."""
    plain = [name for name, entry in DRAFTERS.items() if ":" not in entry.usage]
    assert {"none", "bf16", "int8", "int4"} <= set(plain)
    for name in plain:
        with pytest.raises(ValueError) as info:
            SelfSpecModel(target, f"{name}:3")
        assert f"'{name}' takes no argument" in str(info.value)


def test_gguf_path_expands_home(monkeypatch, tmp_path):
    from infer.drafters.gguf import GGUFDrafter

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        GGUFDrafter("~/x.gguf")
    assert str(tmp_path / "x.gguf") in str(info.value) and "~" not in str(info.value)
    (tmp_path / "x.gguf").write_bytes(b"")
    try:
        assert GGUFDrafter("~/x.gguf").path == tmp_path / "x.gguf"
    except ImportError:  # no llama.cpp here: the file was found, which is what this test is about
        pass


# ---- export folders ----------------------------------------------------------------------------------------


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny target, and an EAGLE-3 drafter saved beside it that records it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("export")
    target = AutoModelForCausalLM.from_pretrained(save_tiny_target(root / "target"))
    # three distinct layers, as vLLM serves them (a 4-layer target's default repeats one)
    heads.build("eagle3", target, feature_layers=[1, 2, 3]).save_pretrained(root / "drafter")
    return root


@pytest.mark.parametrize("into", ["target", "drafter"])
def test_export_into_a_models_folder_is_refused_and_leaves_it_as_it_was(saved, into):
    from heads.export import export_speculators

    before = fingerprint(saved / into)
    with pytest.raises(ValueError) as info:
        export_speculators(heads.load(saved / "drafter"), saved / into)
    assert str(saved / into) in str(info.value) and "empty or new folder" in str(info.value)
    assert fingerprint(saved / into) == before


def test_export_into_a_folder_with_other_files_is_refused(saved, tmp_path):
    from heads.export import export_speculators

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export_speculators(heads.load(saved / "drafter"), tmp_path)
    assert fingerprint(tmp_path) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}


def test_an_earlier_export_is_replaced(saved, tmp_path):
    from heads.export import export_dflash, export_speculators, import_speculators

    drafter = heads.load(saved / "drafter")
    out = tmp_path / "export"
    export_dflash(heads.build("dflash", _target(saved)), out)
    assert (out / "mask_embedding.pt").is_file()
    export_speculators(drafter, out)  # an earlier export of ours, of another format: replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    export_speculators(drafter, out)
    back = import_speculators(out)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values(),
                                                 strict=True))


def _target(saved):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(saved / "target")


def test_serve_export_dir_of_the_drafter_itself_is_refused(saved, capsys):
    before = fingerprint(saved / "drafter")
    code = serve.main([str(saved / "drafter"), "--export-dir", str(saved / "drafter"), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and str(saved / "drafter") in err and "empty or new folder" in err, err
    assert fingerprint(saved / "drafter") == before
    assert json.loads((saved / "drafter" / "config.json").read_text())["model_type"] == "selfspec_eagle3"


def test_serve_dry_run_twice_replaces_its_own_export(saved, tmp_path, capsys):
    out = tmp_path / "served"
    for _ in range(2):
        code = serve.main([str(saved / "drafter"), "--export-dir", str(out), "--dry-run"])
        assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_push_to_hub_stage_dir_with_other_files_is_refused(saved, tmp_path, capsys):
    """--stage-dir re-saves the drafter there (config.json, model.safetensors, README.md): a folder of the user's
    that holds them is refused, not overwritten; an earlier staging is replaced."""
    stage = tmp_path / "mine"
    stage.mkdir()
    (stage / "README.md").write_text("my notes")
    argv = [str(saved / "drafter"), "--repo-id", "me/x", "--dry-run", "--stage-dir", str(stage)]
    with pytest.raises(ValueError) as info:
        publish.main(argv)
    assert str(stage) in str(info.value) and "empty or new folder" in str(info.value)
    assert fingerprint(stage) == {"README.md": hashlib.sha256(b"my notes").hexdigest()}
    again = tmp_path / "staged"
    for _ in range(2):
        assert publish.main([*argv[:-1], str(again)]) == 0
    assert sorted(p.name for p in again.iterdir()) == ["README.md", "config.json", "model.safetensors"]
