"""The training objective of a drafter: its kind's own (registered in heads/), an nn.Module so that
DDP/DeepSpeed wrap a single forward.

`objective(batch, features, stats=None, steps=None) -> (loss, logs)`: `batch` from `data.collate`,
`features` {layer: [B, T, D]} of the frozen target (ignored by an objective that runs its LoRA-adapted
target itself); `stats` (a `losses.StepStats`) collects per-depth accuracy at evaluation, `steps` deep
where the kind unrolls its own outputs.
"""

from __future__ import annotations

from torch import nn

import heads


def build_objective(drafter, config, lora_target=None) -> nn.Module:
    kind = heads.get_kind(drafter.kind)
    if lora_target is not None and not kind.trains_target_lora:
        raise ValueError(f"a {kind.name} drafter trains no LoRA on its target; set lora_r: 0")
    return kind.objective(drafter, config, lora_target)
