"""Loss and accuracy pieces shared by the drafter objectives.

Positions: a sequence x_0..x_{T-1} with loss mask m (1 on assistant tokens). A prediction of x_j counts
only where m_j = 1, so every loss is averaged over the assistant tokens it predicts, over the whole batch: the
mean does not depend on how the samples are laid out in rows, which is what lets packed rows (several samples
per row, `segment_ids` telling them apart) train exactly as one sample per row does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infer.attention import additive_mask


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t + k], filled past the end: [B, T, ...] -> [B, T, ...]."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)[:, : x.shape[1]]


def segments(batch: dict) -> torch.Tensor:
    """[B, T] which sample each position holds: 0 on padding, one nonzero id per sample of the row. A batch
    without `segment_ids` holds one sample per row, so its padding mask is its segments."""
    seg = batch.get("segment_ids")
    return (batch["attention_mask"] if seg is None else seg).long()


def positions(batch: dict) -> torch.Tensor:
    """[B, T] position ids: restarting at every sample of a packed row, 0..T-1 in a row of one sample."""
    pos = batch.get("position_ids")
    if pos is not None:
        return pos
    b, t = batch["input_ids"].shape
    return torch.arange(t, device=batch["input_ids"].device).expand(b, t)


def sample_places(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each sample of the batch lies: its row, first column and length, [N] each. A batch without
    `places` holds one sample per row, from column 0."""
    places = batch.get("places")
    if places is not None:
        return places[:, 0], places[:, 1], places[:, 2]
    attn = batch["attention_mask"]
    rows = torch.arange(attn.shape[0], device=attn.device)
    return rows, torch.zeros_like(rows), attn.long().sum(1)


def same_sample(segment_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: position t + k exists and holds the same sample as t (a shifted label never crosses into
    the next sample of a packed row)."""
    return (shift_left(segment_ids, k, 0) == segment_ids) & (segment_ids > 0)


def sample_attention(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: causal attention within each sample and never across samples; a padding query sees
    only itself (a query that sees nothing would give NaN)."""
    t, device = segment_ids.shape[1], segment_ids.device
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same & (segment_ids[:, None, :] > 0)) | torch.eye(t, dtype=torch.bool, device=device)


def is_packed(batch: dict) -> bool:
    """Whether some row holds more than one sample."""
    seg = batch.get("segment_ids")
    return seg is not None and bool((seg > 1).any())


def target_inputs(batch: dict, dtype: torch.dtype) -> dict:
    """Attention keywords for the target's own forward: the padding mask, or for packed rows a 4D block-diagonal
    causal mask (additive, which eager and sdpa attention of every architecture take as it is) and position ids
    restarting at every sample."""
    if not is_packed(batch):
        return {"attention_mask": batch["attention_mask"]}
    return {"attention_mask": additive_mask(sample_attention(segments(batch)), dtype),
            "position_ids": positions(batch)}


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


# Ranks of the label among a depth's candidates counted at evaluation (`label_rank`); a tree node of a higher
# rank counts as never accepted in the simulated acceptance. Trees expand at most a few ranks per node.
RANKS = 32


def label_rank(logits: torch.Tensor, labels: torch.Tensor, to_target: torch.Tensor | None = None) -> torch.Tensor:
    """[N] long: the label's rank among the logits' top candidates (0 = the argmax), RANKS when it is not among
    the first RANKS. `to_target` maps the logits' vocabulary (EAGLE-3's draft vocabulary) to target ids;
    labels are target ids."""
    top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices  # [N, R]
    if to_target is not None:
        top = to_target[top]
    hit = top == labels[:, None]
    return torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(labels, RANKS))


class StepStats:
    """Counts behind per-step (per-head) accuracy, the estimated accepted length and the simulated acceptance
    of a tree: per depth, how often the label was the drafter's rank-r candidate."""

    def __init__(self, steps: int, device=None):
        self.valid = torch.zeros(steps, dtype=torch.float64, device=device)
        self.ranks = torch.zeros(steps, RANKS, dtype=torch.float64, device=device)  # [S, R] label at rank r
        self.chain = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of accepted, chains]

    def add(self, step: int, rank: torch.Tensor) -> None:
        """rank: [N] from `label_rank` for the step's valid predictions."""
        self.valid[step] += rank.numel()
        self.ranks[step] += torch.bincount(rank, minlength=RANKS + 1)[:RANKS].to(self.ranks)

    @property
    def top1(self) -> torch.Tensor:
        return self.ranks[:, 0]

    @property
    def top3(self) -> torch.Tensor:
        return self.ranks[:, :3].sum(-1)

    def add_chains(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        """correct, valid: [S, B, T] for chains starting at (b, t). A chain is counted where its first
        prediction is valid; it accepts drafts until the first wrong or invalid one."""
        ok = (correct & valid).to(torch.int64)
        accepted = ok.cumprod(0).sum(0)  # [B, T]
        start = valid[0]
        self.chain[0] += accepted[start].sum()
        self.chain[1] += start.sum()

    def tensor(self) -> torch.Tensor:
        return torch.cat([self.valid, self.ranks.flatten(), self.chain])

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> StepStats:
        steps = (packed.numel() - 2) // (1 + RANKS)
        out = cls(steps)
        out.valid, out.ranks = packed[:steps], packed[steps:steps * (1 + RANKS)].view(steps, RANKS)
        out.chain = packed[steps * (1 + RANKS):]
        return out

    def summary(self, name: str, tree: dict | None = None) -> dict[str, float]:
        """top1/top3 per step; `est_accept_len` = 1 + sum_k prod_{j<=k} acc_j (chain, independence
        assumed) and `est_accept_len_chain` = 1 + mean accepted drafts of chains run on held-out text;
        with the drafter's resolved `tree`, `simulated_tau` (`simulated_tau`). All are estimates from
        teacher-forced text, not measured decoding."""
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
        if tree is not None:
            out["simulated_tau"] = round(simulated_tau(self.ranks / self.valid.clamp(min=1)[:, None], tree), 4)
        out["eval_predictions"] = int(self.valid[0])
        return out


def simulated_tau(rank_probs: torch.Tensor, tree: dict) -> float:
    """Expected tokens per verification (accepted drafts + the target's own token) of a drafter's tree, from
    the per-depth probability that the label is the drafter's rank-r candidate, rank_probs [D, R].

    A node is accepted when every node on its path is, and depths are taken as independent: a static tree
    (`paths` of sibling ranks, ancestor-closed) gives 1 + sum over its nodes of prod_j p_j(rank_j); a dynamic
    tree (`top_k` children per node, `depth` deep) is taken whole, 1 + sum_d prod_{j<=d} P(rank_j < top_k),
    an upper bound where `total_tokens` prunes it; a chain (top_k 1) is 1 + sum_d prod_{j<=d} top1_j. Only
    the D measured depths count, so a tree deeper than the evaluation is cut there.
    """
    probs = rank_probs.double().cpu()
    depth, ranks = probs.shape
    paths = tree.get("paths")
    if paths:
        total = 1.0
        for path in paths:
            if len(path) > depth or max(path) >= ranks:
                continue
            total += math.prod(float(probs[j, r]) for j, r in enumerate(path))
        return total
    k = max(1, min(int(tree.get("top_k") or 1), ranks))
    deep = min(int(tree.get("depth") or depth), depth)
    hit = probs[:deep, :k].sum(-1)
    return 1.0 + float(hit.cumprod(0).sum())


def unrolled_attention_mask(segment_ids: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, L, (step + 1) * L] mask for unrolled step `step` of a drafter chain.

    Query t of step s is the chain started at t after s own steps: it sees the real context (step 0's keys
    at positions <= t of its own sample) and its own earlier steps (the keys of steps 1..s at t), as the
    drafter does at inference. segment_ids: [B, L] (0 = padding, one id per sample of a packed row; a
    padding mask is the segments of one sample per row).
    """
    b, length = segment_ids.shape
    eye = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    first = sample_attention(segment_ids.long())  # [B, L, L]
    blocks = [first] + [eye[None].expand(b, length, length)] * step
    return additive_mask(torch.cat(blocks, dim=-1), dtype)
