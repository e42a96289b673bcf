"""Chains as trees: every drafter that proposes one branch builds its tree here."""

from __future__ import annotations

import torch

from ..tree import DraftTree


def chain_tree(roots: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
               q: torch.Tensor | None = None) -> DraftTree:
    """roots [B], drafts [B, K] with `lengths[b]` usable drafts -> a one-branch tree of K + 1 nodes."""
    b, k = drafts.shape
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    parents = torch.arange(-1, k, device=roots.device).expand(b, k + 1)
    valid = torch.arange(k + 1, device=roots.device)[None, :] <= lengths[:, None]
    if q is not None:  # q: [B, K, V] for the drafts; the root's entry is never read
        q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)
    return DraftTree(tokens=tokens, parents=parents.contiguous(), valid=valid, q=q)
