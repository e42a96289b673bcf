"""compile=True: the draft model's one-token forwards run through torch.compile (dynamic over the cache
length), output stays the target's greedy output, and a compiler failure falls back to eager drafting with
one warning, mid-generation, without corrupting the draft cache."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import perturbed_copy, tiny_model

from infer import SelfSpecModel
from infer.drafters.draft_model import DraftModelDrafter

pytestmark = pytest.mark.slow  # inductor compiles C++ on first use


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_compiled_draft_forward_is_exact(model_type):
    target = tiny_model(model_type)
    ids = torch.tensor([[5, 9, 14, 22, 31], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=[])
    model = SelfSpecModel(target, "early_exit:2", compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(2):  # the second call reuses the compiled graph
            got = model.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[])
            assert torch.equal(got, expected)
            if call == 0:  # later calls may draft less: the adaptive rule has timed this weak drafter
                assert max(model.last_stats["accepted_lengths"]) >= 2
    failed = [str(w.message) for w in caught if "compiling the draft forward failed" in str(w.message)]
    assert not failed, failed  # compiled for real (a batch of 2 once reached oneDNN ops inductor cannot take)
    assert model.drafter.decode is not None


def test_compiler_failure_falls_back_with_one_warning(monkeypatch):
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 22, 31]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=[])
    drafter = DraftModelDrafter(perturbed_copy(target), num_tokens=4)
    real_model = drafter.model

    class HalfDoneThenFail:
        """What a graph that ran in part leaves: the first layer's cache written, then a compiler error."""

        dtype = real_model.dtype
        calls = 0

        def __call__(self, *args, past_key_values=None, **kwargs):
            self.calls += 1
            layer = past_key_values.layers[0]
            layer.update(torch.zeros_like(layer.keys[:, :, :1]), torch.zeros_like(layer.values[:, :, :1]))
            raise RuntimeError("no C++ compiler found")

    failing = HalfDoneThenFail()
    monkeypatch.setattr(torch, "compile", lambda model, **kw: failing)
    model = SelfSpecModel(target, drafter, compile=True)
    with pytest.warns(UserWarning, match="compiling the draft forward failed \\(RuntimeError: no C\\+\\+ compiler"):
        got = model.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(got, expected)
    assert failing.calls == 1 and drafter.decode is None and drafter.model is real_model
    assert max(model.last_stats["accepted_lengths"]) >= 2  # the draft cache was put back: drafts still land


def test_compile_on_a_drafter_without_forwards_warns():
    with pytest.warns(UserWarning, match="NgramDrafter runs no forward of its own to compile"):
        SelfSpecModel(tiny_model("llama"), "ngram", compile=True)


def test_compile_on_layerskip_warns_and_drafts_eagerly():
    target = tiny_model("llama")
    with pytest.warns(UserWarning, match="layerskip picks a new set of layers for every request"):
        model = SelfSpecModel(target, "layerskip", compile=True)
    assert model.drafter.decode is None


def test_compile_reaches_the_drafter_behind_lookup_first():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "early_exit:2", lookup_first=True, compile=True)
    assert model.drafter.primary.decode is not None


def test_compile_on_staged_warns_and_drafts_eagerly():
    target = tiny_model("llama")
    with pytest.warns(UserWarning, match="staged drafting feeds the draft model blocks"):
        model = SelfSpecModel(target, "staged:int8+ngram", compile=True)
    assert model.drafter.decode is None
