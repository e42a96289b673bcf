"""The target's greedy token without streaming its whole fp32 LM head: an int8 copy finds the candidates,
the fp32 rows score them.

A greedy verify needs, at every tree node, only the argmax of the target's logits. On SmolLM2-135M the LM
head (49,152 x 576, tied to the embedding) is 113 MB of the 538 MB a forward streams, a fifth of a verify's
reading. `ArgmaxHead` holds the head as int8 rows with one scale each
(28 MB) and, for every row of hidden states x, proves which tokens could still be the argmax:

    |approx_j - logit_j| <= ||x|| * rho_j

for any fp32 evaluation of logit_j = x . w_j (+ b_j), by Cauchy-Schwarz on the quantization residual
r_j = w_j - scale_j * q_j, plus the float rounding of both dot products (gamma_K ||x|| (||w_j|| +
||w^_j||), Higham's bound for a K-term sum; `rho` folds both in, computed in float64 when the head is made).
A token j is a candidate where approx_j + bound_j reaches max_k (approx_k - bound_k); the true argmax
always is one. Candidates are then scored exactly from the fp32 rows, and every other logit is -inf, so
the argmax (first index on ties, as torch's) is the one the full head would give, to float rounding
(already how the lean forward differs from transformers'). A row whose candidates cover too much of the
vocabulary, or whose hidden state is not finite, is scored in full.

Only the argmax survives, so the engine uses it only where nothing else is read from the logits: greedy
verification with no token bans (suppress_tokens, min_new_tokens), no typical acceptance (`infer.engine`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import linear

_U = 2.0 ** -24  # fp32 unit roundoff
# Covers the fp32 rounding of ||x||, of ||x|| * rho and of the sums and differences in the candidate test
# (each at most a few units of 2^-24 relative to the largest |logit| + bound of the row).
_RELATIVE_SLACK = 2.0 ** -10
_ABSOLUTE_SLACK = 2.0 ** -18
FULL_FRACTION = 0.125  # more candidates than this share of the vocabulary: the full fp32 head is cheaper


class ArgmaxHead:
    """An LM head `weight` [V, K] for greedy tokens: `logits(x, bias)` is exact at every token that could be
    the argmax and -inf elsewhere. Holds a reference to `weight` and an int8 copy of it (a quarter of its
    bytes); make a new one if the weight changes (the engine keeps it in its `linear.PackCache`, which
    does)."""

    def __init__(self, weight: torch.Tensor, kernel=None):
        """`kernel`: a build of selfspec's CPU kernel (default: this machine's, `linear.streamed_kernel`)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"ArgmaxHead needs an fp32 CPU weight [V, K], got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.kernel = linear.streamed_kernel() if kernel is None else kernel
        if self.kernel is None:
            raise ValueError("ArgmaxHead needs selfspec's CPU kernel, which could not be built here")
        self.weight = weight
        self.q, self.scale = linear.int8_rows(weight.detach())  # [V, K] int8, [V]
        with torch.no_grad():
            w = weight.detach().double()  # [V, K]
            approx = self.q.double() * self.scale.double()[:, None]  # w^ exactly: int8 times fp32 fits float64
            k = weight.shape[1] + 2  # the K products' sum, then the scale (and the bias)
            gamma = k * _U / (1 - k * _U)
            rho = (w - approx).norm(dim=1) + gamma * (w.norm(dim=1) + approx.norm(dim=1))
            self.rho = (rho * (1 + _RELATIVE_SLACK)).float()  # [V], rounded up by the slack
        self.max_candidates = int(FULL_FRACTION * weight.shape[0])

    @torch.no_grad()
    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] fp32 hidden states (after the final norm), the head's `bias` [V] or None -> [R, V]: exact
        where a token could be the argmax, -inf elsewhere."""
        x = x.contiguous()
        logits = self.kernel.argmax_logits(x, self.weight, self.q, self.scale, self.rho, bias, _RELATIVE_SLACK,
                                           _ABSOLUTE_SLACK, self.max_candidates)
        return logits if logits.numel() else F.linear(x, self.weight, bias)
