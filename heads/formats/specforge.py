"""EAGLE-3 drafters as SpecForge writes them (sgl-project/SpecForge, `LlamaForCausalLMEagle3` saved with
`save_pretrained`, the layout SGLang serves).

The checkpoint is `config.json`, a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`,
`draft_vocab_size`, optionally `head_dim`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`,
`fc_norm` and `norm_output`, and `model.safetensors` with the same weights as EAGLE's authors' (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`; an `embed_tokens.weight` copy of the target's when exported with it). A
`pytorch_model.bin` beside a config with SpecForge's own keys (`eagle_config`, `fc_norm`, `norm_output`) is read too.

The math is the EAGLE authors' (see eagle_authors.py) with SpecForge's choices:
  - the captured layers are `eagle_aux_hidden_state_layer_ids`, default [1, L//2 - 1, L - 4], counted as SGLang
    counts them: id i is the output of layer i, the residual stream entering layer i + 1 (hidden_states index
    i + 1); SGLang captures each once and concatenates them in ascending layer order, whatever order the config
    lists (`set_eagle3_layers_to_capture` and the capture loop of its target models), and so does SpecForge's
    own capture through SGLang, so fc's column blocks follow the ascending order;
  - head_dim is the config's when it has one;
  - `fc_norm` (an RMSNorm per captured layer before fc) and `norm_output: false` (logits without the final norm)
    have no counterpart in our drafter and are refused.
"""

from __future__ import annotations

from ..base import text_config
from ..eagle3 import Eagle3Model
from .common import check_config, check_export_files, read_tensors, resolve_file, selfspec_fields
from .eagle_authors import SPECFORGE_KEYS, check_llama_eagle3_config, is_llama_eagle3, llama_eagle3

NAME = "specforge"
DESCRIPTION = "EAGLE-3, SpecForge's format (LlamaForCausalLMEagle3 config, model.safetensors; SGLang serves it)"


def detect(config: dict, files: frozenset[str]) -> bool:
    return is_llama_eagle3(config) and ("model.safetensors" in files or (
        "pytorch_model.bin" in files and any(k in config for k in SPECFORGE_KEYS)))


# What our SGLang export (heads.export.export_sglang) adds in its `selfspec` block and carries back here; the layout
# itself (feature layers, fc) is read from SpecForge's own keys.
SELFSPEC_FIELDS = ("base_model_name_or_path", "target_model_type", "target_num_layers", "tokenizer_fingerprint", "tree",
                   "training", "metrics", "calibration", "lookup_first")


def target_name(config: dict) -> str | None:
    return (config.get("selfspec") or {}).get("base_model_name_or_path")


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> Eagle3Model:
    what = f"EAGLE-3 checkpoint {path_or_id} (SpecForge's format)"
    check_llama_eagle3_config(what, config, head_dim=config.get("head_dim") is not None)
    check_config(what, config.get("eagle_config") or {}, {"eagle_aux_hidden_state_layer_ids": "ids?"},
                 section="config.json's eagle_config")
    check_export_files(what, path_or_id, config, ("model.safetensors",), **hub_kwargs)
    if config.get("fc_norm"):
        raise ValueError(f"{what} has fc_norm: true (an RMSNorm per captured layer before fc), which selfspec's "
                         "EAGLE-3 drafter does not have")
    if config.get("norm_output", True) is False:
        raise ValueError(f"{what} has norm_output: false (logits without the final norm), which selfspec's EAGLE-3 "
                         "drafter does not compute")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target is None:
            raise ValueError(f"{what} records no eagle_config.eagle_aux_hidden_state_layer_ids, so which target "
                             "layers it reads follows the target's layer count: pass target=<the model it was "
                             "trained for>")
        n = text_config(target).num_hidden_layers
        ids = [1, n // 2 - 1, n - 4]
    if len(ids) != 3 or any(not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != 3:
        raise ValueError(f"{what}: eagle_aux_hidden_state_layer_ids must be three distinct layer indices >= 0 (SGLang "
                         f"captures each once), got {ids}")
    name = "model.safetensors" if resolve_file(path_or_id, "model.safetensors", **hub_kwargs) else "pytorch_model.bin"
    tensors = read_tensors(path_or_id, name, **hub_kwargs)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    selfspec = selfspec_fields(what, config)
    return llama_eagle3(config, tensors, what=what, target=target, feature_layers=sorted(i + 1 for i in ids),
                        head_dim=head_dim, fields={k: selfspec[k] for k in SELFSPEC_FIELDS if k in selfspec})
