"""Training an EAGLE-3 drafter: its draft vocabulary fitted to the data, and the EAGLE objective over it."""

from __future__ import annotations

import torch

from heads.losses import token_loss

from ..eagle.objective import EagleObjective
from .model import build_vocab_map


class Eagle3Objective(EagleObjective):
    """The EAGLE objective (heads/eagle/objective.py) for EAGLE-3: step 0 reads the fused low/mid/high target
    layers; CE/KL over the draft vocabulary only, labels outside it masked from the loss; no feature loss."""

    def __init__(self, drafter, config, lora_target=None):
        if drafter.config.layer_windows:  # the unrolled training masks are full attention
            raise ValueError(f"this EAGLE-3 drafter has sliding-window attention layers (layer_windows "
                             f"{drafter.config.layer_windows}, as speculators trains them), which selfspec's training "
                             "does not mask; it drafts with them, but train a drafter of selfspec's own instead")
        super().__init__(drafter, config, lora_target)
        to_target = drafter.draft_to_target(torch.arange(drafter.d2t.numel(), device=drafter.d2t.device))
        to_draft = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long)
        to_draft[to_target.cpu()] = torch.arange(to_target.numel())
        self.register_buffer("to_target", to_target, persistent=False)
        self.register_buffer("to_draft", to_draft.to(to_target.device), persistent=False)

    def columns(self) -> torch.Tensor:
        return self.to_target

    def step_inputs(self, s: int) -> dict:
        return {"fused": s == 0}

    def _step_loss(self, hidden, logits, valid, labels, last, soft_targets, s, length):
        soft = self._soft_at_step(soft_targets, valid, s, length)
        tok = token_loss(logits, self.to_draft[labels], soft, self.config.loss)  # logits [N, V]: at `valid`
        return tok, {f"loss/step{s}": tok.detach()}


def prepare(drafter, target, train_set) -> None:
    """The draft vocabulary: the training data's most frequent assistant tokens; the drafter's lm_head rows
    are then copied from the target's again, and the data's coverage recorded for the model card."""
    counts = token_counts(train_set, drafter.config.target_vocab_size)
    drafter.set_vocab_map(*build_vocab_map(counts, drafter.config.draft_vocab_size))
    drafter.init_from_target(target)
    drafter.config.training = {**(drafter.config.training or {}),
                               "draft_vocab_coverage": round(float(counts[drafter.t2d.cpu()].sum() / counts.sum()), 4)}


def token_counts(samples: list, vocab_size: int) -> torch.Tensor:
    """How often each token is an assistant (trained) token: [V]; sets EAGLE-3's draft vocabulary."""
    # One bincount over all trained ids: a [V] add per sample is one multithreaded op per sample, far slower.
    trained = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
    return torch.bincount(torch.tensor(trained, dtype=torch.long), minlength=vocab_size)[:vocab_size]

