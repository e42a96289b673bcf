"""Training an EAGLE-1/2 drafter: the objective (unrolled on its own outputs) and its evaluation depth.
EAGLE-3's objective (heads/eagle3/objective.py) is this one with its draft vocabulary and fused features."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from heads.losses import (
    StepStats,
    label_rank,
    positions,
    same_sample,
    segments,
    shift_left,
    token_loss,
    unrolled_attention_mask,
)


class EagleObjective(nn.Module):
    """EAGLE-1/2, unrolled `steps` times on the drafter's own outputs (training-time test).

    Step s at position t continues the chain started at t: input (x_{t+1+s}, h) with h the target feature
    f_t at s = 0 and the drafter's own step s-1 output after; it predicts x_{t+2+s} and the feature
    f_{t+1+s}. Step weights ttt_decay**s. Loss: smooth-L1 on features (feature_loss_weight) + CE/KL on
    tokens (token_loss_weight). In a packed row a chain stays inside its sample: it attends to its own
    sample only, and a step whose label x_{t+2+s} lies in the next sample is masked out.
    """

    def __init__(self, drafter, config, lora_target=None):
        # lora_target: always None, as the kind is registered without trains_target_lora
        super().__init__()
        self.drafter, self.config = drafter, config
        self.last = drafter.config.target_num_layers

    def columns(self) -> torch.Tensor | None:
        """The target vocabulary ids the drafter's logits cover, in order; None: the whole vocabulary."""
        return None

    def step_inputs(self, s: int) -> dict:
        """Extra drafter forward arguments at unrolled step s."""
        return {}

    def forward(self, batch, features, stats: StepStats | None = None, steps: int | None = None):
        ids, mask, seg = batch["input_ids"], batch["loss_mask"], segments(batch)
        steps = steps or self.config.ttt_steps
        length = ids.shape[1] - 1  # chains start at t = 0..T-2 (x_{t+1} must exist)
        feats = self.drafter.fuse_features(tuple(features[i] for i in self.drafter.feature_layers))
        hidden_in = feats[:, :length]  # [B, L, F]
        if self.training and self.config.feature_noise > 0:
            noise = self.config.feature_noise
            hidden_in = hidden_in + (torch.rand_like(hidden_in) * 2 - 1) * noise
        last = features.get(self.last)  # [B, T, D]: regression targets (EAGLE-1/2) and soft targets
        cache = DynamicCache() if steps > 1 else None
        soft = self._soft_targets(last, mask, seg)
        start = positions(batch)[:, :length]  # [B, L]: restarting at each sample of a packed row
        loss, logs = hidden_in.new_zeros(()), {}
        correct = torch.zeros((steps, ids.shape[0], length), dtype=torch.bool, device=ids.device)
        valid_all = torch.zeros_like(correct)
        for s in range(steps):
            tokens = shift_left(ids, 1 + s)[:, :length]
            # x_{t+2+s} is an assistant token of the chain's own sample
            valid = (shift_left(mask, 2 + s, False) & same_sample(seg, 2 + s))[:, :length]
            # logits [N, V] at the valid positions only
            hidden, logits = self.drafter(
                tokens, hidden_in, attention_mask=unrolled_attention_mask(seg[:, :length], s, hidden_in.dtype),
                position_ids=start + s, past_key_values=cache,
                cache_position=torch.arange(s * length, (s + 1) * length, device=ids.device), logits_at=valid,
                **self.step_inputs(s))
            labels = shift_left(ids, 2 + s)[:, :length][valid]
            step_loss, step_logs = self._step_loss(hidden, logits, valid, labels, last, soft, s, length)
            loss = loss + self.config.ttt_decay ** s * step_loss
            logs.update(step_logs)
            if stats is not None:
                rank = label_rank(logits.detach(), labels, to_target=self.columns())
                stats.add(s, rank)
                correct[s][valid] = rank == 0
                valid_all[s] = valid
            hidden_in = hidden
        if stats is not None:
            stats.add_chains(correct, valid_all)
        return loss, logs

    def _soft_targets(self, last, mask, seg=None):
        """The target's logits wherever it predicts an assistant token (every TTT step draws its soft
        targets from these same positions, shifted), computed once per batch, over `columns()` only.
        Returns (rows [N, V], index [B, T] into rows, -1 elsewhere) or None."""
        if self.config.loss == "hard":
            return None
        predicts = shift_left(mask, 1, False)  # last[:, t] predicts x_{t+1}
        if seg is not None:
            predicts = predicts & same_sample(seg, 1)  # of the same sample
        with torch.no_grad():
            rows = self.drafter.target_logits(last[predicts], columns=self.columns())
        index = torch.full(predicts.shape, -1, dtype=torch.long, device=predicts.device)
        index[predicts] = torch.arange(rows.shape[0], device=predicts.device)
        return rows, index

    @staticmethod
    def _soft_at_step(soft_targets, valid, s, length):
        """[N, V]: the target's soft targets at t + 1 + s for the valid positions, or None."""
        if soft_targets is None:
            return None
        rows, index = soft_targets
        return rows[shift_left(index, 1 + s, -1)[:, :length][valid]]

    def _step_loss(self, hidden, logits, valid, labels, last, soft_targets, s, length):
        # hidden [B, L, D]; logits [N, V] at the N valid positions
        logs = {}
        soft = self._soft_at_step(soft_targets, valid, s, length)
        tok = token_loss(logits, labels, soft, self.config.loss)
        target_feature = shift_left(last, 1 + s)[:, :length][valid]
        reg = F.smooth_l1_loss(hidden[valid].float(), target_feature.float()) if valid.any() else hidden.sum() * 0
        logs[f"loss/step{s}_token"], logs[f"loss/step{s}_feature"] = tok.detach(), reg.detach()
        return self.config.feature_loss_weight * reg + self.config.token_loss_weight * tok, logs


def eval_depth(drafter, config) -> int:
    """The unrolled chain is evaluated `eval_steps_depth` steps deep."""
    return config.eval_steps_depth
