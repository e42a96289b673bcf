"""One training objective per drafter kind, each an nn.Module so that DDP/DeepSpeed wrap a single forward.

`objective(batch, features, stats=None) -> (loss, logs)`: `batch` from `data.collate`, `features`
{layer: [B, T, D]} of the frozen target (ignored by Medusa-2, which runs its adapted target itself);
`stats` (a `losses.StepStats`) collects per-step accuracy at evaluation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .losses import StepStats, shift_left, token_loss, topk_hits, unrolled_attention_mask


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
        ids, mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        k_heads = self.drafter.config.num_heads
        logs = {}
        extra = 0.0
        if self.lora_target is not None:
            hidden, target_logits, extra, logs["target_kl"] = self._adapted_target(ids, attn, mask)
        else:
            hidden = features[self.last]  # [B, T, D]
            target_logits = None
            if self.config.loss != "hard":
                with torch.no_grad():
                    target_logits = self.drafter.target_logits(hidden)
        # Only positions some head learns from go through the heads: [N] positions, not B*T.
        valid = torch.stack([shift_left(mask, k + 2, False) for k in range(k_heads)])  # [K, B, T]
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
                top1, top3 = topk_hits(logits[k][v].detach(), labels)
                stats.add(k, top1, top3)
                hit = torch.zeros_like(v)
                hit[v] = top1
                correct[k][used] = hit
        if stats is not None:
            stats.add_chains(correct, valid)
        logs["loss/heads"] = loss.detach()
        return loss + extra, logs

    def _adapted_target(self, ids, attn, mask):
        out = self.lora_target(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
        with torch.no_grad(), self.lora_target.disable_adapter():
            original = self.lora_target(input_ids=ids, attention_mask=attn, use_cache=False).logits
        predicts_assistant = shift_left(mask, 1, False)  # position t predicts x_{t+1}
        kl = token_loss(out.logits[predicts_assistant], None, original[predicts_assistant], "soft")
        return out.hidden_states[self.last], original, self.config.target_kl_weight * kl, kl.detach()


class EagleObjective(nn.Module):
    """EAGLE-1/2 and EAGLE-3, unrolled `steps` times on the drafter's own outputs (training-time test).

    Step s at position t continues the chain started at t: input (x_{t+1+s}, h) with h the target feature
    f_t at s = 0 (EAGLE-3: its fused low/mid/high layers) and the drafter's own step s-1 output after;
    it predicts x_{t+2+s} and, for EAGLE-1/2, the feature f_{t+1+s}. Step weights ttt_decay**s.
    EAGLE-1/2: smooth-L1 on features (feature_loss_weight) + CE/KL on tokens (token_loss_weight).
    EAGLE-3: CE/KL over its draft vocabulary only; labels outside it are masked from the loss.
    """

    def __init__(self, drafter, config):
        super().__init__()
        self.drafter, self.config = drafter, config
        self.eagle3 = drafter.kind == "eagle3"
        self.last = drafter.config.target_num_layers
        if self.eagle3:
            to_target = drafter.draft_to_target(torch.arange(drafter.d2t.numel(), device=drafter.d2t.device))
            to_draft = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long)
            to_draft[to_target.cpu()] = torch.arange(to_target.numel())
            self.register_buffer("to_target", to_target, persistent=False)
            self.register_buffer("to_draft", to_draft.to(to_target.device), persistent=False)

    def forward(self, batch, features, stats: StepStats | None = None, steps: int | None = None):
        ids, mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        steps = steps or self.config.ttt_steps
        length = ids.shape[1] - 1  # chains start at t = 0..T-2 (x_{t+1} must exist)
        feats = self.drafter.fuse_features(tuple(features[i] for i in self.drafter.feature_layers))
        hidden_in = feats[:, :length]  # [B, L, F]
        if self.training and self.config.feature_noise > 0:
            noise = self.config.feature_noise
            hidden_in = hidden_in + (torch.rand_like(hidden_in) * 2 - 1) * noise
        last = features.get(self.last)  # [B, T, D]: regression targets (EAGLE-1/2) and soft targets
        cache = _new_cache() if steps > 1 else None
        soft = self._soft_targets(last, mask)
        loss, logs = hidden_in.new_zeros(()), {}
        correct = torch.zeros((steps, ids.shape[0], length), dtype=torch.bool, device=ids.device)
        valid_all = torch.zeros_like(correct)
        for s in range(steps):
            tokens = shift_left(ids, 1 + s)[:, :length]
            positions = (torch.arange(length, device=ids.device) + s)[None].expand(ids.shape[0], length)
            extra = {"fused": s == 0} if self.eagle3 else {}
            hidden, logits = self.drafter(
                tokens, hidden_in, attention_mask=unrolled_attention_mask(attn[:, :length], s, hidden_in.dtype),
                position_ids=positions, past_key_values=cache,
                cache_position=torch.arange(s * length, (s + 1) * length, device=ids.device), **extra)
            valid = shift_left(mask, 2 + s, False)[:, :length]  # x_{t+2+s} is an assistant token
            labels = shift_left(ids, 2 + s)[:, :length][valid]
            step_loss, step_logs = self._step_loss(hidden, logits, valid, labels, last, soft, s, length)
            loss = loss + self.config.ttt_decay ** s * step_loss
            logs.update(step_logs)
            if stats is not None:
                top1, top3 = topk_hits(logits[valid].detach(), labels,
                                       to_target=self.to_target if self.eagle3 else None)
                stats.add(s, top1, top3)
                correct[s][valid] = top1
                valid_all[s] = valid
            hidden_in = hidden
        if stats is not None:
            stats.add_chains(correct, valid_all)
        return loss, logs

    def _soft_targets(self, last, mask):
        """The target's logits wherever it predicts an assistant token (every TTT step draws its soft
        targets from these same positions, shifted), computed once per batch; EAGLE-3 needs only its draft
        vocabulary's columns. Returns (rows [N, V], index [B, T] into rows, -1 elsewhere) or None."""
        if self.config.loss == "hard":
            return None
        predicts = shift_left(mask, 1, False)  # last[:, t] predicts x_{t+1}
        with torch.no_grad():
            rows = self.drafter.target_logits(last[predicts], columns=self.to_target if self.eagle3 else None)
        index = torch.full(predicts.shape, -1, dtype=torch.long, device=predicts.device)
        index[predicts] = torch.arange(rows.shape[0], device=predicts.device)
        return rows, index

    def _step_loss(self, hidden, logits, valid, labels, last, soft_targets, s, length):
        logs = {}
        soft = None
        if soft_targets is not None:
            rows, index = soft_targets
            soft = rows[shift_left(index, 1 + s, -1)[:, :length][valid]]  # [N, V]: the target at t + 1 + s
        if self.eagle3:
            draft_labels = self.to_draft[labels]
            tok = token_loss(logits[valid], draft_labels, soft, self.config.loss)
            logs[f"loss/step{s}"] = tok.detach()
            return tok, logs
        tok = token_loss(logits[valid], labels, soft, self.config.loss)
        target_feature = shift_left(last, 1 + s)[:, :length][valid]
        reg = F.smooth_l1_loss(hidden[valid].float(), target_feature.float()) if valid.any() else hidden.sum() * 0
        logs[f"loss/step{s}_token"], logs[f"loss/step{s}_feature"] = tok.detach(), reg.detach()
        return self.config.feature_loss_weight * reg + self.config.token_loss_weight * tok, logs


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def build_objective(drafter, config, lora_target=None) -> nn.Module:
    if drafter.kind == "medusa":
        return MedusaObjective(drafter, config, lora_target)
    return EagleObjective(drafter, config)
