"""DFlash (Chen, Liang and Liu, 2026, arXiv:2602.06036): a block drafter. From the last accepted token and a
block of mask slots, one non-causal pass through a few decoder layers of the target's own class, reading
chosen target layers' hidden states as context, proposes the next `block_size - 1` tokens at once; the
target's embedding and lm_head are shared."""

from __future__ import annotations

from ..base import DrafterConfig
from ..layers import default_attn_implementation, layer_config_dict

# Drafting settings. One block pass gives a distribution per block position; `top_k` = 1 drafts the
# argmax (or, when sampling, a sample) of each position as a chain, as DFlash does. `top_k` > 1 grows a
# tree from the positions' top-k candidates (EAGLE-2's expansion, with the block's per-position
# log-probs in place of further drafter steps) and keeps the `total_tokens` nodes of highest joint draft
# log-probability.
DFLASH_TREE_DEFAULTS = {
    "top_k": 1,  # candidates per block position; 1 = a chain
    "depth": None,  # block positions drafted; None = block_size - 1 (the whole block)
    "total_tokens": 32,  # drafted nodes kept (the root not counted)
}


def spread_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` indices into the target's hidden_states tuple spread evenly from layer 1 to L - 1 (shallow
    to deep, the last layer's input included), fewer when the target has fewer layers."""
    if num_layers < 3:
        return list(range(1, num_layers + 1))
    step = (num_layers - 2) / max(count - 1, 1)
    return sorted({1 + round(k * step) for k in range(count)})


class DFlashConfig(DrafterConfig):
    model_type = "selfspec_dflash"

    layer_config: dict | None = None  # one-layer, full-attention copy of the target's config (with model_type)
    attn_implementation: str | None = None  # of the drafter layers: "sdpa" or "eager" (None = per architecture)
    num_layers: int = 2  # decoder layers of the target's class the block passes through
    feature_layers: list[int] | None = None  # hidden_states indices read as context; None = spread_layers(L)
    block_size: int = 16  # the anchor (last accepted token) + block_size - 1 mask slots, each drafting a token
    fc_bias: bool = False  # the fc over the concatenated target features
    # Training (recorded here because they define the trained drafter): blocks anchored per sequence, and
    # the weight of block position k = 1..block_size-1: exp(-(k - 1) / loss_decay).
    anchors_per_sample: int = 16
    loss_decay: float = 7.0

    TREE_DEFAULTS = DFLASH_TREE_DEFAULTS

    def __post_init__(self, **kwargs):
        for name, least in (("num_layers", 1), ("block_size", 2), ("anchors_per_sample", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"DFlash {name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.loss_decay, (int, float)) or not self.loss_decay > 0:
            raise ValueError(f"DFlash loss_decay must be a number > 0, got {self.loss_decay!r}")
        super().__post_init__(**kwargs)
        n_layers = self.target_num_layers
        if self.feature_layers is None and n_layers is not None:
            self.feature_layers = spread_layers(n_layers)
        if self.feature_layers is not None:
            self.feature_layers = [int(i) for i in self.feature_layers]
            bad = [i for i in self.feature_layers if n_layers is not None and not 0 <= i <= n_layers]
            if not self.feature_layers or bad:
                raise ValueError(f"DFlash feature_layers {self.feature_layers} must be non-empty indices into "
                                 f"the target's hidden_states tuple, 0..{n_layers}")

    def resolve_tree(self, tree: dict | None) -> dict:
        tree = super().resolve_tree(tree)
        most = self.block_size - 1
        if tree["depth"] is None:
            tree["depth"] = most
        for name in ("top_k", "depth", "total_tokens"):
            if not isinstance(tree[name], int) or isinstance(tree[name], bool) or tree[name] < 1:
                raise ValueError(f"DFlash tree {name} must be an int >= 1, got {tree[name]!r}")
        if tree["depth"] > most:
            raise ValueError(f"DFlash tree depth {tree['depth']} is deeper than the block: a block of "
                             f"block_size={self.block_size} drafts at most {most} tokens")
        return tree

    @classmethod
    def for_target(cls, target_config, **fields) -> DFlashConfig:
        fields.setdefault("layer_config", layer_config_dict(target_config))
        fields.setdefault("attn_implementation", default_attn_implementation(target_config.model_type))
        return cls(**fields)
