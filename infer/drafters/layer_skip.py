"""Layer skipping chosen on the fly: the target itself, minus the layers this request can spare, drafts.

No training and no per-model table (SWIFT, Xia et al. 2025, chooses the skipped layers per input from how
well the skipping model agrees with the target on it). Here, at each request's prefill:

1. one target forward over the last `window` prompt tokens gives, per decoder layer, how much it changes
   the residual stream (1 - cosine of its input and output, ShortGPT's block influence, Men et al. 2024)
   and the target's own next-token choices;
2. layers are skipped in order of least influence; for a few skip counts, the shallow model's next-token
   agreement alpha with the target on the same window is measured;
3. the count that maximizes expected tokens per unit of time is kept: a chain of K drafts yields
   (1 - alpha^(K+1)) / (1 - alpha) tokens for K draft forwards costing (kept / layers) of a target forward
   each, plus one verify.

The chosen model drafts a chain with adaptive length through `DraftModelDrafter`, with its own KV cache
(the target's cache is never touched). It shares the target's tensors (`shallow_model`), so it costs no
memory beyond that cache. The last decoder layer is always kept (its output is what the final norm reads).
`layerskip:<fraction>` skips that fraction of the layers, ranked the same way, without the search.
"""

from __future__ import annotations

import warnings

import torch

from ..drafting import TargetStep
from ..kv import KVState
from .draft_model import DraftModelDrafter
from .self_draft import MAX_TOKENS, _layer_count, shallow_model

WINDOW = 128  # prompt tokens the choice is made on
SKIP_FRACTIONS = (0.125, 0.25, 0.375, 0.5)  # skip counts tried by the search, as fractions of the layers
VERIFY_COST = 1.5  # a verify forward over a chain, in one-token target forwards (docs/benchmarks.md)


def from_spec(arg, target, tokenizer=None) -> LayerSkipDrafter:
    layers = _layer_count(target)
    if layers < 2:
        raise ValueError(f"layerskip needs a target with at least 2 decoder layers; "
                         f"{type(target).__name__} has {layers}")
    if not arg:
        return LayerSkipDrafter(target)
    try:
        fraction = float(arg)
    except ValueError:
        raise ValueError(f"write layerskip (chosen per request) or layerskip:<fraction of layers to skip>, "
                         f"e.g. layerskip:0.25; got {arg!r}") from None
    if not 0 < fraction < 1 or _count(fraction, layers) < 1:
        raise ValueError(f"layerskip:{arg} must skip at least one and fewer than all of the target's {layers} "
                         f"layers: a fraction in (0, 1), at least {1 / layers:.3g} here")
    return LayerSkipDrafter(target, fraction)


def _count(fraction: float, layers: int) -> int:
    """Layers skipped for a fraction; the last layer is never skipped."""
    return min(layers - 1, round(fraction * layers))


class LayerSkipDrafter(DraftModelDrafter):
    """Drafts with the target's own layers minus those chosen at each prefill (see the module docstring).
    `fraction` fixes how many are skipped; None searches it per request."""

    def __init__(self, target, fraction: float | None = None):
        self.target, self.fraction = target, fraction
        self.layers = _layer_count(target)
        super().__init__(shallow_model(target, list(range(self.layers))), num_tokens=MAX_TOKENS, adaptive=True)
        self.skipped: list[int] = []  # layers the current request's draft skips
        self.alpha: float | None = None  # measured agreement of that choice with the target

    def compile_forwards(self) -> bool:
        warnings.warn("compile=True: layerskip picks a new set of layers for every request, each of which would "
                      "compile anew (about a minute); it drafts without compiling", stacklevel=3)
        return True  # said here, in its own words

    def observe(self, step: TargetStep) -> None:
        if self.kv.size == 0 and not self.off:
            self._choose(step)
            self.kv = KVState(step.tokens.shape[0], step.tokens.device, self.model.config)
            if self.length is not None and self.length is not self.timed_length:  # sampling: the chosen model's cost
                self.length = self._sampled_length()
        super().observe(step)

    @torch.inference_mode()
    def _choose(self, step: TargetStep) -> None:
        """Pick the skipped layers from the longest row's last `window` prompt tokens."""
        row = int(step.valid.sum(1).argmax())
        ids = step.tokens[row][step.valid[row]][-WINDOW:][None]  # [1, T]
        out = self.target(input_ids=ids, output_hidden_states=True, use_cache=False)
        wanted = out.logits[0, :-1].argmax(-1)  # the target's next token at every position but the last
        states = out.hidden_states  # embeddings, then each layer's output; the last may be normed already
        influence = [1 - torch.cosine_similarity(states[i][0].float(), states[i + 1][0].float(), dim=-1).mean()
                     for i in range(self.layers - 1)]
        order = sorted(range(self.layers - 1), key=lambda i: float(influence[i]))  # least influential first
        fractions = (self.fraction,) if self.fraction is not None else SKIP_FRACTIONS
        counts = sorted({max(1, _count(f, self.layers)) for f in fractions})
        best = None
        for n in counts:
            skip = sorted(order[:n])
            model = shallow_model(self.target, [i for i in range(self.layers) if i not in skip])
            got = model(input_ids=ids, use_cache=False).logits[0, :-1].argmax(-1)
            alpha = float((got == wanted).float().mean()) if len(wanted) else 0.0
            speed = _tokens_per_cost(alpha, 1 - n / self.layers)
            if best is None or speed > best[0]:
                best = (speed, skip, model, alpha)
        _, self.skipped, self.model, self.alpha = best

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.skipped, self.alpha = [], None


def _tokens_per_cost(alpha: float, draft_cost: float, k: int = MAX_TOKENS) -> float:
    """Expected tokens per target-forward of cost, for the best chain length up to k (the adaptive length
    stops a chain that no longer pays, so a weak drafter runs short chains)."""
    alpha = min(alpha, 1 - 1e-6)
    return max((1 - alpha ** (j + 1)) / (1 - alpha) / (j * draft_cost + VERIFY_COST) for j in range(1, k + 1))
