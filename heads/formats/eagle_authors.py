"""EAGLE-3 drafters as EAGLE's authors publish them (SafeAILab/EAGLE; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

The checkpoint is `config.json`, a Llama config of the drafter's one layer plus `draft_vocab_size` (and
`target_hidden_size` when the drafter is narrower than its target), and `pytorch_model.bin` holding `fc.weight`
[D, 3D], `midlayer.*` (one Llama layer whose q/k/v read 2D-wide inputs, with a `midlayer.hidden_norm`),
`norm.weight`, `lm_head.weight` [Vd, D] and the draft-vocabulary map `d2t` [Vd] / `t2d` [V]. No embedding: their
code loads the target's, as we use it.

What their code computes, and our `Eagle3Model` with these weights (input_mode "widen", a Llama layer):
  feature = the target's residual stream entering layers 2, L//2 and L-3 (hidden_states indices), in layer order
  h = feature @ fc;  h = h + attn([input_layernorm(e), hidden_norm(h)]);  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) over the draft vocabulary; target id = draft id + d2t[draft id]; h is fed back unnormed
with head_dim = hidden_size // num_attention_heads whatever the config says, RoPE at the config's rope_theta
(10000 without one), no biases, and d2t/t2d ignored when the draft vocabulary is the whole vocabulary. Their
checkpoints name no target and depend on its layer count: the target must be given.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from ..base import text_config
from ..eagle3 import Eagle3Config, Eagle3Model
from .common import (
    check_config,
    check_embedding,
    check_fits,
    check_vocab_map,
    fields_for_target,
    finish,
    load_strict,
    named,
    read_tensors,
)

NAME = "eagle_authors"
DESCRIPTION = "EAGLE-3, EAGLE authors' format (SafeAILab/EAGLE: config with draft_vocab_size, pytorch_model.bin)"


def is_llama_eagle3(config: dict) -> bool:
    """A config of the LlamaForCausalLMEagle3 family that EAGLE's authors and SpecForge both write."""
    return (config.get("model_type") == "llama" and "draft_vocab_size" in config
            and "speculators_model_type" not in config)


# config.json's keys a LlamaForCausalLMEagle3 checkpoint (theirs, SpecForge's) is read by, and what each must be ("?":
# may be absent or null)
CONFIG = {"hidden_size": "size", "vocab_size": "size", "draft_vocab_size": "size", "intermediate_size": "size",
          "num_attention_heads": "size", "num_key_value_heads": "size?", "head_dim": "size?",
          "target_hidden_size": "size?", "num_hidden_layers": "size?", "rms_norm_eps": "number?",
          "rope_theta": "number?", "max_position_embeddings": "size?", "hidden_act": "name?",
          "eagle_config": "table?", "rope_scaling": "table?", "rope_parameters": "table?"}


def check_llama_eagle3_config(what: str, config: dict, head_dim: bool) -> None:
    """Refuse, naming the key and the fix, a config missing a key the layer is built from or holding one of another
    kind; and head counts that do not divide (with `head_dim=False`, their code's head width is hidden_size /
    num_attention_heads)."""
    check_config(what, config, CONFIG)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if not head_dim and config["hidden_size"] % heads:
        raise ValueError(f"{what}: config.json's hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {heads} (their layer's head width is hidden_size / num_attention_heads): "
                         "the file was edited or damaged; re-download the checkpoint")
    if heads % kv:
        raise ValueError(f"{what}: config.json's num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv}: the file was edited or damaged; re-download the checkpoint")


# Config keys only SpecForge writes (its capture layers and options): their code would ignore them, so a checkpoint
# that has them is SpecForge's, whichever weight file it holds.
SPECFORGE_KEYS = ("eagle_config", "fc_norm", "norm_output")


def detect(config: dict, files: frozenset[str]) -> bool:
    # their loader reads pytorch_model.bin (what their training saves); SpecForge writes model.safetensors
    return (is_llama_eagle3(config) and "pytorch_model.bin" in files and "model.safetensors" not in files
            and not any(k in config for k in SPECFORGE_KEYS))


def target_name(config: dict) -> str | None:
    return None


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> Eagle3Model:
    what = f"EAGLE-3 checkpoint {path_or_id} (EAGLE authors' format)"
    check_llama_eagle3_config(what, config, head_dim=False)
    if target is None:
        raise ValueError(f"{what} records neither its target nor which target layers it reads (2, L//2 and L-3 of "
                         "an L-layer target): pass target=<the model it was trained for>")
    layers = sorted({2, text_config(target).num_hidden_layers // 2, text_config(target).num_hidden_layers - 3})
    if len(layers) != 3 or layers[0] < 0:
        raise ValueError(f"{what}: its fc reads three target layers (2, L//2, L-3), which a target of "
                         f"{text_config(target).num_hidden_layers} layers does not have distinct ({layers})")
    tensors = read_tensors(path_or_id, "pytorch_model.bin", **hub_kwargs)
    if "fc.bias" in tensors:  # their fc has none, and their loader would drop it without a word
        raise ValueError(f"{what} holds an fc.bias, which the EAGLE authors' fc does not have; it was not written by "
                         "their code")
    model = llama_eagle3(config, tensors, what=what, target=target, feature_layers=layers,
                         head_dim=config["hidden_size"] // config["num_attention_heads"])
    return model


def llama_rope(config: dict, what: str) -> dict:
    """The RoPE of a Llama-family drafter config as transformers' `rope_parameters`: unscaled, or scaled by any
    kind transformers computes (`llama3` in the Llama-3.1 drafters, `linear`, `yarn`, ...), with the scaling's own
    fields; a kind transformers does not know is refused rather than guessed."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(config.get("rope_parameters") or {})
    scaling = {k: v for k, v in (config.get("rope_scaling") or {}).items() if k != "type"}
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type") or scaling.get("rope_type") or (config.get("rope_scaling") or {}).get("type") \
        or "default"
    if kind == "default":
        return {"rope_type": "default", "rope_theta": theta}
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"{what}: RoPE scaling {kind!r} is not one transformers computes "
                         f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})")
    return {**scaling, **rope, "rope_type": kind, "rope_theta": theta}


def llama_eagle3(config: dict, tensors: dict[str, torch.Tensor], *, what: str, target, feature_layers: list[int],
                 head_dim: int, fields: dict | None = None) -> Eagle3Model:
    """Our EAGLE-3 drafter computing what a LlamaForCausalLMEagle3 checkpoint (EAGLE authors', SpecForge's)
    computes, with its weights: `midlayer.*` becomes our first layer, `midlayer.hidden_norm` our hidden_norm, and an
    `fc.bias` (SGLang's `bias: true`) our fc's bias. `fields` are further config fields (tree, provenance)."""
    d, vocab, draft_vocab = config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]
    if (config.get("target_hidden_size") or d) != d:
        raise ValueError(f"{what}: its layer is {d} wide (hidden_size) over a {config['target_hidden_size']}-wide "
                         "target (target_hidden_size); selfspec's EAGLE-3 drafter is as wide as its target")
    if (config.get("num_hidden_layers") or 1) != 1:
        raise ValueError(f"{what}: num_hidden_layers is {config['num_hidden_layers']}; this format has one layer "
                         "(midlayer)")
    check_fits(what, target, hidden_size=d, vocab_size=vocab)
    check_embedding(what, tensors, "embed_tokens.weight", target)
    state = {}
    for key, value in tensors.items():
        if key == "embed_tokens.weight":  # a frozen copy of the target's (checked above): we use the target's
            continue
        if key.startswith("midlayer."):
            rest = key[len("midlayer."):]
            key = "hidden_norm.weight" if rest == "hidden_norm.weight" else f"layers.0.{rest}"
        state[key] = value
    if draft_vocab == vocab:  # their code drafts target ids directly then, whatever d2t/t2d hold
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    elif "d2t" not in state:
        raise ValueError(f"{what}: a draft vocabulary of {draft_vocab} < {vocab} needs its d2t map, which the "
                         "checkpoint lacks")
    else:
        check_vocab_map(what, state["d2t"], state.get("t2d"), draft_vocab, vocab)
        if "t2d" not in state:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[torch.arange(draft_vocab) + state["d2t"].long()] = True
            state["t2d"] = t2d
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    heads, rope = config["num_attention_heads"], llama_rope(config, what)
    with named(what):
        layer = LlamaConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=config["intermediate_size"], num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim, hidden_act=config.get("hidden_act", "silu"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config.get("max_position_embeddings", 2048), rope_parameters=rope,
            attention_bias=False, mlp_bias=False).to_diff_dict()
    for key in ("transformers_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                "tie_word_embeddings"):
        layer.pop(key, None)
    layer["model_type"] = "llama"
    fields = fields_for_target(what, {**(fields or {}), "target_hidden_size": d, "target_vocab_size": vocab}, target)
    with named(what):
        model = Eagle3Model(Eagle3Config(
            layer_style="llama", layer_config=layer, attn_implementation="sdpa", input_mode="widen",
            feature_layers=feature_layers, draft_vocab_size=draft_vocab, norm_before_residual=False,
            fc_bias="fc.bias" in state, num_layers=1, **fields))
    return finish(load_strict(model, state, what), target)
