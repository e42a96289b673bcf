"""Inference: tree-verified speculative generation over any transformers causal LM."""

from . import cpu_linear
from .drafters import DRAFTERS, DraftModelDrafter, LookupFirstDrafter, NgramDrafter, build_drafter
from .drafting import Drafter, TargetStep
from .engine import SelfSpecModel
from .sampling import SamplingParams, logits_to_probs, sample
from .tree import DraftTree, tree_from_paths

__all__ = ["DRAFTERS", "build_drafter", "SelfSpecModel", "Drafter", "TargetStep", "DraftTree", "tree_from_paths", "NgramDrafter",
           "DraftModelDrafter", "LookupFirstDrafter", "SamplingParams", "logits_to_probs", "sample", "cpu_linear"]
