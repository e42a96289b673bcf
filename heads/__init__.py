"""Drafter kinds for self-speculative decoding: Medusa heads, EAGLE-1/2 and EAGLE-3 drafters, DFlash block drafters.

    import heads
    drafter = heads.build("eagle", target.config)   # or heads.build("eagle", target) to init from weights
    drafter.save_pretrained("out/eagle")            # config.json + model.safetensors + README.md
    drafter = heads.load("out/eagle")               # or a hub id; dispatches on the saved model_type

Each kind lives in its own folder (`config.py`, `model.py`, `objective.py`, ...) and is registered here
whole, with one `register(Kind(...))` call that names every part of it the rest of the code uses (see
heads/kinds.py); train/, infer/ and scripts/ look kinds up here and never name one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import PretrainedConfig, PreTrainedModel

from infer.loading import beside_a_local_folder, looks_local

from . import export, formats
from .base import DrafterConfig, DrafterModel, text_config, tokenizer_fingerprint
from .dflash import DFlashConfig, DFlashModel
from .dflash import objective as dflash_objective
from .eagle import EagleConfig, EagleModel
from .eagle import objective as eagle_objective
from .eagle3 import Eagle3Config, Eagle3Model, build_vocab_map
from .eagle3 import objective as eagle3_objective
from .kinds import REGISTRY, ExportFormat, Kind, get_kind, register
from .medusa import MedusaConfig, MedusaModel
from .medusa import objective as medusa_objective

register(Kind(
    name="medusa", title="Medusa-1 heads", config_cls=MedusaConfig, model_cls=MedusaModel,
    objective=medusa_objective.MedusaObjective, eval_depth=medusa_objective.eval_depth, depth_label="head",
    trains_target_lora=True, exports=(export.VLLM_MEDUSA,), imports=(formats.medusa_fd.NAME,),
))
register(Kind(
    name="eagle", title="EAGLE-1/2 drafter", config_cls=EagleConfig, model_cls=EagleModel,
    objective=eagle_objective.EagleObjective, eval_depth=eagle_objective.eval_depth, depth_label="step",
    unrolled=True, imports=(formats.eagle1_authors.NAME,),
))
register(Kind(
    name="eagle3", title="EAGLE-3 drafter", config_cls=Eagle3Config, model_cls=Eagle3Model,
    objective=eagle3_objective.Eagle3Objective, eval_depth=eagle_objective.eval_depth, depth_label="step",
    unrolled=True, prepare=eagle3_objective.prepare, exports=(export.SPECULATORS, export.SGLANG),
    imports=(formats.eagle_authors.NAME, formats.specforge.NAME, formats.speculators.NAME),
))
register(Kind(
    name="dflash", title="DFlash block drafter", config_cls=DFlashConfig, model_cls=DFlashModel,
    objective=dflash_objective.DFlashObjective, eval_depth=dflash_objective.eval_depth, depth_label="pos",
    exports=(export.DFLASH,), imports=(formats.dflash_zlab.NAME,),
))


def build(kind: str, target: PretrainedConfig | PreTrainedModel, *, tokenizer=None, **options) -> DrafterModel:
    """A fresh drafter of `kind` for a target given by its config or, better, the model itself.

    With the model, the drafter is also attached to it and initialised from its weights where the kind
    starts from them (Medusa's own projections, EAGLE-3's lm_head rows). `options` are config fields of the
    kind (e.g. `num_heads=5`, `tree={"top_k": 4}`); unknown ones are an error.
    """
    registered = get_kind(kind)
    config_cls, model_cls = registered.config_cls, registered.model_cls
    known = set(config_cls.__dataclass_fields__)
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown {kind} options {sorted(unknown)}; known: {sorted(known - _BASE_ONLY)}")
    fields = config_cls.target_fields(target)
    if tokenizer is not None:
        fields["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
    config = config_cls.for_target(text_config(target), **{**fields, **options})
    model = model_cls(config)
    if isinstance(target, PreTrainedModel):
        model.attach(target, tokenizer)
        model.init_from_target(target)
        model.to(device=target.device)
    return model.eval()


# Drafters shipped inside the package (heads/shipped/<name>/, written by save_pretrained), loaded by name and
# offline, as the embedded target is: heads.load("<name>"), SelfSpecModel.from_pretrained("<name>").
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def shipped_drafters() -> list[str]:
    """The names of the drafters shipped with selfspec."""
    return sorted(p.parent.name for p in SHIPPED_DIR.glob("*/config.json"))


def resolve_drafter(path_or_hub_id):
    """A shipped drafter's name becomes its folder (a local path of that name wins); anything else is
    returned as it is."""
    name = os.fspath(path_or_hub_id)
    if "/" not in name and not os.path.exists(name) and (SHIPPED_DIR / name / "config.json").is_file():
        return SHIPPED_DIR / name
    return path_or_hub_id


def check_source(path_or_hub_id, subfolder: str = "") -> None:
    """Raise a clear error for a path that is neither a saved drafter folder nor a possible hub id."""
    path = Path(path_or_hub_id, subfolder)
    if path.is_dir():
        if not (path / "config.json").is_file():
            inside = sorted(p.parent.name for p in path.glob("*/config.json"))
            hint = f" Its subfolders {inside} hold one; pass one of them." if inside else ""
            raise ValueError(f"{path} is a folder without config.json, so not a saved drafter (config.json + "
                             f"model.safetensors, written by drafter.save_pretrained).{hint}")
        return
    if path.exists():
        raise ValueError(f"{path} is a file; a drafter is a folder (config.json + model.safetensors) or a hub id")
    try:
        validate_repo_id(str(path_or_hub_id))
        hub_id = not looks_local(path_or_hub_id)
    except HFValidationError:
        hub_id = False
    if not hub_id:
        shipped = ", ".join(shipped_drafters()) or "none"
        raise FileNotFoundError(f"no drafter at {path_or_hub_id}: no such folder ({path.absolute()}), and not a hub "
                                f"id (owner/name) or a shipped drafter ({shipped}); check the path")


# PretrainedConfig bookkeeping fields not worth listing in error messages.
_BASE_ONLY = set(PretrainedConfig.__dataclass_fields__)


def load(path_or_hub_id, *, target=None, **hf_kwargs) -> DrafterModel:
    """Load a drafter from a folder, a hub id or a shipped drafter's name: one saved by selfspec (safetensors
    only), or one published in another project's format (heads/formats/: EAGLE-3 from EAGLE's authors, SpecForge
    or speculators, Medusa from FasterDecoding, DFlash from z-lab), recognised from its config and files.

    `target` (a model, or its config) is the target the drafter will serve: a foreign checkpoint is checked
    against it (hidden size, vocabulary, draft-vocabulary map, embedding) before anything is built, and reads
    from it what its format does not record (the target's layer count, DFlash's mask embedding). Shipped
    drafters are stored in half precision and load in fp32, the embedded target's dtype, unless `dtype=` says
    otherwise."""
    resolved = resolve_drafter(path_or_hub_id)
    if resolved is not path_or_hub_id:
        hf_kwargs.setdefault("dtype", torch.float32)
    path_or_hub_id = resolved
    fmt, config_dict = _recognise(path_or_hub_id, **hf_kwargs)
    if fmt is None:
        kind = next(k for k in REGISTRY.values() if k.config_cls.model_type == config_dict.get("model_type"))
        return _check_finite(kind.model_cls.from_pretrained(path_or_hub_id, **hf_kwargs), path_or_hub_id)
    hub_kwargs = {k: hf_kwargs.pop(k) for k in _HUB_KWARGS if k in hf_kwargs}
    dtype = hf_kwargs.pop("dtype", None)
    if hf_kwargs:
        raise TypeError(f"{', '.join(sorted(hf_kwargs))}: not an option for a checkpoint in another project's format "
                        f"(these are: target, dtype, {', '.join(_HUB_KWARGS)})")
    model = fmt.load(path_or_hub_id, config_dict, target=target, **hub_kwargs)
    if dtype is not None and dtype != "auto":
        model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return _check_finite(model, path_or_hub_id)


def imported_format(path_or_hub_id, **hf_kwargs) -> formats.Format | None:
    """The foreign format (heads/formats/) a drafter checkpoint is in, or None for one saved by selfspec; an
    error listing the known formats for anything else."""
    return _recognise(resolve_drafter(path_or_hub_id), **hf_kwargs)[0]


def target_name(path_or_hub_id, **hf_kwargs) -> str | None:
    """The target a saved or published drafter names (its `base_model_name_or_path`, a speculators verifier,
    Medusa's base model), read from its config alone; None where it names none (EAGLE's authors', SpecForge)."""
    fmt, config_dict = _recognise(resolve_drafter(path_or_hub_id), **hf_kwargs)
    return config_dict.get("base_model_name_or_path") if fmt is None else fmt.target_name(config_dict)


def _recognise(path_or_hub_id, **hf_kwargs) -> tuple[formats.Format | None, dict]:
    """(None, config) for a selfspec drafter, (its format, config) for a foreign one, else a ValueError naming the
    known formats."""
    check_source(path_or_hub_id, hf_kwargs.get("subfolder", ""))
    config_dict = _config_dict(path_or_hub_id, **hf_kwargs)
    model_type = config_dict.get("model_type")
    if any(kind.config_cls.model_type == model_type for kind in REGISTRY.values()):
        return None, config_dict
    hub_kwargs = {k: hf_kwargs[k] for k in _HUB_KWARGS if k in hf_kwargs}
    matches = formats.detect(config_dict, formats.files_of(path_or_hub_id, **hub_kwargs))
    if len(matches) == 1:
        return matches[0], config_dict
    if matches:  # the detectors are meant to exclude one another: a checkpoint two claim is not guessed at
        raise ValueError(f"{path_or_hub_id} is recognised as several formats ({[f.name for f in matches]}); "
                         "remove the files of the ones it is not")
    exports = [f for kind in REGISTRY.values() for f in kind.exports if f.recognizes(config_dict)]
    hint = f"\nIt is a {exports[0].description} checkpoint: use heads.export.{exports[0].load.__name__}(folder)." \
        if exports else ""
    known = sorted(kind.config_cls.model_type for kind in REGISTRY.values())
    raise ValueError(f"{path_or_hub_id} holds model_type {model_type!r}, not a selfspec drafter ({known}) nor a "
                     f"checkpoint in a format selfspec imports:\n{formats.known()}{hint}")


# what locates a checkpoint on the hub (passed to the file lookups of foreign formats)
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def _config_dict(path_or_hub_id, **hf_kwargs) -> dict:
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(path_or_hub_id, **hf_kwargs)
    except OSError as err:
        if os.path.exists(path_or_hub_id):
            raise
        shipped = ", ".join(shipped_drafters()) or "none"
        if beside_a_local_folder(path_or_hub_id):
            raise FileNotFoundError(f"no drafter at {path_or_hub_id}: no such folder "
                                    f"({Path(path_or_hub_id).absolute()}), not a shipped drafter ({shipped}), and as "
                                    f"a hub id: {err}") from err
        raise OSError(f"no drafter at {path_or_hub_id}: not a local folder, not a shipped drafter ({shipped}), and "
                      f"as a hub id: {err}") from err
    if not isinstance(config_dict, dict):
        raise ValueError(f"{path_or_hub_id}: its config.json holds a JSON {type(config_dict).__name__}, not an object "
                         "(a config): the file was damaged or replaced; restore the config.json saved with the drafter, "
                         "or save it again")
    return config_dict


def _check_finite(model: DrafterModel, source) -> DrafterModel:
    """A weight file whose bytes were damaged loads without complaint but holds NaN/inf: refuse it."""
    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"{source} holds non-finite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}):"
                         " the file is damaged or was saved from a diverged run; re-download or retrain it")
    return model


__all__ = [
    "REGISTRY", "Kind", "ExportFormat", "register", "get_kind", "build", "load", "imported_format", "target_name", "tokenizer_fingerprint", "build_vocab_map",
    "DrafterConfig", "DrafterModel", "MedusaConfig", "MedusaModel", "EagleConfig", "EagleModel",
    "Eagle3Config", "Eagle3Model", "DFlashConfig", "DFlashModel",
]
