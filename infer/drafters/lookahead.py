"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iteration over a window of future positions fills a
pool of n-grams, and the same target forward verifies pool n-grams that start with the pending token. No
drafter model at all.

Every step one target forward runs, per row:

    verify branch      the tree of up to `guesses` pool n-grams whose first token is the root (the pending
                       token), common prefixes merged; accepted as any tree is
    lookahead branch   the Jacobi window, as `ScoredNodes`: never accepted, never seen by the tree, dropped
                       from the cache afterwards, so the output cannot depend on it

The window holds `ngram - 1` levels of `window` tokens. Level j, column i sits i + j + 1 positions after
the root and sees the committed context, the root, level 0's columns 0..i and its own column's levels
1..j (the pattern of Fu et al.'s figure: a Jacobi row at level 0, each column a trajectory above it). From
its own point of view each node continues one sequence, so the target's output at the top level of column
i predicts the token after (level 0 .. top level of column i): with the column that is an n-gram,

    (w[0][i], w[1][i], ..., w[top][i], output[i])

which goes to the pool keyed by its first token. The window then slides: each level moves down one, the
outputs become the new top level, the oldest level is dropped. The window starts as random tokens of the
row's prompt; n-grams are collected once every level above 0 holds the target's outputs (after `ngram - 2`
steps). Outputs are the target's argmax, also when sampling: the window only makes guesses.

The pool also takes the n-grams of the committed text (prompt and output so far), as prompt lookup
would find them; `context_ngrams=False` keeps it to the window's. Per first token it keeps the `guesses`
most recently seen distinct continuations, the most recent proposed first. Guesses are deterministic, so
under sampling they are the one-hot q case of verification (distinct siblings), and sampling stays exact.

Defaults are Fu et al.'s for 7B models on one GPU (window 15, n-gram 5, guess set 15): 60 window nodes and
up to 61 tree nodes per forward. On a CPU, where a forward's cost grows with its tokens, a smaller
setting (`lookahead:5,4,5`) is cheaper per step.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree, ScoredNodes

LIMITS = {"window": (1, 128), "ngram": (2, 16), "guesses": (1, 128)}


class NgramPool:
    """n-grams keyed by their first token: per key the `size` most recently seen distinct continuations."""

    def __init__(self, size: int):
        self.size = size
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        conts = self.table.setdefault(key, OrderedDict())
        if continuation in conts:
            conts.move_to_end(continuation)
            return
        conts[continuation] = None
        if len(conts) > self.size:
            conts.popitem(last=False)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """Continuations of `key`, most recently seen first."""
        return list(reversed(self.table.get(key, ())))


def merged_tree(root: int, guesses: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """The guesses under the root as a tree with common prefixes merged: (tokens, parents), node 0 the root."""
    tokens, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for guess in guesses:
        node = 0
        for tok in guess:
            nxt = children.get((node, tok))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                children[(node, tok)] = nxt
            node = nxt
    return tokens, parents


def window_pattern(window: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets [E] and attention among window nodes [E, E] for E = levels * window, node j * window + i
    being level j, column i (see the module docstring). Every node also sees the root, added by the caller."""
    e = levels * window
    level, col = np.divmod(np.arange(e), window)
    offsets = torch.as_tensor(col + level + 1)
    sees = torch.zeros(e, e, dtype=torch.bool)
    for node in range(e):
        j, i = level[node], col[node]
        sees[node, :i + 1] = True  # level 0, columns 0..i
        sees[node, [lv * window + i for lv in range(1, j + 1)]] = True  # its column, levels 1..j
    return offsets, sees


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window scored in the verify forward feeds an n-gram pool whose guesses
    for the pending token are verified as a tree (see the module docstring)."""

    def __init__(self, window: int = 15, ngram: int = 5, guesses: int = 15, context_ngrams: bool = True,
                 seed: int = 0):
        for name, value in (("window", window), ("ngram", ngram), ("guesses", guesses)):
            low, high = LIMITS[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"lookahead setting {name} must be an int, got {value!r}")
            if not low <= value <= high:
                raise ValueError(f"lookahead setting {name} must be in {low}..{high}, got {value}")
        if not isinstance(context_ngrams, bool):
            raise TypeError(f"lookahead setting context_ngrams must be True or False, got {context_ngrams!r}")
        self.window, self.ngram, self.guesses = int(window), int(ngram), int(guesses)
        self.levels = self.ngram - 1
        self.context_ngrams, self.seed = context_ngrams, seed
        self.offsets, self.sees = window_pattern(self.window, self.levels)

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.rng = np.random.default_rng(self.seed)  # its own: the caller's generator draws the same samples
        self.pools = [NgramPool(self.guesses) for _ in range(batch_size)]
        self.windows: list[np.ndarray] = []  # per row: [levels, window] tokens
        self.age: list[int] = []  # per row: window updates so far
        self.tails: list[list[int]] = []  # per row: the last ngram - 1 committed tokens
        self.roots, self.host_roots = None, []

    def observe(self, step: TargetStep) -> None:
        # the step on the host, from the engine's one read of it: nothing of the device is read here
        committed, self.host_roots = step.on_host()
        if not self.windows:  # the prefill: windows start from the prompt's own tokens
            for prompt in committed:
                self.windows.append(self.rng.choice(np.array(prompt, dtype=np.int64),
                                                    size=(self.levels, self.window)))
                self.age.append(0)
                self.tails.append([])
        if step.scored_logits is not None:
            choice, scored_valid = step.host_scored_choice, step.host_scored_valid
            if choice is None:  # a step made without the engine's read
                choice, scored_valid = step.scored_logits.argmax(-1).tolist(), step.scored_valid.tolist()
            self._jacobi_step(np.array(choice, dtype=np.int64), [all(v) for v in scored_valid])
        if self.context_ngrams:
            for b, new in enumerate(committed):
                self._add_text(b, new)
        self.roots = step.next_tokens

    def _jacobi_step(self, choice: np.ndarray, complete: list[bool]) -> None:
        # choice: [B, E] the target's argmax at every window node; the top level's are the new tokens. complete: a
        # row cut by its budget keeps its window as it was
        top = choice[:, (self.levels - 1) * self.window:]  # [B, window]
        for b, ok in enumerate(complete):
            if not ok:
                continue
            win = self.windows[b]
            if self.age[b] >= self.levels - 1:  # levels 1.. hold outputs: the columns are real n-grams
                for i in range(self.window):
                    self.pools[b].add(int(win[0, i]), (*win[1:, i].tolist(), int(top[b, i])))
            self.windows[b] = np.concatenate([win[1:], top[b][None]], axis=0)
            self.age[b] += 1

    def _add_text(self, b: int, new: list[int]) -> None:
        """The n-grams of the committed text that end in `new`."""
        seq = self.tails[b] + new
        n = self.ngram
        for start in range(max(0, len(self.tails[b]) - n + 1), len(seq) - n + 1):
            self.pools[b].add(seq[start], tuple(seq[start + 1:start + n]))
        self.tails[b] = seq[-(n - 1):]

    def propose(self, budget: torch.Tensor) -> DraftTree:
        roots = self.host_roots
        trees = [merged_tree(root, self.pools[b].guesses(root)) for b, root in enumerate(roots)]
        # tokens, parents, valid: [B, N]; padding nodes hang off the root, invalid
        b, n = len(trees), max(len(t) for t, _ in trees)
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        for row, (toks, pars) in enumerate(trees):
            tokens[row, :len(toks)] = torch.tensor(toks)
            parents[row, :len(pars)] = torch.tensor(pars)
            valid[row, :len(toks)] = True
        device = self.roots.device
        # non-blocking: a blocking copy to a GPU would wait for its queue as a read does
        return DraftTree(tokens.to(device, non_blocking=True), parents.to(device, non_blocking=True),
                         valid.to(device, non_blocking=True), scored=self._window_nodes(n, device))

    def _window_nodes(self, n: int, device) -> ScoredNodes:
        b, e = len(self.windows), self.levels * self.window
        tokens = torch.from_numpy(np.stack(self.windows).reshape(b, e).astype(np.int64))
        attend = torch.zeros(e, n + e, dtype=torch.bool)
        attend[:, 0] = True  # the root; no other tree node
        attend[:, n:] = self.sees
        return ScoredNodes(tokens=tokens.to(device, non_blocking=True),
                           offsets=self.offsets.to(device, non_blocking=True).expand(b, e),
                           attend=attend.to(device, non_blocking=True).expand(b, e, n + e),
                           valid=torch.ones(b, e, dtype=torch.bool, device=device))

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.pools = [self.pools[r] for r in keep]
        self.windows = [self.windows[r] for r in keep]
        self.age = [self.age[r] for r in keep]
        self.tails = [self.tails[r] for r in keep]
        self.host_roots = [self.host_roots[r] for r in keep]
        self.roots = self.roots[rows]


def from_spec(arg: str | None, target, tokenizer=None) -> LookaheadDrafter:
    """`lookahead` (Fu et al.'s defaults) or `lookahead:<window>,<ngram>,<guesses>`, e.g. `lookahead:5,4,5`."""
    if arg is None:
        return LookaheadDrafter()
    parts = [p.strip() for p in arg.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"write lookahead or lookahead:<window>,<ngram>,<guesses> (e.g. lookahead:15,5,15); "
                         f"got lookahead:{arg}")
    window, ngram, guesses = (int(p) for p in parts)
    return LookaheadDrafter(window=window, ngram=ngram, guesses=guesses)
