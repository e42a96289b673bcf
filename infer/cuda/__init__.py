"""GPU-only acceleration, in one place: what runs only where the step is captured (`infer.options.Plan.captured_step`).

- `graphs`: the target's verify forward as one CUDA graph per node bucket over the static KV cache (`StepGraphs`),
  and an EAGLE drafter's forwards as one graph per block shape over its own static cache (the engine hands
  `StepGraphs` to the drafter's `capture_forwards`); run uncaptured on the same buffers where there is no CUDA
  device.

The engine reaches it through this module only; whether it runs is settled before the engine exists
(`infer.policy.captured_step`).
"""

from __future__ import annotations

from . import graphs
from .graphs import StepGraphs

__all__ = ["StepGraphs", "graphs"]
