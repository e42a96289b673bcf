"""Training inside a wall-clock budget.

The trainer counts optimizer steps, and its learning-rate schedule needs the total up front, so a budget in
minutes is turned into steps by timing the first ones: a probe run (the warm-up steps, which are the same
whatever the total) checkpoints and stops, then the run resumes from that checkpoint with as many steps as
the measured pace fits into the time left. The pace is the trainer's `seconds_per_step`, which leaves out
the first steps (on a GPU they cost several times a steady one). `max_train_minutes` is set too, as a
safety net: if the pace was wrong the run still ends in time, with its schedule cut short.

The probe's setup extracted and cached the target's features (offline features); the resumed run only reads
them, so its setup is charged the probe's setup less that extraction. On a slow machine the extraction alone can
take most of the budget: where the budget fits fewer than `min_steps`, the run says so and trains `min_steps`
anyway, past the budget and without the safety net, since a drafter of a few steps is worse than a late one.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from .config import TrainConfig
from .train_heads import train


def train_within(minutes: float, load: Callable[[dict], TrainConfig], probe_steps: int = 0,
                 reserve_seconds: float = 0.0, min_steps: int = 0) -> dict:
    """Train for about `minutes` of wall clock, setup and final evaluation included; returns train()'s result
    with a "budget" record (plan_steps's). `load(overrides)` builds the run's config; `probe_steps` defaults to
    the warm-up (at least 5); `reserve_seconds` is kept back for the final evaluation and saving; `min_steps`
    are trained however long they take."""
    tic = time.perf_counter()
    config = load({})
    probe_steps = probe_steps or max(config.warmup_steps, 5)
    guess = max(probe_steps + 1, config.max_steps, min_steps)  # only sizes the progress bar; the probe stops early
    # overwrite: a resume must only ever find this run's probe, never an earlier run's checkpoints.
    probe = train(load({"max_steps": guess, "save_every": probe_steps, "halt_after_steps": probe_steps,
                        "overwrite": True}))
    plan = plan_steps(minutes, time.perf_counter() - tic, probe, reserve_seconds, min_steps)
    print(f"[budget] pace {plan['seconds_per_step']:.3f} s/step after {probe['step']} probe steps; setup "
          f"{plan['setup_seconds']:.0f} s, {plan['feature_seconds']:.0f} of them extracting target features, which "
          f"the resumed run reads from the cache: {plan['fits_steps']} steps in all fit the {minutes:g} min budget",
          flush=True)
    if plan["planned_steps"] > plan["fits_steps"]:
        print(f"[budget] WARNING: the {minutes:g} min budget fits only {plan['fits_steps']} steps on this machine, "
              f"too few to train a drafter; training {plan['planned_steps']} steps anyway, about "
              f"{plan['over_budget_seconds'] / 60:.1f} min past the budget", flush=True)
    with warnings.catch_warnings():  # by design: a new total after the warm-up, and no checkpoint after the probe's
        warnings.filterwarnings("ignore", message="resuming .* the run's length changed")
        warnings.filterwarnings("ignore", message="resuming .* save_every=0")
        result = train(load({"max_steps": plan["planned_steps"], "resume": True,
                             "max_train_minutes": plan["max_train_minutes"]}))
    shutil.rmtree(Path(config.output_dir) / "checkpoints", ignore_errors=True)
    result["budget"] = {**plan, "wall_seconds": round(time.perf_counter() - tic, 1)}
    return result


def plan_steps(minutes: float, probe_wall: float, probe: dict, reserve_seconds: float = 0.0,
               min_steps: int = 0) -> dict:
    """The resumed run's total steps from the probe's result and wall clock: as many as fit the seconds left
    after the probe, the resumed run's setup and `reserve_seconds`, and at least `min_steps`."""
    per_step = probe.get("seconds_per_step") or probe["train_seconds"] / max(probe["step"], 1)
    setup = probe_wall - probe["train_seconds"]
    features = probe.get("feature_seconds", 0.0)
    # The resumed run reads the data and loads the target again, but not the features: they are cached now.
    left = 60 * minutes - probe_wall - (setup - features) - reserve_seconds
    fits = probe["step"] + max(1, int(left / per_step))
    total = max(fits, min_steps)
    return {"minutes": minutes, "probe_steps": probe["step"], "seconds_per_step": round(per_step, 4),
            "setup_seconds": round(setup, 1), "feature_seconds": round(features, 1), "fits_steps": fits,
            "min_steps": min_steps, "planned_steps": total,
            "over_budget_seconds": round((total - fits) * per_step, 1),
            # the safety net (0 = none) ends a run whose pace was misread; never one that is already past the budget
            "max_train_minutes": 0.0 if total > fits else max(left + 0.1 * 60 * minutes, 1.0) / 60}
