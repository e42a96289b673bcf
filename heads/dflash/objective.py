"""Training a DFlash drafter: the block objective, and how evaluation counts depth (one block position each)."""

from __future__ import annotations

import torch
from torch import nn

from heads.losses import StepStats, label_rank, positions, sample_places, segments, token_loss
from infer.attention import additive_mask

from .model import block_attention


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
    seeded by the batch's sample indices, so held-out metrics are repeatable and leave the RNG alone. Anchors
    are drawn per sample, so a packed batch (several samples per row) draws the same ones as one sample per
    row, and a block reads only its own sample's context and predicts only its own sample's tokens.
    """

    def __init__(self, drafter, config, lora_target=None):
        # lora_target: always None, as the kind is registered without trains_target_lora
        super().__init__()
        self.drafter, self.config = drafter, config
        self.last = drafter.config.target_num_layers
        slot = torch.arange(drafter.config.block_size - 1, dtype=torch.float32)
        self.register_buffer("weights", torch.exp(-slot / drafter.config.loss_decay), persistent=False)

    def anchors(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """anchors [B, M] (columns of the batch's rows) and whether each is usable [B, M].

        Drawn in a layout of one sample per row ([N, longest sample]), which is the batch's own unless it is
        packed; a packed row holds anchors_per_sample slots for each of its samples, in segment order."""
        ids, loss_mask, seg = batch["input_ids"], batch["loss_mask"], segments(batch)
        rows, starts, lengths = sample_places(batch)
        n, t = rows.numel(), int(lengths.max())
        span = torch.arange(t, device=ids.device)
        inside = span < lengths[:, None]  # [N, t]
        cols = (starts[:, None] + span).clamp(max=ids.shape[1] - 1)
        trained = loss_mask.bool()[rows[:, None], cols] & inside
        usable = torch.zeros(n, t, dtype=torch.bool, device=ids.device)
        usable[:, 1:-1] = inside[:, 1:-1] & trained[:, 2:]
        if self.training:
            scores = torch.rand(n, t, device=ids.device)
        else:
            seed = int((batch["index"].long() * 7919 + 1).sum()) % (2**31)
            scores = torch.rand(n, t, generator=torch.Generator().manual_seed(seed)).to(ids.device)
        m = min(self.drafter.config.anchors_per_sample, t)
        picked = scores.masked_fill(~usable, -1.0).topk(m, dim=1).indices  # [N, m], within each sample
        ok = usable.gather(1, picked)
        slot = (seg[rows, starts] - 1)[:, None] * m + torch.arange(m, device=ids.device)  # [N, m]
        anchors = torch.zeros(ids.shape[0], m * int(seg.max()), dtype=torch.long, device=ids.device)
        usable_out = torch.zeros_like(anchors, dtype=torch.bool)
        anchors[rows[:, None], slot] = (starts[:, None] + picked).clamp(max=ids.shape[1] - 1)  # unusable ones may spill
        usable_out[rows[:, None], slot] = ok
        return anchors, usable_out

    def forward(self, batch, features, stats: StepStats | None = None, steps: int | None = None):
        # steps: unused (every block position is evaluated)
        ids, loss_mask, seg = batch["input_ids"], batch["loss_mask"], segments(batch)
        drafter, s = self.drafter, self.drafter.config.block_size
        (b, t), device = ids.shape, ids.device
        anchors, usable = self.anchors(batch)  # [B, M]
        feats = drafter.fuse_features(tuple(features[i] for i in drafter.feature_layers))  # [B, T, n*D]
        anchor_seg = seg.gather(1, anchors)  # [B, M]
        slot_seg = torch.cat([seg, anchor_seg.repeat_interleave(s, dim=1)], dim=1)  # [B, T+M*S]
        own_sample = slot_seg[:, :, None] == slot_seg[:, None, :]
        mask = additive_mask(block_attention(seg > 0, anchors, s) & own_sample, drafter.dtype)
        pos = positions(batch)
        block_pos = (pos.gather(1, anchors)[..., None] + torch.arange(s, device=device)).flatten(1)  # [B, M*S]
        _, logits = drafter(feats, ids.gather(1, anchors), attention_mask=mask,
                            position_ids=torch.cat([pos, block_pos], dim=1))
        # logits: [B, M, S-1, V]; slot k-1 predicts x_{a+k}
        target_pos = anchors[..., None] + torch.arange(1, s, device=device)  # [B, M, S-1]
        flat = target_pos.clamp(max=t - 1).flatten(1)
        inside = (target_pos < t) & (seg.gather(1, flat).view_as(target_pos) == anchor_seg[..., None])
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
                rank = label_rank(logits[:, :, k][v].detach(), labels[:, :, k][v])
                stats.add(k, rank)
                correct[k][v] = rank == 0
        if stats is not None:
            stats.add_chains(correct, valid.permute(2, 0, 1))
        return loss / self.weights.sum(), logs


def eval_depth(drafter, config) -> int:
    """Every drafted block position (block_size - 1) is evaluated."""
    return drafter.config.block_size - 1
