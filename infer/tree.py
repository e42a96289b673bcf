"""Draft trees as data.

A tree is a batch of node tables: `tokens[b, n]`, `parents[b, n]` (-1 for the root, always node 0; a
parent always precedes its children) and `valid[b, n]` (padding nodes are False). Every drafter hands the
engine one of these; chains (draft model, n-gram) are trees with one branch. From the parents alone we
derive what verification needs: each node's depth (its position offset) and its ancestor set (the
attention mask among tree nodes).

A tree may also carry `ScoredNodes`: nodes the target scores in the same verify forward but never
accepts, whose logits go back to the drafter (lookahead decoding's Jacobi window). They sit after the
tree nodes, each with its own position and an explicit attention row that need not form a tree; the
tree nodes never see them and their cache entries are dropped like rejected nodes', so the output
cannot depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoredNodes:
    """Nodes scored by the verify forward and never accepted; their logits reach the drafter in
    `TargetStep.scored_logits`. Each sees the committed context, itself, and what its `attend` row names."""

    tokens: torch.Tensor  # [B, E] long
    offsets: torch.Tensor  # [B, E] long; position relative to the root (the root is at 0, its children at 1)
    attend: torch.Tensor  # [B, E, N + E] bool; which tree nodes (first N columns) and scored nodes each sees
    valid: torch.Tensor  # [B, E] bool; invalid ones are seen by nothing and their logits are meaningless

    def __post_init__(self):
        b, e = self.tokens.shape
        if self.offsets.shape != (b, e) or self.valid.shape != (b, e) or self.attend.shape[:2] != (b, e):
            raise ValueError(f"scored node tables disagree: tokens {tuple(self.tokens.shape)}, offsets "
                             f"{tuple(self.offsets.shape)}, attend {tuple(self.attend.shape)}, valid "
                             f"{tuple(self.valid.shape)}")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] long; node 0 is the root: the pending token, not yet in the target's cache
    parents: torch.Tensor  # [B, N] long; -1 for the root
    valid: torch.Tensor  # [B, N] bool
    # [B, N, V] float or None. For drafts sampled i.i.d. with their siblings: the distribution each node's
    # token was drawn from. None when drafts are deterministic (top-k, argmax, lookup): q is then one-hot.
    q: torch.Tensor | None = None
    scored: ScoredNodes | None = None  # scored after the tree in the same forward, never accepted
    # [B, N] float or None: the drafter's confidence in each node (EAGLE: cumulative draft log-prob), for
    # observers of the engine (tree calibration ranks nodes by it); never read by verification.
    scores: torch.Tensor | None = None

    def __post_init__(self):
        b, n = self.tokens.shape
        if self.parents.shape != (b, n) or self.valid.shape != (b, n):
            raise ValueError(f"tree tables disagree: tokens {tuple(self.tokens.shape)}, parents "
                             f"{tuple(self.parents.shape)}, valid {tuple(self.valid.shape)}")
        if self.q is not None and self.q.shape[:2] != (b, n):
            raise ValueError(f"tree q must be [B, N, V]; got {tuple(self.q.shape)} for {n} nodes")
        if self.scores is not None and self.scores.shape != (b, n):
            raise ValueError(f"tree scores must be [B, N] = [{b}, {n}]; got {tuple(self.scores.shape)}")
        e = 0 if self.scored is None else self.scored.num_nodes
        if self.scored is not None and self.scored.attend.shape != (b, e, n + e):
            raise ValueError(f"scored nodes' attend must be [B, E, N + E] = [{b}, {e}, {n + e}]; got "
                             f"{tuple(self.scored.attend.shape)}")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def depth_and_ancestors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """depth: [B, N] (root 0); ancestors: [B, N, N] bool, ancestors[b, i, j] = j is i or an ancestor of i."""
        return depth_and_ancestors(self.parents, self.valid)

    def prune_deeper_than(self, max_depth: torch.Tensor) -> DraftTree:
        """Invalidate nodes deeper than `max_depth[b]` (so a row never drafts past its token budget); scored
        nodes too, so no position id passes the target's context (an invalid one is moved onto the root's)."""
        depth, _ = self.depth_and_ancestors()
        scored = self.scored
        if scored is not None:
            ok = scored.valid & (scored.offsets <= max_depth[:, None])
            scored = ScoredNodes(scored.tokens, torch.where(ok, scored.offsets, 0), scored.attend, ok)
        return DraftTree(self.tokens, self.parents, self.valid & (depth <= max_depth[:, None]), self.q, scored,
                         self.scores)

    def verify_block(self, depth: torch.Tensor, ancestors: torch.Tensor):
        """What the verify forward runs: tokens [B, M], position offsets [B, M], attend [B, M, M] and valid
        [B, M] for the M = N + E tree and scored nodes. Tree nodes see their ancestors only, never a scored
        node, so their logits are the same with or without scored nodes."""
        s = self.scored
        if s is None:
            return self.tokens, depth, ancestors, self.valid
        b, n = self.tokens.shape
        tree_rows = torch.cat([ancestors, ancestors.new_zeros(b, n, s.num_nodes)], dim=2)
        return (torch.cat([self.tokens, s.tokens], 1), torch.cat([depth, s.offsets], 1),
                torch.cat([tree_rows, s.attend], 1), torch.cat([self.valid, s.valid], 1))


def depth_and_ancestors(parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # parents: [B, N]; valid: [B, N]
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    # step[b, i, j]: j is the parent of i
    has_parent = parents >= 0
    step = torch.zeros(b, n, n, dtype=torch.bool, device=parents.device)
    step.scatter_(2, parents.clamp(min=0)[..., None], has_parent[..., None])
    ancestors = eye.clone()
    reach = eye.float()
    stepf = step.float()
    for _ in range(n - 1):
        reach = reach @ stepf  # reach[b, i, j]: j is the k-th ancestor of i
        if not reach.any():
            break
        ancestors |= reach.bool()
    depth = ancestors.sum(-1) - 1
    # A node is usable only if its whole ancestry is valid.
    ancestry_ok = ~(ancestors & ~valid[:, None, :]).any(-1)
    if (valid & ~ancestry_ok).any():
        raise ValueError("draft tree has a valid node below an invalid parent")
    return depth, ancestors


def tree_from_paths(paths: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A static tree (Medusa-style "choices") from its paths of sibling ranks.

    `paths` lists every non-root node as the ranks taken from the root, e.g. `[(0,), (1,), (0, 0)]`: the
    top-1 and top-2 children of the root, and the top-1 child of the first. Every prefix of a path must
    itself be a path. Returns `parents` [N] (node 0 = root, -1) and `ranks` [N] (root 0), nodes ordered by
    depth then rank, so parents precede children.
    """
    nodes = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    if not nodes:
        raise ValueError("a static tree needs at least one path, e.g. [(0,), (0, 0)]")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in nodes:
        if len(path) == 0 or any((not isinstance(r, int)) or r < 0 for r in path):
            raise ValueError(f"tree path {path!r} must be a non-empty tuple of non-negative ranks")
        if path[:-1] not in index:
            raise ValueError(f"tree path {path!r} has no parent path {path[:-1]!r}; add it to the tree")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return torch.tensor(parents), torch.tensor(ranks)

