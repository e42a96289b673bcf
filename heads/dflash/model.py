"""The DFlash block drafter module and the attention layout of its context and blocks."""

from __future__ import annotations

import copy

import torch
from torch import nn

from infer.kv import additive_mask

from ..base import DrafterModel
from ..layers import arch_classes, build_layer_config, call_layer, first_norm, rotary_embeddings
from .config import DFlashConfig


def build_layers(layer_config: dict, attn_implementation: str, count: int):
    """`count` decoder layers of the target's class (layer_idx 0..count-1, all full attention, so one KV
    cache holds them all) and, where the class needs one, its rotary embedding."""
    config = build_layer_config(layer_config, attn_implementation)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * count
    arch = arch_classes(config.model_type)
    layers = nn.ModuleList(arch.layer(config, layer_idx=i) for i in range(count))
    return layers, arch.rotary(config) if arch.rotary is not None else None


def block_attention(context_valid: torch.Tensor, anchors: torch.Tensor, size: int) -> torch.Tensor:
    """Which keys each query sees, for C context slots followed by M blocks of `size` slots: [B, C+M*S, C+M*S].

    A context slot sees the valid context slots up to itself (causal). Block j, anchored at context index
    anchors[b, j], sees the valid context slots before its anchor and every slot of its own block (not
    causal), and nothing of the other blocks. context_valid: [B, C] bool; anchors: [B, M] long.
    """
    b, c = context_valid.shape
    m, device = anchors.shape[1], anchors.device
    eye = torch.eye(c, dtype=torch.bool, device=device)
    causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    context_rows = torch.cat([(causal & context_valid[:, None, :]) | eye,
                              torch.zeros(b, c, m * size, dtype=torch.bool, device=device)], dim=2)
    before = (torch.arange(c, device=device) < anchors[..., None]) & context_valid[:, None, :]  # [B, M, C]
    block_of = torch.arange(m * size, device=device) // size
    own_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    block_rows = torch.cat([before.repeat_interleave(size, dim=1), own_block], dim=2)
    return torch.cat([context_rows, block_rows], dim=1)


def block_positions(anchors: torch.Tensor, size: int) -> torch.Tensor:
    """[B, M*S]: block j holds positions anchors[b, j] .. anchors[b, j] + size - 1."""
    return (anchors[..., None] + torch.arange(size, device=anchors.device)).flatten(1)


class DFlashModel(DrafterModel):
    """`forward(features [B, C, n*D], anchor_ids [B, M], ...) -> (hidden [B, C+M*S, D], logits [B, M, S-1, V])`.

    The input is C context slots and M blocks of S = `block_size` slots, one sequence through the
    `num_layers` decoder layers of the target's class:
      context slot t: norm(fc(concatenated target hidden states at `feature_layers`, position t))
      block j:        [embedding of anchor_ids[:, j], mask_embed[0], ..., mask_embed[S-2]]
    where the embedding is the target's own. Context slots attend causally among themselves; a block
    attends to the context before its anchor and to all of itself (not causal), so the context is read as
    keys and values at every layer. Block slot k = 1..S-1 predicts the token k places after the anchor,
    through the drafter's norm and the target's frozen lm_head; the mask embedding is one learned vector
    per block slot (it also gives position to architectures without rotary embeddings, GPT-2).

    `attention_mask` is the 4D additive mask of that layout ([B, 1, C+M*S, past+C+M*S], `block_attention`
    and `additive` build it; `infer.kv.KVState` does at inference, where the context sits in the cache).
    Without one, the default is the inference layout: every cached slot is context, then the C new
    context slots, then M blocks all anchored right after them; `position_ids` default accordingly.
    """

    config_class = DFlashConfig
    kind = "dflash"

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if config.layer_config is None or config.feature_layers is None or config.target_hidden_size is None:
            raise ValueError("DFlashConfig needs layer_config, feature_layers and target_hidden_size; build it "
                             "with heads.build('dflash', target.config)")
        d = config.target_hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * d, d, bias=config.fc_bias)
        self.layers, self.rotary_emb = build_layers(config.layer_config, config.attn_implementation,
                                                    config.num_layers)
        norm = first_norm(self.layers[0])
        self.context_norm = copy.deepcopy(norm)
        self.norm = copy.deepcopy(norm)
        self.mask_embed = nn.Embedding(config.block_size - 1, d)
        self.post_init()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def fuse_features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(hidden, dim=-1)  # [B, A, n*D]

    def target_problems(self, config) -> list[str]:
        n = config.num_hidden_layers
        missing = [i for i in self.feature_layers if not 0 <= i <= n]
        return [f"feature layers {missing} do not exist: the target's hidden_states are 0..{n}"] if missing else []

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        # anchor_ids: [B, M] -> [B, M*S, D]
        b, m = anchor_ids.shape
        anchors = self.embed_tokens(anchor_ids)[:, :, None]  # [B, M, 1, D]
        masks = self.mask_embed.weight.to(anchors.dtype)[None, None].expand(b, m, -1, -1)  # [B, M, S-1, D]
        return torch.cat([anchors, masks], dim=2).flatten(1, 2)

    def forward(self, features, anchor_ids, *, attention_mask=None, position_ids=None, past_key_values=None,
                cache_position=None):
        # features: [B, C, n*D] or None (no new context); anchor_ids: [B, M] (M may be 0)
        b, m, s = anchor_ids.shape[0], anchor_ids.shape[1], self.config.block_size
        if features is None:
            features = self.fc.weight.new_zeros(b, 0, self.fc.in_features)
        c = features.shape[1]
        x = torch.cat([self.context_norm(self.fc(features.to(self.dtype))), self.block_inputs(anchor_ids)], dim=1)
        if attention_mask is None or position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            valid = torch.ones(b, past + c, dtype=torch.bool, device=x.device)
            anchors = torch.full((b, m), past + c, device=x.device)
            if attention_mask is None:
                attention_mask = additive_mask(block_attention(valid, anchors, s)[:, past:], x.dtype)
            if position_ids is None:
                context = torch.arange(past, past + c, device=x.device).expand(b, c)
                position_ids = torch.cat([context, block_positions(anchors, s)], dim=1)
        position_embeddings = rotary_embeddings(self.rotary_emb, x, position_ids)
        for layer in self.layers:
            x = call_layer(layer, x, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, cache_position=cache_position,
                           position_embeddings=position_embeddings)
        drafts = x[:, c:].reshape(b, m, s, x.shape[-1])[:, :, 1:]  # [B, M, S-1, D]: the mask slots
        return x, self.target_logits(self.norm(drafts))

    def as_drafter(self, **tree_overrides):
        from .drafter import DFlashDrafter

        return DFlashDrafter(self, self.config.resolve_tree({**self.config.tree, **tree_overrides}))
