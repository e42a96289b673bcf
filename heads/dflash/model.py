"""The DFlash block drafter module in the reference layout (z-lab's, which vLLM and SGLang serve), and the
attention layout of its context and blocks."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3 import modeling_qwen3

from infer.attention import additive_mask

from ..base import DrafterModel
from ..layers import call_layer, rotary_embeddings
from .config import DFlashConfig


def build_layers(layer_config: dict, attn_implementation: str, count: int):
    """`count` Qwen3 decoder layers (layer_idx 0..count-1, full attention) and their rotary embedding."""
    fields = {k: v for k, v in layer_config.items() if k != "model_type"}
    config = Qwen3Config(**fields, num_hidden_layers=count, attn_implementation=attn_implementation)
    layers = nn.ModuleList(modeling_qwen3.Qwen3DecoderLayer(config, layer_idx=i) for i in range(count))
    return layers, modeling_qwen3.Qwen3RotaryEmbedding(config)


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
    """`forward(features [B, C, n*D], anchor_ids [B, M], ...) -> (context [B, C, D], logits [B, M, S-1, V])`.

    The input is C context slots and M blocks of S = `block_size` slots:
      context slot t: ctx_t = hidden_norm(fc(concatenated target hidden states at `feature_layers`, position t))
      block j:        [embedding of anchor_ids[:, j], mask, ..., mask] (S - 1 copies of one learned vector)
    where the embedding is the target's own. The context never passes through a layer: each of the
    `num_layers` Qwen3 decoder layers reads it as keys and values projected from ctx_t by that layer's own
    k/v projections (keys k-normed, rotated to position t) and written into the KV cache. The blocks are the
    queries: a block attends to the context before its anchor and to all of itself (not causal). Block slot
    k = 1..S-1 predicts the token k places after the anchor, through the drafter's norm and the target's
    frozen lm_head. This is the reference design (z-lab's DFlash and vLLM's `DFlashQwen3ForCausalLM`), so a
    trained drafter exports to vLLM as it is (heads/export.py).

    `attention_mask` is the 4D additive mask over all C + M*S slots ([B, 1, C+M*S, past+C+M*S],
    `block_attention` and `additive_mask` build it; `infer.kv.KVState` does at inference, where earlier
    context sits in the cache); only the block rows are used, the context rows being keys only. Without one,
    the default is the inference layout: every cached slot is context, then the C new context slots, then M
    blocks all anchored right after them; `position_ids` default accordingly. Without `past_key_values`
    the context lives in a cache made for the call (training: gradients flow through it).
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
        eps = self.layers[0].input_layernorm.variance_epsilon
        self.hidden_norm = modeling_qwen3.Qwen3RMSNorm(d, eps=eps)
        self.norm = modeling_qwen3.Qwen3RMSNorm(d, eps=eps)
        self.mask_embed = nn.Embedding(1, d)  # the one vector every mask slot starts from
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
        masks = self.mask_embed.weight.to(anchors.dtype)[None, None].expand(b, m, self.config.block_size - 1, -1)
        return torch.cat([anchors, masks], dim=2).flatten(1, 2)

    def write_context(self, cache, context: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Each layer's keys and values of the context slots (context [B, C, D] at position_ids [B, C]),
        projected by the layer's own k/v projections and k-norm, rotated, appended to its cache."""
        cos, sin = rotary_embeddings(self.rotary_emb, context, position_ids)
        for layer in self.layers:
            attn = layer.self_attn
            shape = (*context.shape[:-1], -1, attn.head_dim)
            keys = attn.k_norm(attn.k_proj(context).view(shape)).transpose(1, 2)  # [B, KV, C, d]
            values = attn.v_proj(context).view(shape).transpose(1, 2)
            _, keys = modeling_qwen3.apply_rotary_pos_emb(keys, keys, cos, sin)
            cache.update(keys, values, attn.layer_idx)

    def forward(self, features, anchor_ids, *, attention_mask=None, position_ids=None, past_key_values=None,
                cache_position=None):
        # features: [B, C, n*D] or None (no new context); anchor_ids: [B, M] (M may be 0)
        b, m, s = anchor_ids.shape[0], anchor_ids.shape[1], self.config.block_size
        if features is None:
            features = self.fc.weight.new_zeros(b, 0, self.fc.in_features)
        c = features.shape[1]
        cache = past_key_values if past_key_values is not None else DynamicCache()
        context = self.hidden_norm(self.fc(features.to(self.dtype)))  # [B, C, D]
        if attention_mask is None or position_ids is None:
            past = cache.get_seq_length()
            valid = torch.ones(b, past + c, dtype=torch.bool, device=context.device)
            anchors = torch.full((b, m), past + c, device=context.device)
            if attention_mask is None:
                attention_mask = additive_mask(block_attention(valid, anchors, s)[:, past:], context.dtype)
            if position_ids is None:
                positions = torch.arange(past, past + c, device=context.device).expand(b, c)
                position_ids = torch.cat([positions, block_positions(anchors, s)], dim=1)
        if c:
            self.write_context(cache, context, position_ids[:, :c])
        if not m:
            return context, context.new_zeros(b, 0, s - 1, self.config.target_vocab_size)
        x = self.block_inputs(anchor_ids)
        block_pos = position_ids[:, c:]
        position_embeddings = rotary_embeddings(self.rotary_emb, x, block_pos)
        for layer in self.layers:
            x = call_layer(layer, x, attention_mask=attention_mask[:, :, c:], position_ids=block_pos,
                           past_key_values=cache, position_embeddings=position_embeddings,
                           cache_position=None if cache_position is None else cache_position[c:])
        drafts = x.view(b, m, s, x.shape[-1])[:, :, 1:]  # [B, M, S-1, D]: the mask slots
        return context, self.target_logits(self.norm(drafts))

    def as_drafter(self, **tree_overrides):
        from .drafter import DFlashDrafter

        return DFlashDrafter(self, self.config.resolve_tree({**self.config.tree, **tree_overrides}))
