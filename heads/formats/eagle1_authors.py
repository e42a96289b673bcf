"""EAGLE-1/2 drafters as EAGLE's authors publish them (SafeAILab/EAGLE; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B,
yuhuili/EAGLE-Vicuna-7B-v1.3; SGLang's copies of them, `LlamaForCausalLMEagle`).

The checkpoint is `config.json`, a Llama config of the drafter's one layer (no `draft_vocab_size`: that is
EAGLE-3), with `bias` saying whether fc has one (absent: it has, as their loader defaults it), and
`pytorch_model.bin` holding `fc.weight` [D, 2D] (`fc.bias`), `layers.0.self_attn.*`, `layers.0.mlp.*`,
`layers.0.post_attention_layernorm.weight` and a copy of the target's `embed_tokens.weight`; no
`layers.0.input_layernorm`, no final norm and no lm_head.

What their code computes (eagle/model/cnets1.py, `Model` and its `LlamaDecoderLayer` of index 0; read at SafeAILab/EAGLE
commit cb7e084), and our `EagleModel` with these weights (layer_style "llama", `layer_input_norm=False`):
  f = the target's last hidden state after its final norm;  x = fc([embedding of token t+1, f_t])
  h = x + attn(x);  h = h + mlp(post_attention_layernorm(h))      (layer 0 has no input norm)
  logits = the target's lm_head(h), no norm; h is fed back as the next step's feature
with head_dim = hidden_size / num_attention_heads, RoPE at the config's rope_theta (10000 without one; `linear`
scaling as transformers computes it), q/k/v biases where the config has `qkv_bias` (their Qwen2 drafters). Their
checkpoints name no target, and the feature index follows its layer count: the target must be given.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from ..eagle import EagleConfig, EagleModel
from .common import (
    check_config,
    check_embedding,
    check_fits,
    fields_for_target,
    finish,
    load_strict,
    named,
    read_tensors,
)
from .eagle_authors import SPECFORGE_KEYS

NAME = "eagle1_authors"
DESCRIPTION = ("EAGLE-1/2, EAGLE authors' format (SafeAILab/EAGLE: one-layer Llama config without draft_vocab_size, "
               "pytorch_model.bin with fc over 2 x hidden)")
ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle")
# config.json's keys read here and what each must be ("?": may be absent or null)
CONFIG = {"hidden_size": "size", "vocab_size": "size", "intermediate_size": "size", "num_attention_heads": "size",
          "num_key_value_heads": "size?", "num_hidden_layers": "size", "rms_norm_eps": "number?",
          "rope_theta": "number?", "max_position_embeddings": "size?", "hidden_act": "name?", "bias": "flag?",
          "qkv_bias": "flag?", "rope_scaling": "table?"}


def detect(config: dict, files: frozenset[str]) -> bool:
    # their training saves pytorch_model.bin; a draft vocabulary or SpecForge's keys make it EAGLE-3
    return (config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1
            and any(a in ARCHITECTURES for a in config.get("architectures") or [])
            and "draft_vocab_size" not in config and "speculators_model_type" not in config
            and not any(k in config for k in SPECFORGE_KEYS)
            and "pytorch_model.bin" in files and "model.safetensors" not in files)


def target_name(config: dict) -> str | None:
    return None


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> EagleModel:
    what = f"EAGLE-1/2 checkpoint {path_or_id} (EAGLE authors' format)"
    check_config(what, config, CONFIG)
    d, heads = config["hidden_size"], config["num_attention_heads"]
    if d % heads or heads % (config.get("num_key_value_heads") or heads):
        raise ValueError(f"{what}: config.json's hidden_size {d}, num_attention_heads {heads} and num_key_value_heads "
                         f"{config.get('num_key_value_heads')} do not divide (their head width is hidden_size / "
                         "num_attention_heads): the file was edited or damaged; re-download the checkpoint")
    if config["num_hidden_layers"] != 1:
        raise ValueError(f"{what}: num_hidden_layers is {config['num_hidden_layers']}; selfspec's EAGLE-1/2 drafter "
                         "has one layer")
    if target is None:
        raise ValueError(f"{what} records neither its target nor its layer count, whose last hidden state it reads: "
                         "pass target=<the model it was trained for>")
    check_fits(what, target, hidden_size=d, vocab_size=config["vocab_size"])
    tensors = read_tensors(path_or_id, "pytorch_model.bin", **hub_kwargs)
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (d, 2 * d):
        found = f"an fc.weight of shape {tuple(fc.shape)}" if fc is not None else f"keys {sorted(tensors)[:4]}"
        raise ValueError(f"{what}: an EAGLE-1/2 drafter holds fc.weight [{d}, {2 * d}] (over [embedding, feature]); "
                         f"this file holds {found}: it is not an EAGLE drafter (a one-layer Llama model?)")
    state = _state(what, config, tensors, target)
    with named(what):
        model = EagleModel(EagleConfig(
            layer_style="llama", layer_config=_layer_config(config, what), attn_implementation="sdpa",
            fc_bias="fc.bias" in state, layer_input_norm=False,
            **fields_for_target(what, {"target_hidden_size": d, "target_vocab_size": config["vocab_size"]}, target)))
    return finish(load_strict(model, state, what), target)


def _state(what: str, config: dict, tensors: dict[str, torch.Tensor], target) -> dict[str, torch.Tensor]:
    """Their weights under our names: the embedding copy checked against the target's and dropped, fc's bias as
    their loader reads it (present unless the config says `bias: false`), zero o_proj biases beside q/k/v ones."""
    check_embedding(what, tensors, "embed_tokens.weight", target)
    state = {k: v for k, v in tensors.items() if k != "embed_tokens.weight" and not k.endswith("rotary_emb.inv_freq")}
    if config.get("bias", True) and "fc.bias" not in state:
        raise ValueError(f"{what}: its config gives fc a bias (no `bias: false`), which pytorch_model.bin lacks: their "
                         "loader (strict=False) would leave it at its random initial value; re-download the checkpoint")
    if not config.get("bias", True):
        state.pop("fc.bias", None)  # their fc has none then, and their loader drops the tensor
    if config.get("qkv_bias"):  # Llama's attention_bias covers o_proj too: an exact zero bias there
        state["layers.0.self_attn.o_proj.bias"] = torch.zeros(config["hidden_size"],
                                                              dtype=state["layers.0.self_attn.o_proj.weight"].dtype)
    return state


def _layer_config(config: dict, what: str) -> dict:
    """Their layer as transformers' Llama layer config (one layer, head_dim = hidden / heads, their RoPE)."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "linear"):  # their dynamic NTK cache grows and never shrinks, unlike transformers'
        raise ValueError(f"{what}: RoPE scaling {kind!r}; selfspec computes their unscaled and linear RoPE only")
    theta = float(config.get("rope_theta") or 10000.0)
    rope = {"rope_type": "default", "rope_theta": theta} if kind == "default" else {
        "rope_type": "linear", "factor": float(scaling["factor"]), "rope_theta": theta}
    heads = config["num_attention_heads"]
    with named(what):
        layer = LlamaConfig(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_hidden_layers=1, num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads, head_dim=config["hidden_size"] // heads,
            hidden_act=config.get("hidden_act") or "silu", rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            max_position_embeddings=config.get("max_position_embeddings") or 2048, rope_parameters=rope,
            attention_bias=bool(config.get("qkv_bias")), mlp_bias=False).to_diff_dict()
    for key in ("transformers_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                "tie_word_embeddings"):
        layer.pop(key, None)
    layer["model_type"] = "llama"
    return layer
