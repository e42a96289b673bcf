"""The user's objects are left as they were, generate means what transformers' generate means, and a
SelfSpecModel refuses to be driven from two threads at once (issue: nothing silently wrong)."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import pickle
import threading

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_model
from transformers import GenerationConfig

from infer import DraftModelDrafter, LookupFirstDrafter, SelfSpecModel

IDS = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])

DRAFTERS = {
    "ngram": lambda t: "ngram",
    "draft_model": lambda t: perturbed_copy(t),
    "adaptive": lambda t: DraftModelDrafter(perturbed_copy(t), adaptive=True),
    "bf16": lambda t: "bf16",
    "int8": lambda t: "int8",
    "early_exit": lambda t: "early_exit:2",
    "int4": lambda t: "int4",
    "layerskip": lambda t: "layerskip",
    "staged": lambda t: "staged:bf16+ngram",
    "lookup_first": lambda t: LookupFirstDrafter(DraftModelDrafter(perturbed_copy(t)), min_match=1),
    "suffix": lambda t: "suffix:early_exit:2",
    "lookahead": lambda t: "lookahead:4,3,4",
}


def heads_drafter(kind: str, target):
    import heads

    return heads.build(kind, target)


def module_state(model) -> list:
    return [(name, sorted(m.__dict__), m.training) for name, m in model.named_modules()]


@contextlib.contextmanager
def generating_in_another_thread(model):
    """`model.generate` running in another thread for the duration of the block: its streamer holds the call inside
    generate from its first token until the block ends, then the thread finishes."""
    started, release = threading.Event(), threading.Event()

    class Streamer:
        def put(self, value):
            started.set()
            release.wait(10)

        def end(self):
            pass

    first = threading.Thread(target=lambda: model.generate(IDS, max_new_tokens=4, streamer=Streamer()))
    first.start()
    assert started.wait(10)
    try:
        yield
    finally:
        release.set()
        first.join()


TRAINED_KINDS = ["medusa", "eagle", "eagle3", "dflash"]


@pytest.mark.parametrize("kind", [*DRAFTERS, *TRAINED_KINDS])
def test_target_is_left_as_it_was(kind):
    target = tiny_model("llama").train()  # a user mid-training: the mode must survive
    target.model.layers[1].eval()  # and per-module flags too
    weights = {k: v.clone() for k, v in target.state_dict().items()}
    before = module_state(target)
    drafter = heads_drafter(kind, target) if kind in TRAINED_KINDS else DRAFTERS[kind](target)
    model = SelfSpecModel(target, drafter)
    model.generate(IDS, max_new_tokens=12)
    assert module_state(target) == before  # no attribute, hook or packed weight left; modes restored
    assert all(torch.equal(v, weights[k]) for k, v in target.state_dict().items())
    copy.deepcopy(target)
    pickle.dumps(target)
    torch.save(target.state_dict(), io.BytesIO())
    torch.save(target, io.BytesIO())
    target.eval()
    own = target.generate(IDS, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=12), own)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_paused_during_generate_and_left_as_it_was(enabled):
    """The engine pauses Python's cyclic collector while it generates (a full collection over the heap costs
    several steps' worth of time); the user's setting comes back after, also when two threads generate at once
    and when a call fails."""
    target = tiny_model("llama")
    seen = []
    model = SelfSpecModel(target, "ngram", step_observer=lambda *args: seen.append(gc.isenabled()))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        model.generate(IDS, max_new_tokens=6)
        assert seen and not any(seen) and gc.isenabled() is enabled
        other = SelfSpecModel(target, "ngram")
        with generating_in_another_thread(model):  # the first call runs while the second one runs and ends
            other.generate(IDS, max_new_tokens=4)
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(ValueError):
            model.generate(IDS, max_new_tokens=-1)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_first_engine_freezes_the_heap_once_unless_told_not_to(monkeypatch):
    """freeze_gc (the default): the first engine made collects, then freezes what is alive, so that the full
    collections a pause only defers scan what came after; later engines freeze nothing more; freeze_gc=False never
    freezes."""
    from infer import engine

    calls = []
    monkeypatch.setattr(engine.gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(engine.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setitem(engine._gc_state, "frozen", False)
    target = tiny_model("llama")
    SelfSpecModel(target, "ngram", freeze_gc=False)
    assert calls == []
    SelfSpecModel(target, "ngram")
    assert calls == ["collect", "freeze"]
    model = SelfSpecModel(target, "ngram")
    assert calls == ["collect", "freeze"]
    expected = target.generate(IDS, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=8), expected)


def test_flex_attention_target_gets_its_attention_back():
    target = tiny_model("llama", attn_implementation="flex_attention")
    with pytest.warns(UserWarning, match="runs with 'sdpa' during generate"):
        model = SelfSpecModel(target, "ngram")
    expected = target.generate(IDS, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=10), expected)
    assert target.config._attn_implementation == "flex_attention"


def test_second_thread_is_refused_while_one_generates():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "ngram")
    with generating_in_another_thread(model), pytest.raises(RuntimeError, match="already generating in another thread"):
        model.generate(IDS, max_new_tokens=4)
    # the lock is released: the model works again, and one model per thread is the documented way
    assert torch.equal(model.generate(IDS, max_new_tokens=8), target.generate(IDS, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", [
    {"min_new_tokens": 10, "eos_token_id": 7},
    {"suppress_tokens": [20, 33, 5]},
    {"begin_suppress_tokens": [5, 20]},
    {"bad_words_ids": [[20], [9]]},
])
def test_supported_generation_config_fields_match_transformers(drafter, setting):
    target = tiny_model("llama")
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=0, **setting)
    expected = target.generate(IDS, generation_config=gc)
    model = SelfSpecModel(target, perturbed_copy(target) if drafter == "draft_model" else "ngram")
    assert torch.equal(model.generate(IDS, generation_config=gc), expected)


def test_min_new_tokens_really_changes_the_output():
    """Not vacuous: with the third greedy token as eos, plain decoding stops after 3 tokens; with
    min_new_tokens=10 both transformers and SelfSpecModel go on, identically."""
    target = tiny_model("llama")
    eos = int(target.generate(IDS, max_new_tokens=3, do_sample=False)[0, -1])
    plain = target.generate(IDS, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    held = target.generate(IDS, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0,
                           min_new_tokens=10)
    assert (plain[0, IDS.shape[1]:] != 0).sum() < (held[0, IDS.shape[1]:] != 0).sum()
    model = SelfSpecModel(target, "ngram")
    assert torch.equal(model.generate(IDS, max_new_tokens=16, eos_token_id=eos, pad_token_id=0,
                                      generation_config=GenerationConfig(min_new_tokens=10)), held)


def test_token_ids_and_lengths_in_the_forms_generate_takes():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "ngram")
    expected = target.generate(IDS, max_new_tokens=12, do_sample=False, eos_token_id=[40, 41], pad_token_id=0)
    for eos in ([40, 41], torch.tensor([40, 41]), np.array([40, 41])):
        for n in (12, np.int64(12), torch.tensor(12)):
            assert torch.equal(model.generate(IDS, max_new_tokens=n, eos_token_id=eos, pad_token_id=0), expected)
    one = target.generate(IDS, max_new_tokens=12, do_sample=False, eos_token_id=40, pad_token_id=0)
    assert torch.equal(model.generate(IDS, max_new_tokens=12, eos_token_id=np.int64(40), pad_token_id=0), one)


def test_eos_list_without_pad_pads_with_the_first_eos():
    target = tiny_model("llama")
    target.generation_config.pad_token_id = None
    ids = torch.tensor([[5, 9, 14, 5], [3, 3, 8, 7]])
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    eos = [int(reference[0, 6]), 1]  # row 0 stops early on its third new token; pad must be eos[0]
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    got = SelfSpecModel(target, "ngram").generate(ids, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(got, expected)


def test_too_many_new_tokens_for_the_context_warns():
    target = tiny_model("llama")  # 256 positions
    with pytest.warns(UserWarning, match="does not fit the target's context of 256 positions"):
        out = SelfSpecModel(target, "ngram").generate(IDS, max_new_tokens=1000, eos_token_id=[])
    assert out.shape[1] == 256


def test_seeded_sampling_with_a_draft_model_is_reproducible():
    target = tiny_model("llama")
    model = SelfSpecModel(target, perturbed_copy(target, scale=0.3))
    runs = [model.generate(IDS.repeat(4, 1), max_new_tokens=12, do_sample=True,
                           generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    torch.manual_seed(123)  # the global RNG must not matter
    runs.append(model.generate(IDS.repeat(4, 1), max_new_tokens=12, do_sample=True,
                               generator=torch.Generator().manual_seed(3)))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_short_context_draft_model_stops_drafting_instead_of_failing():
    """A gpt2 draft model with 24 positions drafting for a 256-position target: once a row outgrows the
    draft model's context the target goes on alone, with the same output."""
    target = tiny_model("gpt2")
    draft = tiny_model("gpt2", seed=3, n_positions=24)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[])
    model = SelfSpecModel(target, draft)
    assert torch.equal(model.generate(ids, max_new_tokens=40, eos_token_id=[]), expected)
    long_prompt = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(1))
    expected = target.generate(long_prompt, max_new_tokens=8, do_sample=False, eos_token_id=[])
    assert torch.equal(model.generate(long_prompt, max_new_tokens=8, eos_token_id=[]), expected)


def test_drafter_trained_with_another_tokenizer_is_refused_without_passing_one(tmp_path):
    """The target's own tokenizer is found beside it, so a mismatched drafter cannot slip through."""
    from test_bench import tiny_tokenizer

    import heads

    target = tiny_model("llama")
    tokenizer = tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter = heads.build("medusa", target)
    drafter.config.tokenizer_fingerprint = "0" * 16  # trained with some other tokenizer
    drafter.save_pretrained(tmp_path / "drafter")
    local = type(target).from_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="tokenizer fingerprint"):
        SelfSpecModel(local, heads.load(tmp_path / "drafter"))
    with pytest.raises(ValueError, match="tokenizer fingerprint"):
        SelfSpecModel.from_pretrained(str(tmp_path / "drafter"), target=local, tokenizer=tokenizer)


def test_from_pretrained_passes_engine_options_on_and_loader_keywords_to_the_target(tmp_path):
    """SelfSpecModel's own keywords set up the engine; the rest load the recorded target, so with a target given
    they are refused rather than dropped."""
    from test_bench import tiny_tokenizer

    import heads

    tiny_model("llama").save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    target = type(tiny_model("llama")).from_pretrained(tmp_path / "target")
    heads.build("eagle3", target).save_pretrained(tmp_path / "drafter")
    folder = str(tmp_path / "drafter")
    model = SelfSpecModel.from_pretrained(folder, lookup_first=True, int8_drafter=False, dtype=torch.bfloat16)
    assert isinstance(model.drafter, LookupFirstDrafter) and model.drafter.primary._int8 is None
    assert model.target.dtype == torch.bfloat16  # loaded with the loader's keyword
    model = SelfSpecModel.from_pretrained(folder, target=target, lookup_first=False)
    assert not isinstance(model.drafter, LookupFirstDrafter) and model.drafter._int8 is not None
    with pytest.raises(TypeError, match="revision: neither a SelfSpecModel option nor usable with target="):
        SelfSpecModel.from_pretrained(folder, target=target, revision="main")
