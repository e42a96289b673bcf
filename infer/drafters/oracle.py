"""A drafter for measuring the engine, not for use: it knows the target's greedy answer.

`OracleDrafter(alpha, depth)` proposes, below each root, the next `depth` tokens of the target's own greedy
continuation (given to it with `expect` before `generate`), each replaced by a wrong token with probability
1 - alpha, independently. Acceptance is then set by alpha alone: a chain keeps its first i drafts with
probability alpha^i (1 - alpha), so a step emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average, and
drafting costs nothing. What a run at that acceptance falls short of the ideal (that many tokens for the
price of one plain step) is the engine's own cost and the verify forward's width; `scripts/bench.py
--oracle <alpha>` reports it.

Not registered by name: it needs the answer, which only a benchmark has.
"""

from __future__ import annotations

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree
from .chain import chain_tree


def expected_tokens_per_step(alpha: float, depth: int) -> float:
    """Mean tokens a step emits (accepted drafts + the target's own) when each of `depth` chained drafts is
    right with probability alpha: (1 - alpha^(K+1)) / (1 - alpha)."""
    return depth + 1.0 if alpha == 1.0 else (1 - alpha ** (depth + 1)) / (1 - alpha)


class OracleDrafter(Drafter):
    """Drafts the target's known greedy continuation, each token corrupted with probability 1 - alpha."""

    pure_propose = False

    def __init__(self, alpha: float, depth: int = 8, seed: int = 0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"oracle alpha must be in [0, 1], got {alpha}")
        if depth < 1:
            raise ValueError(f"oracle depth must be >= 1, got {depth}")
        self.alpha, self.depth = float(alpha), int(depth)
        self.rng = np.random.default_rng(seed)
        self.answers: list[list[int]] | None = None

    def expect(self, answers: list[list[int]]) -> None:
        """The target's greedy new tokens for each row of the next `generate` call."""
        self.answers = [list(map(int, a)) for a in answers]

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        if self.answers is None or len(self.answers) != batch_size:
            got = "none" if self.answers is None else f"{len(self.answers)} rows"
            raise ValueError(f"OracleDrafter needs the target's greedy answer for each of the {batch_size} rows "
                             f"(call expect() before generate); it has {got}")
        self.vocab = target.config.get_text_config().vocab_size
        self.at = [0] * batch_size  # per row: index in its answer of the pending root
        self.roots = None
        self.first = True

    def observe(self, step: TargetStep) -> None:
        if not self.first:  # the root and the accepted drafts were emitted; the next root follows them
            self.at = [a + int(n) for a, n in zip(self.at, step.valid.sum(1).tolist(), strict=True)]
        self.first = False
        self.roots = step.next_tokens
        for row, (a, root) in enumerate(zip(self.at, self.roots.tolist(), strict=True)):
            answer = self.answers[row]
            if a < len(answer) and answer[a] != root:
                raise ValueError(f"row {row}: the target's token {a} is {root}, but the oracle's answer has "
                                 f"{answer[a]}; expect() needs the target's own greedy output for these prompts")

    def propose(self, budget: torch.Tensor) -> DraftTree:
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

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.at = [self.at[r] for r in keep]
        self.answers = [self.answers[r] for r in keep]
        self.roots = self.roots[rows]
