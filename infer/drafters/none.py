"""No drafts: each step verifies its root alone, one token a target forward through selfspec's own forward.

Not speculation. It is the baseline that tells what the engine's forward gains (the lean forward, and a target on
its 4-bit grid read as such) from what drafting gains on top of it: where a drafter's row runs no faster than this
one, its drafts do not pay on that machine."""

from __future__ import annotations

import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree
from .chain import chain_tree


class NoDrafter(Drafter):
    """Proposes nothing: every tree is its root."""

    pure_propose = True

    def observe(self, step: TargetStep) -> None:
        self.roots = step.next_tokens

    def propose(self, budget: torch.Tensor) -> DraftTree:
        rows = self.roots.shape[0]
        return chain_tree(self.roots, self.roots.new_zeros(rows, 0), self.roots.new_zeros(rows))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.roots = self.roots[rows]


def from_spec(arg: str | None, target, tokenizer=None) -> NoDrafter:
    if arg is not None:
        raise ValueError(f"'none' takes no argument, got {arg!r}; write none")
    return NoDrafter()
