"""What a drafter is to the engine.

The engine owns the target, its cache and verification; a drafter only proposes trees. After the prefill
and after every verification the engine tells the drafter what the target committed (`observe`), then
asks for the next tree (`propose`), whose root is the target's pending next token. Medusa heads, EAGLE
drafters, a separate draft model and n-gram lookup all implement this one interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams
from .tree import DraftTree


@dataclass
class TargetStep:
    """Tokens the target just committed to its cache, and what it computed for them."""

    tokens: torch.Tensor  # [B, A]; the prompt after the prefill, root + accepted drafts after a verify
    valid: torch.Tensor  # [B, A] bool; valid slots are contiguous (left padding at prefill, right after)
    hidden: tuple[torch.Tensor, ...]  # one [B, A, D] per index in the drafter's `feature_layers`
    next_tokens: torch.Tensor  # [B] the target's token after each row's last valid slot: the next root
    # The target's raw logits for the proposed tree's `scored` nodes ([B, E, V]; None if it had none) and
    # which of them were scored as proposed ([B, E]; a node pruned by the budget or a row-mixing wrapper is not).
    scored_logits: torch.Tensor | None = None
    scored_valid: torch.Tensor | None = None
    # At the prefill only: the target's KV cache, whose layers hold the K/V of `tokens` in their first A slots
    # (a drafter whose model is a copy of the target may take them instead of computing its own). Read-only.
    prompt_cache: object | None = None
    # The same tokens on the host, from the engine's one read of the step: per row, the valid slots' tokens, and
    # the next root. A drafter that works on the host (prompt lookup) reads these, not the device.
    host_tokens: list[list[int]] | None = None
    host_next: list[int] | None = None
    # and the scored nodes' (with `scored_logits`): the target's argmax at each, and `scored_valid`, on the host
    host_scored_choice: list[list[int]] | None = None
    host_scored_valid: list[list[bool]] | None = None

    def on_host(self) -> tuple[list[list[int]], list[int]]:
        """(`host_tokens`, `host_next`): from the engine's read where it gave them, else read here (a step a
        caller made without the engine)."""
        if self.host_tokens is None:
            tokens, valid = self.tokens.tolist(), self.valid.tolist()
            self.host_tokens = [[t for t, v in zip(row, keep, strict=True) if v] for row, keep in zip(tokens, valid,
                                                                                                    strict=True)]
            self.host_next = self.next_tokens.tolist()
        return self.host_tokens, self.host_next

    def following_tokens(self) -> torch.Tensor:
        """[B, A]: for every slot, the token that follows it (the next slot's, or `next_tokens` at the end)."""
        nxt = torch.cat([self.tokens[:, 1:], self.next_tokens[:, None]], dim=1)
        nxt_valid = torch.cat([self.valid[:, 1:], torch.zeros_like(self.valid[:, :1])], dim=1)
        return torch.where(nxt_valid, nxt, self.next_tokens[:, None])

    def last_valid_index(self) -> torch.Tensor:
        """[B]: index of each row's last valid slot."""
        a = self.valid.shape[1]
        idx = torch.arange(a, device=self.valid.device).expand_as(self.valid)
        return torch.where(self.valid, idx, -1).max(1).values


class Drafter:
    """Base class. Subclasses set `feature_layers` and implement `observe` and `propose`."""

    # Indices into the target's `output_hidden_states` tuple (0 = embeddings, L = last layer after the
    # final norm) that `observe` needs in `TargetStep.hidden`.
    feature_layers: tuple[int, ...] = ()
    # True if propose() leaves no state behind, so a wrapper (LookupFirstDrafter) may skip it for a step.
    pure_propose: bool = False
    # Set by the engine before any call where its step runs on a GPU (`infer.options.Plan.captured_step`): propose
    # reads nothing on the host. A drafter that honours it drafts trees of a fixed shape (no early stop, no trimming
    # to the nodes in use), trading a little drafting for a queue that never drains; on a CPU, where a read costs
    # next to nothing, it stays False and drafting stops early where it can.
    sync_free: bool = False

    def check_target(self, target) -> None:
        """Raise ValueError if this drafter cannot serve `target`."""

    def bind(self, target, sampling: SamplingParams, batch_size: int,
             generator: torch.Generator | None = None) -> None:
        """Start a generation: remember the target, the sampling settings and the caller's random generator
        (drafts sampled from it, so a seeded generate is reproducible); reset per-row state."""
        self.target, self.sampling, self.batch_size, self.generator = target, sampling, batch_size, generator

    def observe(self, step: TargetStep) -> None:
        raise NotImplementedError

    def propose(self, budget: torch.Tensor) -> DraftTree:
        """A tree per row whose root is the last `next_tokens`; `budget[b]` is the deepest depth row b can use."""
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (others finished)."""

    # Capabilities the engine sets once, from its settled plan, before any call. A drafter that runs no forward of
    # its own (n-gram, lookup, Medusa's heads over the target's features) keeps these defaults.
    def compile_forwards(self) -> bool:
        """`compile=True`: compile the forwards this drafter runs of its own; False where it runs none (the
        engine then says that nothing of the drafter's is compiled)."""
        return False

    def lean_forwards(self, stream_rows: int | None, int8: bool = True) -> None:
        """A CPU's lean verify: run this drafter's own forwards without transformers' module machinery too, blocks
        of 2..stream_rows rows on the streamed kernel, with `int8` on int8 copies of the weights."""

    def capture_forwards(self, make) -> None:
        """The captured step: run this drafter's forwards after the prompt's through `make(model)` (the engine's
        `infer.cuda.StepGraphs`); None: through the model as before."""
