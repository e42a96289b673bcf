"""Export to (and import from) the formats vLLM serves (speculators EAGLE-3, vLLM Medusa and DFlash), and export
of EAGLE-3 to the layout SGLang loads (SpecForge's output).

What was checked against which release is recorded in docs/export.md. Each exported config also carries a
`selfspec` block (ignored by vLLM and speculators) with what the format itself does not record, such as
the target's layer count, so that re-importing gives back the same drafter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.utils import cached_file

from .base import check_weights_file
from .dflash import DFlashModel
from .eagle3 import Eagle3Config, Eagle3Model
from .folders import check_writable, file_record, written_whole
from .kinds import REGISTRY, ExportFormat
from .layers import arch_classes
from .medusa import MedusaConfig, MedusaModel
from .weights import WEIGHTS_NAME as WEIGHTS

MASK_EMBEDDING_FILE = "mask_embedding.pt"
EXPORT_FILES = ("config.json", WEIGHTS, MASK_EMBEDDING_FILE)  # all an export of ours writes
SPECULATORS_VERSION = "0.2.0"  # the speculators format generation these configs follow (see docs/export.md)

# The decoder-layer weights of a speculators EAGLE-3 layer ("layers.0." + name), Llama names.
LLAMA_LAYER_WEIGHTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
ATTENTION_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                    "self_attn.o_proj.bias")
# Config fields of a Llama decoder layer that carry over from the drafter's layer config.
LLAMA_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "hidden_act", "rms_norm_eps", "max_position_embeddings", "mlp_bias", "initializer_range",
                      "bos_token_id", "eos_token_id", "pad_token_id")


def _read_config(path_or_id, **hub_kwargs) -> dict:
    config_file = cached_file(path_or_id, "config.json", **hub_kwargs)
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}): the file is damaged; export or download the "
                         "drafter again") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} holds a JSON {type(config).__name__}, not an object: it is not a drafter's "
                         "config; export or download the drafter again")
    return config


def _read_weights(path_or_id, **hub_kwargs) -> dict[str, torch.Tensor]:
    return load_file(check_weights_file(path_or_id, **hub_kwargs))


def check_out_dir(out_dir) -> None:
    """Refuse, before anything is written, a folder where an export would overwrite or mix with files of the
    user's: one that is not empty, unless it holds an earlier export of ours and nothing else (which an export
    replaces). A model's own folder (the target's, the drafter's) is never one. Also one that cannot be written
    whole: a file, a path under a file, or a read-only place (`heads.folders.check_writable`)."""
    check_writable(out_dir, "export folder")
    path = Path(out_dir)
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not names or _earlier_export(path, names):
        return
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    raise ValueError(f"export folder {path} is not empty ({shown}) and holds no earlier export of selfspec's: "
                     f"exporting writes {', '.join(EXPORT_FILES[:2])} there, over or beside these files; choose an "
                     "empty or new folder")


def _earlier_export(path: Path, names: list[str]) -> bool:
    """Whether the folder holds only the files an export writes, its config one of ours (our `selfspec` block
    in a format we export)."""
    if "config.json" not in names or not set(names) <= set(EXPORT_FILES):
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(config, dict) and isinstance(config.get("selfspec"), dict)
            and any(fmt.recognizes(config) for fmt in export_formats().values()))


def _write_folder(out_dir, config: dict, tensors: dict[str, torch.Tensor], pickled: dict | None = None) -> None:
    """Write an export whole (`heads.folders.written_whole`): an earlier export there is replaced only once the new
    one is complete, and is left as it was if this one fails or is killed. config.json comes last and records each
    other file's size and sha256 (`selfspec.files`), so that a loader refuses a folder missing one or mixing them."""
    check_out_dir(out_dir)
    try:
        with written_whole(out_dir) as folder:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.fspath(folder / WEIGHTS),
                      metadata={"format": "pt"})
            for name, value in (pickled or {}).items():
                torch.save(value, folder / name)
            files = {p.name: file_record(p) for p in sorted(folder.iterdir())}
            with open(folder / "config.json", "w", encoding="utf-8") as f:
                json.dump({**config, "selfspec": {**config["selfspec"], "files": files}}, f, indent=2, sort_keys=True)
    except (OSError, SafetensorError) as err:
        raise OSError(f"could not write the export {out_dir}: {getattr(err, 'strerror', None) or err}; an earlier "
                      "export there is left as it was. Free some space if the disk is full, or choose another "
                      "folder") from err


def _check_kind(model, cls: type, fmt: str) -> None:
    """Refuse, naming the kind's own formats, a drafter of another kind than `fmt` writes."""
    if not isinstance(model, cls):
        kind = getattr(model, "kind", None)
        own = kind_formats(kind)
        hint = (f"its formats: {list(own)} (heads.export.export(drafter, out_dir, format=...))" if own
                else "it exports to no serving format")
        raise ValueError(f"{fmt} writes {cls.__name__} drafters; this is a {type(model).__name__} (drafter kind "
                         f"{kind!r}): {hint}")


def _load_strict(model, state: dict[str, torch.Tensor], what: str):
    from .formats.common import load_strict  # in the function: heads.formats imports this module

    return load_strict(model, state, what)


# ---- speculators EAGLE-3 -----------------------------------------------------------------------------------


def export_speculators(model: Eagle3Model, out_dir) -> str:
    """Write `model` as a speculators EAGLE-3 checkpoint (config.json + model.safetensors) vLLM can serve.

    Only the paper layout exports (`input_mode="widen"`, a Llama-layout layer without extra parameters such
    as Qwen3's q/k norms): every `layer_style="llama"` drafter, whatever the target. The embedding is not
    written: vLLM and speculators then use the verifier's. vLLM captures each target layer once, in ascending
    order, and its fc reads three: the feature layers are written ascending with fc's column blocks (and
    `norm_before_fc`'s norm) permuted to match, and another count or a repeated layer is refused.
    """
    _check_kind(model, Eagle3Model, "export_speculators (speculators EAGLE-3)")
    c = model.config
    _check_llama_layers(model, "speculators EAGLE-3")
    if c.fc_bias:
        raise ValueError("speculators EAGLE-3 has no fc bias; this drafter was built with fc_bias=True")
    order = _served_order(c.feature_layers, "vLLM's EAGLE-3 (speculators format)")
    layer_sd = model.layers[0].state_dict()
    biases = [k for k in ATTENTION_BIASES if k in layer_sd]
    tensors = {}
    for i, layer in enumerate(model.layers):  # layers after the first are plain Llama layers in vLLM too
        tensors.update({f"layers.{i}.{k}": v for k, v in layer.state_dict().items()})
        if biases:  # Llama's attention_bias covers q, k, v and o alike: write an exact zero bias where absent
            for k in ATTENTION_BIASES:
                if f"layers.{i}.{k}" not in tensors:
                    out_features = tensors[f"layers.{i}.{k.replace('.bias', '.weight')}"].shape[0]
                    tensors[f"layers.{i}.{k}"] = torch.zeros(out_features, dtype=layer_sd[biases[0]].dtype)
    d = c.target_hidden_size
    tensors.update({
        "layers.0.hidden_norm.weight": model.hidden_norm.weight, "fc.weight": _blocks(model.fc.weight, order, d),
        "norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight, "d2t": model.d2t, "t2d": model.t2d,
    })
    if c.norm_before_fc:
        tensors["input_norm.weight"] = _blocks(model.input_norm.weight, order, d)
    _write_folder(out_dir, _speculators_config(model, attention_bias=bool(biases)), tensors)
    return os.fspath(out_dir)


def _served_order(layers, server: str) -> list[int]:
    """The order that puts `layers` ascending, as vLLM and SGLang capture and concatenate them; refused where their
    EAGLE-3 cannot serve them: not three layers (their fc reads 3 x hidden), or a layer twice (each captured once)."""
    layers = list(layers)
    if len(layers) != 3:
        raise ValueError(f"{server}'s fc reads exactly 3 target layers (3 x target_hidden_size inputs); this drafter "
                         f"reads {len(layers)}: {layers}; train with three feature_layers to serve it there")
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature layers {layers} cannot be served by {server}: it captures each target layer once "
                         "(repeated layers); train with three distinct feature_layers")
    return sorted(range(len(layers)), key=lambda j: layers[j])


def _blocks(weight: torch.Tensor, order: list[int], d: int) -> torch.Tensor:
    """`weight`'s D-wide blocks along its last dimension (fc's columns, a norm over the concatenated features) in
    `order`."""
    return torch.cat([weight[..., j * d:(j + 1) * d] for j in order], dim=-1)


def _check_llama_layers(model: Eagle3Model, fmt: str) -> None:
    """Refuse, naming the fix, a drafter whose layers are not Llama layers in the paper's widened layout."""
    c = model.config
    if c.input_mode != "widen":
        raise ValueError(f"{fmt} has no '{c.input_mode}' input mode (used for {c.target_model_type} layers with "
                         "layer_style='target'): only input_mode='widen' drafters export; train with "
                         "layer_style='llama' (a Llama layer for any target), or keep this drafter in the selfspec "
                         "format")
    layer_sd = model.layers[0].state_dict()
    expected = set(LLAMA_LAYER_WEIGHTS) | {k for k in ATTENTION_BIASES if k in layer_sd}
    extra = sorted(set(layer_sd) - expected)
    if extra:
        raise ValueError(f"the {c.layer_config.get('model_type')} decoder layer has parameters a Llama layer lacks: "
                         f"{extra}; this drafter cannot be exported to {fmt}: train with layer_style='llama'")


def _llama_layer_config(model: Eagle3Model, attention_bias: bool) -> dict:
    """The Llama config dict of the drafter's layers, as speculators and SpecForge write it."""
    c = model.config
    layer = model.layers[0]
    lc = c.layer_config
    rope = dict(layer.self_attn.config.rope_parameters or {})
    out = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": c.num_layers,
           "vocab_size": c.target_vocab_size, "tie_word_embeddings": False, "attention_bias": attention_bias,
           "rope_theta": rope.get("rope_theta", 10000.0)}
    out.update({k: lc[k] for k in LLAMA_LAYER_FIELDS if lc.get(k) is not None})
    out.setdefault("head_dim", layer.self_attn.head_dim)
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def _speculators_config(model: Eagle3Model, attention_bias: bool) -> dict:
    c = model.config
    layer_config = _llama_layer_config(model, attention_bias)
    if c.layer_windows:  # speculators' and vLLM's reading of a layer's sliding window
        layer_config.update(layer_types=["full_attention" if w is None else "sliding_attention" for w in c.layer_windows],
                            sliding_window=next(w for w in c.layer_windows if w is not None), use_sliding_window=True)
    depth = c.tree["depth"] if c.tree["mode"] == "dynamic" else max(len(p) for p in c.tree["paths"])
    verifier_arch = arch_classes(c.target_model_type).causal_lm.__name__ if c.target_model_type else None
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,  # always explicit: vLLM's default when absent is True
        "norm_before_fc": c.norm_before_fc, "fc_norm": False, "norm_output": c.norm_output,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": sorted(c.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": c.base_model_name_or_path,
                         "architectures": [verifier_arch] if verifier_arch else []},
        },
        "selfspec": _selfspec_block(c, attn_implementation=c.attn_implementation),
    }


def _selfspec_block(c, **extra) -> dict:
    keys = ("base_model_name_or_path", "target_model_type", "target_hidden_size", "target_vocab_size",
            "target_num_layers", "tokenizer_fingerprint", "tree", "training", "metrics", "calibration", "lookup_first")
    return {**{k: getattr(c, k) for k in keys}, **extra}


# config.json's keys the importer reads and what each must be ("?": may be absent or null), and its
# transformer_layer_config's
SPECULATORS_CONFIG = {"transformer_layer_config": "table", "draft_vocab_size": "size", "target_hidden_size": "size?",
                      "eagle_aux_hidden_state_layer_ids": "ids?", "norm_before_residual": "flag?",
                      "norm_before_fc": "flag?", "fc_norm": "flag?", "norm_output": "flag?",
                      "speculators_config": "table?"}
SPECULATORS_LAYER_CONFIG = {"hidden_size": "size", "vocab_size": "size", "intermediate_size": "size",
                            "num_attention_heads": "size", "num_key_value_heads": "size?", "head_dim": "size?",
                            "num_hidden_layers": "size?", "rms_norm_eps": "number?", "rope_theta": "number?",
                            "max_position_embeddings": "size?", "hidden_act": "name?", "model_type": "name?",
                            "sliding_window": "size?"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_speculators(what: str, config: dict, path_or_id, **hub_kwargs) -> None:
    """Refuse, naming the key and the fix, a speculators config missing what the importer reads or holding it as
    another kind; and an export of ours whose files are not all the ones it was written with."""
    from .formats.common import check_config, check_export_files  # here: heads.formats imports this module

    check_config(what, config, SPECULATORS_CONFIG)
    check_config(what, config["transformer_layer_config"], SPECULATORS_LAYER_CONFIG,
                 section="config.json's transformer_layer_config")
    check_export_files(what, path_or_id, config, (WEIGHTS,), **hub_kwargs)


def import_speculators(path_or_id, target=None, **hub_kwargs) -> Eagle3Model:
    """Load a speculators EAGLE-3 checkpoint as an `Eagle3Model` (its decoder layer is a Llama layer).

    What the format does not record (the target's model type and layer count) comes from the `selfspec`
    block written by `export_speculators`, or from `target` (a model or config) when given; a target that
    contradicts what the checkpoint records is refused.
    """
    what = f"speculators checkpoint {path_or_id}"
    config = _read_config(path_or_id, **hub_kwargs)
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{path_or_id} is not a speculators EAGLE-3 checkpoint (speculators_model_type="
                         f"{config.get('speculators_model_type')!r})")
    check_speculators(what, config, path_or_id, **hub_kwargs)
    return speculators_drafter(what, path_or_id, config, target, **hub_kwargs)


def speculators_drafter(what: str, path_or_id, config: dict, target=None, **hub_kwargs) -> Eagle3Model:
    """`import_speculators` once the checkpoint is checked (`check_speculators`). Its feature layers are read
    ascending with fc as it is: vLLM captures and concatenates them in that order, whatever order the config
    lists."""
    from .formats.common import fields_for_target, named, selfspec_fields

    if config.get("fc_norm"):
        raise ValueError(f"{what} sets fc_norm: true (an RMSNorm per feature layer before fc), which selfspec's "
                         "EAGLE-3 drafter does not compute (norm_before_fc, one norm over all of them, it does)")
    layer_config, num_layers, windows = _speculators_layers(what, config)
    recorded = {"target_hidden_size": config.get("target_hidden_size") or layer_config["hidden_size"],
                "target_vocab_size": layer_config["vocab_size"],
                "base_model_name_or_path": (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")}
    recorded.update({k: v for k, v in selfspec_fields(what, config).items() if v is not None})
    attn = recorded.pop("attn_implementation", None) or "sdpa"
    fields = fields_for_target(what, recorded, target)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids and fields.get("target_num_layers") is None:
        raise ValueError(f"{path_or_id} records no eagle_aux_hidden_state_layer_ids; pass target= so the "
                         "default feature layers can be derived from its layer count")
    if ids and len(set(ids)) != len(ids):
        raise ValueError(f"{what}: eagle_aux_hidden_state_layer_ids {ids} repeats a layer, which vLLM captures once "
                         "and speculators refuses: the config was edited or damaged")
    fields.pop("layer_style", None)  # a speculators layer is a Llama layer, whatever the target
    with named(what):
        model = Eagle3Model(Eagle3Config(
            layer_config=layer_config, layer_style="llama", attn_implementation=attn, input_mode="widen",
            feature_layers=sorted(ids) if ids else None, draft_vocab_size=config["draft_vocab_size"],
            norm_before_residual=config.get("norm_before_residual", True), fc_bias=False, num_layers=num_layers,
            norm_before_fc=bool(config.get("norm_before_fc")), norm_output=bool(config.get("norm_output")),
            layer_windows=windows, **fields))
    tensors = _read_weights(path_or_id, **hub_kwargs)
    renamed = {("hidden_norm.weight" if k == "layers.0.hidden_norm.weight" else k): v for k, v in tensors.items()}
    renamed.pop("embed_tokens.weight", None)  # we use the target's own embedding
    vocab, draft_vocab = layer_config["vocab_size"], config["draft_vocab_size"]
    if "d2t" not in renamed and "t2d" not in renamed and draft_vocab == vocab:
        # speculators writes no map for the whole vocabulary, and vLLM then drafts target ids as they are
        renamed.update(d2t=torch.zeros(vocab, dtype=torch.long), t2d=torch.ones(vocab, dtype=torch.bool))
    elif "d2t" not in renamed:
        raise ValueError(f"{what}: a draft vocabulary of {draft_vocab} < {vocab} needs its d2t map, which "
                         "model.safetensors lacks: the file is incomplete; re-download the checkpoint")
    return _load_strict(model, renamed, what)


def _speculators_layers(what: str, config: dict) -> tuple[dict, int, list | None]:
    """A speculators config's `transformer_layer_config` as ours (one Llama layer's config), the drafter's layer
    count, and each layer's sliding window (None: every layer attends to the whole context)."""
    layer_config = dict(config["transformer_layer_config"])
    layer_config.pop("architectures", None)
    num_layers = layer_config.get("num_hidden_layers") or 1
    layer_config["num_hidden_layers"] = 1  # ours describes one layer; the drafter's count is num_layers
    if layer_config.get("model_type", "llama") != "llama":
        raise ValueError(f"{what}: only Llama-style transformer_layer_config imports, got "
                         f"{layer_config['model_type']!r}")
    if "rope_scaling" in layer_config and layer_config["rope_scaling"]:
        layer_config["rope_parameters"] = {**layer_config.pop("rope_scaling"),
                                           "rope_theta": layer_config.pop("rope_theta", 10000.0)}
    types = layer_config.pop("layer_types", None)
    window = layer_config.pop("sliding_window", None)
    layer_config.pop("use_sliding_window", None)  # speculators and vLLM read layer_types, not this
    if types is None:
        return layer_config, num_layers, None
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{what}: transformer_layer_config's layer_types must list one of {list(LAYER_TYPES)} for "
                         f"each of its {num_layers} layers, got {types!r:.80}: the config was edited or damaged")
    # speculators masks a sliding layer only when it has a window
    windows = [window if t == "sliding_attention" else None for t in types]
    return layer_config, num_layers, windows if any(windows) else None


# ---- vLLM Medusa --------------------------------------------------------------------------------------------


def export_medusa_vllm(model: MedusaModel, out_dir) -> str:
    """Write `model` in vLLM's Medusa format: `blocks.{i}.layers.{j}.{weight,bias}`, `lm_heads.{i}.weight`.

    With `share_lm_head` the config says `original_lm_head: true` and `lm_heads.0.weight` holds the target's
    lm_head, so the model must be attached to its target.
    """
    _check_kind(model, MedusaModel, "export_medusa_vllm (vLLM Medusa)")
    c = model.config
    if c.projection_bias:
        raise ValueError("vLLM's Medusa lm_heads have no bias; this drafter was built with projection_bias=True")
    tensors = {}
    for i, head in enumerate(model.heads):
        for j, block in enumerate(head.blocks):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.weight
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.bias
        if head.lm_head is not None:
            tensors[f"lm_heads.{i}.weight"] = head.lm_head.weight
    if c.share_lm_head:
        tensors["lm_heads.0.weight"] = model._require_target("exporting a shared lm_head")["lm_head"].weight
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "hidden_size": c.target_hidden_size, "vocab_size": c.target_vocab_size,
        "truncated_vocab_size": c.target_vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True, "original_lm_head": c.share_lm_head,
        "selfspec": _selfspec_block(c),
    }
    _write_folder(out_dir, config, tensors)
    return os.fspath(out_dir)


def import_medusa_vllm(path_or_id, target=None, **hub_kwargs) -> MedusaModel:
    """Load a vLLM-format Medusa checkpoint (also with Medusa's own `medusa_num_heads`/`medusa_num_layers`
    config keys) as a `MedusaModel`. Blocks saved without bias (`medusa_fc_bias: false`) get zero biases."""
    from .formats.common import check_config, check_export_files, fields_for_target, named, selfspec_fields

    what = f"vLLM Medusa checkpoint {path_or_id}"
    config = _read_config(path_or_id, **hub_kwargs)
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path_or_id} is not a vLLM Medusa checkpoint (model_type={config.get('model_type')!r})")
    heads_key = "num_heads" if "num_heads" in config or "medusa_num_heads" not in config else "medusa_num_heads"
    layers_key = "num_hidden_layers" if "num_hidden_layers" in config else "medusa_num_layers"
    check_config(what, config, {"hidden_size": "size", "vocab_size": "size", heads_key: "size", layers_key: "size?",
                                "truncated_vocab_size": "size?", "medusa_fc_bias": "flag?", "original_lm_head": "flag?"})
    check_export_files(what, path_or_id, config, (WEIGHTS,), **hub_kwargs)
    num_heads, num_layers = config[heads_key], config.get(layers_key) or 1
    if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"]:
        raise ValueError("Medusa checkpoints with a truncated vocabulary (token_map) are not supported")
    recorded = {"target_hidden_size": config["hidden_size"], "target_vocab_size": config["vocab_size"]}
    recorded.update({k: v for k, v in selfspec_fields(what, config).items() if v is not None})
    fields = fields_for_target(what, recorded, target)
    share = bool(config.get("original_lm_head", False))
    with named(what):
        model = MedusaModel(MedusaConfig(num_heads=num_heads, num_layers=num_layers, share_lm_head=share, **fields))
    tensors = _read_weights(path_or_id, **hub_kwargs)
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            w = tensors.pop(f"blocks.{i}.layers.{j}.weight", None)
            b = tensors.pop(f"blocks.{i}.layers.{j}.bias", None)
            if w is not None and b is None and not config.get("medusa_fc_bias", False):
                b = torch.zeros(w.shape[0], dtype=w.dtype)
            state.update({f"heads.{i}.blocks.{j}.weight": w, f"heads.{i}.blocks.{j}.bias": b})
        if not share:
            state[f"heads.{i}.lm_head.weight"] = tensors.pop(f"lm_heads.{i}.weight", None)
    if share:
        tensors.pop("lm_heads.0.weight", None)  # the target's own lm_head: bound by attach(), not loaded
    state = {k: v for k, v in state.items() if v is not None}
    return _load_strict(model, {**state, **tensors}, what)  # what is left in `tensors` is unexpected


# ---- DFlash (z-lab's layout, vLLM's DFlashDraftModel) -----------------------------------------------------



def export_dflash(model: DFlashModel, out_dir, mask_token_id: int | None = None) -> str:
    """Write `model` as a DFlash checkpoint vLLM serves (`method="dflash"`, `DFlashQwen3ForCausalLM`):
    config.json (`architectures: ["DFlashDraftModel"]`, the Qwen3 layers' fields, `dflash_config`),
    model.safetensors (`fc`, `hidden_norm`, `norm`, `layers.N.*`; the target's embedding and lm_head are
    shared, not written) and `mask_embedding.pt`, our one mask vector.

    vLLM feeds mask slots as `mask_token_id` and swaps that id's embedding for the mask vector, so a bonus
    token equal to it would be drafted from as a mask. The default is the target's end-of-sequence token,
    after which nothing is drafted; pass another id that the target never continues from if its
    generations ignore eos. Serve with `num_speculative_tokens` = block_size - 1: a shorter block changes
    what the non-causal mask slots see.
    """
    _check_kind(model, DFlashModel, "export_dflash (vLLM DFlashDraftModel)")
    c = model.config
    n = c.target_num_layers
    if c.fc_bias:
        raise ValueError("vLLM's DFlash fc has no bias; this drafter was built with fc_bias=True")
    outside = [i for i in c.feature_layers if n is not None and not 1 <= i <= n - 1]
    if outside:
        raise ValueError(f"feature layers {outside} cannot be served: vLLM captures the hidden states entering "
                         f"target layers 1..{n - 1} (hidden_states indices), not the embeddings or the final norm")
    if mask_token_id is None:
        mask_token_id = c.mask_token_id
    if mask_token_id is None or not 0 <= int(mask_token_id) < c.target_vocab_size:
        raise ValueError(f"mask_token_id must be a token id of the target's vocabulary (0..{c.target_vocab_size - 1}),"
                         f" got {mask_token_id!r} (the drafter records none: its target config had no eos); pass "
                         "export_dflash(..., mask_token_id=<an id the target never continues from>)")
    # vLLM concatenates the captured layers in ascending order: fc's column blocks follow that order.
    order = sorted(range(len(c.feature_layers)), key=lambda j: c.feature_layers[j])
    d = c.target_hidden_size
    fc = torch.cat([model.fc.weight[:, j * d:(j + 1) * d] for j in order], dim=1)
    layers = sorted(c.feature_layers)
    tensors = {"fc.weight": fc, "hidden_norm.weight": model.hidden_norm.weight, "norm.weight": model.norm.weight,
               **{f"layers.{k}": v for k, v in model.layers.state_dict().items()}}
    lc = {k: v for k, v in c.layer_config.items() if k != "model_type"}
    config = {
        **lc, "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": c.num_layers,
        "rope_theta": lc["rope_parameters"]["rope_theta"], "tie_word_embeddings": False,
        "target_hidden_size": d, "block_size": c.block_size, "num_target_layers": n,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [i - 1 for i in layers]},
        "eagle_aux_hidden_state_layer_ids": layers,
        "selfspec": _selfspec_block(c, feature_layers=list(c.feature_layers), anchors_per_sample=c.anchors_per_sample,
                                    loss_decay=c.loss_decay),
    }
    mask = {"mask_token_id": int(mask_token_id), "embedding": model.mask_embed.weight[0].detach().cpu().clone()}
    _write_folder(out_dir, config, tensors, pickled={MASK_EMBEDDING_FILE: mask})
    return os.fspath(out_dir)


def import_dflash(path_or_id, target=None, **hub_kwargs) -> DFlashModel:
    """Load a DFlash checkpoint in vLLM's layout (ours from `export_dflash`, or z-lab's) as a `DFlashModel`, with
    heads.formats' z-lab reader.

    The mask vector comes from `mask_embedding.pt`; a checkpoint without one (z-lab's) has its mask slots
    embedded as `mask_token_id`, so `target` (a model) is needed to read that row of its embedding. What
    the format does not record comes from the `selfspec` block or from `target`.
    """
    from .formats import dflash_zlab  # in the function: heads.formats imports this module

    config = _read_config(path_or_id, **hub_kwargs)
    if "DFlashDraftModel" not in (config.get("architectures") or []) or config.get("model_type") != "qwen3":
        raise ValueError(f"{path_or_id} is not a DFlash checkpoint (architectures={config.get('architectures')}, "
                         f"model_type={config.get('model_type')!r}; expected DFlashDraftModel and qwen3)")
    return dflash_zlab.load(path_or_id, config, target=target, **hub_kwargs)


# ---- SGLang EAGLE-3 (SpecForge's output, SGLang's LlamaForCausalLMEagle3) -----------------------------------

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"


def export_sglang(model: Eagle3Model, out_dir) -> str:
    """Write `model` as SGLang loads an EAGLE-3 draft (`--speculative-algorithm EAGLE3`, the layout SpecForge
    saves): config.json, a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`,
    `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; model.safetensors with `fc`,
    `midlayer.*`, `norm`, `lm_head`, `d2t` and `t2d`. The embedding is not written: SGLang shares the target's.

    What SGLang computes is the paper layout with one layer: the drafter must be `input_mode="widen"` with a
    plain Llama layer (`layer_style="llama"` for any target), no attention biases (SGLang's widened q/k/v have
    none), `norm_before_residual=False` (SGLang adds the un-normed hidden state) and `num_layers=1` (SGLang's
    further layers normalise their input with `hidden_norm` and start a new residual, which is not our layer).
    SGLang captures each target layer once, in ascending order, and its fc reads three: feature layers must be three
    distinct target layers 1..L-1 (hidden_states indices), and `fc`'s column blocks are written in ascending order.
    """
    _check_kind(model, Eagle3Model, "export_sglang (SGLang EAGLE-3)")
    c = model.config
    fmt = "SGLang EAGLE-3"
    _check_llama_layers(model, fmt)
    biases = sorted(k for k in model.layers[0].state_dict() if k.endswith(".bias"))
    if biases:
        raise ValueError(f"{fmt}'s widened q/k/v have no bias; this drafter's layer has {biases}: train with "
                         "layer_style='llama'")
    if c.num_layers != 1:
        raise ValueError(f"{fmt} computes layers after the first differently from ours (each normalises its input "
                         f"with hidden_norm and starts a new residual); this drafter has num_layers={c.num_layers}: "
                         "export to speculators (vLLM) or train with num_layers=1")
    if c.norm_before_residual:
        raise ValueError(f"{fmt} adds the un-normed hidden state to the attention output; this drafter was built with "
                         "norm_before_residual=True")
    _check_sglang_options(c, fmt)
    n, layers = c.target_num_layers, list(c.feature_layers)
    if len(layers) != 3:
        raise ValueError(f"{fmt}'s fc reads exactly 3 target layers (3 x target_hidden_size inputs); this drafter "
                         f"reads {len(layers)}: {layers}")
    outside = [i for i in layers if n is None or not 1 <= i <= n - 1]
    if outside or len(set(layers)) != len(layers):
        raise ValueError(f"feature layers {layers} cannot be served by SGLang: it captures each of target layers "
                         f"1..{'L-1' if n is None else n - 1} (hidden_states indices: the input of that layer) once; "
                         f"{'outside that range: ' + str(outside) if outside else 'repeated layers'}")
    order = sorted(range(len(layers)), key=lambda j: layers[j])
    d = c.target_hidden_size
    tensors = {f"midlayer.{k}": v for k, v in model.layers[0].state_dict().items()}
    tensors.update({
        "midlayer.hidden_norm.weight": model.hidden_norm.weight,
        "fc.weight": torch.cat([model.fc.weight[:, j * d:(j + 1) * d] for j in order], dim=1),
        "norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight, "d2t": model.d2t, "t2d": model.t2d,
    })
    config = _llama_layer_config(model, attention_bias=False)
    config.update({
        "architectures": [SGLANG_ARCHITECTURE], "num_hidden_layers": 1, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": d, "target_model_type": c.target_model_type,
        "bias": False,  # SGLang's fc and its attention's o_proj both read it (_check_sglang_options)
        # SGLang's ids are one less than the layer it captures the input of: our hidden_states index - 1
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in sorted(layers)],
                         "use_aux_hidden_state": True},
        "selfspec": _selfspec_block(c, attn_implementation=c.attn_implementation, feature_layers=layers),
    })
    _write_folder(out_dir, config, tensors)
    return os.fspath(out_dir)


def _check_sglang_options(c: Eagle3Config, fmt: str) -> None:
    """Refuse, saying why, what SGLang's LlamaForCausalLMEagle3 does not compute: an fc bias (its fc reads the
    config's `bias`, which its Llama attention also reads as `attention_bias`, so o_proj would get a bias the export
    has no weights for; SpecForge's fc has none), and speculators' options (SGLang has no input_norm, feeds the
    un-normed state back and attends to the whole context)."""
    if c.fc_bias:
        raise ValueError(f"{fmt} reads an fc bias from config.json's `bias`, which its Llama attention also reads as "
                         "attention_bias (o_proj would get a bias no checkpoint holds), and SpecForge's fc has none; "
                         "this drafter was built with fc_bias=True: export to speculators (vLLM) or train with "
                         "fc_bias=False")
    options = [name for name, on in (("norm_before_fc=True", c.norm_before_fc), ("norm_output=True", c.norm_output),
                                     (f"layer_windows={c.layer_windows}", c.layer_windows)) if on]
    if options:
        raise ValueError(f"{fmt} computes none of speculators' options this drafter has ({', '.join(options)}: SGLang "
                         "has no input norm before fc, feeds the un-normed hidden state back and attends to the whole "
                         "context); export it to speculators (vLLM)")


# ---- the formats, registered with their kinds in heads/__init__.py ------------------------------------------

SPECULATORS = ExportFormat("speculators", "speculators", export_speculators, import_speculators,
                           recognizes=lambda config: "speculators_model_type" in config, vllm_method="eagle3")
VLLM_MEDUSA = ExportFormat("vllm", "vLLM Medusa", export_medusa_vllm, import_medusa_vllm,
                           recognizes=lambda config: config.get("model_type") == "medusa", vllm_method="medusa",
                           needs_target=lambda model: model.config.share_lm_head)
DFLASH = ExportFormat("dflash", "DFlash (vLLM DFlashDraftModel)", export_dflash, import_dflash,
                      recognizes=lambda config: "DFlashDraftModel" in (config.get("architectures") or []),
                      vllm_method="dflash")


def import_sglang(path_or_id, target=None, **hub_kwargs) -> Eagle3Model:
    """Read an SGLang EAGLE-3 checkpoint (SpecForge's layout; `export_sglang`'s included) with heads.formats'
    SpecForge reader. Its feature layers come back in ascending order, as SGLang concatenates them."""
    from .formats import specforge

    return specforge.load(path_or_id, _read_config(path_or_id, **hub_kwargs), target=target, **hub_kwargs)


SGLANG = ExportFormat("sglang", "SGLang EAGLE-3 (SpecForge)", export_sglang, import_sglang,
                      recognizes=lambda config: SGLANG_ARCHITECTURE in (config.get("architectures") or []))
def export_formats() -> dict[str, ExportFormat]:
    """Format name -> format, over every registered kind's `exports` (heads.kinds: the one registry of what a kind
    exports to and imports from), for `export(model, out_dir, format=...)` and scripts/export.py."""
    return {fmt.name: fmt for kind in REGISTRY.values() for fmt in kind.exports}


def kind_formats(kind: str | None) -> tuple[str, ...]:
    """The formats a kind exports to, first the one vLLM serves (none for an unknown kind)."""
    return tuple(fmt.name for fmt in REGISTRY[kind].exports) if kind in REGISTRY else ()


def export(model, out_dir, format: str | None = None) -> str:
    """Write `model` in `format` (a name in export_formats(); None = the first its kind exports to, the one vLLM
    serves)."""
    kind = getattr(model, "kind", None)
    allowed = kind_formats(kind)
    formats = export_formats()
    if format is None and not allowed:
        why = " (EAGLE-1/2 has no exact vLLM or SGLang layout)" if kind == "eagle" else ""
        raise ValueError(f"drafter kind {kind or type(model).__name__!r} exports to no serving format{why}; serve it "
                         "with selfspec's own engine (infer.SelfSpecModel)")
    format = format or allowed[0]
    if format not in formats:
        raise ValueError(f"unknown export format {format!r}; known: {sorted(formats)}")
    if format not in allowed:
        raise ValueError(f"drafter kind {kind or type(model).__name__!r} does not export to {format!r}; its formats: "
                         f"{list(allowed) or 'none (EAGLE-1/2 has no exact vLLM or SGLang layout)'}")
    return formats[format].export(model, out_dir)
