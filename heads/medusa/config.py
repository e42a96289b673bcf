"""Medusa-1 heads: K residual-MLP heads on the target's last hidden state, head k predicting token t+k+2."""

from __future__ import annotations

from infer.tuning.candidates import prior_paths

from ..base import MAX_DRAFT_DEPTH, DrafterConfig


def medusa_default_paths(num_heads: int) -> list[tuple[int, ...]]:
    """40 nodes; with 4 heads: 6 candidates from the first head, 15 at depth 2, 14 at 3, 5 at 4."""
    return prior_paths(num_heads, 40)


class MedusaConfig(DrafterConfig):
    model_type = "selfspec_medusa"

    num_heads: int = 4  # K heads; head k predicts the token k+2 positions after the hidden state's
    num_layers: int = 1  # residual blocks x + SiLU(Linear(x)) per head
    share_lm_head: bool = False  # True: every head ends in the target's frozen lm_head (not saved)
    projection_bias: bool = False  # own projections only: whether they carry a bias (as the target's lm_head)

    # paths: the static tree as paths of sibling ranks (None = `medusa_default_paths(num_heads)`).
    TREE_DEFAULTS = {"paths": None}

    def __post_init__(self, **kwargs):
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Medusa {name} must be an int >= 1, got {value!r}")
        if self.num_heads > MAX_DRAFT_DEPTH:
            raise ValueError(f"Medusa num_heads must be <= {MAX_DRAFT_DEPTH} (heads.base.MAX_DRAFT_DEPTH), got "
                             f"{self.num_heads}")
        super().__post_init__(**kwargs)

    def resolve_tree(self, tree: dict | None) -> dict:
        tree = super().resolve_tree(tree)
        paths = tree["paths"] if tree["paths"] is not None else medusa_default_paths(self.num_heads)
        paths = [list(p) for p in paths]
        too_deep = [p for p in paths if len(p) > self.num_heads]
        if too_deep:
            raise ValueError(f"Medusa tree paths deeper than num_heads={self.num_heads}: {too_deep[:3]}; "
                             "a node at depth d needs head d-1")
        tree["paths"] = paths
        return tree
