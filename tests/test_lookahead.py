"""Lookahead decoding: the window's attention pattern, the n-gram pool, the merged guess tree, and that the
Jacobi window alone (no n-grams from the text) finds continuations the target accepts."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from infer import SelfSpecModel
from infer.drafters.lookahead import LookaheadDrafter, NgramPool, merged_tree, window_pattern


def test_window_pattern():
    # window 3, 2 levels: nodes 0..2 level 0 (offsets 1..3), nodes 3..5 level 1 (offsets 2..4)
    offsets, sees = window_pattern(3, 2)
    assert offsets.tolist() == [1, 2, 3, 2, 3, 4]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],  # level 1, column 0: level 0 column 0, then itself
        [1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    assert sees.int().tolist() == expected
    # what each node sees lies at consecutive positions 1, 2, ..., its own: one sequence after the root
    for node in range(6):
        assert sorted(offsets[sees[node]].tolist()) == list(range(1, int(offsets[node]) + 1))


def test_pool_keeps_the_most_recent_distinct_continuations():
    pool = NgramPool(size=2)
    pool.add(7, (1, 2))
    pool.add(7, (3, 4))
    pool.add(7, (1, 2))  # seen again: most recent
    pool.add(7, (5, 6))  # evicts (3, 4), the least recent
    assert pool.guesses(7) == [(5, 6), (1, 2)]
    assert pool.guesses(8) == []


def test_merged_tree_shares_prefixes():
    tokens, parents = merged_tree(9, [(1, 2, 3), (1, 2, 4), (5, 6, 7)])
    assert tokens == [9, 1, 2, 3, 4, 5, 6, 7]
    assert parents == [-1, 0, 1, 2, 2, 0, 5, 6]


def markov_target():
    """Attention outputs zeroed: the next token depends on the last one only, x -> f(x)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def test_jacobi_window_alone_speculates_and_its_ngrams_are_the_targets():
    """No n-grams from the text: every pool n-gram comes from the window. With a target whose next token
    depends on the last one only, each must be a chain x, f(x), f(f(x)), ... (the levels slide as they
    should), and guesses from them get accepted."""
    target = markov_target()
    ids = torch.tensor([[5, 9, 14, 22, 31, 40, 51, 63]])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[])
    drafter = LookaheadDrafter(window=6, ngram=4, guesses=6, context_ngrams=False)
    model = SelfSpecModel(target, drafter)
    assert torch.equal(model.generate(ids, max_new_tokens=40, eos_token_id=[]), expected)
    assert model.last_stats["mean_accepted_length"] > 1.5

    def f(x: int) -> int:
        with torch.no_grad():
            return int(target(torch.tensor([[x]])).logits[0, -1].argmax())

    entries = [(key, cont) for key, conts in drafter.pools[0].table.items() for cont in conts]
    assert len(entries) >= 6
    for key, cont in entries:
        chain = [key]
        for _ in cont:
            chain.append(f(chain[-1]))
        assert tuple(chain[1:]) == cont, (key, cont)


@pytest.mark.parametrize("batch", [1, 3])
def test_sampling_runs_with_one_hot_guesses(batch):
    target = tiny_model("qwen2")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9]]).repeat(batch, 1)
    model = SelfSpecModel(target, "lookahead:4,3,4")
    out = model.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=[],
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (batch, ids.shape[1] + 20)
