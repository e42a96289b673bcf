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

A bf16 head (a bf16 target's) is held the same way, an int8 copy of half its bytes (a Llama-3.2-1B shape's tied head:
525 MB -> 263 MB, a tenth of a step's reading). Its logits are fp32 sums of exact bf16 products, the same bound
holds, and each is rounded to bf16 as the target's own head rounds it; two tokens within two bf16 units of each other
may then tie, so the candidate test widens by that much (`_BF16_TIE`). A candidate is scored by the streamed kernel's
own bf16 tile, so its logit has the bits the full head on the kernel gives it. Where the CPU multiplies bf16 pairs
the int8 copy is multiplied in bf16 too (an int8 is exact in bf16), so it stays cheaper than the bf16 head at every
block size: on that 1B head (Zen 5, 2 threads) 4.9 / 5.8 / 8.2 / 19.7 ms at 1 / 4 / 9 / 17 rows against 10.8 / 12.9
/ 14.8 / 25.9.

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
# A bf16 logit is within 2^-8 of its magnitude of its fp32 sum: two tokens whose sums differ by up to 2^-7 of the
# largest |logit| may round to one value, where the first index wins.
_BF16_TIE = 2.0 ** -7
FULL_FRACTION = 0.125  # more candidates than this share of the vocabulary: the full head is cheaper


class ArgmaxHead:
    """An LM head `weight` [V, K] for greedy tokens: `logits(x, bias)` is exact at every token that could be
    the argmax and -inf elsewhere. Holds a reference to `weight` and an int8 copy of it (a quarter of its
    bytes); make a new one if the weight changes (the engine keeps it in its `linear.PackCache`, which
    does)."""

    def __init__(self, weight: torch.Tensor, kernel=None):
        """`weight`: fp32, or bf16 (a bf16 target's head: the int8 copy is half its bytes, and each logit is rounded to
        bf16 as the target's own head rounds it). `kernel`: a build of selfspec's CPU kernel (default: this machine's,
        `linear.streamed_kernel`)."""
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError(f"ArgmaxHead needs an fp32 or bf16 CPU weight [V, K], got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.kernel = linear.streamed_kernel() if kernel is None else kernel
        if self.kernel is None:
            raise ValueError("ArgmaxHead needs selfspec's CPU kernel, which could not be built here")
        self.weight = weight
        vocab, width = weight.shape
        k = width + 2  # the K products' sum, then the scale (and the bias)
        gamma = k * _U / (1 - k * _U)
        # int8 rows as linear.int8_rows makes them, and rho in float64, rounded up by the slack: one pass in the kernel
        self.q, self.scale, self.rho = self.kernel.int8_rows_radius(weight.detach(), gamma, _RELATIVE_SLACK)
        # a bf16 head's logits are rounded to bf16, and a token within two of its units of the winner may tie it then
        self.absolute_slack = _ABSOLUTE_SLACK + (_BF16_TIE if weight.dtype == torch.bfloat16 else 0.0)
        self.max_candidates = int(FULL_FRACTION * vocab)

    @torch.no_grad()
    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] hidden states (after the final norm; the head's dtype), the head's `bias` [V] or None -> [R, V]
        fp32: exact where a token could be the argmax, -inf elsewhere. A bf16 head's logits are its bf16 values,
        widened (the same argmax, first index on ties, without torch's slow bf16 argmax)."""
        x = x.contiguous()
        logits = self.kernel.argmax_logits(x, self.weight, self.q, self.scale, self.rho, bias, _RELATIVE_SLACK,
                                           self.absolute_slack, self.max_candidates)
        return logits if logits.numel() else self._full(x, bias)

    def _full(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Every logit: a bf16 head as the lean forward streams it (rounded as it rounds it, widened), an fp32 one
        by torch."""
        if self.weight.dtype == torch.bfloat16:
            full = self.kernel.few_rows_linear(x, self.weight, None if bias is None else bias.float())
            return full.to(torch.bfloat16).float()
        return F.linear(x, self.weight, bias)
