"""SuffixDecoding (Oliaro et al., NeurIPS 2025): draft what followed the context's suffix in this request and
in earlier responses, at no model cost.

Two sources are searched every step, per row:

    request     this row's prompt and output so far (a new one each generate call)
    responses   earlier responses of the same drafter, kept across generate calls; bounded by
                `max_cached_tokens` (and optionally `max_cached_requests`), oldest evicted first; `clear()`

For each source the longest suffix of the context (up to `max_match` tokens, the pending root included)
that occurs earlier is found, and the tokens that followed its occurrences are counted into a tree: a
node's probability is its parent's times the fraction of the parent's occurrences continued by its token.
The most probable nodes are taken best-first while above `min_prob`, up to
min(`max_spec_tokens`, `spec_factor` * match length + `spec_offset`) nodes: a long match drafts a big tree,
a short one a small tree. Of the two sources' trees the one with the higher score (the sum of its node
probabilities, the expected number of accepted tokens) is proposed. With a `fallback` drafter, rows whose
match is shorter than `min_match` take the fallback's tree instead (suffix where the match is long, the
model elsewhere). A sampled call with a fallback searches the request alone: the fallback's drafts are drawn,
so where they are taken shapes the sample, and earlier responses must not change what one seed gives.

These are the queries a depth-bounded suffix tree answers (deepest node matching the context; the counts
of the subtree below it). Here they are answered from the token arrays themselves: one vectorized
comparison finds the occurrences of the context's last token and each further step keeps those whose
preceding token also matches, so memory is one int per cached token rather than a trie node per
(token, depth), and eviction is dropping an array.

Drafts are deterministic, so under sampling they are the one-hot q case of verification (distinct
siblings), and the output follows the target's distribution exactly; verification then samples the target's
own tokens as without drafts (infer/verify.py), so earlier responses never change what a seed gives.

arctic-inference (vLLM's method="suffix") does run on CPU: 0.3.0 is published as source only and builds in
about a minute with a C++20 compiler, cmake, nanobind 2.9.2 and torch >= 2.10 present at build time (pip
install arctic-inference --no-build-isolation; its CUDA ops are optional and off). It is not a dependency:
our search needs no compiler, bounds the cache by tokens (arctic's by requests only), and on the repeated
MT-bench smoke run drafted exactly as well (the same tau). Where it is installed, `backend="arctic"`
(`suffix:arctic`) drafts from its C++ suffix trees instead, bounded here the same way, for comparison.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..tree import DraftTree
from .lookup_first import _pick_rows
from .ngram import to_device
from .registry import build_drafter

_BOUNDARY = -1  # between cached responses; never equal to a token, so no match crosses it


@dataclass
class Draft:
    """One row's speculation: `parents[i]` indexes `tokens` (-1: a child of the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of the nodes' estimated probabilities
    match: int = 0  # length of the matched context suffix


class ResponseCache:
    """Earlier responses as token arrays, at most `max_tokens` tokens (and `max_requests` responses) in all;
    adding past the bound evicts the oldest first. A response longer than the whole bound keeps its first
    `max_tokens` tokens."""

    def __init__(self, max_tokens: int, max_requests: int | None = None):
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.responses: deque[np.ndarray] = deque()
        self.num_tokens = 0
        self._corpus: np.ndarray | None = None

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)[:self.max_tokens]
        if not len(tokens) or (self.max_requests is not None and self.max_requests < 1):
            return
        self.responses.append(tokens)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens or (self.max_requests and len(self.responses) > self.max_requests):
            self.num_tokens -= len(self.responses.popleft())
        self._corpus = None

    def clear(self) -> None:
        self.responses.clear()
        self.num_tokens = 0
        self._corpus = None

    def corpus(self) -> np.ndarray:
        """Every response, each followed by a boundary: [num_tokens + num_responses]."""
        if self._corpus is None:
            parts = [p for r in self.responses for p in (r, np.array([_BOUNDARY]))]
            self._corpus = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._corpus


def longest_match(corpus: np.ndarray, pattern: np.ndarray, end: int, max_match: int) -> tuple[int, np.ndarray]:
    """The longest suffix of `pattern` (at most `max_match` tokens) that ends somewhere in corpus[:end]:
    its length (0: not even the last token occurs) and the positions of its last token, ascending."""
    hits = np.flatnonzero(corpus[:end] == pattern[-1])
    if not len(hits):
        return 0, hits
    m = 1
    while m < min(max_match, len(pattern)):
        before = hits - m
        ok = before >= 0
        longer = hits[ok][corpus[before[ok]] == pattern[-1 - m]]
        if not len(longer):
            break
        hits, m = longer, m + 1
    return m, hits


def continuations(corpus: np.ndarray, ends: np.ndarray, depth: int) -> np.ndarray:
    """[len(ends), depth]: the tokens after each position, -1 past the corpus end or a boundary."""
    idx = ends[:, None] + 1 + np.arange(depth)
    cont = np.where(idx < len(corpus), corpus[np.minimum(idx, len(corpus) - 1)], _BOUNDARY)
    cont[np.cumsum(cont < 0, axis=1) > 0] = _BOUNDARY
    return cont


def frequency_tree(cont: np.ndarray, size: int, min_prob: float) -> Draft:
    """The `size` most probable nodes of the continuation counts, best first (a child is never more probable
    than its parent, so every parent is taken before its children)."""
    # cont: [n, depth]
    draft = Draft()
    heap: list = []
    order = itertools.count()  # ties: first found first

    def push_children(rows: np.ndarray, depth: int, parent: int, prob: float) -> None:
        if depth >= cont.shape[1]:
            return
        tokens = cont[rows, depth]
        going = tokens >= 0
        if not going.any():
            return
        values, inverse, counts = np.unique(tokens[going], return_inverse=True, return_counts=True)
        for i, tok in enumerate(values.tolist()):
            p = prob * int(counts[i]) / len(rows)  # rows that ended here count against every child
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), tok, parent, depth, rows[going][inverse == i]))

    push_children(np.arange(len(cont)), 0, -1, 1.0)
    while heap and len(draft.tokens) < size:
        neg_p, _, tok, parent, depth, rows = heapq.heappop(heap)
        draft.tokens.append(tok)
        draft.parents.append(parent)
        draft.score -= neg_p
        push_children(rows, depth + 1, len(draft.tokens) - 1, -neg_p)
    return draft


@dataclass(frozen=True)
class TreeSize:
    max_spec_tokens: int
    spec_factor: float
    spec_offset: float
    min_prob: float

    def nodes(self, match: int, depth: int) -> int:
        """How many nodes a match of this length earns, for a row that may draft `depth` deep."""
        if match == 0 or depth <= 0:
            return 0
        return max(0, min(self.max_spec_tokens, math.floor(self.spec_factor * match + self.spec_offset)))


class OwnTrees:
    """Our suffix search over a row's context and the `ResponseCache` (see the module docstring)."""

    def __init__(self, max_match: int, max_cached_tokens: int, max_cached_requests: int | None,
                 max_occurrences: int):
        self.max_match, self.max_occurrences = max_match, max_occurrences
        self.responses = ResponseCache(max_cached_tokens, max_cached_requests)

    def start(self, key: int, prompt: np.ndarray) -> None:
        pass

    def extend(self, key: int, tokens: np.ndarray) -> None:
        pass

    def stop(self, key: int, response: np.ndarray) -> None:
        self.responses.add(response)

    def drop(self, key: int) -> None:
        pass

    def clear(self) -> None:
        self.responses.clear()

    def speculate(self, key: int, context: np.ndarray, size: TreeSize, depth: int) -> Draft:
        """context: this row's prompt, output and pending root."""
        best = request_draft(context, size, depth, self.max_match, self.max_occurrences)
        corpus = self.responses.corpus()
        match, ends = longest_match(corpus, context[-self.max_match:], len(corpus), self.max_match)
        draft = _draft_after(corpus, match, ends, size, depth, self.max_occurrences)
        if draft.score > best.score or (not best.tokens and draft.match > best.match):
            best = draft
        return best


def request_draft(context: np.ndarray, size: TreeSize, depth: int, max_match: int, max_occurrences: int) -> Draft:
    """The tree of what followed earlier occurrences of the context's suffix in the context itself (ending
    before its last token, the pending root)."""
    match, ends = longest_match(context, context[-max_match:], len(context) - 1, max_match)
    return _draft_after(context, match, ends, size, depth, max_occurrences)


def _draft_after(corpus: np.ndarray, match: int, ends: np.ndarray, size: TreeSize, depth: int,
                 max_occurrences: int) -> Draft:
    """The frequency tree of the tokens after a match's latest occurrences; empty where the match earns none."""
    nodes = size.nodes(match, depth)
    if nodes == 0:
        return Draft()
    draft = frequency_tree(continuations(corpus, ends[-max_occurrences:], min(nodes, depth)), nodes, size.min_prob)
    draft.match = match
    return draft


class ArcticTrees:
    """arctic-inference's C++ suffix trees (`SuffixDecodingCache`), for comparison where it is installed."""

    def __init__(self, max_match: int, max_cached_tokens: int, max_cached_requests: int | None):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as err:
            raise ValueError("suffix:arctic needs the arctic-inference package (pip install arctic-inference "
                             "--no-build-isolation, with torch >= 2.10, cmake, nanobind==2.9.2 and a C++20 "
                             "compiler); use plain 'suffix' for our own suffix search") from err
        self.cache = SuffixDecodingCache(max_tree_depth=max_match, max_cached_requests=-1)
        self.max_match, self.max_tokens, self.max_requests = max_match, max_cached_tokens, max_cached_requests
        self.cached: dict[int, int] = {}  # key -> response length, oldest first
        self.num_tokens = 0

    def start(self, key: int, prompt: np.ndarray) -> None:
        self.cache.start_request(key, prompt.astype(np.int32))

    def extend(self, key: int, tokens: np.ndarray) -> None:
        self.cache.add_active_response(key, tokens.astype(np.int32))

    def stop(self, key: int, response: np.ndarray) -> None:
        self.extend(key, response[-1:])  # the final root, never observed as committed
        self.cache.stop_request(key)
        self.cached[key] = len(response)
        self.num_tokens += len(response)
        while self.cached and (self.num_tokens > self.max_tokens
                               or (self.max_requests is not None and len(self.cached) > self.max_requests)):
            oldest = next(iter(self.cached))
            self.cache.evict_cached_response(oldest)
            self.num_tokens -= self.cached.pop(oldest)

    def drop(self, key: int) -> None:
        """Forget a started request without caching it (arctic keeps active responses in its global tree)."""
        self.cache.stop_request(key)
        self.cache.evict_cached_response(key)

    def clear(self) -> None:
        for key in list(self.cached):
            self.cache.evict_cached_response(key)
        self.cached.clear()
        self.num_tokens = 0

    def speculate(self, key: int, context: np.ndarray, size: TreeSize, depth: int) -> Draft:
        if depth <= 0:
            return Draft()
        got = self.cache.speculate(key, context[-self.max_match:].astype(np.int32),
                                   max_spec_tokens=min(size.max_spec_tokens, depth),
                                   max_spec_factor=size.spec_factor, max_spec_offset=size.spec_offset,
                                   min_token_prob=size.min_prob, use_tree_spec=True)
        draft = Draft(list(got.token_ids), list(got.parents), float(got.score), int(got.match_len))
        # its node count follows max_spec_tokens, not depth: drop nodes deeper than the row may draft
        node_depth: list[int] = []
        keep: list[bool] = []
        for p in draft.parents:
            node_depth.append(1 if p < 0 else node_depth[p] + 1)
            keep.append(node_depth[-1] <= depth and (p < 0 or keep[p]))
        if not all(keep):
            new = {old: i for i, old in enumerate(i for i, k in enumerate(keep) if k)}
            draft.tokens = [t for t, k in zip(draft.tokens, keep, strict=True) if k]
            draft.parents = [p if p < 0 else new[p] for p, k in zip(draft.parents, keep, strict=True) if k]
        return draft


class SuffixDrafter(Drafter):
    """SuffixDecoding: per-request and cross-request suffix matches, a frequency-scored tree whose size
    follows the match length (see the module docstring); optionally a `fallback` drafter where the match is
    shorter than `min_match` tokens."""

    pure_propose = True  # without a fallback; with one, `propose` below runs the fallback when it must

    def __init__(self, max_spec_tokens: int = 16, spec_factor: float = 1.0, spec_offset: float = 0.0,
                 min_prob: float = 0.1, max_match: int = 32, max_cached_tokens: int = 1 << 18,
                 max_cached_requests: int | None = None, max_occurrences: int = 256,
                 fallback: Drafter | None = None, min_match: int = 3, backend: str = "ours"):
        _check_int("max_spec_tokens", max_spec_tokens, 1, 1024)
        _check_real("spec_factor", spec_factor, low=0.0, open_low=True)
        _check_real("spec_offset", spec_offset)
        _check_real("min_prob", min_prob, low=0.0, high=1.0)
        _check_int("max_match", max_match, 1, 1 << 16)
        _check_int("max_cached_tokens", max_cached_tokens, 0, None)
        if max_cached_requests is not None:
            _check_int("max_cached_requests", max_cached_requests, 0, None)
        _check_int("max_occurrences", max_occurrences, 1, None)
        _check_int("min_match", min_match, 1, max_match)
        if fallback is not None and not isinstance(fallback, Drafter):
            raise TypeError(f"fallback must be an infer.Drafter, got {type(fallback).__name__}")
        self.size = TreeSize(max_spec_tokens, float(spec_factor), float(spec_offset), float(min_prob))
        if backend == "ours":
            self.trees = OwnTrees(max_match, max_cached_tokens, max_cached_requests, max_occurrences)
        elif backend == "arctic":
            self.trees = ArcticTrees(max_match, max_cached_tokens, max_cached_requests)
        else:
            raise ValueError(f"backend must be 'ours' or 'arctic', got {backend!r}")
        self.fallback, self.min_match = fallback, min_match
        self.max_match, self.max_occurrences = max_match, max_occurrences
        if fallback is not None:
            self.feature_layers = fallback.feature_layers
            self.model = getattr(fallback, "model", None)  # its linears get the engine's CPU prepacking too
            self.pure_propose = False
        self.context: list[np.ndarray] = []  # per row: prompt + committed output
        self.keys: list[int] = []  # per row: its request key in `trees`
        self.prompt_len: list[int] = []
        self._next_key = 0
        self.roots = None

    def check_target(self, target) -> None:
        if self.fallback is not None:
            self.fallback.check_target(target)

    def clear(self) -> None:
        """Forget every earlier response (and the previous call's rows not yet cached)."""
        for key in self.keys:
            self.trees.drop(key)
        self.trees.clear()
        self.context, self.keys, self.prompt_len = [], [], []

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self._retire(range(len(self.context)))  # the previous call's last rows: their responses are cached now
        self.context = [np.empty(0, dtype=np.int64)] * batch_size
        self.keys, self.prompt_len, self.roots, self.host_roots = [], [], None, []
        if self.fallback is not None:
            self.fallback.bind(target, sampling, batch_size, generator)

    def observe(self, step: TargetStep) -> None:
        committed, self.host_roots = step.on_host()  # the engine's read of the step: nothing read here
        first = not self.keys
        for b in range(len(self.context)):
            new = np.array(committed[b], dtype=np.int64)
            if first:
                self.keys.append(self._next_key)
                self._next_key += 1
                self.prompt_len.append(len(new))
                self.trees.start(self.keys[b], new)
            else:
                self.trees.extend(self.keys[b], new)
            self.context[b] = np.concatenate([self.context[b], new])
        self.roots = step.next_tokens
        if self.fallback is not None:
            self.fallback.observe(step)

    def propose(self, budget: torch.Tensor) -> DraftTree:
        roots = self.host_roots
        # sync_free (the captured step): no read of the budget; the engine prunes each row's tree to it
        depth = [self.size.max_spec_tokens] * len(roots) if self.sync_free else budget.tolist()
        if self.fallback is not None and getattr(self.sampling, "do_sample", False):
            # the fallback samples its drafts, so which rows take them shapes the sample: they must not depend
            # on earlier calls' responses, or one seed would give another sample on each call
            drafts = [request_draft(np.append(ctx, root), self.size, d, self.max_match, self.max_occurrences)
                      for ctx, root, d in zip(self.context, roots, depth, strict=True)]
        else:
            drafts = [self.trees.speculate(key, np.append(ctx, root), self.size, d)
                      for key, ctx, root, d in zip(self.keys, self.context, roots, depth, strict=True)]
        tree = self._tree(drafts)
        if self.fallback is None:
            return tree
        use_suffix = [d.match >= self.min_match and bool(d.tokens) for d in drafts]
        if all(use_suffix) and self.fallback.pure_propose:
            return tree
        other = self.fallback.propose(budget)
        return _pick_rows(to_device(np.array(use_suffix), tree.tokens.device), tree, other) if any(use_suffix) \
            else other

    def _tree(self, drafts: list[Draft]) -> DraftTree:
        # tokens, parents, valid: [B, 1 + most nodes]; node 0 is the root
        n = 1 + max(len(d.tokens) for d in drafts)
        tokens = torch.zeros(len(drafts), n, dtype=torch.long)
        parents = torch.zeros(len(drafts), n, dtype=torch.long)  # padding hangs off the root, invalid
        valid = torch.zeros(len(drafts), n, dtype=torch.bool)
        parents[:, 0], valid[:, 0] = -1, True
        for b, d in enumerate(drafts):
            k = len(d.tokens)
            tokens[b, 1:k + 1] = torch.tensor(d.tokens, dtype=torch.long)
            parents[b, 1:k + 1] = torch.tensor(d.parents, dtype=torch.long) + 1
            valid[b, 1:k + 1] = True
        device = self.roots.device
        tokens = tokens.to(device, non_blocking=True)  # a blocking copy to a GPU would wait for its queue
        tokens[:, 0] = self.roots
        return DraftTree(tokens=tokens, parents=parents.to(device, non_blocking=True),
                         valid=valid.to(device, non_blocking=True))

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self._retire(sorted(set(range(len(self.context))) - set(keep)))
        self.context = [self.context[r] for r in keep]
        self.keys = [self.keys[r] for r in keep]
        self.prompt_len = [self.prompt_len[r] for r in keep]
        self.host_roots = [self.host_roots[r] for r in keep]
        self.roots = self.roots[rows]
        if self.fallback is not None:
            self.fallback.select_rows(rows)

    def _retire(self, rows) -> None:
        """Finished rows: their responses (output and final root) go to the cache of earlier responses."""
        if not self.keys:
            return
        roots = self.roots.cpu().tolist() if self.roots is not None else None
        for r in rows:
            response = self.context[r][self.prompt_len[r]:]
            if roots is not None:
                response = np.append(response, roots[r])
            self.trees.stop(self.keys[r], response)


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"suffix drafter setting {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"suffix drafter setting {name} must be {bound}, got {value}")


def _check_real(name: str, value, low: float | None = None, high: float | None = None,
                open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"suffix drafter setting {name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if open_low else value < low)
    if not math.isfinite(value) or too_low or (high is not None and value > high):
        rng = {(True, True): f"in [{low}, {high}]", (True, False): f"{'>' if open_low else '>='} {low}",
               (False, False): "finite"}[(low is not None, high is not None)]
        raise ValueError(f"suffix drafter setting {name} must be {rng}, got {value}")


def from_spec(arg: str | None, target, tokenizer=None) -> SuffixDrafter:
    """`suffix`, `suffix:<drafter>` (the drafter where the match is short, e.g. `suffix:int8`),
    `suffix:arctic` and `suffix:arctic+<drafter>` (arctic-inference's suffix trees, where installed)."""
    backend, rest = "ours", (arg or "").strip()
    if rest == "arctic" or rest.startswith("arctic+"):
        backend, rest = "arctic", rest[len("arctic"):].lstrip("+").strip()
    if arg is not None and not (rest or backend == "arctic"):
        raise ValueError("write suffix, suffix:<drafter> (e.g. suffix:int8), suffix:arctic or "
                         f"suffix:arctic+<drafter>; got suffix:{arg}")
    fallback = build_drafter(rest, target, tokenizer) if rest else None
    if isinstance(fallback, SuffixDrafter):
        raise ValueError(f"suffix:{arg}: the fallback drafter must be another kind, not a suffix drafter")
    return SuffixDrafter(fallback=fallback, backend=backend)
