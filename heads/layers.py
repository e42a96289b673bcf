"""Decoder layers for EAGLE drafters, built from transformers and called through their own forward.

An EAGLE drafter's layer is either transformers' Llama decoder layer at the target's sizes (`layer_style`
"llama": one layout for every target, the one vLLM and SGLang serve) or the target architecture's own layer
("target"). We never copy modeling code: we look up the layer class transformers uses for a `model_type`,
build it from a one-layer, full-attention config, and call it with keyword arguments (a 4D additive mask,
position ids, the rotary `position_embeddings` when the architecture uses them, and the KV cache).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, LlamaConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from infer.attention import additive_mask


@dataclass(frozen=True)
class ArchClasses:
    causal_lm: type  # e.g. LlamaForCausalLM
    layer: type  # e.g. LlamaDecoderLayer
    rotary: type | None  # e.g. LlamaRotaryEmbedding; None when the layer takes no position embeddings


def arch_classes(model_type: str) -> ArchClasses:
    """transformers' classes for `model_type`; a clear error (never another architecture) if not found."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"transformers has no causal LM for model_type {model_type!r}, so an EAGLE drafter "
                         "cannot be built from its decoder layer")
    folder = model_type_to_module_name(model_type)
    module_name = f"transformers.models.{folder}.modeling_{folder}"
    try:
        module = importlib.import_module(module_name)
        causal_lm = getattr(module, name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {name} from {module_name} for model_type {model_type!r}: {err}") from err

    # The class transformers records hidden states from is the decoder layer; `_no_split_modules` names it too.
    layer = (getattr(causal_lm, "_can_record_outputs", None) or {}).get("hidden_states")
    if not isinstance(layer, type):
        names = [n for n in (causal_lm._no_split_modules or []) if isinstance(getattr(module, n, None), type)]
        if len(names) != 1:
            raise ValueError(f"cannot tell the decoder-layer class of {name} (candidates: {names}); "
                             f"model_type {model_type!r} is not supported by EAGLE drafters")
        layer = getattr(module, names[0])

    rotary = None
    if "position_embeddings" in inspect.signature(layer.forward).parameters:
        found = [c for n, c in vars(module).items()
                 if isinstance(c, type) and n.endswith("RotaryEmbedding") and c.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"{layer.__name__} needs rotary position embeddings but {module_name} defines "
                             f"{len(found)} rotary classes; model_type {model_type!r} is not supported")
        rotary = found[0]
    return ArchClasses(causal_lm, layer, rotary)


def default_attn_implementation(model_type: str) -> str:
    """sdpa where the architecture supports it, else eager (Gemma 2's soft-capping needs eager)."""
    return "sdpa" if arch_classes(model_type).causal_lm._supports_sdpa else "eager"


def layer_config_dict(target_config: PretrainedConfig) -> dict:
    """A one-layer, full-attention copy of the target's text config, as a JSON-able dict (with model_type)."""
    config = copy.deepcopy(target_config.get_text_config())
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    elif getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None  # the drafter's cache is full attention (KVState with config=None)
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = False
    d = config.to_diff_dict()
    d["model_type"] = config.model_type
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype",
                "quantization_config"):  # the drafter layer is a plain, unquantized layer
        d.pop(key, None)
    return d


# How an EAGLE drafter's decoder layer is built (EagleConfig.layer_style).
LAYER_STYLES = ("llama", "target")


def llama_layer_config_dict(target_config: PretrainedConfig) -> dict:
    """A one-layer Llama config at the target's sizes, as a JSON-able dict (with model_type "llama").

    Width, heads, KV heads, head_dim, MLP width, norm epsilon, context length and the RoPE of the target's
    full-attention layers carry over; the rest is Llama's: SiLU, RMSNorm, no biases, rotary over the whole head
    (a partial rotary factor is dropped), so targets without RoPE (GPT-2's learned positions) get RoPE at
    theta 10000. A Llama target's own layer config is returned as it is: there the two layer styles coincide.
    """
    c = target_config.get_text_config()
    if c.model_type == "llama":
        return layer_config_dict(c)
    heads = c.num_attention_heads
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    eps = next((v for v in (getattr(c, k, None) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"))
                if v is not None), 1e-6)
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=ffn, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, hidden_act="silu", rms_norm_eps=float(eps),
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 4096,
        rope_parameters=_full_attention_rope(c), attention_bias=False, mlp_bias=False,
        initializer_range=getattr(c, "initializer_range", 0.02))
    d = config.to_diff_dict()
    for key in ("transformers_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                "tie_word_embeddings"):
        d.pop(key, None)
    d["model_type"] = "llama"
    return d


def _full_attention_rope(config: PretrainedConfig) -> dict:
    """The target's RoPE for full-attention layers (Gemma 3 keeps one per layer type) without a partial rotary
    factor; theta 10000 (Llama's default) for targets without RoPE."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    rope.pop("partial_rotary_factor", None)
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    return rope


def build_layer_config(layer_config: dict, attn_implementation: str) -> PretrainedConfig:
    d = dict(layer_config)
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, attn_implementation=attn_implementation, **d)


def _accepted(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def build_decoder_layer(layer_config: PretrainedConfig, layer_idx: int = 0) -> tuple[nn.Module, nn.Module | None]:
    """One decoder layer of the target's class and, when it needs one, its rotary embedding (whose tables are
    non-persistent buffers rebuilt from the config, never saved). `layer_idx` is the layer's slot in the
    drafter's own KV cache; every drafter layer is full attention."""
    arch = arch_classes(layer_config.model_type)
    if layer_idx >= layer_config.num_hidden_layers:  # classes that read per-layer settings index them by it
        layer_config = copy.deepcopy(layer_config)
        layer_config.num_hidden_layers = layer_idx + 1
        if getattr(layer_config, "layer_types", None):
            layer_config.layer_types = ["full_attention"] * (layer_idx + 1)
    layer = arch.layer(layer_config, layer_idx=layer_idx)
    rotary = arch.rotary(layer_config) if arch.rotary is not None else None
    return layer, rotary


def rotary_embeddings(rotary: nn.Module | None, x: torch.Tensor, position_ids: torch.Tensor):
    """`(cos, sin)` for the layer, or None for architectures without rotary embeddings (GPT-2)."""
    if rotary is None:
        return None
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        # Gemma 3 keeps one table per layer type; the drafter layer is full attention.
        return rotary(x, position_ids, layer_type="full_attention")
    return rotary(x, position_ids)


def call_layer(module: nn.Module, hidden: torch.Tensor, *, attention_mask, position_ids, past_key_values,
               cache_position=None, position_embeddings=None) -> torch.Tensor:
    """Call a decoder layer (or its `self_attn`) with the keyword arguments its forward names; `out[0]` if it
    returns a tuple. The cache goes in under the name the class gives it: `cache` (transformers >= 5.24),
    `past_key_values` or `layer_past`."""
    kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, cache_position=cache_position,
                  position_embeddings=position_embeddings, cache=past_key_values, past_key_values=past_key_values,
                  layer_past=past_key_values, use_cache=past_key_values is not None)
    accepted = _accepted(module.forward, kwargs)
    if past_key_values is not None and not {"cache", "past_key_values", "layer_past"} & set(accepted):
        raise ValueError(f"{type(module).__name__}.forward takes no KV cache argument we know")
    out = module(hidden, **accepted)
    return out[0] if isinstance(out, tuple) else out


def causal_mask(batch: int, length: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [B, 1, T, past + T] mask: every query sees the whole past and the causal prefix of its block."""
    allowed = torch.ones(1, length, past + length, dtype=torch.bool, device=device).tril(past)
    return additive_mask(allowed, dtype).expand(batch, 1, length, past + length)


def default_positions(batch: int, length: int, past: int, device) -> torch.Tensor:
    return torch.arange(past, past + length, device=device)[None].expand(batch, length)


# The decoder-layer layout EAGLE-3's widened attention is defined for (Llama, Mistral, Qwen2/3, ...).
LLAMA_LAYOUT = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def widen_problem(layer: nn.Module) -> str | None:
    """Why EAGLE-3's 2D-wide q/k/v cannot be used with this layer class, or None if it can: the layer must
    have the Llama layout (pre-norm attention and MLP, nothing else) with separate q/k/v projections."""
    children = {name for name, _ in layer.named_children()}
    if children != LLAMA_LAYOUT:
        return f"{type(layer).__name__} has submodules {sorted(children)}, not the Llama layout {sorted(LLAMA_LAYOUT)}"
    for name in ("q_proj", "k_proj", "v_proj"):
        if not isinstance(getattr(layer.self_attn, name, None), nn.Linear):
            return f"{type(layer).__name__}.self_attn has no separate {name} Linear"
    return None


def first_norm(layer: nn.Module) -> nn.Module:
    """The layer's first normalisation submodule (its input norm), to copy the architecture's norm class."""
    for _, module in layer.named_children():
        if "norm" in type(module).__name__.lower():
            return module
    raise ValueError(f"{type(layer).__name__} has no normalisation submodule to copy")


def meta_layer(layer_config: dict, attn_implementation: str) -> nn.Module:
    """The decoder layer built on the meta device: its structure, without allocating weights."""
    with torch.device("meta"):
        return build_decoder_layer(build_layer_config(layer_config, attn_implementation))[0]
