"""Medusa-1 heads (Cai et al., 2024, arXiv:2401.10774) and their static-tree drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.tree import DraftTree, tree_from_paths

from ..base import DrafterModel, HeadDrafter
from .config import MedusaConfig


class ResidualBlock(nn.Linear):
    """x + SiLU(W x + b), zero-initialised so that a fresh head passes the hidden state through unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(super().forward(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_layers: int, own_lm_head: bool, bias: bool):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden, hidden) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=bias) if own_lm_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class MedusaModel(DrafterModel):
    """K heads over the target's last hidden state; the target's own lm_head predicts t+1, head k t+k+2.

    `forward(hidden [B, T, D]) -> logits [K, B, T, V]`. With `share_lm_head` every head ends in the target's
    frozen lm_head (bound by `attach`, never saved); otherwise each head owns a projection, initialised as
    a copy of the target's lm_head by `heads.build(kind, target_model)`, so that a fresh head predicts what
    the lm_head predicts from the same hidden state.
    """

    config_class = MedusaConfig
    kind = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        d, v = config.target_hidden_size, config.target_vocab_size
        if d is None or v is None:
            raise ValueError("MedusaConfig needs target_hidden_size and target_vocab_size; build it with "
                             "heads.build('medusa', target.config)")
        self.heads = nn.ModuleList(
            MedusaHead(d, v, config.num_layers, not config.share_lm_head, config.projection_bias)
            for _ in range(config.num_heads)
        )
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, ResidualBlock):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.config.target_num_layers,)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """logits [K, B, T, V] of the first `num_heads` (default all) heads for hidden [B, T, D]."""
        heads = self.heads[: num_heads or len(self.heads)]
        hidden = hidden.to(self.dtype)
        out = []
        for head in heads:
            x = head(hidden)
            out.append(head.lm_head(x) if head.lm_head is not None else self.target_logits(x))
        return torch.stack(out)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Copy the target's lm_head into every own projection (no-op when sharing the lm_head)."""
        if self.config.share_lm_head:
            return
        lm_head = target.get_output_embeddings()
        for head in self.heads:
            head.lm_head.weight.copy_(lm_head.weight)
            if head.lm_head.bias is not None:
                head.lm_head.bias.copy_(lm_head.bias)

    def as_drafter(self, **tree_overrides) -> MedusaDrafter:
        tree = self.config.resolve_tree({**self.config.tree, **tree_overrides})
        return MedusaDrafter(self, [tuple(p) for p in tree["paths"]])


class MedusaDrafter(HeadDrafter):
    """Static tree: the node at depth d with rank r is the r-th best token of head d-1, all heads reading
    the target's hidden state at the last committed position. Drafts are deterministic (q = None)."""

    def __init__(self, model: MedusaModel, paths: list[tuple[int, ...]]):
        super().__init__(model)
        self.parents, self.ranks = tree_from_paths(paths)  # [N]; nodes ordered by depth then rank
        depth = [0]
        for p in self.parents[1:].tolist():
            depth.append(depth[p] + 1)
        self.depth = torch.tensor(depth)
        self._depths, self._ranks = depth, self.ranks.tolist()  # the same on the host: propose reads neither
        self._tables: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (device, nodes) -> depth, ranks, parents there
        self.hidden = self.root = None

    def observe(self, step) -> None:
        # step.hidden[0]: [B, A, D] at the target's last layer
        last = step.last_valid_index().clamp(min=0)
        rows = torch.arange(last.shape[0], device=last.device)
        self.hidden = step.hidden[0][rows, last]  # [B, D]
        self.root = step.next_tokens  # [B]

    @torch.no_grad()
    def propose(self, budget: torch.Tensor) -> DraftTree:
        # budget: [B]
        b, device = self.root.shape[0], self.root.device
        # sync_free (a GPU's step): no read of the budget; the whole tree, pruned to the budget below
        max_depth = max(self._depths) if self.sync_free else min(max(self._depths), int(budget.max()))
        n = sum(d <= max_depth for d in self._depths)  # nodes are depth-ordered: keep a prefix
        if (device, n) not in self._tables:  # copied once: a copy to a GPU each step would wait for its queue
            self._tables[device, n] = tuple(t[:n].to(device) for t in (self.depth, self.ranks, self.parents))
        depth, ranks, parents = self._tables[device, n]
        tokens = self.root[:, None].expand(b, n).clone()
        if n > 1:
            logits = self.model(self.hidden[:, None], num_heads=max_depth)[:, :, 0]  # [K, B, V]
            top = logits.topk(max(self._ranks[:n]) + 1, dim=-1).indices  # [K, B, R]
            tokens[:, 1:] = top[depth[1:] - 1, :, ranks[1:]].T
        parents = parents.expand(b, n)
        tree = DraftTree(tokens, parents, torch.ones(b, n, dtype=torch.bool, device=device))
        return tree.prune_deeper_than(budget)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.hidden, self.root = self.hidden[rows], self.root[rows]
