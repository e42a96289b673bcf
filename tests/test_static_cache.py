"""The static-cache path (`SelfSpecModel(..., static_cache=...)`): the target's KV cache preallocated for the
generation and committed in place, verify blocks padded to fixed node counts, and with `compile=True` the
verify forward compiled. Output stays the target's own: greedy-identical on every architecture (batch 1 and
a left-padded batch), lossless under sampling; a request larger than the cache is refused before any work."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from conftest import ARCHITECTURES, perturbed_copy, tiny_model
from test_infer import left_pad, prompts
from test_sampling import PROMPT, V, chi_square_p, drafters, exact_joint

import heads
import infer.engine
from infer import SelfSpecModel
from infer.attention import prompt_tree
from infer.kv import VERIFY_BUCKETS, KVState, forward_block, verify_bucket

# a drafter of every shape of verify block: chains (n-gram, a draft model), a tree from the suffix cache,
# and lookahead's window of scored nodes beside its guesses
STATIC_DRAFTERS = {
    "ngram": lambda target: "ngram",
    "draft_model": lambda target: perturbed_copy(target),
    "suffix": lambda target: "suffix",
    "lookahead": lambda target: "lookahead:4,3,4",
    "eagle_dynamic_tree": lambda target: heads.build("eagle", target),  # EAGLE-2 trees, target features
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", list(STATIC_DRAFTERS))
def test_static_cache_is_greedy_exact(arch, drafter, batch):
    target = tiny_model(arch)
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = SelfSpecModel(target, STATIC_DRAFTERS[drafter](target), static_cache=True)
    for _ in range(2):  # the second call starts from a fresh cache of the same shape
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24)
        assert torch.equal(got, expected)
    if drafter == "draft_model":  # a perturbed copy's guesses land on every architecture: padded blocks accept
        assert max(model.last_stats["accepted_lengths"]) >= 2


@pytest.mark.parametrize("arch_name", sorted(ARCHITECTURES))
def test_static_cache_with_eager_attention(arch_name):
    target = tiny_model(arch_name, attn_implementation="eager")
    ids, mask = left_pad(prompts(3))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = SelfSpecModel(target, perturbed_copy(target), static_cache=True).generate(ids, attention_mask=mask,
                                                                                   max_new_tokens=20)
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_model("llama", vocab_size=V, init_std=0.2)


@pytest.mark.parametrize("kind", ["tree", "draft_model", "lookahead", "dflash_tree"])
def test_static_cache_sampling_is_lossless(sampling_target, kind, monkeypatch):
    # 2,000 rows of one batch: room for small blocks only, so the static buffers and masks stay small
    monkeypatch.setattr(infer.engine, "VERIFY_ROOM", 32)
    model = SelfSpecModel(sampling_target, drafters(sampling_target)[kind], static_cache=True)
    ids = torch.tensor([PROMPT]).repeat(2000, 1)
    out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, eos_token_id=[],
                         generator=torch.Generator().manual_seed(0))
    pairs = out[:, len(PROMPT):len(PROMPT) + 2]
    assert max(model.last_stats["accepted_lengths"]) >= 2
    p = chi_square_p(exact_joint(sampling_target, PROMPT, 0.7, 5, 1.0), pairs)
    assert p > 1e-3, f"static-cache samples differ from the target's distribution (chi-square p={p:.2e})"


def test_cache_is_written_and_committed_in_place():
    """Prefill, a verify block and its commit: the layers' buffers are the ones allocated first, of the full
    capacity, and hold exactly what a plain forward over the kept tokens computes."""
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 22, 31]])
    kv = KVState(1, ids.device, target.config, capacity=16)
    depth, ancestors, valid = prompt_tree(torch.ones_like(ids))
    with torch.no_grad():
        forward_block(target, kv, depth, ancestors, valid, input_ids=ids)
        kv.mark_valid(valid)
        buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.cache.layers]
        # a tree of 3 nodes: root 40 with children 41 and 42; keep the path root -> 42
        tokens = torch.tensor([[40, 41, 42]])
        block_depth = torch.tensor([[0, 1, 1]])
        block_ancestors = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        start = kv.size
        forward_block(target, kv, block_depth, block_ancestors, torch.ones_like(tokens, dtype=torch.bool),
                      input_ids=tokens)
        kv.commit(start, torch.tensor([[0, 2]]), torch.tensor([[True, True]]))
        reference = target(torch.tensor([[5, 9, 14, 22, 31, 40, 42]]), use_cache=True)
    assert kv.size == 7 and kv.length.tolist() == [7] and kv.pos[0].tolist() == list(range(7))
    for layer, ptrs, ref in zip(kv.cache.layers, buffers, reference.past_key_values.layers, strict=True):
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs and layer.keys.shape[2] == 16
        assert int(layer.cumulative_length) == 7  # the next block is written after the kept path
        torch.testing.assert_close(layer.keys[:, :, :7], ref.keys)
        torch.testing.assert_close(layer.values[:, :, :7], ref.values)


def test_the_cache_is_kept_for_later_calls_of_the_same_shape():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "ngram", static_cache=True)
    first, second = torch.tensor([[5, 9, 14, 5, 9, 14, 5]]), torch.tensor([[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]])
    model.generate(first, max_new_tokens=20)
    kv = model._cache
    buffers = [layer.keys.data_ptr() for layer in kv.cache.layers]
    got = model.generate(second, max_new_tokens=30)  # another prompt length: the same 256-slot cache
    assert model._cache is kv and [layer.keys.data_ptr() for layer in kv.cache.layers] == buffers
    assert torch.equal(got, target.generate(second, max_new_tokens=30, do_sample=False))
    model.free_cache()
    model.generate(first, max_new_tokens=20)
    assert model._cache is not kv


def test_verify_blocks_are_padded_to_a_few_shapes(monkeypatch):
    assert [verify_bucket(n) for n in (1, 3, 8, 9, 60, 128, 129, 300)] == [1, 4, 8, 16, 64, 128, 256, 384]
    import infer.engine

    target = tiny_model("llama")
    seen = []
    forward_block = infer.engine.forward_block

    def spy(model, kv, *args, **kwargs):  # every target forward of the engine: the prefill, then each verify
        seen.append(kwargs["input_ids"].shape[1])
        return forward_block(model, kv, *args, **kwargs)

    monkeypatch.setattr(infer.engine, "forward_block", spy)
    model = SelfSpecModel(target, "lookahead:4,3,4", static_cache=True)
    model.generate(torch.tensor([[5, 9, 14, 5, 9, 14, 5]]), max_new_tokens=24)
    assert seen[0] == 7  # the prefill is the prompt itself
    assert len(seen) == model.last_stats["target_forwards"] > 1
    assert set(seen[1:]) <= set(VERIFY_BUCKETS) and set(seen[1:]) != {1}


def test_request_larger_than_the_static_cache_is_refused_before_any_work():
    target = tiny_model("llama")
    calls = []
    target.register_forward_pre_hook(lambda module, args: calls.append(1))
    model = SelfSpecModel(target, "ngram", static_cache=20)
    ids = torch.tensor([[5, 9, 14, 22, 31, 7, 8]])
    with pytest.raises(ValueError, match=r"needs 31 slots; the static cache holds 20: raise static_cache"):
        model.generate(ids, max_new_tokens=24)
    assert calls == []
    expected = target.generate(ids, max_new_tokens=13, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=13), expected)  # 7 + 13 = 20 fits


@pytest.mark.parametrize("value", [0, -4, 2.5, "yes"])
def test_bad_static_cache_settings(value):
    with pytest.raises(ValueError, match="static_cache must be True, False, None or a number of tokens"):
        SelfSpecModel(tiny_model("llama"), "ngram", static_cache=value)


def test_a_block_larger_than_the_room_grows_the_cache_with_a_warning(monkeypatch):
    monkeypatch.setattr(infer.engine, "VERIFY_ROOM", 2)
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 14, 5]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=[])
    # exactly the request's slots plus 2: lookahead's blocks stop fitting near the end
    model = SelfSpecModel(target, "lookahead:4,3,4", static_cache=ids.shape[1] + 24)
    with pytest.warns(UserWarning, match="does not fit the static KV cache .* it grows"):
        got = model.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(got, expected)


def test_target_is_left_as_it_was_with_a_static_cache():
    target = tiny_model("llama").train()
    before = [(name, sorted(m.__dict__), m.training) for name, m in target.named_modules()]
    SelfSpecModel(target, "ngram", static_cache=True).generate(torch.tensor([[5, 9, 14, 5, 9]]), max_new_tokens=12)
    assert [(name, sorted(m.__dict__), m.training) for name, m in target.named_modules()] == before
    copy.deepcopy(target)
    pickle.dumps(target)


@pytest.mark.slow  # inductor compiles C++ on first use
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_compiled_verify_is_exact_and_compiles_once_per_shape(model_type):
    import torch._dynamo.utils

    target = tiny_model(model_type)
    ids, mask = left_pad(prompts(3))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    before = [(name, sorted(m.__dict__), m.training) for name, m in target.named_modules()]
    model = SelfSpecModel(target, "lookahead:4,3,4", static_cache=True, compile=True)
    graphs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24), expected)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        one = torch.tensor([[5, 9, 14, 5, 9, 14, 5]])
        assert torch.equal(model.generate(one, max_new_tokens=16),
                           target.generate(one, max_new_tokens=16, do_sample=False))
    failed = [str(w.message) for w in caught if "verify forward failed" in str(w.message)]
    assert not failed, failed
    assert model._verify_forward is not None
    assert graphs[1] == graphs[0]  # the second call of the same shapes reuses the first call's graphs
    assert [(name, sorted(m.__dict__), m.training) for name, m in target.named_modules()] == before


def test_compiler_failure_falls_back_with_one_warning(monkeypatch):
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)

    class HalfDoneThenFail:
        """What a graph that ran in part leaves: the first layer's cache written, then a compiler error."""

        def __init__(self, model):
            self.model, self.calls = model, 0

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, *args, cache=None, past_key_values=None, **kwargs):
            self.calls += 1
            layer = (cache or past_key_values).layers[0]
            layer.update(torch.zeros_like(layer.keys[:, :, :2]), torch.zeros_like(layer.values[:, :, :2]))
            raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: HalfDoneThenFail(model))
    model = SelfSpecModel(target, perturbed_copy(target), static_cache=True, compile=True)
    with pytest.warns(UserWarning, match=r"compiling the target's verify forward failed \(RuntimeError: no C\+\+"):
        got = model.generate(ids, max_new_tokens=24)
    assert torch.equal(got, expected)
    assert model._verify_forward is None
    assert max(model.last_stats["accepted_lengths"]) >= 2
