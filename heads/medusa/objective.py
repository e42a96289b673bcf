"""Training Medusa heads: the objective and how evaluation counts depth (one head per depth)."""

from __future__ import annotations

import torch
from torch import nn

from heads.losses import StepStats, label_rank, same_sample, segments, shift_left, target_inputs, token_loss


class MedusaObjective(nn.Module):
    """Head k at position t predicts x_{t+k+2}; head losses weighted head_decay**k (Medusa's 0.8**k).

    Medusa-2 (`lora_target` given): the target carries LoRA adapters trained jointly with the heads, the
    heads read its adapted last hidden state, and KL(original || adapted) on the target's own next-token
    distribution (original = adapters disabled) keeps the target's outputs what they were.
    """

    def __init__(self, drafter, config, lora_target=None):
        super().__init__()
        self.drafter, self.config = drafter, config
        self.lora_target = lora_target  # registered only for Medusa-2: its adapters are trained
        self.last = drafter.config.target_num_layers

    def forward(self, batch, features, stats: StepStats | None = None, steps: int | None = None):
        # steps: unused (every head is evaluated); the EAGLE objectives take it
        ids, mask, seg = batch["input_ids"], batch["loss_mask"], segments(batch)
        k_heads = self.drafter.config.num_heads
        logs = {}
        extra = 0.0
        if self.lora_target is not None:
            hidden, target_logits, extra, logs["target_kl"] = self._adapted_target(batch)
        else:
            hidden = features[self.last]  # [B, T, D]
            target_logits = None
            if self.config.loss != "hard":
                with torch.no_grad():
                    target_logits = self.drafter.target_logits(hidden)
        # Only positions some head learns from go through the heads: [N] positions, not B*T. A head's label
        # lies in the same sample (packed rows hold several).
        valid = torch.stack([shift_left(mask, k + 2, False) & same_sample(seg, k + 2) for k in range(k_heads)])
        used = valid.any(0)  # [B, T]
        logits = self.drafter(hidden[used][None])[:, 0]  # [K, N, V]
        loss = logits.new_zeros(())
        correct = torch.zeros_like(valid)
        for k in range(k_heads):
            v = valid[k][used]  # [N]
            labels = shift_left(ids, k + 2)[used][v]
            soft = shift_left(target_logits, k + 1)[used][v] if target_logits is not None else None
            head_loss = token_loss(logits[k][v], labels, soft, self.config.loss)
            loss = loss + self.config.head_decay ** k * head_loss
            logs[f"loss/head{k}"] = head_loss.detach()
            if stats is not None:
                rank = label_rank(logits[k][v].detach(), labels)
                stats.add(k, rank)
                hit = torch.zeros_like(v)
                hit[v] = rank == 0
                correct[k][used] = hit
        if stats is not None:
            stats.add_chains(correct, valid)
        logs["loss/heads"] = loss.detach()
        return loss + extra, logs

    def _adapted_target(self, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        attention = target_inputs(batch, self.drafter.dtype)
        out = self.lora_target(input_ids=ids, **attention, output_hidden_states=True, use_cache=False)
        with torch.no_grad(), self.lora_target.disable_adapter():
            original = self.lora_target(input_ids=ids, **attention, use_cache=False).logits
        predicts_assistant = shift_left(mask, 1, False) & same_sample(segments(batch), 1)  # t predicts x_{t+1}
        kl = token_loss(out.logits[predicts_assistant], None, original[predicts_assistant], "soft")
        return out.hidden_states[self.last], original, self.config.target_kl_weight * kl, kl.detach()


def eval_depth(drafter, config) -> int:
    """Every head is evaluated: depth d is head d."""
    return drafter.config.num_heads
