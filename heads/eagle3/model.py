"""The EAGLE-3 drafter module and its draft-vocabulary map."""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from ..base import DrafterModel
from ..eagle.model import _defaults
from ..layers import build_decoder_layer, build_layer_config, call_layer, first_norm, rotary_embeddings
from .config import Eagle3Config


def build_vocab_map(token_counts, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`d2t` [Vd] and `t2d` [V] for the `draft_vocab_size` most frequent target tokens.

    `token_counts[i]` is how often target token i occurs in the training data (length V). Draft ids follow
    target-id order; target id = draft id + d2t[draft id]; t2d[i] says whether target token i is drafted.
    Ties go to the lower target id.
    """
    counts = torch.as_tensor(token_counts).flatten()
    v = counts.numel()
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in 1..{v} (the number of token counts), got {draft_vocab_size}")
    order = counts.sort(descending=True, stable=True).indices[:draft_vocab_size]
    keep = order.sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(draft_vocab_size), t2d


class Eagle3Model(DrafterModel):
    """`forward(input_ids [B, T], hidden_states, ...) -> (hidden [B, T, D], logits [B, T, Vd])`.

    Input at t is (token x_{t+1}, h_t) where h_t is either the fused target features: the concatenated
    hidden states at `feature_layers`, [B, T, n*D], which go through `fc` first; or the drafter's own
    previous output hidden [B, T, D], which skips `fc`. Which one is told by the last dimension, or by
    `fused=True/False` when they coincide. The output hidden (pre-norm) is what the next step feeds back;
    logits = lm_head(norm(hidden)) over the draft vocabulary (`draft_to_target` maps ids back).

    Layer layouts (`config.input_mode`):
      widen:   residual = h (or hidden_norm(h) with norm_before_residual);
               a = self_attn([input_layernorm(e), hidden_norm(h)])   q/k/v take 2D inputs
               h = residual + a;  h = h + mlp(post_attention_layernorm(h))
      project: h = layer(proj([embed_norm(e), hidden_norm(h)]))     the layer as it is
    where e is the target's embedding of the token and every module is of the layer's class (`layer_style`:
    Llama's, which is always widen, or the target architecture's); with `num_layers` > 1 that layer as it is
    follows, num_layers - 1 times. speculators' options: `norm_before_fc` reads fc(input_norm(features)) with one
    RMSNorm over the whole concatenation; `norm_output` returns norm(h) as the hidden state fed back (the logits
    are lm_head(norm(h)) either way); `layer_windows` gives a layer sliding-window attention, and then
    `attention_mask` is a dict of masks by layer type ("full_attention", "sliding_attention"), as `infer.kv.KVState`
    builds them for `mask_config()`.

    Training-time test: call forward repeatedly, feeding step j's output hidden (and tokens drafted or
    shifted for step j+1) back in with the same `past_key_values` (a `DynamicCache`): each call appends its
    T keys/values, so pass a 4D additive `attention_mask` [B, 1, T, (j+1)T] letting position t of step j see
    the prefix of step 0 and its own entries t of steps 1..j, and `position_ids` shifted by j. Nothing here
    is in-place or detached, so gradients flow through every step.
    """

    config_class = Eagle3Config
    kind = "eagle3"

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        if config.layer_config is None or config.input_mode not in ("widen", "project"):
            raise ValueError("Eagle3Config needs layer_config and a resolved input_mode; build it with "
                             "heads.build('eagle3', target.config)")
        d, v, vd = config.target_hidden_size, config.target_vocab_size, config.draft_vocab_size
        self.fc = nn.Linear(len(config.feature_layers) * d, d, bias=config.fc_bias)
        layer_config = build_layer_config(config.layer_config, config.attn_implementation)
        layer, rotary = build_decoder_layer(layer_config)
        norm = first_norm(layer)
        if config.norm_before_fc:  # one norm of the layer's class over all n*D features
            self.input_norm = type(norm)(len(config.feature_layers) * d,
                                         eps=getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))
        if config.input_mode == "widen":
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        else:
            self.embed_norm = copy.deepcopy(norm)
            self.proj = nn.Linear(2 * d, d, bias=False)
        self.hidden_norm = copy.deepcopy(norm)
        self.layers = nn.ModuleList([layer] + [build_decoder_layer(layer_config, i)[0]
                                               for i in range(1, config.num_layers)])
        self.rotary_emb = rotary
        self.norm = copy.deepcopy(norm)
        self.lm_head = nn.Linear(d, vd, bias=False)
        # Before training: the first `draft_vocab_size` target ids. `set_vocab_map` installs a real one.
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(v) < vd)
        self.post_init()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def fuse_features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(hidden, dim=-1)  # [B, A, n*D]

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    @torch.no_grad()
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (from `build_vocab_map`) before training."""
        vd, v = self.d2t.shape[0], self.t2d.shape[0]
        if d2t.shape != (vd,) or t2d.shape != (v,):
            raise ValueError(f"vocab map shapes must be d2t [{vd}] and t2d [{v}], got {tuple(d2t.shape)} and "
                             f"{tuple(t2d.shape)}")
        target_ids = torch.arange(vd) + d2t.cpu()
        if int(t2d.sum()) != vd or not t2d.cpu()[target_ids.clamp(0, v - 1)].all():
            raise ValueError("d2t and t2d disagree: t2d must mark exactly the target ids draft + d2t[draft]")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start the draft lm_head as the target's lm_head rows of the drafted tokens."""
        target_ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
        weight = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(weight[target_ids.to(weight.device)])

    def forward(self, input_ids, hidden_states, *, attention_mask=None, position_ids=None,
                past_key_values=None, cache_position=None, fused: bool | None = None,
                logits_at: torch.Tensor | None = None):
        # input_ids: [B, T]; hidden_states: [B, T, n*D] (fused target features) or [B, T, D] (own output);
        # logits_at: [B, T] bool, the positions whose logits are wanted ([N, V] then; training's loss positions: the
        # LM head, half of a step's products on SmolLM2, never runs on the others)
        hidden_states = hidden_states.to(self.dtype)
        if self._is_fused(hidden_states, fused):
            h = self.fc(self.input_norm(hidden_states) if self.config.norm_before_fc else hidden_states)
        else:
            h = hidden_states
        e = self.embed_tokens(input_ids)
        masks, position_ids = self._layer_masks(h, attention_mask, position_ids, past_key_values)
        layer_kwargs = dict(position_ids=position_ids, past_key_values=past_key_values, cache_position=cache_position,
                            position_embeddings=rotary_embeddings(self.rotary_emb, h, position_ids))
        layer = self.layers[0]
        if self.config.input_mode == "widen":
            residual = self.hidden_norm(h) if self.config.norm_before_residual else h
            x = torch.cat([layer.input_layernorm(e), self.hidden_norm(h)], dim=-1)
            h = residual + call_layer(layer.self_attn, x, attention_mask=masks[0], **layer_kwargs)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            x = self.proj(torch.cat([self.embed_norm(e), self.hidden_norm(h)], dim=-1))
            h = call_layer(layer, x, attention_mask=masks[0], **layer_kwargs)
        for layer, mask in zip(self.layers[1:], masks[1:], strict=True):
            h = call_layer(layer, h, attention_mask=mask, **layer_kwargs)
        if self.config.norm_output:  # speculators' norm_output: the normed state is what the next step reads
            h = self.norm(h)
            return h, self.lm_head(h if logits_at is None else h[logits_at])
        return h, self.lm_head(self.norm(h if logits_at is None else h[logits_at]))

    def mask_config(self):
        """What `infer.kv.KVState` reads to build this drafter's masks (`layer_types`, `sliding_window`), or None
        when every layer attends to the whole context."""
        windows = self.config.layer_windows
        if not windows:
            return None
        return types.SimpleNamespace(model_type=self.config.model_type, layer_types=_layer_types(windows),
                                     sliding_window=next(w for w in windows if w is not None))

    def _layer_masks(self, h, attention_mask, position_ids, past_key_values) -> tuple[list, torch.Tensor]:
        """Each layer's attention mask, and the positions: the mask given, or its layer type's from a dict of them;
        none given, the causal mask over the cache and the block, cut to each layer's window."""
        windows = self.config.layer_windows or [None] * len(self.layers)
        if isinstance(attention_mask, dict):
            _, position_ids = _defaults(h, attention_mask, position_ids, past_key_values)
            return [attention_mask[kind] for kind in _layer_types(windows)], position_ids
        if attention_mask is not None and any(windows):
            raise ValueError("this EAGLE-3 drafter has sliding-window layers: pass attention masks by layer type "
                             "(infer.kv.KVState(..., config=model.mask_config()) builds them), not one mask")
        mask, position_ids = _defaults(h, attention_mask, position_ids, past_key_values)
        masks = []
        for window in windows:
            far = None if window is None else (  # [B, 1, T, past + T]: keys at or beyond the window
                position_ids[:, None, :, None] - torch.arange(mask.shape[-1], device=h.device) >= window)
            masks.append(mask if far is None else mask.masked_fill(far, torch.finfo(mask.dtype).min))
        return masks, position_ids

    def _is_fused(self, hidden_states: torch.Tensor, fused: bool | None) -> bool:
        d, width = self.config.target_hidden_size, self.fc.in_features
        if hidden_states.shape[-1] not in (d, width):
            raise ValueError(f"EAGLE-3 hidden_states must be [B, T, {width}] (fused target features) or "
                             f"[B, T, {d}] (the drafter's own output), got {tuple(hidden_states.shape)}")
        if fused is None:
            if d == width:
                raise ValueError("with a single feature layer, fused target features and the drafter's own "
                                 "hidden states have the same width: pass fused=True or fused=False")
            fused = hidden_states.shape[-1] == width
        return fused

    def lean_forward(self, stream_rows: int, int8=None):
        """This forward as plain tensor code for drafting (`heads.eagle3.lean.LeanEagle3`: no transformers
        modules, blocks of 2..stream_rows rows on the streamed kernel; with `int8`, a
        `infer.cpu.linear.PackCache`, draft steps on int8 copies of the weights kept there), or None where it cannot run
        (not fp32 on CPU, `input_mode: project`, ...: `heads.eagle3.lean.why_not` says why)."""
        from infer.cpu.lean_forward import Unsupported

        from .lean import LeanEagle3

        try:
            return LeanEagle3(self, stream_rows, int8)
        except Unsupported:
            return None

    def as_drafter(self, **tree_overrides):
        from ..eagle.drafter import EagleDrafter

        return EagleDrafter(self, self.config.resolve_tree({**self.config.tree, **tree_overrides}))


def _layer_types(windows: list) -> list[str]:
    return ["full_attention" if w is None else "sliding_attention" for w in windows]
