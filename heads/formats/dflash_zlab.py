"""DFlash block drafters as z-lab publishes them (z-lab/dflash, e.g. z-lab/Qwen3-8B-DFlash-b16; vLLM and SGLang
serve the same layout), ours from `heads.export.export_dflash` included.

The checkpoint is `config.json`, a Qwen3 config of the drafter's layers with `architectures:
["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`,
and `model.safetensors` with `fc.weight` [D, n*D], `hidden_norm.weight`, `norm.weight` and `layers.N.*` (Qwen3
names, q/k norms included); no embedding or lm_head, which are the target's.

What their code computes, and our `DFlashModel` with these weights:
  context_t = hidden_norm(fc(cat of the target's hidden_states[id + 1] for id in target_layer_ids)), position t
  block     = [embedding of the last accepted token, embedding of mask_token_id x (block_size - 1)]
  each layer: queries from the block (input_layernorm, q_norm), keys/values from the context (no input norm, k_norm)
  and the block, RoPE at each slot's position, attention not causal; block slot k predicts the token k places on
  through the drafter's norm and the target's lm_head.
`target_layer_ids` default, as in their code, to the middle layer for a one-layer drafter and otherwise to layers
spread evenly from 1 to L - 3. The mask vector is the target's embedding of `mask_token_id` (so the target must be
given), unless the checkpoint carries `mask_embedding.pt` (our exports do).
"""

from __future__ import annotations

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedModel, Qwen3Config

from ..dflash import DFlashConfig, DFlashModel
from .common import (
    check_config,
    check_export_files,
    check_fits,
    fields_for_target,
    finish,
    load_strict,
    named,
    read_pickled,
    read_tensors,
    resolve_file,
    selfspec_fields,
)

NAME = "dflash_zlab"
DESCRIPTION = "DFlash, z-lab's format (DFlashDraftModel config with dflash_config; vLLM and SGLang serve it)"
MASK_FILE = "mask_embedding.pt"
LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias")
# config.json's keys read here and what each must be ("?": may be absent); the Qwen3 fields default to nothing
# sensible for a drafter (a missing hidden_size would become Qwen3's 4096)
CONFIG = {"hidden_size": "size", "vocab_size": "size", "intermediate_size": "size", "num_attention_heads": "size",
          "num_hidden_layers": "size", "num_key_value_heads": "size?", "head_dim": "size?", "block_size": "size?",
          "num_target_layers": "size?", "rms_norm_eps": "number?", "rope_theta": "number?",
          "max_position_embeddings": "size?", "hidden_act": "name?", "dflash_config": "table?"}
DFLASH_CONFIG = {"target_layer_ids": "ids?", "mask_token_id": "id?"}


def detect(config: dict, files: frozenset[str]) -> bool:
    return "DFlashDraftModel" in (config.get("architectures") or [])


def target_name(config: dict) -> str | None:
    return (config.get("selfspec") or {}).get("base_model_name_or_path")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers z-lab's code reads when the config names none: the middle one for a one-layer drafter,
    else one per drafter layer from layer 1 to L - 3, evenly spaced and rounded."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    last = num_target_layers - 3
    return [int(round(1 + k * (last - 1) / (num_draft_layers - 1))) for k in range(num_draft_layers)]


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> DFlashModel:
    what = f"DFlash checkpoint {path_or_id} (z-lab's format)"
    if config.get("model_type") != "qwen3":
        raise ValueError(f"{what}: model_type is {config.get('model_type')!r}; DFlash drafters are Qwen3 layers")
    check_config(what, config, CONFIG)
    check_config(what, config.get("dflash_config") or {}, DFLASH_CONFIG, section="config.json's dflash_config")
    check_export_files(what, path_or_id, config, ("model.safetensors", MASK_FILE), **hub_kwargs)
    try:
        theirs = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type")})
    except (ValueError, TypeError, StrictDataclassError) as err:
        raise ValueError(f"{what}: config.json is not a Qwen3 config transformers accepts ({err}); re-download the "
                         "checkpoint") from None
    count = theirs.num_hidden_layers
    sliding = [i for i, t in enumerate(theirs.layer_types[:count]) if t != "full_attention"]
    if sliding:
        raise ValueError(f"{what}: layers {sliding} use sliding-window attention; selfspec's DFlash layers attend "
                         "to the whole context")
    dflash = config.get("dflash_config") or {}
    num_target = config.get("num_target_layers")
    check_fits(what, target, hidden_size=theirs.hidden_size, vocab_size=theirs.vocab_size,
               num_hidden_layers=num_target)
    ids = dflash.get("target_layer_ids")
    if ids is None:
        if num_target is None:
            raise ValueError(f"{what} names neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_layer_ids(num_target, count)
    read = [i + 1 for i in ids]  # their feature for layer id i is hidden_states[i + 1], the output of layer i
    recorded = {"feature_layers": read, "target_hidden_size": theirs.hidden_size, "target_vocab_size": theirs.vocab_size,
                "target_num_layers": num_target, "mask_token_id": dflash.get("mask_token_id")}
    # what our own exports add (absent in z-lab's), then the target's fields where neither records one
    recorded.update({k: v for k, v in selfspec_fields(what, config).items() if v is not None})
    fields = fields_for_target(what, recorded, target)
    fields.pop("attn_implementation", None)
    layer = {k: getattr(theirs, k) for k in LAYER_FIELDS}
    layer.update(model_type="qwen3", rope_parameters=dict(theirs.rope_parameters))
    with named(what):
        model = DFlashModel(DFlashConfig(layer_config=layer, num_layers=count, block_size=config.get("block_size", 16),
                                         fc_bias=False, **fields))
    if sorted(model.feature_layers) != sorted(read):
        raise ValueError(f"{what}: its selfspec block reads layers {list(model.feature_layers)}, its dflash_config "
                         f"{read}")
    state = read_tensors(path_or_id, "model.safetensors", **hub_kwargs)
    fc = state.get("fc.weight")
    d = theirs.hidden_size
    if fc is not None and fc.shape == model.fc.weight.shape:  # their column blocks follow target_layer_ids' order
        blocks = dict(zip(read, fc.split(d, dim=1), strict=True))
        state["fc.weight"] = torch.cat([blocks[i] for i in model.feature_layers], dim=1)
    state["mask_embed.weight"] = mask_vector(path_or_id, what, dflash.get("mask_token_id"), target,
                                              **hub_kwargs).reshape(1, -1)
    return finish(load_strict(model, state, what), target)


def mask_vector(path_or_id, what: str, mask_token_id, target, **hub_kwargs) -> torch.Tensor:
    """The vector DFlash writes into its mask slots: `mask_embedding.pt` where the checkpoint has one (our
    exports), else the target's embedding of `mask_token_id`, taken through the embedding module as z-lab's code
    does (an embedding that scales inside, such as Gemma's, scales it too)."""
    path = resolve_file(path_or_id, MASK_FILE, **hub_kwargs)
    if path is not None:
        saved = read_pickled(path)
        if isinstance(saved, dict) and isinstance(saved.get("embedding"), torch.Tensor):
            saved_id = saved.get("mask_token_id", mask_token_id)
            if mask_token_id is not None and saved_id != mask_token_id:
                raise ValueError(f"{what}: {MASK_FILE} is for mask token {saved_id!r}, the config's "
                                 f"dflash_config.mask_token_id is {mask_token_id}")
            saved = saved["embedding"]
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
            raise ValueError(f"{path} holds {_described(saved)}, not DFlash's mask vector ({{'mask_token_id': <id>, "
                             "'embedding': <float tensor [hidden size]>}, as heads.export.export_dflash writes it): "
                             "export the drafter again, or remove the file to embed mask slots as mask_token_id")
        return saved.reshape(-1)
    if mask_token_id is None:
        raise ValueError(f"{what} has neither dflash_config.mask_token_id nor {MASK_FILE}: nothing says what its mask "
                         "slots are")
    if not isinstance(target, PreTrainedModel):
        raise ValueError(f"{what} embeds its mask slots as token {mask_token_id} of the target's vocabulary: pass "
                         "target=<the target model> to read that embedding")
    embed = target.get_input_embeddings()
    if not 0 <= int(mask_token_id) < embed.weight.shape[0]:
        raise ValueError(f"{what}: mask_token_id {mask_token_id} is outside the target's vocabulary "
                         f"(0..{embed.weight.shape[0] - 1})")
    # through the module, as their code embeds it (Gemma's embedding scales by sqrt(D) inside the module)
    with torch.no_grad():
        row = embed(torch.tensor([int(mask_token_id)], device=embed.weight.device))
    return row[0].float().cpu().clone()


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:6]}"
    return f"a {type(value).__name__}"
