"""Drafters that need no training: n-gram prompt lookup and a separate draft model.

Both propose a chain: a tree with one branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .drafting import Drafter, TargetStep
from .kv import KVState, forward_block, prompt_tree
from .sampling import logits_to_probs, sample
from .tree import DraftTree


def chain_tree(roots: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
               q: torch.Tensor | None = None) -> DraftTree:
    """roots [B], drafts [B, K] with `lengths[b]` usable drafts -> a one-branch tree of K + 1 nodes."""
    b, k = drafts.shape
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    parents = torch.arange(-1, k, device=roots.device).expand(b, k + 1)
    valid = torch.arange(k + 1, device=roots.device)[None, :] <= lengths[:, None]
    if q is not None:  # q: [B, K, V] for the drafts; the root's entry is never read
        q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)
    return DraftTree(tokens=tokens, parents=parents.contiguous(), valid=valid, q=q)


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; Fu et al. 2024): find an earlier occurrence of the context's last n
    tokens (n from `max_ngram` down to `min_ngram`) and propose what followed it."""

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def bind(self, target, sampling, batch_size):
        super().bind(target, sampling, batch_size)
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


class DraftModelDrafter(Drafter):
    """A smaller causal LM with the target's tokenizer drafts `num_tokens` tokens autoregressively
    (Leviathan et al. 2023; Chen et al. 2023). When sampling, drafts are drawn from the draft model's
    processed distribution q, which verification uses for rejection sampling."""

    def __init__(self, model, num_tokens: int = 4):
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.model, self.num_tokens = model.eval(), num_tokens

    def check_target(self, target) -> None:
        mine, theirs = self.model.config.get_text_config(), target.config.get_text_config()
        if mine.vocab_size != theirs.vocab_size:
            raise ValueError(f"draft model vocab_size {mine.vocab_size} != target vocab_size "
                             f"{theirs.vocab_size}: a draft model must share the target's tokenizer")
        if self.model.device != target.device:
            raise ValueError(f"draft model is on {self.model.device} but the target is on {target.device}; "
                             "move both to one device")

    def bind(self, target, sampling, batch_size):
        super().bind(target, sampling, batch_size)
        self.kv = KVState(batch_size, target.device, self.model.config)
        self.pending: list[torch.Tensor] = []  # committed tokens the draft model has not seen, per row
        self.start = self.fed = self.pend_width = 0

    def observe(self, step: TargetStep) -> None:
        if self.kv.size == 0:  # prefill: the whole prompt
            depth, ancestors, valid = prompt_tree(step.valid)
            forward_block(self.model, self.kv, depth, ancestors, valid, input_ids=step.tokens, logits_to_keep=1)
            self.kv.mark_valid(valid)
            self.pending = [step.tokens.new_empty(0)] * step.tokens.shape[0]
        else:
            # Slots since the last propose: [pending (left-padded), root, d1, ..., d_{fed-1}]. Keep the
            # pending ones and the chain nodes the target accepted; queue accepted tokens never fed.
            accepted = step.valid.sum(1)
            chain_keep = torch.arange(self.fed, device=accepted.device)[None, :] < accepted[:, None]
            keep = torch.cat([self.pend_valid, chain_keep], dim=1)
            order = (~keep).long().argsort(dim=1, stable=True)  # kept slots first, in order
            self.kv.commit(self.start, order, keep.gather(1, order))
            self.pending = [step.tokens[b, self.fed:int(accepted[b])] for b in range(len(accepted))]
        self.roots = step.next_tokens

    def propose(self, budget: torch.Tensor) -> DraftTree:
        k = max(0, min(self.num_tokens, int(budget.max())))
        b = self.roots.shape[0]
        if k == 0:  # nothing to draft; the root reaches the draft cache with the next block
            self.start, self.fed, self.pend_width = self.kv.size, 0, 0
            self.pend_valid = torch.zeros(b, 0, dtype=torch.bool, device=self.roots.device)
            self.pending = [torch.cat([p, self.roots[r:r + 1]]) for r, p in enumerate(self.pending)]
            return chain_tree(self.roots, self.roots.new_zeros(b, 0), torch.zeros_like(budget))
        # The unseen committed tokens and the root, as one left-padded block.
        width = max(len(p) for p in self.pending) + 1
        block = self.roots.new_zeros(b, width)
        valid = torch.zeros(b, width, dtype=torch.bool, device=block.device)
        for row, pend in enumerate(self.pending):
            seq = torch.cat([pend, self.roots[row:row + 1]])
            block[row, width - len(seq):] = seq
            valid[row, width - len(seq):] = True
        self.start, self.fed, self.pend_width = self.kv.size, 0, width - 1
        self.pend_valid = valid[:, :-1]
        depth, ancestors, node_valid = prompt_tree(valid)
        inputs, drafts, qs = block, [], []
        one = torch.ones(b, 1, dtype=torch.bool, device=block.device)
        for _ in range(k):
            logits = forward_block(self.model, self.kv, depth, ancestors, node_valid, input_ids=inputs,
                                   logits_to_keep=1).logits[:, -1]
            self.kv.mark_valid(node_valid)
            self.fed += 1
            if self.sampling.do_sample:
                q = logits_to_probs(logits, self.sampling)
                token = sample(q)
                qs.append(q)
            else:
                token = logits.argmax(-1)
            drafts.append(token)
            # The next query is one new node right after everything fed so far.
            inputs, depth, ancestors, node_valid = token[:, None], torch.zeros_like(inputs[:, :1]), one[..., None], one
        q = torch.stack(qs, 1) if qs else None
        return chain_tree(self.roots, torch.stack(drafts, 1), torch.full_like(budget, k), q)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        self.pending = [self.pending[int(r)] for r in rows]
        self.roots = self.roots[rows]


class LookupFirstDrafter(Drafter):
    """Prompt lookup where the context repeats itself, another drafter everywhere else.

    Each step, a row whose last `min_match` tokens (or more) occur earlier in its context takes the n-gram
    chain (copying from the prompt: extraction, code edits, quotes), every other row the `primary` tree.
    Both drafters observe every step. Verification is the same for any tree, so output stays exact.
    """

    def __init__(self, primary: Drafter, lookup: NgramDrafter | None = None, min_match: int = 3):
        self.primary, self.lookup = primary, lookup or NgramDrafter()
        if not 1 <= min_match <= self.lookup.max_ngram:
            raise ValueError(f"min_match must be in 1..{self.lookup.max_ngram} (the lookup's max_ngram), "
                             f"got {min_match}")
        self.min_match = min_match
        self.feature_layers = primary.feature_layers
        self.model = getattr(primary, "model", None)  # its linears get the engine's CPU prepacking too

    def check_target(self, target) -> None:
        self.primary.check_target(target)

    def bind(self, target, sampling, batch_size):
        super().bind(target, sampling, batch_size)
        self.primary.bind(target, sampling, batch_size)
        self.lookup.bind(target, sampling, batch_size)

    def observe(self, step: TargetStep) -> None:
        self.primary.observe(step)
        self.lookup.observe(step)

    def propose(self, budget: torch.Tensor) -> DraftTree:
        chain, matched = self.lookup.lookup(budget)
        use_chain = matched >= self.min_match  # [B]
        if use_chain.all() and getattr(self.primary, "pure_propose", False):
            return chain
        tree = self.primary.propose(budget)
        if not use_chain.any():
            return tree
        return _pick_rows(use_chain, chain, tree)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.primary.select_rows(rows)
        self.lookup.select_rows(rows)


def _pick_rows(take_a: torch.Tensor, a: DraftTree, b: DraftTree) -> DraftTree:
    """Row r of the result is a's row r where take_a[r], else b's; the narrower tree is padded with
    invalid nodes, and deterministic drafts get one-hot q when the other tree carries q."""
    n = max(a.num_nodes, b.num_nodes)

    def widened(t: DraftTree, vocab: int | None):
        pad = n - t.num_nodes
        tokens = F.pad(t.tokens, (0, pad))
        parents = F.pad(t.parents, (0, pad))  # pads hang off the root, invalid
        valid = F.pad(t.valid, (0, pad), value=False)
        q = None
        if vocab is not None:
            q = t.q if t.q is not None else F.one_hot(t.tokens, vocab).float()
            q = F.pad(q, (0, 0, 0, pad))
        return tokens, parents, valid, q

    vocab = next((t.q.shape[-1] for t in (a, b) if t.q is not None), None)
    wa, wb = widened(a, vocab), widened(b, vocab)
    pick = [torch.where(take_a.view(-1, *[1] * (x.dim() - 1)), x, y) if x is not None else None
            for x, y in zip(wa, wb, strict=True)]
    return DraftTree(*pick)
