"""DFlash (Chen, Liang and Liu, 2026, arXiv:2602.06036): a block drafter. From the last accepted token and a
block of mask slots, one non-causal pass through a few Qwen3 decoder layers, which read chosen target
layers' hidden states as keys and values, proposes the next `block_size - 1` tokens at once; the target's
embedding and lm_head are shared. The layout is the reference one (z-lab's, served by vLLM and SGLang)."""

from __future__ import annotations

from transformers import Qwen3Config

from ..base import MAX_DRAFT_DEPTH, DrafterConfig, text_config

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


def qwen3_layer_config(target_config) -> dict:
    """The drafter layers' config: Qwen3 decoder layers at the target's width, heads and RoPE base, whatever
    the target's architecture (DFlash drafters are Qwen3 layers in the reference implementation and in
    vLLM, also for Llama targets). As a JSON-able dict with model_type."""
    c = text_config(target_config)
    heads = c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None)) or 10000.0
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate_size=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-6,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 32768,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        initializer_range=getattr(c, "initializer_range", 0.02), attention_bias=False, hidden_act="silu")
    d = config.to_diff_dict()
    for key in ("transformers_version", "use_cache", "layer_types", "max_window_layers", "num_hidden_layers",
                "pad_token_id", "bos_token_id", "eos_token_id"):
        d.pop(key, None)
    d["model_type"] = "qwen3"
    return d


class DFlashConfig(DrafterConfig):
    model_type = "selfspec_dflash"

    layer_config: dict | None = None  # the Qwen3 layers' config at the target's sizes (`qwen3_layer_config`)
    attn_implementation: str = "sdpa"  # of the drafter layers: "sdpa" or "eager"
    num_layers: int = 2  # Qwen3 decoder layers the block passes through
    feature_layers: list[int] | None = None  # hidden_states indices read as context; None = spread_layers(L)
    block_size: int = 16  # the anchor (last accepted token) + block_size - 1 mask slots, each drafting a token
    fc_bias: bool = False  # the fc over the concatenated target features
    # The token id vLLM feeds mask slots as (and swaps for our mask vector): exports only; None = the
    # target's eos, after which nothing is drafted.
    mask_token_id: int | None = None
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
        if self.block_size - 1 > MAX_DRAFT_DEPTH:
            raise ValueError(f"DFlash block_size must be <= {MAX_DRAFT_DEPTH + 1} (a root and at most "
                             f"heads.base.MAX_DRAFT_DEPTH drafted tokens), got {self.block_size}")
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
        fields.setdefault("layer_config", qwen3_layer_config(target_config))
        eos = getattr(text_config(target_config), "eos_token_id", None)
        fields.setdefault("mask_token_id", eos[0] if isinstance(eos, list) and eos else eos)
        return cls(**fields)
