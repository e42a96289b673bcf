"""Prompt lookup where the context repeats itself, another drafter elsewhere."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree, ScoredNodes
from .ngram import NgramDrafter, to_device


class LookupFirstDrafter(Drafter):
    """Prompt lookup where the context repeats itself, another drafter everywhere else.

    Each step, a row whose last `min_match` tokens (or more) occur earlier in its context takes the n-gram
    chain (copying from the prompt: extraction, code edits, quotes), every other row the `primary` tree.
    Both drafters observe every step. Verification is the same for any tree, so output stays exact.
    """

    def __init__(self, primary: Drafter, lookup: NgramDrafter | None = None, min_match: int = 3):
        self.primary, self.lookup = primary, lookup or NgramDrafter()
        if not 1 <= min_match <= self.lookup.max_ngram:
            raise ValueError(f"min_match must be in 1..{self.lookup.max_ngram} (the lookup's max_ngram), "
                             f"got {min_match}")
        self.min_match = min_match
        self.feature_layers = primary.feature_layers
        self.model = getattr(primary, "model", None)  # its linears get the engine's CPU prepacking too

    @property
    def sync_free(self) -> bool:
        return self.primary.sync_free

    @sync_free.setter
    def sync_free(self, value: bool) -> None:  # the engine's captured step: neither drafter reads the device
        self.primary.sync_free = self.lookup.sync_free = value

    def check_target(self, target) -> None:
        self.primary.check_target(target)

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.primary.bind(target, sampling, batch_size, generator)
        self.lookup.bind(target, sampling, batch_size, generator)

    def observe(self, step: TargetStep) -> None:
        self.primary.observe(step)
        self.lookup.observe(step)

    def propose(self, budget: torch.Tensor) -> DraftTree:
        chain, matched = self.lookup.lookup(budget)  # matched: on the host, as the lookup ran there
        use_chain = [n >= self.min_match for n in matched]
        if all(use_chain) and getattr(self.primary, "pure_propose", False):
            return chain
        tree = self.primary.propose(budget)
        if not any(use_chain):
            return tree
        return _pick_rows(to_device(np.array(use_chain), chain.tokens.device), chain, tree)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.primary.select_rows(rows)
        self.lookup.select_rows(rows)


def _pick_rows(take_a: torch.Tensor, a: DraftTree, b: DraftTree) -> DraftTree:
    """Row r of the result is a's row r where take_a[r], else b's; the narrower tree is padded with
    invalid nodes, and deterministic drafts get one-hot q when the other tree carries q."""
    n = max(a.num_nodes, b.num_nodes)

    def widened(t: DraftTree, vocab: int | None):
        pad = n - t.num_nodes
        tokens = F.pad(t.tokens, (0, pad))
        parents = F.pad(t.parents, (0, pad))  # pads hang off the root, invalid
        valid = F.pad(t.valid, (0, pad), value=False)
        q = None
        if vocab is not None:
            q = t.q if t.q is not None else F.one_hot(t.tokens, vocab).float()
            q = F.pad(q, (0, 0, 0, pad))
        return tokens, parents, valid, q

    vocab = next((t.q.shape[-1] for t in (a, b) if t.q is not None), None)
    wa, wb = widened(a, vocab), widened(b, vocab)
    pick = [torch.where(take_a.view(-1, *[1] * (x.dim() - 1)), x, y) if x is not None else None
            for x, y in zip(wa, wb, strict=True)]
    return DraftTree(*pick, scored=_pick_scored(take_a, a, b, n))


def _pick_scored(take_a: torch.Tensor, a: DraftTree, b: DraftTree, n: int) -> ScoredNodes | None:
    """The scored nodes of each row's chosen tree, attend columns widened to `n` tree nodes. A row whose
    chosen tree has none keeps the other tree's where they see no tree node but the root (the two trees
    share it); elsewhere they are invalid, and the drafter sees `scored_valid` False."""
    if a.scored is None and b.scored is None:
        return None
    e = max(t.scored.num_nodes for t in (a, b) if t.scored is not None)

    def widened(t: DraftTree, own: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # own: [B] rows that chose t
        s, pad = t.scored, e - t.scored.num_nodes
        tree_cols, node_cols = s.attend[..., :t.num_nodes], s.attend[..., t.num_nodes:]
        attend = torch.cat([F.pad(tree_cols, (0, n - t.num_nodes)), F.pad(node_cols, (0, pad))], dim=2)
        attend = F.pad(attend, (0, 0, 0, pad))
        root_only = ~tree_cols[..., 1:].any(-1)  # [B, E]
        valid = F.pad(s.valid & (own[:, None] | root_only), (0, pad), value=False)
        return F.pad(s.tokens, (0, pad)), F.pad(s.offsets, (0, pad)), attend, valid

    sa = widened(a, take_a) if a.scored is not None else None
    sb = widened(b, ~take_a) if b.scored is not None else None
    if sa is None or sb is None:
        return ScoredNodes(*(sa or sb))
    return ScoredNodes(*(torch.where(take_a.view(-1, *[1] * (x.dim() - 1)), x, y)
                         for x, y in zip(sa, sb, strict=True)))
