"""Training a DFlash drafter: the block objective, and how evaluation counts depth (one block position each)."""

from __future__ import annotations

import torch
from torch import nn

from heads.losses import StepStats, token_loss, topk_hits
from infer.kv import additive_mask

from .model import block_attention, block_positions


class DFlashObjective(nn.Module):
    """Blocks anchored at random positions of each sequence, predicting the tokens that follow.

    An anchor is a position a (after at least one token) whose next token x_{a+1} is an assistant token;
    `anchors_per_sample` of them are drawn per sequence (fewer where a sequence has fewer). Block j is
    [x_a, mask x (S-1)] at positions a..a+S-1 and reads the target features at positions < a as context,
    exactly the layout `propose` runs after the target committed x_0..x_{a-1} with root x_a. Block slot k
    predicts x_{a+k} where that is an assistant token; its CE/KL (`loss`) is averaged per slot and weighted
    exp(-(k-1)/loss_decay), the loss being the weighted mean over slots: the first slots, which every
    accepted draft passes through, matter most. All blocks and the context are one forward (`block_attention`).

    Training draws anchors from torch's global RNG (a resumed run restores it); evaluation from a generator
    seeded by the batch's sample indices, so held-out metrics are repeatable and leave the RNG alone.
    """

    def __init__(self, drafter, config, lora_target=None):
        # lora_target: always None, as the kind is registered without trains_target_lora
        super().__init__()
        self.drafter, self.config = drafter, config
        self.last = drafter.config.target_num_layers
        slot = torch.arange(drafter.config.block_size - 1, dtype=torch.float32)
        self.register_buffer("weights", torch.exp(-slot / drafter.config.loss_decay), persistent=False)

    def anchors(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """anchors [B, M] (positions) and whether each is usable [B, M]."""
        ids, loss_mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        b, t = ids.shape
        usable = torch.zeros(b, t, dtype=torch.bool, device=ids.device)
        usable[:, 1:-1] = attn[:, 1:-1].bool() & loss_mask[:, 2:].bool()
        if self.training:
            scores = torch.rand(b, t, device=ids.device)
        else:
            seed = int((batch["index"].long() * 7919 + 1).sum()) % (2**31)
            scores = torch.rand(b, t, generator=torch.Generator().manual_seed(seed)).to(ids.device)
        m = min(self.drafter.config.anchors_per_sample, t)
        picked = scores.masked_fill(~usable, -1.0).topk(m, dim=1).indices
        return picked, usable.gather(1, picked)

    def forward(self, batch, features, stats: StepStats | None = None, steps: int | None = None):
        # steps: unused (every block position is evaluated)
        ids, loss_mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        drafter, s = self.drafter, self.drafter.config.block_size
        (b, t), device = ids.shape, ids.device
        anchors, usable = self.anchors(batch)  # [B, M]
        feats = drafter.fuse_features(tuple(features[i] for i in drafter.feature_layers))  # [B, T, n*D]
        mask = additive_mask(block_attention(attn.bool(), anchors, s), drafter.dtype)
        positions = torch.cat([torch.arange(t, device=device).expand(b, t), block_positions(anchors, s)], dim=1)
        _, logits = drafter(feats, ids.gather(1, anchors), attention_mask=mask, position_ids=positions)
        # logits: [B, M, S-1, V]; slot k-1 predicts x_{a+k}
        target_pos = anchors[..., None] + torch.arange(1, s, device=device)  # [B, M, S-1]
        inside = target_pos < t
        flat = target_pos.clamp(max=t - 1).flatten(1)
        labels = ids.gather(1, flat).view_as(target_pos)
        valid = inside & loss_mask.bool().gather(1, flat).view_as(target_pos) & usable[..., None]
        last = features.get(self.last) if self.config.loss != "hard" else None  # [B, T, D]
        loss, logs = logits.new_zeros(()), {}
        correct = torch.zeros(s - 1, b, anchors.shape[1], dtype=torch.bool, device=device)
        for k in range(s - 1):
            v = valid[:, :, k]
            soft = None
            if last is not None:
                rows, cols = v.nonzero(as_tuple=True)
                with torch.no_grad():  # the target's distribution for x_{a+k+1}: its lm_head at a+k
                    soft = drafter.target_logits(last[rows, target_pos[rows, cols, k] - 1])
            slot_loss = token_loss(logits[:, :, k][v], labels[:, :, k][v], soft, self.config.loss)
            loss = loss + self.weights[k] * slot_loss
            logs[f"loss/pos{k}"] = slot_loss.detach()
            if stats is not None:
                top1, top3 = topk_hits(logits[:, :, k][v].detach(), labels[:, :, k][v])
                stats.add(k, top1, top3)
                correct[k][v] = top1
        if stats is not None:
            stats.add_chains(correct, valid.permute(2, 0, 1))
        return loss / self.weights.sum(), logs


def eval_depth(drafter, config) -> int:
    """Every drafted block position (block_size - 1) is evaluated."""
    return drafter.config.block_size - 1
