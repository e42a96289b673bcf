"""Staged drafting (Spector & Re 2023): a draft for the draft.

A self-drafter (the bf16 or int8 copy, early exit, any draft model) runs one forward per drafted token.
Here prompt lookup first guesses how the draft model will continue; the draft model scores the guess in
ONE forward, keeps the longest prefix that matches its own greedy choices and adds its own next token,
exactly as the target verifies the draft model. Where the text repeats itself the draft model drafts
several tokens per forward; elsewhere it pays one forward per token as before. The drafts are the draft
model's own greedy tokens either way, so acceptance is unchanged.

Under sampling the guess would have to be verified against the draft model's distribution too; the
drafter then drafts plainly (one token per forward), which keeps sampling exact.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..attention import prompt_tree
from ..kv import forward_block
from ..tree import DraftTree
from .chain import chain_tree
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .registry import build_drafter


class StagedDrafter(DraftModelDrafter):
    """`DraftModelDrafter` whose sequential steps are shortened by an inner prompt-lookup guess."""

    def __init__(self, model, num_tokens: int = 8, adaptive: bool = True, guess_tokens: int = 4):
        super().__init__(model, num_tokens=num_tokens, adaptive=adaptive)
        self.inner = NgramDrafter(num_tokens=guess_tokens)
        self.node_slot: list[list[int]] = []  # per row, the chain slot of each fed node (root first)

    def compile_forwards(self) -> bool:
        warnings.warn("compile=True: staged drafting feeds the draft model blocks of every length the guess "
                      "takes; it drafts without compiling", stacklevel=3)
        return True  # said here, in its own words

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.inner.bind(target, sampling, batch_size, generator)

    def observe(self, step):
        super().observe(step)
        self.inner.observe(step)

    def select_rows(self, rows):
        super().select_rows(rows)
        self.inner.select_rows(rows)
        self.node_slot = [self.node_slot[int(r)] for r in rows] if self.node_slot else []

    def _chain_slots_kept(self, accepted: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(len(accepted), self.fed, dtype=torch.bool, device=accepted.device)
        for row, slots in enumerate(self.node_slot):
            kept = slots[:int(accepted[row])]
            keep[row, kept] = True
        return keep

    def _kept_in_place(self) -> bool | None:
        return None  # the kept nodes of a tree need not be a prefix of the slots fed: looked up

    def _nodes_fed(self, rows: int) -> list[int]:
        return [len(slots) for slots in self.node_slot]

    def propose(self, budget: torch.Tensor) -> DraftTree:
        k = self._room(budget)
        b = self.roots.shape[0]
        if k == 0:
            self.node_slot = [[] for _ in range(b)]
            return self._skip_drafting()
        near_end = self.max_positions and self._used() + k + self.inner.num_tokens > self.max_positions
        if self.sampling.do_sample or near_end:  # guesses need room past the drafts: draft plainly
            tree = super().propose(budget)
            self.node_slot = [list(range(self.fed))] * b
            return tree
        if self.length is not None:
            self.length.start(b)  # the catch-up forward is part of what drafting costs
        block, valid = self._catch_up_block()
        depth, ancestors, node_valid = prompt_tree(valid)
        logits = forward_block(self.model, self.kv, depth, ancestors, node_valid, input_ids=block,
                               logits_to_keep=1).logits[:, -1:]
        self.kv.mark_valid(node_valid)
        self.fed = 1
        self.node_slot = [[0] for _ in range(b)]
        limit = [min(k, int(n)) for n in budget.tolist()]
        drafts: list[list[int]] = [[] for _ in range(b)]
        guesses: list[list[int]] = [[] for _ in range(b)]
        going = [n > 0 for n in limit]
        while True:
            self._take(logits, guesses, drafts, going, limit)
            if not any(going):
                break
            logits, guesses = self._score_guesses(drafts, going)
        if self.length is not None:
            self.length.drafted()
        width = max(len(d) for d in drafts)
        out = torch.zeros(b, width, dtype=torch.long)
        for row, d in enumerate(drafts):
            out[row, :len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts])
        device = self.roots.device
        return chain_tree(self.roots, out.to(device), lengths.to(device))

    def _take(self, logits: torch.Tensor, guesses, drafts, going, limit) -> None:
        """Append to each going row the guessed tokens its own argmax confirms, then its own next token.

        logits: [B, G + 1, V], position i scored after the row's last draft and its first i guesses."""
        choice = logits.argmax(-1).tolist()
        probs = torch.softmax(logits.float(), -1).gather(2, logits.argmax(-1, keepdim=True))[..., 0].tolist()
        for row in range(len(drafts)):
            if not going[row]:
                continue
            for i, token in enumerate(choice[row][:len(guesses[row]) + 1]):
                drafts[row].append(token)
                more = self.length.keep_going(row, probs[row][i]) if self.length is not None else True
                if len(drafts[row]) >= limit[row] or not more:
                    going[row] = False
                    break
                if i == len(guesses[row]) or guesses[row][i] != token:
                    break

    def _score_guesses(self, drafts, going) -> tuple[torch.Tensor, list[list[int]]]:
        """Feed each going row's newest draft plus a prompt-lookup guess of what follows, in one forward.

        Only the newest draft and the guessed tokens the model confirms stay valid in its cache."""
        b = len(drafts)
        roots = self.roots.tolist()
        guesses = []
        for row in range(b):
            if not going[row]:
                guesses.append([])
                continue
            ctx = np.concatenate([self.inner.context[row].tokens(), np.array([roots[row], *drafts[row]])])
            guess, _ = self.inner._lookup(ctx, self.inner.num_tokens)
            guesses.append(guess.tolist())
        width = 1 + max(len(g) for g in guesses)
        block = torch.zeros(b, width, dtype=torch.long)
        node_valid = torch.zeros(b, width, dtype=torch.bool)
        for row in range(b):
            if going[row]:
                seq = [drafts[row][-1]] + guesses[row]
                block[row, :len(seq)] = torch.tensor(seq)
                node_valid[row, :len(seq)] = True
        device = self.roots.device
        block, node_valid = block.to(device), node_valid.to(device)
        depth = torch.arange(width, device=device).expand(b, width)
        ancestors = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(b, width, width)
        logits = forward_block(self.model, self.kv, depth, ancestors, node_valid, input_ids=block).logits
        # The model confirms guess i when its argmax after position i - 1 is guess i; later ones are holes.
        choice = logits.argmax(-1).tolist()
        keep = torch.zeros_like(node_valid)
        for row in range(b):
            if not going[row]:
                continue
            confirmed = 0
            while confirmed < len(guesses[row]) and choice[row][confirmed] == guesses[row][confirmed]:
                confirmed += 1
            keep[row, :confirmed + 1] = True
            self.node_slot[row] += [self.fed + i for i in range(confirmed + 1)]
        self.kv.mark_valid(keep)
        self.fed += width
        return logits, guesses


def from_spec(arg: str | None, target, tokenizer=None) -> StagedDrafter:
    """`staged:<self-drafter>+ngram`, e.g. `staged:bf16+ngram`: prompt lookup drafts for the self-drafter."""
    outer, plus, inner = (arg or "").partition("+")
    if not outer or (plus and inner.strip() != "ngram"):
        raise ValueError(f"write staged:<drafter>+ngram with a self-drafter such as bf16, int8 or early_exit:<k> "
                         f"(prompt lookup is the inner drafter); got {arg!r}")
    drafter = build_drafter(outer.strip(), target, tokenizer)
    if not isinstance(drafter, DraftModelDrafter) or isinstance(drafter, StagedDrafter):
        raise ValueError(f"staged drafting needs a drafter that runs a model per token (bf16, int8, "
                         f"early_exit:<k>), not {outer!r}")
    return StagedDrafter(drafter.model, num_tokens=drafter.num_tokens, adaptive=drafter.adaptive)
