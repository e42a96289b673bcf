"""Trees to choose from, and the choice: for a drafter's measured acceptance statistics, the candidate trees of
1..N nodes with their expected accepted drafts (`candidate_trees`), each with this machine's costs a `Prediction` of
tokens per second, and the fastest (`best_prediction`). Tree settings as data, not the drafted trees themselves
(`infer.tree.DraftTree`).

A static tree should hold the paths most likely to be accepted. Without calibration data, paths are ranked by a
simple prior (`prior_paths`): the rank-r candidate at depth d is right with probability `top1 * decay**d *
spread**r` (deeper predictions are less reliable; lower-ranked candidates much less likely), and a path's score
is the product along it. Keeping the `num_nodes` best paths gives a tree that is wide near the root and narrow
deep down; the trained drafters' default static trees are such priors.

Calibration (`infer.tree_choice`, `scripts/calibrate.py`) drafts a wide tree on held-out prompts and counts how
often each node is accepted. A node is accepted only if its parent is, so P(accepted) never grows going down,
and for a static tree the expected number of accepted drafts is exactly the sum of its nodes' P: the best tree
of N nodes holds the N most likely paths, which are ancestor-closed. For EAGLE-2's dynamic tree the same holds
for nodes ranked by the drafter's own score (keeping the `total_tokens` best is keeping ranks 0..N-1).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


def prior_paths(depth: int, num_nodes: int, *, top1: float = 0.6, decay: float = 0.75, spread: float = 0.4,
                max_rank: int = 10) -> list[tuple[int, ...]]:
    """The `num_nodes` highest-prior paths of length <= `depth` (ancestor-closed, ordered by depth, rank)."""
    if depth < 1 or num_nodes < 1:
        raise ValueError(f"a tree needs depth >= 1 and num_nodes >= 1, got depth={depth}, num_nodes={num_nodes}")

    def p(d: int, r: int) -> float:
        return top1 * decay**d * spread**r

    # Best-first search: a child's score never exceeds its parent's, so popping in score order yields an
    # ancestor-closed set.
    heap = [(-p(0, r), (r,)) for r in range(max_rank)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth:
            for r in range(max_rank):
                heapq.heappush(heap, (neg * p(len(path), r), path + (r,)))
    return sorted(chosen, key=lambda q: (len(q), q))


@dataclass(frozen=True)
class Candidate:
    """A tree calibration may pick."""

    tree: dict  # tree settings for the drafter (overrides of its saved ones)
    nodes: int  # drafted nodes verified per step (the root not counted)
    expected_accepted: float  # expected drafted tokens accepted per step, from the measured statistics


@dataclass(frozen=True)
class Prediction:
    """A candidate with its measured per-step costs on this machine."""

    candidate: Candidate
    draft_seconds: float  # drafting one step (propose the tree + observe the accepted tokens)
    verify_seconds: float  # one target forward over the root and the tree's nodes
    engine_seconds: float = 0.0  # the engine's own work a step outside both (accept, commit, emit)

    @property
    def tokens_per_second(self) -> float:
        """E[accepted + 1] / (draft + verify + engine cost): every step emits the accepted drafts and one
        token of the target's own."""
        return (1 + self.candidate.expected_accepted) / (self.draft_seconds + self.verify_seconds
                                                         + self.engine_seconds)


NO_DRAFTS = Candidate(tree={}, nodes=0, expected_accepted=0.0)  # one token a target forward: what drafting must beat


def best_prediction(predictions: list[Prediction]) -> Prediction:
    """The fastest predicted tree; on a tie the smaller one."""
    if not predictions:
        raise ValueError("no candidate trees to choose from: the calibration measured no steps")
    return max(predictions, key=lambda p: (p.tokens_per_second, -p.candidate.nodes))


def ranked_paths(paths: list, p_accept: list[float]) -> list[tuple[int, ...]]:
    """Measured paths by decreasing P(accepted), a parent before its children on ties, so that every prefix
    of the list is an ancestor-closed tree."""
    if len(paths) != len(p_accept):
        raise ValueError(f"calibration statistics hold {len(paths)} paths but {len(p_accept)} probabilities")
    p = {tuple(path): float(q) for path, q in zip(paths, p_accept, strict=True)}
    for path, q in p.items():
        parent = path[:-1]
        if parent and parent not in p:
            raise ValueError(f"calibration path {list(path)} was measured without its parent {list(parent)}")
        if parent and q > p[parent]:
            raise ValueError(f"calibration path {list(path)} is accepted more often ({q:.4f}) than its parent "
                             f"{list(parent)} ({p[parent]:.4f}), which cannot be: the statistics are damaged")
    return sorted(p, key=lambda path: (-p[path], len(path), path))


def dynamic_nodes(top_k: int, depth: int) -> int:
    """Nodes an EAGLE-2 dynamic tree drafts at most down to `depth`: top_k children of the root, then top_k
    children for each of the top_k best nodes per depth."""
    return top_k + (depth - 1) * top_k * top_k


def candidate_trees(measured: dict, max_nodes: int = 64) -> list[Candidate]:
    """The trees of 1..`max_nodes` drafted nodes that one measured wide tree's statistics predict.

    `measured` is one entry of a drafter's `config.calibration["measured"]`:
      static:  {"mode": "static", "tree": {..., "paths": P}, "p_accept": [P(path accepted) per path in P]}
      dynamic: {"mode": "dynamic", "tree": {..., "top_k": K, "depth": D}, "p_rank": [per depth limit d = 1..D:
               P(the node ranked r among nodes no deeper than d by draft score is accepted), r = 0, 1, ...]}
    Static candidates keep the N likeliest paths; dynamic ones keep the drafter's N best-scored nodes of a tree
    drafted d deep (`total_tokens` = N, `depth` = d), for N >= d: N best-scored nodes lie at most N deep (a
    node scores no higher than its parent), and the drafter stops there, so a tree of N < d nodes is depth
    N's and is listed once, under that depth."""
    tree = measured["tree"]
    out = []
    if measured["mode"] == "static":
        ranked = ranked_paths(tree["paths"], measured["p_accept"])
        p = dict(zip(map(tuple, tree["paths"]), measured["p_accept"], strict=True))
        expected = 0.0
        for n, path in enumerate(ranked[:max_nodes], start=1):
            expected += p[path]
            kept = sorted(ranked[:n], key=lambda q: (len(q), q))
            out.append(Candidate({**tree, "paths": [list(q) for q in kept]}, n, expected))
        return out
    if measured["mode"] != "dynamic":
        raise ValueError(f"calibration mode must be 'static' or 'dynamic', got {measured['mode']!r}")
    for depth, p_rank in enumerate(measured["p_rank"], start=1):
        expected = 0.0
        most = min(max_nodes, len(p_rank), dynamic_nodes(tree["top_k"], depth))
        for n in range(1, most + 1):
            expected += p_rank[n - 1]
            if n >= depth:
                out.append(Candidate({**tree, "depth": depth, "total_tokens": n}, n, expected))
    return out
