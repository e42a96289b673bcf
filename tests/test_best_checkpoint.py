"""The checkpoint that decodes best: evaluations report the simulated acceptance of the drafter's tree
(`simulated_tau`), <output_dir>/best holds the drafter of the evaluation where it was highest, and
early_stop_patience ends a run once it stops rising.

The runs here learn, then diverge: the learning rate warms up past what the tiny EAGLE drafter can take
(constant schedule, warm-up longer than the run), so simulated_tau peaks early while the run goes on."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import conversations, save_tiny_target, write_messages

import heads
from heads.losses import RANKS, StepStats, simulated_tau
from train.config import load_config
from train.train_heads import train

DIVERGING = {"drafter": "eagle", "batch_size": 8, "lr": 0.3, "lr_schedule": "constant", "warmup_steps": 40,
             "max_steps": 40, "eval_every": 4, "eval_fraction": 0.2, "eval_steps_depth": 2, "features": "offline",
             "progress_bar": False, "log_every": 0}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    return {"root": root, "target": save_tiny_target(root / "target"),
            "data": write_messages(root / "data.jsonl", conversations(48))}


def run(workspace, out: str, **overrides) -> dict:
    values = {"target": workspace["target"], "data": workspace["data"], "output_dir": str(workspace["root"] / out),
              "feature_cache_dir": str(workspace["root"] / "cache"), **DIVERGING, **overrides}
    return train(load_config(None, values))


def evaluated(result: dict) -> dict[int, float]:
    return {h["step"]: h["eval/simulated_tau"] for h in result["history"] if "eval/simulated_tau" in h}


def test_best_holds_the_drafter_of_the_highest_simulated_tau_not_the_last(workspace):
    result = run(workspace, "diverging", save_every=4, keep_checkpoints=20)
    taus = evaluated(result)
    assert sorted(taus) == list(range(4, 40, 4))
    best_step = max(taus, key=taus.get)
    assert result["best"]["step"] == best_step and result["best"]["simulated_tau"] == taus[best_step]
    # the run goes on past its best: the last drafter is not the best one
    assert best_step < result["step"] and result["eval"]["simulated_tau"] < taus[best_step]
    out = workspace["root"] / "diverging"
    best = heads.load(out / "best")
    assert best.config.training["steps"] == best_step and best.config.metrics["simulated_tau"] == taus[best_step]
    saved = load_file(out / "best" / "model.safetensors")
    at_best = load_file(out / "checkpoints" / f"step_{best_step:08d}" / "model.safetensors")
    last = load_file(out / "drafter" / "model.safetensors")
    assert saved.keys() and all(torch.equal(saved[k], at_best[f"drafter.{k}"]) for k in saved)
    assert not all(torch.equal(saved[k], last[k]) for k in saved)
    assert sorted(p.name for p in out.iterdir() if "best" in p.name) == ["best"]  # no partial or old copy left
    assert json.loads((out / "result.json").read_text())["best"]["step"] == best_step


def test_early_stop_ends_the_run_after_patience_evaluations_without_a_better_tau(workspace):
    full = evaluated(run(workspace, "full_for_patience", keep_best=False))
    best_step = max(full, key=full.get)
    result = run(workspace, "patience", early_stop_patience=2)
    assert result["step"] == best_step + 2 * DIVERGING["eval_every"] < DIVERGING["max_steps"]
    assert result["stopped_early"]["early_stop_patience"] == 2
    assert result["best"]["step"] == best_step and (workspace["root"] / "patience" / "drafter").is_dir()
    assert not (workspace["root"] / "full_for_patience" / "best").exists()  # keep_best=false


def test_early_stop_needs_evaluations():
    with pytest.raises(ValueError, match="early_stop_patience=3 stops on held-out evaluations: set eval_every"):
        load_config(None, {"data": "d.jsonl", "early_stop_patience": 3})


def ranks(per_depth: list[list[float]]) -> torch.Tensor:
    """[D, RANKS] probabilities of the label at rank r, from the first ranks given per depth."""
    out = torch.zeros(len(per_depth), RANKS, dtype=torch.float64)
    for d, probs in enumerate(per_depth):
        out[d, :len(probs)] = torch.tensor(probs)
    return out


def test_simulated_tau_of_a_chain_a_static_tree_and_a_dynamic_tree():
    probs = ranks([[0.8, 0.1, 0.05], [0.5, 0.2], [0.4]])
    # a chain: 1 + a0 + a0 a1 + a0 a1 a2
    assert simulated_tau(probs, {"top_k": 1}) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.4)
    # a static tree: every node's path probability
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    expected = 1 + 0.8 + 0.1 + 0.8 * 0.5 + 0.8 * 0.2 + 0.1 * 0.5 + 0.8 * 0.5 * 0.4
    assert simulated_tau(probs, {"paths": paths}) == pytest.approx(expected)
    # a dynamic tree two wide and two deep: the top-2 hit rate per depth, cut at its depth
    assert simulated_tau(probs, {"top_k": 2, "depth": 2}) == pytest.approx(1 + 0.9 + 0.9 * 0.7)
    # nodes deeper than the evaluation measured count nothing
    assert simulated_tau(probs[:1], {"paths": paths}) == pytest.approx(1 + 0.8 + 0.1)


def test_step_stats_report_simulated_tau_for_the_drafters_tree():
    stats = StepStats(2)
    stats.add(0, torch.tensor([0, 0, 0, 1]))  # label at rank 0 three times in four, rank 1 once
    stats.add(1, torch.tensor([0, RANKS, 2, 0]))
    out = stats.summary("step", {"top_k": 1})
    assert out["step0/top1"] == 0.75 and out["step1/top3"] == 0.75
    assert out["simulated_tau"] == out["est_accept_len"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    assert StepStats.from_tensor(stats.tensor()).summary("step", {"top_k": 3})["simulated_tau"] == \
        pytest.approx(1 + 1.0 + 1.0 * 0.75)


def test_a_resumed_run_keeps_its_best_and_its_patience(workspace):
    """The best value and the evaluations since it are saved in checkpoints: killed after its best and resumed,
    a run stops where the uninterrupted one does, its best/ still the same step's."""
    common = dict(early_stop_patience=2, save_every=4)
    straight = run(workspace, "straight_patience", **common)
    halted = run(workspace, "resumed_patience", halt_after_steps=straight["best"]["step"] + 4, **common)
    assert halted["halted"]
    resumed = run(workspace, "resumed_patience", resume=True, **common)
    assert resumed["step"] == straight["step"] and resumed["best"] == {
        **straight["best"], "drafter_dir": str(workspace["root"] / "resumed_patience" / "best")}
    saved = [load_file(workspace["root"] / out / "best" / "model.safetensors")
             for out in ("straight_patience", "resumed_patience")]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
