"""Prompt lookup: propose what followed an earlier occurrence of the context's last n tokens."""

from __future__ import annotations

import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree
from .chain import chain_tree


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; Fu et al. 2024): find an earlier occurrence of the context's last n
    tokens (n from `max_ngram` down to `min_ngram`) and propose what followed it."""

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.context: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * batch_size
        self.roots = None

    def observe(self, step: TargetStep) -> None:
        tokens, valid = step.tokens.cpu(), step.valid.cpu()
        self.context = [torch.cat([ctx, tokens[b][valid[b]]]) for b, ctx in enumerate(self.context)]
        self.roots = step.next_tokens

    def _lookup(self, ctx: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """The continuation of the latest earlier match of the context's suffix that still has k tokens
        after it (in a loop the latest match is the suffix's previous copy, with one token after it), and
        the length of the matched suffix (0: no match)."""
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            windows = ctx[:-1].unfold(0, n, 1)  # every n-gram that has a token after it
            hits = (windows == ctx[-n:]).all(-1).nonzero()[:, 0]
            if len(hits):
                room = (len(ctx) - (hits + n)).clamp(max=k)
                start = int(hits[room == room.max()][-1]) + n
                return ctx[start:start + k], n
        return ctx[:0], 0

    def lookup(self, budget: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
        """The lookup chain of every row and the length of the suffix each row matched ([B], 0 = none)."""
        k = max(0, min(self.num_tokens, int(budget.max())))
        roots = self.roots.cpu()
        found = [self._lookup(torch.cat([ctx, roots[b:b + 1]]), k) for b, ctx in enumerate(self.context)]
        drafts = torch.zeros(len(found), k, dtype=torch.long)
        for b, (cont, _) in enumerate(found):
            drafts[b, :len(cont)] = cont
        lengths = torch.tensor([len(c) for c, _ in found])
        matched = torch.tensor([n for _, n in found])
        device = self.roots.device
        return chain_tree(self.roots, drafts.to(device), lengths.to(device)), matched.to(device)

    def propose(self, budget: torch.Tensor) -> DraftTree:
        return self.lookup(budget)[0]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.context = [self.context[int(r)] for r in rows]
        self.roots = self.roots[rows]


def from_spec(arg: str | None, target, tokenizer=None) -> NgramDrafter:
    """`ngram`, or `ngram:<n>`: match suffixes of up to n tokens (vLLM's prompt_lookup_max; default 3)."""
    if arg is None:
        return NgramDrafter()
    if not (arg.isascii() and arg.isdigit()) or int(arg) < 1:
        raise ValueError(f"write ngram or ngram:<longest n-gram>, a whole number >= 1 of tokens to match (e.g. "
                         f"ngram:4); got ngram:{arg}")
    return NgramDrafter(max_ngram=int(arg))
