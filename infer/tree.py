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

from dataclasses import dataclass, field

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
    # (depth, ancestors) once computed: they depend on `parents` only, which a pruned copy shares
    _structure: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

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
        """depth: [B, N] (root 0); ancestors: [B, N, N] bool, ancestors[b, i, j] = j is i or an ancestor of i.
        Raises ValueError for a valid node below an invalid one (a read on the host: the engine's loop uses
        `structure` and `malformed` instead, and reads the flag with the step's other results)."""
        depth, ancestors = self.structure()
        if bool(self.malformed().any()):
            raise ValueError(MALFORMED)
        return depth, ancestors

    def structure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`depth_and_ancestors` without the check, computed once per tree and without a host read."""
        if self._structure is None:
            self._structure = tree_structure(self.parents)
        return self._structure

    def malformed(self) -> torch.Tensor:
        """[B] bool: the row has a valid node below an invalid one (a drafter's bug)."""
        return malformed_rows(self.structure()[1], self.valid)

    def prune_deeper_than(self, max_depth: torch.Tensor) -> DraftTree:
        """Invalidate nodes deeper than `max_depth[b]` (so a row never drafts past its token budget); scored
        nodes too, so no position id passes the target's context (an invalid one is moved onto the root's)."""
        depth, _ = self.structure()
        scored = self.scored
        if scored is not None:
            ok = scored.valid & (scored.offsets <= max_depth[:, None])
            scored = ScoredNodes(scored.tokens, torch.where(ok, scored.offsets, 0), scored.attend, ok)
        return DraftTree(self.tokens, self.parents, self.valid & (depth <= max_depth[:, None]), self.q, scored,
                         self.scores, self._structure)

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


MALFORMED = "draft tree has a valid node below an invalid parent"


def depth_and_ancestors(parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`DraftTree.depth_and_ancestors` for bare tables: raises ValueError where a valid node has an invalid
    ancestor (a node is usable only if its whole ancestry is)."""
    depth, ancestors = tree_structure(parents)
    if bool(malformed_rows(ancestors, valid).any()):
        raise ValueError(MALFORMED)
    return depth, ancestors


def malformed_rows(ancestors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row has a valid node with an invalid ancestor. ancestors: [B, N, N]; valid: [B, N]"""
    return (valid & (ancestors & ~valid[:, None, :]).any(-1)).any(1)


def tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depth [B, N] and ancestors [B, N, N] of parent tables [B, N], in a fixed number of ops for N nodes.

    The ancestor relation is the reflexive-transitive closure of "is the parent of", found by squaring: after k
    squarings every ancestor up to 2**k generations away is in, so ceil(log2 N) squarings find them all, with no
    look at the data to stop early (a look would be a host read, which stalls a GPU's queue)."""
    b, n = parents.shape
    # closure[b, i, j]: j is i or i's parent, then (after squaring) any ancestor of i
    closure = torch.eye(n, device=parents.device).expand(b, n, n).clone()
    closure.scatter_add_(2, parents.clamp(min=0)[..., None], (parents >= 0)[..., None].float())
    closure = (closure > 0).float()
    for _ in range(max(n - 1, 0).bit_length()):
        closure = ((closure @ closure) > 0).float()  # binarized each time: path counts would overflow float32
    ancestors = closure.bool()
    return ancestors.sum(-1) - 1, ancestors


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

