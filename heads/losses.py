"""Loss and accuracy pieces shared by the drafter objectives.

Positions: a sequence x_0..x_{T-1} with loss mask m (1 on assistant tokens). A prediction of x_j counts
only where m_j = 1, so every loss is averaged over the assistant tokens it predicts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.kv import additive_mask


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t + k], filled past the end: [B, T, ...] -> [B, T, ...]."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)[:, : x.shape[1]]


def token_loss(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
               mode: str) -> torch.Tensor:
    """Mean over N predictions. logits [N, V]; labels [N] (-100 = ignore for the hard part);
    target_logits [N, V] the target's, for `soft` (KL(target || drafter)) and `both` (their sum)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    loss = logits.new_zeros(())
    if mode in ("hard", "both"):
        if (labels != -100).any():
            loss = loss + F.cross_entropy(logits.float(), labels, ignore_index=-100)
    if mode in ("soft", "both"):
        log_q = F.log_softmax(logits.float(), dim=-1)
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        loss = loss + (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return loss


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int = 3,
              to_target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prediction top-1 and top-k correctness [N] (bool). `to_target` maps the logits' vocabulary
    (EAGLE-3's draft vocabulary) to target ids; labels are target ids."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    if to_target is not None:
        top = to_target[top]
    hit = top == labels[:, None]
    return hit[:, 0], hit.any(-1)


class StepStats:
    """Counts behind per-step (per-head) top-1/top-3 accuracy and the estimated accepted length."""

    def __init__(self, steps: int, device=None):
        self.valid = torch.zeros(steps, dtype=torch.float64, device=device)
        self.top1 = torch.zeros_like(self.valid)
        self.top3 = torch.zeros_like(self.valid)
        self.chain = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of accepted, chains]

    def add(self, step: int, top1: torch.Tensor, top3: torch.Tensor) -> None:
        self.valid[step] += top1.numel()
        self.top1[step] += top1.sum()
        self.top3[step] += top3.sum()

    def add_chains(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        """correct, valid: [S, B, T] for chains starting at (b, t). A chain is counted where its first
        prediction is valid; it accepts drafts until the first wrong or invalid one."""
        ok = (correct & valid).to(torch.int64)
        accepted = ok.cumprod(0).sum(0)  # [B, T]
        start = valid[0]
        self.chain[0] += accepted[start].sum()
        self.chain[1] += start.sum()

    def tensor(self) -> torch.Tensor:
        return torch.cat([self.valid, self.top1, self.top3, self.chain])

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> StepStats:
        steps = (packed.numel() - 2) // 3
        out = cls(steps)
        out.valid, out.top1, out.top3 = packed[:steps], packed[steps:2 * steps], packed[2 * steps:3 * steps]
        out.chain = packed[3 * steps:]
        return out

    def summary(self, name: str) -> dict[str, float]:
        """top1/top3 per step; `est_accept_len` = 1 + sum_k prod_{j<=k} acc_j (chain, independence
        assumed) and `est_accept_len_chain` = 1 + mean accepted drafts of chains run on held-out text;
        both are estimates from teacher-forced text, not measured decoding."""
        acc1 = (self.top1 / self.valid.clamp(min=1)).tolist()
        acc3 = (self.top3 / self.valid.clamp(min=1)).tolist()
        out = {}
        for s, (a1, a3) in enumerate(zip(acc1, acc3, strict=True)):
            out[f"{name}{s}/top1"] = round(a1, 4)
            out[f"{name}{s}/top3"] = round(a3, 4)
        tau, prod = 1.0, 1.0
        for a in acc1:
            prod *= a
            tau += prod
        out["est_accept_len"] = round(tau, 4)
        out["est_accept_len_chain"] = round(1.0 + float(self.chain[0] / self.chain[1].clamp(min=1)), 4)
        out["eval_predictions"] = int(self.valid[0])
        return out


def unrolled_attention_mask(attention_mask: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, L, (step + 1) * L] mask for unrolled step `step` of a drafter chain.

    Query t of step s is the chain started at t after s own steps: it sees the real context (step 0's keys
    at positions <= t that are not padding) and its own earlier steps (the keys of steps 1..s at t), as the
    drafter does at inference. attention_mask: [B, L] (1 = token, 0 = padding).
    """
    b, length = attention_mask.shape
    device = attention_mask.device
    eye = torch.eye(length, dtype=torch.bool, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    first = (causal[None] & attention_mask[:, None, :].bool()) | eye[None]  # [B, L, L]
    blocks = [first] + [eye[None].expand(b, length, length)] * step
    return additive_mask(torch.cat(blocks, dim=-1), dtype)
