"""SuffixDrafter: earlier responses kept across generate calls (and bounded), a tree sized by the match, the
fallback where the match is short, exact greedy and sampled output with a warm cache, settings checked."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_model
from test_infer import RootAnd50, left_pad, prompts
from test_sampling import PROMPT, chi_square_p, exact_joint, sampled_pairs

from infer import DraftModelDrafter, SelfSpecModel
from infer.drafters.suffix import OwnTrees, ResponseCache, SuffixDrafter, TreeSize, frequency_tree
from infer.drafting import TargetStep

ARCTIC = importlib.util.find_spec("arctic_inference") is not None


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_target_generate_with_earlier_responses(arch, batch):
    """Asked again, every row drafts its own earlier answer from the response cache; asked something else,
    the cache holds only wrong guesses. Output equals the target's greedy output every time."""
    target = tiny_model(arch)
    model = SelfSpecModel(target, "suffix")
    forwards = []
    for seed in (3, 3, 4):
        ids, mask = left_pad(prompts(batch, seed=seed))
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24), expected)
        forwards.append(model.last_stats["target_forwards"])
    assert forwards[1] < forwards[0]  # the repeated request reuses the first answer
    assert model.drafter.trees.responses.num_tokens > 0


def test_repeated_request_accepts_long_drafts_and_clear_forgets():
    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    model = SelfSpecModel(target, SuffixDrafter(max_spec_tokens=16))
    model.generate(ids, max_new_tokens=40, eos_token_id=[])
    first = model.last_stats["accepted_lengths"]
    model.generate(ids, max_new_tokens=40, eos_token_id=[])
    second = model.last_stats["accepted_lengths"]
    # the drafted tree grows with the match: 1 node on the root alone, then doubling, capped at 16
    assert second[:4] == [2, 4, 8, 16] and len(second) < len(first)
    model.drafter.clear()
    assert model.drafter.trees.responses.num_tokens == 0
    model.generate(ids, max_new_tokens=40, eos_token_id=[])
    assert model.last_stats["accepted_lengths"] == first


def test_response_cache_evicts_oldest_first_and_never_grows_past_its_bound():
    cache = ResponseCache(max_tokens=100)
    rng = np.random.default_rng(0)
    added = []
    for _ in range(60):  # about 600 tokens into a 100-token bound
        added.append(rng.integers(0, 50, int(rng.integers(1, 20))))
        cache.add(added[-1])
        assert cache.num_tokens <= 100
        assert len(cache.corpus()) == cache.num_tokens + len(cache.responses)
    kept = list(cache.responses)
    assert all(np.array_equal(a, b) for a, b in zip(kept, added[-len(kept):], strict=True))  # the newest
    assert cache.num_tokens + len(added[-len(kept) - 1]) > 100  # the next older one would not have fit
    cache.add(np.arange(250))  # longer than the whole bound: its first 100 tokens, alone
    assert [len(r) for r in cache.responses] == [100] and cache.num_tokens == 100
    by_count = ResponseCache(max_tokens=10**6, max_requests=3)
    for i in range(7):
        by_count.add(np.full(4, i))
    assert [int(r[0]) for r in by_count.responses] == [4, 5, 6]
    by_count.clear()
    assert by_count.num_tokens == 0 and len(by_count.corpus()) == 0


def test_drafter_cache_bound_holds_across_many_generate_calls():
    target = tiny_model("qwen2")
    model = SelfSpecModel(target, SuffixDrafter(max_cached_tokens=50))
    for seed in range(8):  # 8 calls x 3 rows x up to 20 tokens: far more than 50
        ids, mask = left_pad(prompts(3, seed=seed))
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=20), expected)
        assert model.drafter.trees.responses.num_tokens <= 50
    assert model.drafter.trees.responses.num_tokens > 20  # it was filled, and evicted


def test_tree_size_follows_the_match_length():
    trees = OwnTrees(max_match=32, max_cached_tokens=1000, max_cached_requests=None, max_occurrences=256)
    size = TreeSize(max_spec_tokens=6, spec_factor=1.0, spec_offset=0.0, min_prob=0.0)
    text = np.array([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    # the context ends in a 3-token repeat of "11 12 13": 3 nodes, the continuation 14 15 16
    d = trees.speculate(0, np.concatenate([text, [11, 12, 13]]), size, depth=10)
    assert (d.match, d.tokens, d.parents) == (3, [14, 15, 16], [-1, 0, 1])
    # a 7-token repeat earns 7 nodes, capped at max_spec_tokens
    d = trees.speculate(0, np.concatenate([text, text[:7]]), size, depth=10)
    assert (d.match, d.tokens) == (7, [17, 18, 19, 20, 10, 11])
    assert trees.speculate(0, np.concatenate([text, text[:7]]), size, depth=2).tokens == [17, 18]
    assert trees.speculate(0, np.concatenate([text, [99]]), size, depth=10).tokens == []  # no match
    # an earlier response with a longer match and the same continuation outscores the request
    trees.stop(1, np.array([5, 6, 7, 11, 12, 13, 14, 15, 16, 17]))
    d = trees.speculate(0, np.array([1, 2, 6, 7, 11, 12, 13]), size, depth=10)
    assert d.match == 5 and d.tokens == [14, 15, 16, 17]


def test_frequency_tree_scores_by_counts():
    # after the match: 4 occurrences continue "a b" x2, "a c", "d"
    cont = np.array([[1, 2, -1], [1, 2, -1], [1, 3, -1], [4, -1, -1]])
    d = frequency_tree(cont, size=10, min_prob=0.2)
    assert d.tokens == [1, 2, 4, 3] and d.parents == [-1, 0, -1, 0]  # 0.75, 0.5, then 0.25 twice: found first
    assert d.score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25)
    assert frequency_tree(cont, size=2, min_prob=0.0).tokens == [1, 2]  # best first
    assert frequency_tree(cont, size=10, min_prob=0.3).tokens == [1, 2]


def test_fallback_takes_rows_whose_match_is_short():
    d = SuffixDrafter(fallback=RootAnd50(), min_match=3, spec_offset=2)
    d.bind(None, None, 2)
    # with their roots, row 0 ends in a repeated trigram (7 8 9), row 1 in a repeated unigram (2)
    seqs = torch.tensor([[7, 8, 9, 1, 7, 8], [7, 8, 9, 2, 4, 3]])
    d.observe(TargetStep(seqs, torch.ones_like(seqs, dtype=torch.bool), (), torch.tensor([9, 2])))
    tree = d.propose(torch.tensor([5, 5]))
    assert tree.tokens[0][tree.valid[0]].tolist() == [9, 1, 7, 8, 9]  # 3 + 2 nodes of "7 8 9 | 1 7 8 9"
    assert tree.tokens[1][tree.valid[1]].tolist() == [2, 50]  # the fallback's tree


def test_sampling_with_earlier_responses_matches_target_distribution():
    """The second call drafts from the first call's 4000 sampled responses (and rows that finish early feed
    the cache of rows still running): the samples must still follow the target's distribution."""
    target = tiny_model("llama", vocab_size=8, init_std=0.2)
    model = SelfSpecModel(target, "suffix")
    sampled_pairs(model, 1.0, 0, 1.0, seed=1)
    assert model.drafter.trees.responses.num_tokens > 0
    pairs = sampled_pairs(model, 1.0, 0, 1.0, seed=2)
    assert max(model.last_stats["accepted_lengths"]) >= 2
    p = chi_square_p(exact_joint(target, PROMPT, 1.0, 0, 1.0), pairs)
    assert p > 1e-3, f"speculative samples differ from the target's distribution (chi-square p={p:.2e})"


@pytest.mark.parametrize("kwargs,error,match", [
    ({"max_spec_tokens": 0}, ValueError, "max_spec_tokens must be 1..1024, got 0"),
    ({"max_spec_tokens": 5000}, ValueError, "max_spec_tokens must be 1..1024"),
    ({"max_spec_tokens": 4.0}, TypeError, "max_spec_tokens must be an int"),
    ({"spec_factor": 0.0}, ValueError, "spec_factor must be > 0.0"),
    ({"spec_factor": float("nan")}, ValueError, "spec_factor must be > 0.0"),
    ({"spec_offset": float("inf")}, ValueError, "spec_offset must be finite"),
    ({"min_prob": 1.5}, ValueError, r"min_prob must be in \[0.0, 1.0\]"),
    ({"min_prob": -0.1}, ValueError, "min_prob must be in"),
    ({"max_match": 0}, ValueError, "max_match must be 1..65536"),
    ({"max_cached_tokens": -1}, ValueError, "max_cached_tokens must be >= 0"),
    ({"max_cached_tokens": True}, TypeError, "max_cached_tokens must be an int"),
    ({"max_cached_requests": -2}, ValueError, "max_cached_requests must be >= 0"),
    ({"max_occurrences": 0}, ValueError, "max_occurrences must be >= 1"),
    ({"min_match": 40, "max_match": 32}, ValueError, "min_match must be 1..32"),
    ({"fallback": "ngram"}, TypeError, "fallback must be an infer.Drafter"),
    ({"backend": "vllm"}, ValueError, "backend must be 'ours' or 'arctic'"),
])
def test_bad_settings_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        SuffixDrafter(**kwargs)


@pytest.mark.parametrize("spec,match", [
    ("suffix:", "has nothing after ':'; write suffix"),
    ("suffix:hydra", "unknown drafter 'hydra'"),
    ("suffix:suffix", "must be another kind"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        SelfSpecModel(tiny_model("llama"), spec)


@pytest.mark.skipif(ARCTIC, reason="arctic-inference is installed here")
def test_arctic_backend_needs_the_package():
    with pytest.raises(ValueError, match="needs the arctic-inference package"):
        SelfSpecModel(tiny_model("llama"), "suffix:arctic")


@pytest.mark.skipif(not ARCTIC, reason="arctic-inference is not installed")
@pytest.mark.parametrize("batch", [1, 3])
def test_arctic_backend_is_exact_and_reuses_earlier_responses(batch):
    target = tiny_model("llama")
    ours, theirs = SelfSpecModel(target, "suffix"), SelfSpecModel(target, SuffixDrafter(backend="arctic",
                                                                                        max_cached_tokens=60))
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    forwards = {}
    for name, model in (("ours", ours), ("arctic", theirs)):
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24), expected)
            forwards.setdefault(name, []).append(model.last_stats["target_forwards"])
    assert forwards["arctic"][1] < forwards["arctic"][0] and forwards["ours"][1] < forwards["ours"][0]
    assert theirs.drafter.trees.num_tokens <= 60


def test_fallback_by_name_is_exact():
    target = tiny_model("gemma2")
    ids, mask = left_pad(prompts(3))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    model = SelfSpecModel(target, SuffixDrafter(fallback=DraftModelDrafter(perturbed_copy(target)), min_match=2))
    for _ in range(2):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=30), expected)


@pytest.mark.skipif(not ARCTIC, reason="arctic-inference is not installed")
def test_arctic_clear_forgets_the_last_calls_rows_too():
    """arctic keeps a running request's response in its global tree: clear() must drop the rows of the last
    call (not yet cached) as well, or a warm-up answer would help the first measured question."""
    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    model = SelfSpecModel(target, "suffix:arctic")
    model.generate(ids, max_new_tokens=40, eos_token_id=[])
    first = model.last_stats["target_forwards"]
    model.drafter.clear()
    model.generate(ids, max_new_tokens=40, eos_token_id=[])
    assert model.last_stats["target_forwards"] == first
