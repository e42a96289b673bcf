"""EAGLE-1/2 (Li et al., 2024, arXiv:2401.15077 and arXiv:2406.16858): one decoder layer (Llama's at the
target's sizes, or the target's own; `layer_style`) over [embedding of token t+1, target feature at t]. EAGLE-1 and EAGLE-2 share the module;
only the tree differs (static paths vs. the dynamic, confidence-ranked tree)."""

from __future__ import annotations

from infer.tuning.candidates import prior_paths

from ..base import DrafterConfig
from ..layers import LAYER_STYLES, default_attn_implementation, layer_config_dict, llama_layer_config_dict

# New drafters' layer style: "llama" measured no worse than the target's own layer at equal budget (docs/export.md,
# "Layer style") and exports to vLLM and SGLang for every target.
DEFAULT_LAYER_STYLE = "llama"

# Tree settings shared by EAGLE and EAGLE-3. The EAGLE-2 reference setup drafts on the order of 60 tokens
# with depth 5-6 and top-10 expansion for 7B-13B targets; we default a little smaller (cheaper to verify
# on modest hardware): expand the 8 best nodes per depth, 6 deep, keep the 48 best drafted nodes.
EAGLE_TREE_DEFAULTS = {
    "mode": "dynamic",  # "dynamic" (EAGLE-2) or "static" (EAGLE-1: fixed `paths` of sibling ranks)
    "depth": 6,  # dynamic: drafting steps (tree depth below the root)
    "top_k": 8,  # dynamic: children per expanded node, and nodes expanded per depth
    "total_tokens": 48,  # dynamic: drafted nodes kept after reranking (the root not counted)
    "paths": None,  # static: paths of ranks; None = `eagle_static_default_paths()`
    # dynamic: a row stops drafting deeper once the best node of its last drafted depth has a cumulative draft
    # probability below this (easy rows go deep, hard rows stop early); 0 = never stop early
    "min_confidence": 0.0,
}


def eagle_static_default_paths(depth: int = 6) -> list[tuple[int, ...]]:
    """30 nodes, 6 deep. One autoregressive drafter is more reliable per step than independent Medusa
    heads, so the prior decays slower and the tree is deeper and narrower."""
    return prior_paths(depth, 30, top1=0.8, decay=0.9, spread=0.3)


def resolve_eagle_tree(tree: dict) -> dict:
    if tree["mode"] not in ("dynamic", "static"):
        raise ValueError(f"EAGLE tree mode must be 'dynamic' or 'static', got {tree['mode']!r}")
    for name in ("depth", "top_k", "total_tokens"):
        if not isinstance(tree[name], int) or tree[name] < 1:
            raise ValueError(f"EAGLE tree {name} must be an int >= 1, got {tree[name]!r}")
    confidence = tree["min_confidence"]
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < 1:
        raise ValueError(f"EAGLE tree min_confidence must be a number in [0, 1) (0 = never stop early), got "
                         f"{confidence!r}")
    if tree["mode"] == "static" and confidence > 0:
        raise ValueError(f"EAGLE tree min_confidence={confidence} stops the dynamic tree early; a static tree "
                         "drafts its fixed paths: set mode='dynamic' or min_confidence=0")
    tree["min_confidence"] = float(confidence)
    if tree["mode"] == "static" and tree["paths"] is None:
        tree["paths"] = eagle_static_default_paths()
    if tree["paths"] is not None:
        tree["paths"] = [list(p) for p in tree["paths"]]
    return tree


class EagleConfig(DrafterConfig):
    model_type = "selfspec_eagle"

    # The decoder layer: "llama", transformers' Llama layer at the target's sizes (exports to vLLM and SGLang
    # whatever the target); "target", the target architecture's own layer. None = DEFAULT_LAYER_STYLE for a new
    # drafter; a saved one without the field is read from its layer_config.
    layer_style: str | None = None
    layer_config: dict | None = None  # one-layer, full-attention config of the drafter's layer (with model_type)
    attn_implementation: str | None = None  # of the drafter layer: "sdpa" or "eager" (None = per architecture)
    fc_bias: bool = True  # the fc over [embedding, feature]
    # The decoder layer's input norm. False: fc's output enters attention as it is, as in the EAGLE authors' EAGLE-1/2
    # drafters (their layer 0 has no input_layernorm: SafeAILab/EAGLE eagle/model/cnets1.py); Llama layers only.
    layer_input_norm: bool = True

    TREE_DEFAULTS = EAGLE_TREE_DEFAULTS

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.layer_style is not None and self.layer_style not in LAYER_STYLES:
            raise ValueError(f"{self.model_type} layer_style must be one of {LAYER_STYLES}, got {self.layer_style!r}")
        if self.layer_config is None:
            return
        built = self.layer_config.get("model_type")
        if self.layer_style is None:  # saved before the field existed: the layer config says which
            self.layer_style = "target" if built == self.target_model_type else "llama"
        expected = "llama" if self.layer_style == "llama" else self.target_model_type
        if expected is not None and built != expected:
            raise ValueError(f"{self.model_type} layer_style={self.layer_style!r} needs a layer_config of model_type "
                             f"{expected!r}, got {built!r}; rebuild the config with heads.build(kind, target, "
                             f"layer_style={self.layer_style!r})")

    def resolve_tree(self, tree: dict | None) -> dict:
        return resolve_eagle_tree(super().resolve_tree(tree))

    @classmethod
    def for_target(cls, target_config, **fields) -> EagleConfig:
        style = fields.get("layer_style") or DEFAULT_LAYER_STYLE
        if style not in LAYER_STYLES:
            raise ValueError(f"{cls.model_type} layer_style must be one of {LAYER_STYLES}, got {style!r}")
        fields["layer_style"] = style
        if style == "llama":
            fields.setdefault("layer_config", llama_layer_config_dict(target_config))
            fields.setdefault("attn_implementation", "sdpa")
        else:
            fields.setdefault("layer_config", layer_config_dict(target_config))
            fields.setdefault("attn_implementation", default_attn_implementation(target_config.model_type))
        return cls(**fields)
