"""One sampling module for drafting and verification.

Lossless speculative sampling needs the target and the drafter to mean the same thing by temperature,
top-k and top-p, so both go through `logits_to_probs` with one `SamplingParams`. The warpers are
transformers' own, in the order `generate` applies them (temperature, top-k, top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {self.do_sample!r}")
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}; "
                                 "use do_sample=False for greedy decoding")
            if not isinstance(self.top_k, int) or self.top_k < 0:
                raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def warpers(self) -> LogitsProcessorList:
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            procs.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(self.top_p))
        return procs


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution (float32) for logits [..., V]."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1]).float()
    flat = params.warpers()(None, flat)
    return torch.softmax(flat, dim=-1).reshape(shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """The target's own choice from logits [..., V]: argmax when greedy, else a processed sample."""
    if not params.do_sample:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)
