"""Inference: tree-verified speculative generation over any transformers causal LM.

This module is the public face of `infer/`, and the one place in it that reaches above it: `SelfSpecModel`
loads trained drafters by name or folder (`from_pretrained`, through `heads`). Nothing else in `infer/` imports it.
"""

import os
import warnings

from transformers import PreTrainedModel

from . import cpu
from .drafters import DRAFTERS, DraftModelDrafter, LookupFirstDrafter, NgramDrafter, build_drafter
from .drafting import Drafter, TargetStep
from .engine import Engine
from .options import EngineOptions
from .policy import settle
from .sampling import SamplingParams, logits_to_probs, sample
from .tree import DraftTree, tree_from_paths


class SelfSpecModel(Engine):
    """A frozen target plus a drafter, generating with tree-verified speculation.

    >>> model = SelfSpecModel(target, "ngram")
    >>> out = model.generate(input_ids, max_new_tokens=64)   # == target.generate(input_ids, ...)

    `drafter`: a drafter name from `infer.drafters.DRAFTERS` ("ngram", "int8", "early_exit:8", ...), a trained
    drafter (`heads.load(...)`), a causal LM sharing the target's tokenizer, or an `infer.Drafter`. The keyword
    options are `infer.options.EngineOptions`' fields (each documented there), checked before any work; what they
    leave to "where it pays" is settled for this machine (`infer.policy.settle`) before the engine runs.
    """

    def __init__(self, target: PreTrainedModel, drafter, **options):
        super().__init__(target, settle(target, drafter, EngineOptions.of(**options)))

    @classmethod
    def from_pretrained(cls, drafter_path_or_hub_id: str, target: PreTrainedModel | None = None,
                        tokenizer=None, tree: dict | str | None = None, **kwargs) -> "SelfSpecModel":
        """Load a saved drafter and, unless given, the target recorded in its config (with its tokenizer,
        which is checked against the one the drafter was trained with; pass `tokenizer=` with your own
        target, or it is looked for beside the target). The drafter may also be one published in another
        project's format (EAGLE-3 from EAGLE's authors, SpecForge or speculators, FasterDecoding's Medusa, z-lab's
        DFlash: `heads.load`), checked against the target before anything runs.

        A Medusa-2 drafter (trained jointly with LoRA on the target) records `target_adapter`; the
        adapter saved beside it is applied to the loaded target and merged, since the heads only predict
        well on top of the adapted target. `tree` is passed on to `SelfSpecModel` ("calibrated": the tree
        chosen for this machine).

        Keywords that `SelfSpecModel` takes (`lookup_first`, `int8_drafter`, `compile`, ...) set up the engine;
        the others go to the target's `from_pretrained` (`dtype`, `revision`, ...), so they need the target to be
        loaded here: with `target=` given they are an error.
        """
        import heads

        options = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineOptions.names() - {"tokenizer", "tree"}}
        EngineOptions(tree=tree, tokenizer=tokenizer, **options)  # checked before the drafter, maybe the target, loads
        if not isinstance(drafter_path_or_hub_id, (str, os.PathLike)):
            raise TypeError(f"drafter_path_or_hub_id must be a folder or a hub id, got "
                            f"{type(drafter_path_or_hub_id).__name__}")
        if target is not None and not isinstance(target, PreTrainedModel):
            raise TypeError(f"target must be a transformers causal LM (or None: the one the drafter records), got "
                            f"{type(target).__name__}")
        if target is not None and kwargs:
            raise TypeError(f"{', '.join(sorted(kwargs))}: neither a SelfSpecModel option nor usable with target= "
                            "given (keywords other than SelfSpecModel's load the recorded target); load your "
                            "target with them yourself")
        if target is None:
            # A selfspec drafter loads first, so a bad one is refused before its target loads; a checkpoint in
            # another project's format loads after its target, against which it is checked.
            drafter = heads.load(drafter_path_or_hub_id) if heads.imported_format(drafter_path_or_hub_id) is None \
                else None
            name = (drafter.config.base_model_name_or_path if drafter is not None
                    else heads.target_name(drafter_path_or_hub_id))
            if not name:
                raise ValueError(f"{drafter_path_or_hub_id} records no base_model_name_or_path (nor names its target "
                                 "otherwise); pass target=")
            from .loading import resolve_target

            target, recorded = resolve_target(name, **kwargs)
            # a tokenizer given is the one the caller encodes with: it is what the drafter checks, not the target's
            tokenizer = recorded if tokenizer is None else tokenizer
            if drafter is None:
                drafter = heads.load(drafter_path_or_hub_id, target=target)
            adapter = (drafter.config.training or {}).get("target_adapter")
            if adapter:
                target = _merge_adapter(target, heads.resolve_drafter(drafter_path_or_hub_id), adapter)
            return cls(target, drafter, tokenizer=tokenizer, tree=tree, **options)
        drafter = heads.load(drafter_path_or_hub_id, target=target)
        adapter = (drafter.config.training or {}).get("target_adapter")
        if adapter:
            warnings.warn(f"{drafter_path_or_hub_id} was trained with LoRA on its target (Medusa-2); the "
                          f"target you passed must already carry the adapter in '{adapter}/'", stacklevel=2)
        return cls(target, drafter, tokenizer=tokenizer, tree=tree, **options)


def _merge_adapter(target, drafter_path_or_hub_id: str, adapter: str):
    """Apply and merge the LoRA adapter saved in `<drafter>/<adapter>/` (a local folder or hub id)."""
    from huggingface_hub import snapshot_download
    from peft import PeftModel

    folder = drafter_path_or_hub_id
    if not os.path.isdir(folder):
        folder = snapshot_download(folder, allow_patterns=[f"{adapter}/*"])
    return PeftModel.from_pretrained(target, os.path.join(folder, adapter)).merge_and_unload().eval()


__all__ = ["DRAFTERS", "build_drafter", "SelfSpecModel", "EngineOptions", "Drafter", "TargetStep", "DraftTree",
           "tree_from_paths", "NgramDrafter", "DraftModelDrafter", "LookupFirstDrafter", "SamplingParams",
           "logits_to_probs", "sample", "cpu"]
