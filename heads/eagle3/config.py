"""EAGLE-3 (Li et al., 2025, arXiv:2503.01840): fuses low, middle and high target features, predicts tokens
directly over a reduced draft vocabulary, and is trained with training-time test (it feeds itself)."""

from __future__ import annotations

from ..eagle.config import EagleConfig
from ..layers import meta_layer, widen_problem

INPUT_MODES = ("widen", "project")


def default_feature_layers(num_layers: int) -> list[int]:
    """(2, L//2, L-3) as indices into HF's hidden_states tuple (0 = embeddings): the auxiliary layers vLLM
    captures for EAGLE-3 by default, which are the hidden states entering those layers. Clamped for tiny L."""
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


class Eagle3Config(EagleConfig):
    model_type = "selfspec_eagle3"

    feature_layers: list[int] | None = None  # None = default_feature_layers(target_num_layers)
    draft_vocab_size: int | None = None  # None = min(32000, target vocab size)
    # How [norm(embedding), norm(hidden)] (2D wide) enters the layer. "widen": the paper/speculators layout,
    # q/k/v take 2D inputs (Llama-layout layers only, so every layer_style="llama" drafter). "project": a Linear
    # 2D -> D, then the standard layer (any architecture; not exportable). "auto" = widen where possible.
    input_mode: str = "auto"
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) instead of hidden (speculators' flag)
    fc_bias: bool = False
    # speculators' EAGLE-3 options, on by default in its training since 0.9: one RMSNorm over the concatenated
    # target features before fc (its `input_norm`), and norm(h) fed back to the next draft step in place of h (the
    # logits are the same either way)
    norm_before_fc: bool = False
    norm_output: bool = False
    # Per decoder layer, its sliding attention window (a query sees the keys fewer than this many positions before
    # it) or None for full attention; None = every layer full. speculators trains with windows by default
    # (`transformer_layer_config.layer_types` and `sliding_window`).
    layer_windows: list[int | None] | None = None
    # Decoder layers. The first reads [embedding, feature] as above; the others are the same class as it is,
    # on the first one's output (the EAGLE-3 paper and speculators' checkpoints use one).
    num_layers: int = 1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        n_layers, vocab = self.target_num_layers, self.target_vocab_size
        if self.feature_layers is None and n_layers is not None:
            self.feature_layers = default_feature_layers(n_layers)
        if self.feature_layers is not None:
            self.feature_layers = [int(i) for i in self.feature_layers]
            bad = [i for i in self.feature_layers if n_layers is not None and not 0 <= i <= n_layers]
            if not self.feature_layers or bad:
                raise ValueError(f"EAGLE-3 feature_layers {self.feature_layers} must be non-empty indices into "
                                 f"the target's hidden_states tuple, 0..{n_layers}")
        if self.draft_vocab_size is None and vocab is not None:
            self.draft_vocab_size = min(32000, vocab)
        if self.draft_vocab_size is not None and vocab is not None and not 0 < self.draft_vocab_size <= vocab:
            raise ValueError(f"EAGLE-3 draft_vocab_size must be in 1..{vocab} (the target vocab), "
                             f"got {self.draft_vocab_size}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"EAGLE-3 num_layers must be an int >= 1, got {self.num_layers!r}")
        self._check_windows()
        if not self.layer_input_norm:  # EAGLE-3's input norm is over the embedding, which it always reads
            raise ValueError("EAGLE-3 has no layer_input_norm=False variant (that is EAGLE-1/2's, drafter kind 'eagle')")
        if self.input_mode not in (*INPUT_MODES, "auto"):
            raise ValueError(f"EAGLE-3 input_mode must be one of {INPUT_MODES} or 'auto', got {self.input_mode!r}")
        if self.layer_config is not None:
            self._resolve_input_mode()

    def _check_windows(self) -> None:
        windows = self.layer_windows
        if windows is None:
            return
        if len(windows) != self.num_layers or any(w is not None and (isinstance(w, bool) or w < 1) for w in windows):
            raise ValueError(f"EAGLE-3 layer_windows must give each of the {self.num_layers} layers a window >= 1 or "
                             f"None (full attention), got {windows}")
        if len({w for w in windows if w is not None}) > 1:  # the drafter's cache masks one window size
            raise ValueError(f"EAGLE-3 layer_windows must share one window size, got {windows}")
        if all(w is None for w in windows):
            self.layer_windows = None

    def _resolve_input_mode(self) -> None:
        problem = widen_problem(meta_layer(self.layer_config, self.attn_implementation or "eager"))
        if self.input_mode == "auto":
            self.input_mode = "project" if problem else "widen"
        elif self.input_mode == "widen" and problem:
            raise ValueError(f"EAGLE-3 input_mode='widen' needs a Llama-layout layer: {problem}. "
                             "Use input_mode='project' for this architecture.")
