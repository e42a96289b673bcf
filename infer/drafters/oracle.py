"""A drafter for measuring the engine, not for use: it knows the target's greedy answer.

`OracleDrafter(alpha, depth)` proposes, below each root, the next `depth` tokens of the target's own greedy
continuation (given to it with `expect` before `generate`), each replaced by a wrong token with probability
1 - alpha, independently. Acceptance is then set by alpha alone: a chain keeps its first i drafts with
probability alpha^i (1 - alpha), so a step emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average, and
drafting costs nothing. What a run at that acceptance falls short of the ideal (that many tokens for the
price of one plain step) is the engine's own cost and the verify forward's width; `scripts/bench.py
--oracle <alpha>` reports it.

With `top_k` > 1 it drafts a tree of `total_tokens` nodes, as EAGLE-2 does (its default size: depth 6, top-8,
60 nodes): at every level the true token is the sibling of rank r with probability alpha (1 - alpha)^r (each
sibling in turn right with probability alpha), so a node's path of ranks is all true with the product of those,
and the tree holds the `total_tokens` paths most likely to be, as EAGLE-2 keeps the nodes its drafter is most
confident in. The expected tokens per step is 1 + the sum of those paths' probabilities.

`follow=True` keeps going where the target's output leaves the answer it was given (random weights in bf16
make near-ties whose argmax flips with the verify block's shape): the oracle takes the target's token and goes
on drafting the rest of its answer, counting each such event in `followed`. Without it a departure is an error,
since the answer was then not the target's.

Not registered by name: it needs the answer, which only a benchmark has.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree, tree_from_paths
from .chain import chain_tree


def oracle_paths(alpha: float, depth: int, top_k: int, total_tokens: int) -> list[tuple[int, ...]]:
    """The `total_tokens` paths of ranks (each rank < top_k, at most `depth` long) most likely to be all true when
    the rank-r sibling is the true one with probability alpha (1 - alpha)^r; ties go to the shorter, lower path.
    Best-first from the root, so every prefix and every lower-ranked sibling of a chosen path is chosen."""
    def weight(rank: int) -> float:
        return alpha * (1 - alpha) ** rank

    frontier, chosen = [(-weight(0), 1, (0,))], []
    while frontier and len(chosen) < total_tokens:
        neg, _, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            heapq.heappush(frontier, (neg * weight(0), len(path) + 1, (*path, 0)))
        if path[-1] + 1 < top_k:
            sibling = (*path[:-1], path[-1] + 1)
            heapq.heappush(frontier, (neg / weight(path[-1]) * weight(path[-1] + 1), len(sibling), sibling))
    return chosen


def expected_tokens_per_step(alpha: float, depth: int, top_k: int = 1, total_tokens: int | None = None) -> float:
    """Mean tokens a step emits (accepted drafts + the target's own). A chain (top_k 1) of `depth` drafts each
    right with probability alpha: (1 - alpha^(K+1)) / (1 - alpha); a tree: 1 + the sum over its paths of the
    probability that the whole path is true."""
    if top_k == 1 and (total_tokens is None or total_tokens >= depth):
        return depth + 1.0 if alpha == 1.0 else (1 - alpha ** (depth + 1)) / (1 - alpha)
    paths = oracle_paths(alpha, depth, top_k, total_tokens or depth)
    return 1.0 + sum(float(np.prod([alpha * (1 - alpha) ** r for r in path])) for path in paths)


class OracleDrafter(Drafter):
    """Drafts the target's known greedy continuation, each token corrupted with probability 1 - alpha."""

    pure_propose = False

    def __init__(self, alpha: float, depth: int = 8, seed: int = 0, *, top_k: int = 1,
                 total_tokens: int | None = None, follow: bool = False):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"oracle alpha must be in [0, 1], got {alpha}")
        if depth < 1:
            raise ValueError(f"oracle depth must be >= 1, got {depth}")
        if top_k < 1:
            raise ValueError(f"oracle top_k must be >= 1 (1: a chain), got {top_k}")
        if total_tokens is not None and total_tokens < 1:
            raise ValueError(f"oracle total_tokens must be >= 1 drafted nodes, got {total_tokens}")
        self.alpha, self.depth, self.seed, self.follow = float(alpha), int(depth), seed, follow
        self.rng = np.random.default_rng(seed)
        self.answers: list[list[int]] | None = None
        self.followed = 0  # how often the target left the answer and the oracle followed it
        self.paths = None
        if top_k > 1:
            self.paths = oracle_paths(self.alpha, self.depth, top_k, total_tokens or self.depth * top_k)
            self.parents, _ = tree_from_paths(self.paths)
            self.paths = sorted(self.paths, key=lambda p: (len(p), p))  # tree_from_paths' node order
            self.top_k = top_k

    def expect(self, answers: list[list[int]], seed: int | None = None) -> None:
        """The target's greedy new tokens for each row of the next `generate` call; `seed`: start the random
        draws again from it (a repeated run then drafts the same trees)."""
        self.answers = [list(map(int, a)) for a in answers]
        if seed is not None:
            self.rng = np.random.default_rng(seed)

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        if self.answers is None or len(self.answers) != batch_size:
            got = "none" if self.answers is None else f"{len(self.answers)} rows"
            raise ValueError(f"OracleDrafter needs the target's greedy answer for each of the {batch_size} rows "
                             f"(call expect() before generate); it has {got}")
        self.vocab = target.config.get_text_config().vocab_size
        if self.paths is not None and self.top_k >= self.vocab:
            raise ValueError(f"oracle top_k {self.top_k} must be below the vocabulary ({self.vocab}): siblings "
                             "are distinct tokens")
        self.at = [0] * batch_size  # per row: index in its answer of the pending root
        self.roots = None
        self.first = True
        self.followed = 0

    def observe(self, step: TargetStep) -> None:
        if not self.first:  # the root and the accepted drafts were emitted; the next root follows them
            self.at = [a + int(n) for a, n in zip(self.at, step.valid.sum(1).tolist(), strict=True)]
        self.first = False
        self.roots = step.next_tokens
        for row, (a, root) in enumerate(zip(self.at, self.roots.tolist(), strict=True)):
            answer = self.answers[row]
            if a < len(answer) and answer[a] != root:
                if not self.follow:
                    raise ValueError(f"row {row}: the target's token {a} is {root}, but the oracle's answer has "
                                     f"{answer[a]}; expect() needs the target's own greedy output for these "
                                     "prompts (or OracleDrafter(follow=True) to follow the target)")
                answer[a] = root
                self.followed += 1

    def propose(self, budget: torch.Tensor) -> DraftTree:
        if self.paths is not None:
            return self._propose_tree(budget)
        b = len(self.at)
        drafts = torch.zeros(b, self.depth, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        for row, a in enumerate(self.at):
            truth = self.answers[row][a + 1:a + 1 + min(self.depth, int(budget[row]))]
            wrong = self.rng.random(len(truth)) >= self.alpha
            for i, (tok, bad) in enumerate(zip(truth, wrong, strict=True)):
                drafts[row, i] = (tok + 1) % self.vocab if bad else tok
            lengths[row] = len(truth)
        device = self.roots.device
        return chain_tree(self.roots, drafts.to(device), lengths.to(device))

    def _propose_tree(self, budget: torch.Tensor) -> DraftTree:
        """The tree of `self.paths` below each root: per level the true token at a rank drawn as alpha sets it,
        distinct wrong tokens at the other ranks; nodes past the answer or the budget are invalid."""
        # tokens, valid: [B, N] with node 0 the root
        b, n = len(self.at), len(self.paths) + 1
        tokens = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        valid[:, 0] = True
        for row, a in enumerate(self.at):
            truth = self.answers[row][a + 1:a + 1 + min(self.depth, int(budget[row]))]
            hits = self.rng.random((self.depth, self.top_k)) < self.alpha
            # the true path's rank per level; a level whose true token is at no rank ends it
            true_ranks = []
            for level in hits:
                if not level.any():
                    break
                true_ranks.append(int(level.argmax()))
            for j, path in enumerate(self.paths, start=1):
                d = len(path)
                if d > len(truth):
                    continue
                on_path = tuple(true_ranks[:d]) == path
                tokens[row, j] = truth[d - 1] if on_path else (truth[d - 1] + 1 + path[-1]) % self.vocab
                valid[row, j] = True
        device = self.roots.device
        tokens[:, 0] = self.roots.cpu()
        parents = self.parents.to(device).expand(b, n).contiguous()
        return DraftTree(tokens=tokens.to(device), parents=parents, valid=valid.to(device))

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.at = [self.at[r] for r in keep]
        self.answers = [self.answers[r] for r in keep]
        self.roots = self.roots[rows]
