"""Training inside a wall-clock budget.

The trainer counts optimizer steps, and its learning-rate schedule needs the total up front, so a budget in
minutes is turned into steps by timing the first ones: a probe run (the warm-up steps, which are the same
whatever the total) checkpoints and stops, then the run resumes from that checkpoint with as many steps as
the measured pace fits into the time left. The pace is the trainer's `seconds_per_step`, which leaves out
the first steps (on a GPU they cost several times a steady one). `max_train_minutes` is set too, as a
safety net: if the pace was wrong the run still ends in time, with its schedule cut short.
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
                 reserve_seconds: float = 0.0) -> dict:
    """Train for about `minutes` of wall clock, setup and final evaluation included; returns train()'s result
    with a "budget" record. `load(overrides)` builds the run's config; `probe_steps` defaults to the
    warm-up (at least 5); `reserve_seconds` is kept back for the final evaluation and saving."""
    tic = time.perf_counter()
    config = load({})
    probe_steps = probe_steps or max(config.warmup_steps, 5)
    guess = max(probe_steps + 1, config.max_steps)  # only sizes the progress bar; the probe stops early
    # overwrite: a resume must only ever find this run's probe, never an earlier run's checkpoints.
    probe = train(load({"max_steps": guess, "save_every": probe_steps, "halt_after_steps": probe_steps,
                        "overwrite": True}))
    probe_wall = time.perf_counter() - tic
    per_step = probe.get("seconds_per_step") or probe["train_seconds"] / max(probe["step"], 1)
    setup = probe_wall - probe["train_seconds"]  # the resumed run reads the data and loads the target again
    left = 60 * minutes - probe_wall - setup - reserve_seconds
    total = probe["step"] + max(1, int(left / per_step))
    print(f"[budget] pace {per_step:.3f} s/step after {probe['step']} probe steps: {total} steps in all fit "
          f"the {minutes:g} min budget", flush=True)
    with warnings.catch_warnings():  # by design: a new total after the warm-up, and no checkpoint after the probe's
        warnings.filterwarnings("ignore", message="resuming .* the run's length changed")
        warnings.filterwarnings("ignore", message="resuming .* save_every=0")
        result = train(load({"max_steps": total, "resume": True,
                             "max_train_minutes": max(left + 0.1 * 60 * minutes, 1.0) / 60}))
    shutil.rmtree(Path(config.output_dir) / "checkpoints", ignore_errors=True)
    result["budget"] = {"minutes": minutes, "probe_steps": probe["step"], "seconds_per_step": round(per_step, 4),
                        "planned_steps": total, "wall_seconds": round(time.perf_counter() - tic, 1)}
    return result
