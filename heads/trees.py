"""Default static trees (paths of sibling ranks) for Medusa heads and EAGLE-1.

A static tree should hold the paths most likely to be accepted. Without calibration data we rank paths by
a simple prior: the rank-r candidate at depth d is right with probability `top1 * decay**d * spread**r`
(deeper predictions are less reliable; lower-ranked candidates much less likely), and a path's score is
the product along it. Keeping the `num_nodes` best paths gives a tree that is wide near the root and
narrow deep down. Once a drafter is trained, calibrate the tree on real acceptance statistics and store
the measured paths in its config instead.
"""

from __future__ import annotations

import heapq


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


def medusa_default_paths(num_heads: int) -> list[tuple[int, ...]]:
    """40 nodes; with 4 heads: 6 candidates from the first head, 15 at depth 2, 14 at 3, 5 at 4."""
    return prior_paths(num_heads, 40)


def eagle_static_default_paths(depth: int = 6) -> list[tuple[int, ...]]:
    """30 nodes, 6 deep. One autoregressive drafter is more reliable per step than independent Medusa
    heads, so the prior decays slower and the tree is deeper and narrower."""
    return prior_paths(depth, 30, top1=0.8, decay=0.9, spread=0.3)
