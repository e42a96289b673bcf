"""The oracle drafter (a benchmark's instrument): exact output, acceptance set by alpha alone, and a clear
error without the answer; and its bench row, with the engine's share of a step and the ideal."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model

from infer import SelfSpecModel
from infer.drafters.oracle import OracleDrafter, expected_tokens_per_step


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def greedy_answer(target, ids, n):
    out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
    return out[0, ids.shape[1]:].tolist()


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 8) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_acceptance_follows_alpha_and_output_is_exact(target, alpha):
    ids = torch.tensor([[3, 17, 42, 8, 90, 5]])
    answer = greedy_answer(target, ids, 240)
    drafter = OracleDrafter(alpha, depth=4, seed=1)
    model = SelfSpecModel(target, drafter)
    drafter.expect([answer])
    out = model.generate(ids, max_new_tokens=240, eos_token_id=[])
    assert out[0, ids.shape[1]:].tolist() == answer
    steps = model.last_stats["accepted_lengths"][:-1]  # the last step may be cut by the budget
    mean = sum(steps) / len(steps)
    # alpha 0 and 1 are exact; 0.6 over ~100 steps within about three standard errors of the 2.31 expected
    assert mean == pytest.approx(expected_tokens_per_step(alpha, 4), abs=0.3 if 0 < alpha < 1 else 1e-9)


def test_answer_is_required_and_checked(target):
    ids = torch.tensor([[3, 17, 42, 8]])
    with pytest.raises(ValueError, match="call expect\\(\\) before generate"):
        SelfSpecModel(target, OracleDrafter(0.8)).generate(ids, max_new_tokens=8, eos_token_id=[])
    drafter = OracleDrafter(0.8)
    answer = greedy_answer(target, ids, 8)
    drafter.expect([[(answer[0] + 1) % VOCAB] + answer[1:]])
    with pytest.raises(ValueError, match="needs the target's own greedy output"):
        SelfSpecModel(target, drafter).generate(ids, max_new_tokens=8, eos_token_id=[])
    with pytest.raises(ValueError, match="alpha must be in"):
        OracleDrafter(1.5)


def test_bench_oracle_row_reports_engine_share_and_ideal(tmp_path):
    from test_bench import tiny_target, tiny_tokenizer

    from train.apps import bench

    target, tokenizer = tiny_target(), tiny_tokenizer()
    questions = [{"question_id": 1, "category": "a", "turns": ["w10 w11 w12"]},
                 {"question_id": 2, "category": "b", "turns": ["w30 w31"]}]
    methods = [bench.hf_method(target, bench.BASELINE), bench.oracle_method(target, 1.0, depth=3)]
    result = bench.run_bench(target, tokenizer, questions, methods, max_new_tokens=24, progress=False)
    row = result["per_category"]["overall"]["oracle:1"]
    assert not result["mismatches"]
    assert row["tau"] == pytest.approx(48 / (2 + 2 * 6))  # per question: the prefill, then 6 steps of 4 (the last 3 + 1)
    assert row["ideal_tokens_per_step"] == 4.0 and row["fraction_of_ideal"] > 0
    assert row["target_ms_per_step"] > 0 and "engine_ms_per_step" in row
    assert "| oracle:1 |" in bench.to_markdown(result).split("Where a step's time goes")[1]


def test_tree_paths_are_the_most_likely_and_closed():
    from infer.drafters.oracle import oracle_paths

    paths = oracle_paths(0.8, 6, 8, 60)
    assert len(paths) == 60 and max(map(len, paths)) <= 6 and max(r for p in paths for r in p) < 8
    chosen = set(paths)
    assert all(p[:-1] in chosen or len(p) == 1 for p in paths)  # every prefix is in
    assert all(p[-1] == 0 or (*p[:-1], p[-1] - 1) in chosen for p in paths)  # every lower sibling is in
    assert oracle_paths(0.8, 4, 1, 10) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]  # top-1: a chain
    # a tree of chain shape expects what the chain does; a wider one more
    assert expected_tokens_per_step(0.8, 4, 1, 4) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert expected_tokens_per_step(0.6, 6, 8, 60) > expected_tokens_per_step(0.6, 6)


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_tree_acceptance_follows_alpha_and_output_is_exact(target, alpha):
    ids = torch.tensor([[3, 17, 42, 8, 90, 5]])
    answer = greedy_answer(target, ids, 200)
    drafter = OracleDrafter(alpha, depth=6, top_k=8, total_tokens=60, seed=2)
    model = SelfSpecModel(target, drafter)
    drafter.expect([answer])
    out = model.generate(ids, max_new_tokens=200, eos_token_id=[])
    assert out[0, ids.shape[1]:].tolist() == answer
    steps = model.last_stats["accepted_lengths"][:-1]
    assert sum(steps) / len(steps) == pytest.approx(expected_tokens_per_step(alpha, 6, 8, 60), abs=0.6)


def test_following_oracle_keeps_going_where_the_target_leaves_its_answer(target):
    ids = torch.tensor([[3, 17, 42, 8]])
    answer = greedy_answer(target, ids, 40)
    wrong = answer[:5] + [(answer[5] + 1) % VOCAB] + answer[6:]
    drafter = OracleDrafter(0.9, depth=4, follow=True)
    drafter.expect([wrong])
    out = SelfSpecModel(target, drafter).generate(ids, max_new_tokens=40, eos_token_id=[])
    assert out[0, ids.shape[1]:].tolist() == answer and drafter.followed == 1
    # a seed given to expect() starts the draws again: the same trees, the same steps
    lengths = []
    model = SelfSpecModel(target, drafter)
    for _ in range(2):
        drafter.expect([answer], seed=7)
        model.generate(ids, max_new_tokens=40, eos_token_id=[])
        lengths.append(model.last_stats["accepted_lengths"])
    assert lengths[0] == lengths[1]
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        OracleDrafter(0.5, top_k=0)
