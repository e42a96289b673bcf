"""Prompt lookup: propose what followed an earlier occurrence of the context's last n tokens."""

from __future__ import annotations

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree
from .chain import chain_tree


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; Fu et al. 2024): find an earlier occurrence of the context's last n
    tokens (n from `max_ngram` down to `min_ngram`) and propose what followed it.

    The contexts live on the host, fed from the engine's one read of each step (`TargetStep.host_tokens`), and
    the lookup runs there in numpy: drafting reads nothing of the device, so a GPU's queue never drains for it.
    Under `sync_free` (the captured step) the chain is always `num_tokens` long and the engine prunes it to each
    row's budget on the device."""

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.context = [_Tokens() for _ in range(batch_size)]
        self.roots = None  # [B] on the device: each row's next root
        self.host_roots: list[int] = []

    def observe(self, step: TargetStep) -> None:
        committed, roots = step.on_host()
        for ctx, new in zip(self.context, committed, strict=True):
            ctx.extend(new)
        self.roots, self.host_roots = step.next_tokens, list(roots)

    def _lookup(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """The continuation of the latest earlier match of the context's suffix that still has k tokens
        after it (in a loop the latest match is the suffix's previous copy, with one token after it), and
        the length of the matched suffix (0: no match)."""
        size = len(ctx)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            # hits: every start i of an n-gram with a token after it (i < size - n) equal to the last n tokens, one
            # shifted comparison a position (a sliding-window view of the n-grams costs 5x as much here)
            same = ctx[:size - n] == ctx[size - n]
            for j in range(1, n):
                same &= ctx[j:size - n + j] == ctx[size - n + j]
            hits = np.flatnonzero(same)
            if hits.size:
                room = np.minimum(size - (hits + n), k)
                start = int(hits[room == room.max()][-1]) + n
                return ctx[start:start + k], n
        return ctx[:0], 0

    def lookup(self, budget: torch.Tensor) -> tuple[DraftTree, list[int]]:
        """The lookup chain of every row and the length of the suffix each row matched (0 = none), on the host."""
        k = self.num_tokens if self.sync_free else max(0, min(self.num_tokens, int(budget.max())))
        found = [self._lookup(ctx.with_token(root), k) for ctx, root in zip(self.context, self.host_roots, strict=True)]
        drafts = np.zeros((len(found), k), dtype=np.int64)
        for b, (cont, _) in enumerate(found):
            drafts[b, :len(cont)] = cont
        lengths = np.array([len(c) for c, _ in found], dtype=np.int64)
        device = self.roots.device
        return chain_tree(self.roots, to_device(drafts, device), to_device(lengths, device)), [n for _, n in found]

    def propose(self, budget: torch.Tensor) -> DraftTree:
        return self.lookup(budget)[0]

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()  # rows end only at some steps: a read there
        self.context = [self.context[r] for r in keep]
        self.host_roots = [self.host_roots[r] for r in keep]
        self.roots = self.roots[rows]


class _Tokens:
    """A row's context on the host: a numpy buffer that grows by doubling."""

    def __init__(self):
        self._buf, self._n = np.zeros(256, dtype=np.int64), 0

    def extend(self, tokens: list[int]) -> None:
        need = self._n + len(tokens) + 1  # + 1: room for `with_token`
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:self._n + len(tokens)] = tokens
        self._n += len(tokens)

    def tokens(self) -> np.ndarray:
        return self._buf[:self._n]

    def with_token(self, token: int) -> np.ndarray:
        """The context and one more token (the next root) after it, as a view: nothing is copied."""
        self._buf[self._n] = token
        return self._buf[:self._n + 1]


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host values onto the device without waiting for its queue (a plain copy of a list to a GPU waits)."""
    return torch.from_numpy(values).to(device, non_blocking=True)


def from_spec(arg: str | None, target, tokenizer=None) -> NgramDrafter:
    """`ngram`, or `ngram:<n>`: match suffixes of up to n tokens (vLLM's prompt_lookup_max; default 3)."""
    if arg is None:
        return NgramDrafter()
    if not (arg.isascii() and arg.isdigit()) or int(arg) < 1:
        raise ValueError(f"write ngram or ngram:<longest n-gram>, a whole number >= 1 of tokens to match (e.g. "
                         f"ngram:4); got ngram:{arg}")
    return NgramDrafter(max_ngram=int(arg))
