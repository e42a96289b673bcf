"""A drafter kind, registered whole: every part of it the rest of the code reaches, in one `Kind`.

train/, infer/ and scripts/ hold no branch on a kind's name: they look its parts up here (`get_kind(name)`)
or call the methods every `DrafterModel` has (`as_drafter`, `feature_layers`). Adding a kind is its own
folder under heads/ and one `register(Kind(...))` line in heads/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ExportFormat:
    """A serving format a kind's drafters are written to and read from (see heads/export.py)."""

    name: str  # short name, e.g. "speculators"
    description: str  # what error messages call it, e.g. "speculators EAGLE-3"
    export: Callable  # (model, out_dir) -> out_dir
    load: Callable  # (path_or_hub_id, target=None, **hub_kwargs) -> model
    recognizes: Callable[[dict], bool]  # whether a config.json (as a dict) is in this format
    vllm_method: str | None = None  # vLLM's speculative_config "method" serving it (None: vLLM does not)
    needs_target: Callable[[object], bool] = lambda model: False  # export needs the drafter attached to its target


@dataclass(frozen=True)
class Kind:
    """One drafter kind. Its model class also gives, per instance, the target features it reads
    (`feature_layers`, indices into the target's hidden states) and its inference drafter (`as_drafter()`)."""

    name: str  # registry key, the model class's `kind` and a training config's `drafter:` value
    title: str  # heading of the model card, e.g. "EAGLE-3 drafter"
    config_cls: type  # a `DrafterConfig` subclass
    model_cls: type  # a `DrafterModel` subclass
    objective: Callable  # (drafter, train_config, lora_target=None) -> nn.Module: its training loss
    eval_depth: Callable  # (drafter, train_config) -> how many depths evaluation measures
    depth_label: str  # evaluation metrics per depth d are named "<depth_label><d>_top1", ...
    unrolled: bool = False  # trained on its own outputs (training-time test), so `ttt_steps` applies
    trains_target_lora: bool = False  # can train LoRA adapters on the target jointly (lora_r > 0)
    prepare: Callable | None = None  # (drafter, target, train_set) -> None: fitted to the data before training
    exports: tuple[ExportFormat, ...] = ()  # serving formats it exports to, first the one vLLM serves
    imports: tuple[str, ...] = ()  # heads.formats readers of other projects' checkpoints that load as this kind


# kind name -> Kind, in registration order
REGISTRY: dict[str, Kind] = {}


def register(kind: Kind) -> None:
    """Add a kind; a name or saved model_type that is taken already is an error, never an override."""
    if not isinstance(kind, Kind):
        raise TypeError(f"register() takes a heads.Kind, got {type(kind).__name__}")
    if kind.name in REGISTRY:
        raise ValueError(f"drafter kind {kind.name!r} is already registered "
                         f"({REGISTRY[kind.name].model_cls.__name__})")
    model_type = kind.config_cls.model_type
    if any(k.config_cls.model_type == model_type for k in REGISTRY.values()):
        raise ValueError(f"model_type {model_type!r} is already registered under another kind")
    if kind.model_cls.kind != kind.name or kind.model_cls.config_class is not kind.config_cls:
        raise ValueError(f"{kind.model_cls.__name__} has kind {kind.model_cls.kind!r} and config "
                         f"{kind.model_cls.config_class.__name__}; registered as {kind.name!r} with "
                         f"{kind.config_cls.__name__}, they must agree")
    REGISTRY[kind.name] = kind


def get_kind(name: str) -> Kind:
    """The registered kind called `name`; unknown names are an error that lists the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter kind {name!r}; known kinds: {sorted(REGISTRY)}")
    return REGISTRY[name]
