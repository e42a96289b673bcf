"""The EAGLE-1/2 drafter module: fc over [embedding, feature] feeding one decoder layer (`layer_style`)."""

from __future__ import annotations

import torch
from torch import nn

from ..base import DrafterModel
from ..layers import (
    build_decoder_layer,
    build_layer_config,
    call_layer,
    causal_mask,
    default_positions,
    rotary_embeddings,
)
from .config import EagleConfig


class EagleModel(DrafterModel):
    """`forward(input_ids [B, T], hidden_states [B, T, D], ...) -> (hidden [B, T, D], logits [B, T, V])`.

    Input at t is the pair (token x_{t+1}, target feature f_t), f being the target's last hidden state after
    its final norm (`output_hidden_states[-1]`); with `layer_input_norm=False` the layer reads fc's output without
    its input norm (the EAGLE authors' EAGLE-1/2 layout). The output hidden state at t predicts f_{t+1}; the logits
    (the target's frozen lm_head on it) predict x_{t+2}. The decoder layer is transformers' Llama layer at the
    target's sizes or the target architecture's own class (`config.layer_style`); embeddings and lm_head are
    the target's, bound by `attach` and never saved.

    `attention_mask` is a 4D additive float mask [B, 1, T, past + T] (as `infer.kv.KVState` builds); when
    None, a causal mask over the cache and the block is used. `position_ids` default to past + arange(T).
    """

    config_class = EagleConfig
    kind = "eagle"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        if config.layer_config is None or config.target_hidden_size is None:
            raise ValueError("EagleConfig needs layer_config and target_hidden_size; build it with "
                             "heads.build('eagle', target.config)")
        d = config.target_hidden_size
        self.fc = nn.Linear(2 * d, d, bias=config.fc_bias)
        layer, rotary = build_decoder_layer(build_layer_config(config.layer_config, config.attn_implementation))
        if not config.layer_input_norm:
            if not isinstance(getattr(layer, "input_layernorm", None), nn.Module):
                raise ValueError(f"layer_input_norm=False takes a Llama-style layer's input_layernorm away; the "
                                 f"{type(layer).__name__} layer has none: build it with layer_style='llama'")
            layer.input_layernorm = nn.Identity()  # the layer's own forward then feeds fc's output to attention
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = rotary
        self.post_init()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.config.target_num_layers,)

    def fuse_features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The drafter's input feature from `TargetStep.hidden` (one [B, A, D] per feature layer)."""
        return hidden[0]

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def forward(self, input_ids, hidden_states, *, attention_mask=None, position_ids=None,
                past_key_values=None, cache_position=None, logits_at: torch.Tensor | None = None):
        # input_ids: [B, T]; hidden_states: [B, T, D]; logits_at: [B, T] bool, the positions whose logits are
        # wanted ([N, V] then; training's loss positions: the LM head never runs on the others)
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden_states.to(self.dtype)], dim=-1))
        attention_mask, position_ids = _defaults(x, attention_mask, position_ids, past_key_values)
        x = call_layer(self.layers[0], x, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=past_key_values, cache_position=cache_position,
                       position_embeddings=rotary_embeddings(self.rotary_emb, x, position_ids))
        return x, self.target_logits(x if logits_at is None else x[logits_at])

    def mask_config(self):
        """What `infer.kv.KVState` reads to build this drafter's masks: None, its layer attends to the whole
        context (EAGLE-3 drafters may have sliding-window layers)."""
        return None

    def as_drafter(self, **tree_overrides):
        from .drafter import EagleDrafter

        return EagleDrafter(self, self.config.resolve_tree({**self.config.tree, **tree_overrides}))


def _defaults(x: torch.Tensor, attention_mask, position_ids, past_key_values):
    """A causal mask and consecutive positions after the cache when the caller gives none."""
    b, t = x.shape[:2]
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if attention_mask is None:
        attention_mask = causal_mask(b, t, past, x.dtype, x.device)
    if position_ids is None:
        position_ids = default_positions(b, t, past, x.device)
    return attention_mask, position_ids
