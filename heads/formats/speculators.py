"""EAGLE-3 drafters in vLLM's speculators format (vllm-project/speculators, `Eagle3Speculator`), ours from
`heads.export.export_speculators` included.

`heads.export.import_speculators` maps the weights (`layers.0.*` with `layers.0.hidden_norm`, `fc`, `norm`,
`lm_head`, `d2t`, `t2d`, `input_norm` with `norm_before_fc`; `eagle_aux_hidden_state_layer_ids` are hidden_states
indices, the residual stream vLLM captures entering those layers, concatenated in ascending order); here the
checkpoint is first checked against the target. What speculators 0.9.0 trains by default is read as it computes it
(`speculators/models/eagle3/core.py`): `norm_before_fc` (one RMSNorm over the concatenated features before fc),
`norm_output` (the normed hidden state fed back to the next step), `norm_before_residual`, and sliding-window layers
(`transformer_layer_config.layer_types`, `sliding_window`); a checkpoint without `d2t`/`t2d` drafts over the whole
vocabulary. `fc_norm` (one norm per feature) is refused by name.
"""

from __future__ import annotations

from safetensors import safe_open

from ..eagle3 import Eagle3Model
from ..export import check_speculators, speculators_drafter
from ..weights import check_weights_file
from .common import check_embedding, check_fits, check_vocab_map, finish, resolve_file

NAME = "speculators"
DESCRIPTION = "EAGLE-3, speculators format (speculators_model_type: eagle3; vLLM serves it)"
ALGORITHMS = ("eagle3",)


def detect(config: dict, files: frozenset[str]) -> bool:
    return "speculators_model_type" in config


def target_name(config: dict) -> str | None:
    selfspec = config.get("selfspec") or {}
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return selfspec.get("base_model_name_or_path") or verifier.get("name_or_path")


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> Eagle3Model:
    what = f"speculators checkpoint {path_or_id}"
    algorithm = config.get("speculators_model_type")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{what} is a speculators {algorithm!r} drafter; selfspec imports {list(ALGORITHMS)}")
    check_speculators(what, config, path_or_id, **hub_kwargs)
    layer = config["transformer_layer_config"]
    vocab, draft_vocab = layer["vocab_size"], config["draft_vocab_size"]
    check_fits(what, target, hidden_size=config.get("target_hidden_size") or layer["hidden_size"], vocab_size=vocab)
    weights = resolve_file(path_or_id, "model.safetensors", **hub_kwargs)
    if weights is not None:  # the map and embedding are checked before the whole file is read
        check_weights_file(path_or_id, **hub_kwargs)  # a damaged file is named before it is opened
        with safe_open(weights, framework="pt") as f:
            small = {k: f.get_tensor(k) for k in ("d2t", "t2d", "embed_tokens.weight") if k in f.keys()}
        check_embedding(what, small, "embed_tokens.weight", target)
        if "d2t" in small:
            check_vocab_map(what, small["d2t"], small.get("t2d"), draft_vocab, vocab)
    return finish(speculators_drafter(what, path_or_id, config, target=target, **hub_kwargs), target)
