"""`speculators train` (speculators 0.9.0) on a CPU, run in the peers' environment (`make peers`).

Run by train/apps/bench/trainers.py as `.venv-peers/bin/python <this file> <speculators train arguments>`; it imports
only speculators and torch, never selfspec. The patches all undo "no accelerator, so assume CUDA":
 1. `Trainer.local_rank` (an int, 0) is used as the device (`model.to(0)`), which fails without an accelerator:
    it becomes "cpu";
 2. `Trainer.device_type` falls back to "cuda", which would make the bf16 autocast a disabled CUDA one: "cpu";
 3. the checkpointer's `get_current_device()` returns "cuda:0" when resuming: "cpu";
 4. `_StepTimer.mark`/`now` call `torch.accelerator.synchronize()` on logged steps: skipped without an accelerator.
Pass `--draft-attn-impl sdpa --loss-implementation eager` (flex attention and the fused loss need a GPU),
`--num-workers 0` and `--on-missing raise` (no vLLM endpoint to generate missing features).
"""

import sys
import time

import speculators.train.checkpointer as checkpointer
import speculators.train.trainer as trainer
import torch

_setup_trainer = trainer.Trainer.setup_trainer


def _setup_trainer_on_cpu(self):
    self.local_rank = "cpu"
    self.device_type = "cpu"
    return _setup_trainer(self)


def _mark(self, name):
    if self.enabled:
        self._marks[name] = time.perf_counter()


def _now(self):
    return time.perf_counter() if self.enabled else None


trainer.Trainer.setup_trainer = _setup_trainer_on_cpu
checkpointer.get_current_device = lambda: "cpu"
if not torch.accelerator.is_available():
    trainer._StepTimer.mark = _mark
    trainer._StepTimer.now = _now

if __name__ == "__main__":
    from speculators.cli import app

    sys.argv = ["speculators", "train", *sys.argv[1:]]
    app()
