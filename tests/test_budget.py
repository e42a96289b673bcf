"""train/budget.py's plan on a simulated slow machine: the trainer is replaced by one that reports the timings
a slow 2-core CPU gave (a long target feature extraction in the probe's setup), on a clock the test moves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from train import budget

SETUP, EXTRACTION, PACE, PROBE = 20.0, 300.0, 1.0, 10  # seconds; seconds a step; the probe's steps


class SlowMachine:
    """train() as a slow CPU runs it: the first run extracts the target's features (EXTRACTION seconds), every
    later one reads them from the cache; each step takes PACE seconds."""

    def __init__(self):
        self.now, self.runs, self.cached = 0.0, [], False

    def perf_counter(self) -> float:
        return self.now

    def train(self, config) -> dict:
        self.runs.append(config)
        features = 0.0 if self.cached else EXTRACTION
        self.cached = True
        steps = (config.halt_after_steps or config.max_steps) - (PROBE if config.resume else 0)
        self.now += SETUP + features + steps * PACE
        return {"step": config.halt_after_steps or config.max_steps, "seconds_per_step": PACE,
                "train_seconds": steps * PACE, "feature_seconds": features, "drafter_dir": "unused"}


@pytest.fixture
def machine(monkeypatch):
    slow = SlowMachine()
    monkeypatch.setattr(budget, "time", SimpleNamespace(perf_counter=slow.perf_counter))
    monkeypatch.setattr(budget, "train", slow.train)
    return slow


def load(tmp_path):
    defaults = {"warmup_steps": PROBE, "max_steps": 0, "output_dir": str(tmp_path), "halt_after_steps": 0,
                "resume": False, "max_train_minutes": 0.0}
    return lambda extra: SimpleNamespace(**{**defaults, **extra})


def test_the_resumed_run_is_not_charged_the_probes_feature_extraction(machine, tmp_path):
    result = budget.train_within(12, load(tmp_path))
    # 720 s: the probe took 20 + 300 + 10; the resumed run's setup is 20 (it reads the cached features)
    left = 720 - (SETUP + EXTRACTION + PROBE * PACE) - SETUP
    resumed = machine.runs[-1]
    assert resumed.resume and resumed.max_steps == PROBE + int(left / PACE) == 380
    assert result["budget"]["planned_steps"] == 380 and result["budget"]["feature_seconds"] == EXTRACTION
    assert machine.now == pytest.approx(720)  # the plan spent the budget, no more and no less


def test_a_budget_too_small_for_the_minimum_says_so_and_trains_the_minimum(machine, tmp_path, capsys):
    # the demo's 6 minutes on the slow machine: 330 s of probe leave 10 steps after the probe
    result = budget.train_within(6, load(tmp_path), min_steps=150)
    resumed = machine.runs[-1]
    assert resumed.max_steps == 150 and resumed.max_train_minutes == 0  # no safety net cuts the minimum short
    plan = result["budget"]
    assert (plan["fits_steps"], plan["planned_steps"], plan["min_steps"]) == (20, 150, 150)
    printed = capsys.readouterr().out
    assert "fits only 20 steps" in printed and "150 steps anyway" in printed and "2.2 min past" in printed


def test_a_budget_that_fits_the_minimum_keeps_its_safety_net(machine, tmp_path, capsys):
    result = budget.train_within(12, load(tmp_path), min_steps=150)
    assert result["budget"]["planned_steps"] == 380 and "anyway" not in capsys.readouterr().out
    assert machine.runs[-1].max_train_minutes == pytest.approx((370 + 72) / 60)  # left + 10% of the budget
