"""One sampling module for drafting and verification.

Lossless speculative sampling needs the target and the drafter to mean the same thing by temperature,
top-k and top-p, so both go through `logits_to_probs` with one `SamplingParams`. It applies transformers'
warpers' rules in the order `generate` applies them (temperature, top-k, top-p), but finds top-p's nucleus
from the head of the distribution (`_nucleus`) where transformers' `TopPLogitsWarper` sorts the whole
vocabulary: 3.7 ms a row for SmolLM2's 49,152 tokens on the project's 2-core CPU, paid at every verified node.
`sample` draws by the inverse of the cumulative distribution, one uniform number a row, where
`torch.multinomial` draws one exponential number per token (1.2 ms a row there).
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

NOT_A_DISTRIBUTION = "sample: every row of probabilities must be finite, non-negative and not all zero"
NUCLEUS_WIDTH = 64  # tokens a top-p nucleus is first looked for among; doubled while some row's nucleus is wider


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
            if not 0 < self.temperature < float("inf"):  # NaN too; infinity makes -inf logits NaN
                raise ValueError(f"temperature must be > 0 and finite when sampling, got {self.temperature}; "
                                 "use do_sample=False for greedy decoding")
            if not isinstance(self.top_k, int) or self.top_k < 0:
                raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def warpers(self) -> LogitsProcessorList:
        """transformers' own warpers for these settings: what `logits_to_probs` computes, the slow way (tests
        compare the two, and `_nucleus` falls back on top-p's for a nucleus wider than a quarter of the vocabulary)."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            procs.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(self.top_p))
        return procs


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, sync_free: bool = False) -> torch.Tensor:
    """Processed next-token distribution (float32) for logits [..., V]: transformers' warpers (temperature, then
    top-k, then top-p, `SamplingParams.warpers`) and a softmax. The tokens top-p keeps are transformers' but for
    float rounding at the nucleus' edge (its sums run in another order). `sync_free`: top-p's nucleus without a
    host read (`_nucleus`)."""
    shape = logits.shape
    scores = logits.reshape(-1, shape[-1]).float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:  # as TopKLogitsWarper: ties with the k-th stay
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(~_nucleus(scores, params.top_p, sync_free), -float("inf"))
    return torch.softmax(scores, dim=-1).reshape(shape)


def _nucleus(scores: torch.Tensor, top_p: float, sync_free: bool = False) -> torch.Tensor:
    """The tokens TopPLogitsWarper(top_p) keeps of scores [R, V], as a bool mask: those with less than top_p of the
    probability above them (transformers removes a token when its own mass and all below it come to at most
    1 - top_p), so at least the most likely. Read from the best `NUCLEUS_WIDTH` tokens, doubled until every row's
    nucleus ends among them; past a quarter of the vocabulary, transformers' own warper (a full sort).

    `sync_free` (a GPU's step): whether a nucleus ends among the best is a host read, so the whole vocabulary is
    ranked at once (a full sort); the sums over the best tokens are the ones a narrower width finds, so it keeps the
    tokens the head does, but for the order of tied scores."""
    probs = torch.softmax(scores, dim=-1)
    vocab = scores.shape[-1]
    width = vocab if sync_free else min(NUCLEUS_WIDTH, vocab)
    while True:
        best, index = probs.topk(width, dim=-1)  # [R, width], most likely first
        keep = best.cumsum(-1) - best < top_p  # the mass above each token
        if width == vocab or not keep.all(-1).any():  # every row's nucleus ends inside the best `width`
            return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, keep)
        if 2 * width > vocab // 4:
            return TopPLogitsWarper(top_p)(None, scores) > -float("inf")
        width *= 2


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [..., V] (finite, non-negative, not all zero): the first token whose cumulative
    probability exceeds a uniform draw over the row's total, sums in float64. A token of probability 0 is never
    drawn."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)  # [R, V]
    total = cdf[:, -1:]
    if not (torch.isfinite(total).all() and (total > 0).all() and (flat >= 0).all()):
        raise ValueError(NOT_A_DISTRIBUTION)
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=flat.device) * total
    token = torch.searchsorted(cdf, u, right=True)[:, 0]
    past = token == flat.shape[-1]  # u rounded up to the total (a draw within an ulp of 1): no token's sum exceeds it
    if past.any():  # then the last token of nonzero probability
        last = flat.shape[-1] - 1 - (flat.flip(-1) > 0).int().argmax(-1)
        token = torch.where(past, last, token)
    return token.reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """The target's own choice from logits [..., V]: argmax when greedy, else a processed sample."""
    if not params.do_sample:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)
