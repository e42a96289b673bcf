"""What every drafter kind shares: its config (which target it was built for), target checks, binding to the
frozen target, and safe save/load.

A drafter is a small `PreTrainedModel` of its own. It reuses the target's frozen input embeddings and
lm_head through `attach(target)`, which binds them by reference without registering them as submodules, so
`save_pretrained` writes the drafter's own weights only (as peft saves an adapter without its base model).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import types
import typing
import warnings

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from infer.drafting import Drafter

from .card import write_model_card
from .kinds import REGISTRY
from .weights import check_weights_file

# Most tokens a drafter drafts past the root (Medusa heads, a DFlash block): acceptance multiplies along a chain,
# so tokens that deep are almost never kept, while training allocates activations and logits for every one.
MAX_DRAFT_DEPTH = 64


def tokenizer_fingerprint(tokenizer) -> str:
    """A short sha256 over the tokenizer's vocabulary (token, id pairs) and its special tokens.

    Two tokenizers with the same fingerprint map text to the same ids, which is what a drafter trained on one
    target needs from another.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def text_config(target) -> PretrainedConfig:
    """The text-model config of a target given as a model or a config (multimodal configs nest it)."""
    config = target.config if isinstance(target, PreTrainedModel) else target
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config for the target, got {type(target).__name__}")
    return config.get_text_config()


class DrafterConfig(PretrainedConfig):
    """Fields every drafter kind records about the target it serves, its drafting tree and its provenance."""

    model_type = "selfspec_drafter"

    base_model_name_or_path: str | None = None  # the target's hub id or path, for the model card and loading
    target_model_type: str | None = None  # e.g. "llama"; the drafter's decoder layer (EAGLE) follows it
    target_hidden_size: int | None = None
    target_vocab_size: int | None = None
    target_num_layers: int | None = None
    tokenizer_fingerprint: str | None = None  # `tokenizer_fingerprint(tokenizer)` of the target, when known
    tree: dict | None = None  # drafting settings (kind-specific; see each kind's `TREE_DEFAULTS`)
    training: dict | None = None  # provenance for the model card: data, steps, ...
    metrics: dict | None = None  # measured results for the model card: mean accepted length, speedup, ...
    # acceptance statistics on held-out prompts (`scripts/calibrate.py --write`), from which the tree is chosen
    # per machine (`SelfSpecModel(..., tree="calibrated")`); see infer/tree_choice.py
    calibration: dict | None = None
    # draft with prompt lookup first (`infer.drafters.LookupFirstDrafter`) unless the user says otherwise: set by
    # `scripts/calibrate.py --write` where it measured faster on the held-out prompts (`calibration["lookup_first"]`)
    lookup_first: bool | None = None

    # Each kind lists its tree settings and their defaults; unknown keys are an error.
    TREE_DEFAULTS = {}

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.lookup_first not in (None, True, False):
            raise ValueError(f"lookup_first must be true, false or null (unset), got {self.lookup_first!r}; "
                             "scripts/calibrate.py --write measures and sets it")
        self.check_field_types()
        self.tree = self.resolve_tree(self.tree)

    def check_field_types(self) -> None:
        """Each field the drafter kinds declare holds a value of its annotated kind, so `draft_vocab_size: "48"` or
        `tree: [4, 6]` is refused by name, not as an error deep inside the model. Numbers and bools pass for one
        another here: each kind checks its numeric fields' values itself."""
        for klass in type(self).__mro__[: type(self).__mro__.index(DrafterConfig) + 1]:
            for name, written in vars(klass).get("__annotations__", {}).items():
                # postponed annotations are strings, evaluated in the module that wrote them
                annotation = eval(written, vars(sys.modules[klass.__module__])) if isinstance(written, str) else written
                value = getattr(self, name, None)
                if not _is_a(value, annotation):
                    raise TypeError(f"{self.model_type} config field {name!r} must be {written}, got "
                                    f"{type(value).__name__} {value!r:.60}")

    def resolve_tree(self, tree: dict | None) -> dict:
        tree = dict(tree or {})
        unknown = set(tree) - set(self.TREE_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown tree settings {sorted(unknown)} for {self.model_type}; "
                             f"known settings: {sorted(self.TREE_DEFAULTS)}")
        return {**self.TREE_DEFAULTS, **tree}

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, **fields) -> DrafterConfig:
        """A config for the target with text config `target_config`; kinds derive target-dependent defaults
        here (e.g. EAGLE's decoder-layer config). `fields` are config fields, target_* ones included."""
        return cls(**fields)

    @classmethod
    def target_fields(cls, target) -> dict:
        """The `target_*` fields read from a target model or config."""
        config = text_config(target)
        name = getattr(config, "_name_or_path", "") or None
        if isinstance(target, PreTrainedModel):
            name = getattr(target, "name_or_path", None) or name
        return dict(base_model_name_or_path=name, target_model_type=config.model_type,
                    target_hidden_size=config.hidden_size, target_vocab_size=config.vocab_size,
                    target_num_layers=config.num_hidden_layers)


def _is_a(value, annotation) -> bool:
    """isinstance for the annotations drafter configs use (int, float, bool, str, dict, list[int], `X | None`),
    where any number or bool passes for int, float and bool."""
    if isinstance(annotation, types.UnionType):
        return any(_is_a(value, arg) for arg in typing.get_args(annotation))
    if annotation is None or annotation is type(None):
        return value is None
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_is_a(v, item) for v in value)
    if annotation in (int, float, bool):
        return isinstance(value, (int, float, bool))
    return isinstance(value, annotation)


class _TargetParts(dict):
    """The frozen target modules a drafter is bound to. Deep copies of a drafter share them rather than
    copying the target's embedding and lm_head."""

    def __deepcopy__(self, memo):
        return self


class DrafterModel(PreTrainedModel):
    """Base class of every drafter kind. Subclasses define `forward`, `feature_layers` and `as_drafter`."""

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    _supports_sdpa = True
    kind: str = ""  # registry key, set by each kind

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        # Frozen target parts bound by `attach`. A dict, so they are never submodules: never saved, never in
        # `parameters()`, never moved by `.to()`.
        self._target = _TargetParts()

    # ---- the target -------------------------------------------------------------------------------------

    def check_target(self, target, tokenizer=None) -> None:
        """Raise ValueError naming every way `target` (a model or config) differs from what this drafter
        was built for."""
        config = text_config(target)
        c = self.config
        problems = []
        for field, expected, actual in [
            ("model_type", c.target_model_type, config.model_type),
            ("hidden size", c.target_hidden_size, config.hidden_size),
            ("vocab size", c.target_vocab_size, config.vocab_size),
            ("layer count", c.target_num_layers, config.num_hidden_layers),
        ]:
            if expected is not None and expected != actual:
                problems.append(f"{field}: drafter built for {expected!r}, target has {actual!r}")
        problems += self.target_problems(config)
        if tokenizer is not None and c.tokenizer_fingerprint is not None:
            actual = tokenizer_fingerprint(tokenizer)
            if actual != c.tokenizer_fingerprint:
                problems.append(f"tokenizer fingerprint: drafter trained with {c.tokenizer_fingerprint}, "
                                f"tokenizer gives {actual}")
        if problems:
            raise ValueError(
                f"this {self.kind} drafter does not fit the target "
                f"({c.base_model_name_or_path or 'unknown base'}):\n  - " + "\n  - ".join(problems)
                + "\nUse the target the drafter was trained for, or build/train a new drafter for this target "
                "(heads.build(kind, target.config))."
            )

    def target_problems(self, config: PretrainedConfig) -> list[str]:
        """Ways a target with text config `config` cannot serve this drafter beyond the fields every kind
        records (e.g. feature layers it does not have); each a line of `check_target`'s error."""
        return []

    def attach(self, target, tokenizer=None) -> DrafterModel:
        """Validate `target`, then bind its frozen input embeddings and lm_head by reference (not saved)."""
        if not isinstance(target, PreTrainedModel):
            raise TypeError(f"attach() needs the target model itself, got {type(target).__name__}")
        self.check_target(target, tokenizer)
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or lm_head is None:
            raise ValueError(f"{type(target).__name__} exposes no input embeddings or lm_head; a drafter needs "
                             "a causal LM (AutoModelForCausalLM)")
        softcap = getattr(text_config(target), "final_logit_softcapping", None)
        self._target = _TargetParts(embed=embed, lm_head=lm_head, softcap=softcap, model_id=id(target))
        return self

    def attached_to(self, target) -> bool:
        return self._target.get("model_id") == id(target)

    def _require_target(self, what: str) -> dict:
        if not self._target:
            raise RuntimeError(f"{what} uses the target's frozen embeddings/lm_head: call drafter.attach(target) "
                               "first")
        return self._target

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's own input embedding, in the drafter's dtype (Gemma's scaled embedding modules include
        their sqrt(D) scale in the module, so it applies here as in the target)."""
        return self._require_target("embedding tokens")["embed"](input_ids).to(self.dtype)

    def target_logits(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """The target's lm_head, with its final logit soft-capping when it has one (Gemma 2); only the
        vocabulary `columns` when given (EAGLE-3's draft vocabulary: a sixth of the work on SmolLM2)."""
        t = self._require_target("the target lm_head")
        head = t["lm_head"]
        if columns is None:
            logits = head(hidden.to(head.weight.dtype))
        else:
            bias = None if head.bias is None else head.bias[columns]
            logits = F.linear(hidden.to(head.weight.dtype), head.weight[columns], bias)
        if t["softcap"]:
            logits = torch.tanh(logits / t["softcap"]) * t["softcap"]
        return logits

    # ---- what kinds implement ---------------------------------------------------------------------------

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the target's `output_hidden_states` tuple this drafter reads (0 = embeddings,
        L = last layer after the final norm)."""
        raise NotImplementedError

    def as_drafter(self, **tree_overrides):
        """This kind's `infer.drafting.Drafter`, with tree settings from the config unless overridden."""
        raise NotImplementedError

    def init_from_target(self, target) -> None:
        """Initialise own weights from the target's (e.g. a copy of its lm_head). Called by `heads.build`."""

    def _init_weights(self, module):
        # Only plain Linear/Embedding layers get the generic init; norms keep what their own constructor set
        # (RMSNorms are 1-centred in Llama and 0-centred in Gemma; only the class knows).
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            super()._init_weights(module)
        elif module is getattr(self, "rotary_emb", None):
            # Rotary tables are non-persistent buffers: `from_pretrained` leaves them unset, so rebuild
            # them with the class's own constructor.
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer)

    # ---- saving and loading -----------------------------------------------------------------------------

    def save_pretrained(self, save_directory, **kwargs):
        """config.json + model.safetensors (own weights only) + a generated README.md model card."""
        if kwargs.get("safe_serialization") is False:
            raise ValueError("drafters are saved as safetensors only; drop safe_serialization=False")
        kwargs.pop("safe_serialization", None)
        super().save_pretrained(save_directory, **kwargs)
        registered = REGISTRY.get(self.kind)
        write_model_card(save_directory, self.config, kind=self.kind,
                         title=registered.title if registered else None)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Save (with the generated model card) to a temporary folder and upload it; see `heads.hub.push`."""
        from .hub import push

        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder)
            return push(folder, repo_id, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load from a folder or hub id (offline from the hub cache with HF_HUB_OFFLINE=1).

        safetensors only (no pickle); missing, unexpected or mismatched keys are an error, never ignored.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("drafters load from safetensors only; drop use_safetensors=False")
        want_info = kwargs.pop("output_loading_info", False)
        hub_kwargs = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token",
                                             "revision", "subfolder") if k in kwargs}
        check_weights_file(pretrained_model_name_or_path, **hub_kwargs)
        kwargs["use_safetensors"] = True
        # mismatched shapes come back in `info` and are refused below with the shapes, not as transformers' advice
        # to pass ignore_mismatched_sizes
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args,
                                              output_loading_info=True, **kwargs)
        if info.get("mismatched_keys"):
            shapes = "; ".join(f"{key}: file {tuple(saved)}, config {tuple(built)}"
                               for key, saved, built in sorted(info["mismatched_keys"]))
            raise ValueError(f"{pretrained_model_name_or_path}: the sizes in its config.json do not match the weights "
                             f"in its model.safetensors ({shapes}). The config was edited or belongs to another "
                             "drafter: restore the config.json saved with these weights, or re-save the drafter.")
        problems = {k: info.get(k) for k in ("missing_keys", "unexpected_keys") if info.get(k)}
        if problems:
            raise ValueError(f"{pretrained_model_name_or_path} does not match a {cls.__name__} built from its "
                             f"config.json: {problems}. The weights were saved by another kind or version of "
                             "the drafter, or edited; re-save them with the matching heads kind.")
        return (model, info) if want_info else model


class HeadDrafter(Drafter):
    """What every kind's drafting adapter shares: the drafter model, target checks and binding."""

    pure_propose = True  # drafts on a scratch cache it rolls back: a step may skip propose()

    def __init__(self, model: DrafterModel):
        self.model = model
        self.feature_layers = model.feature_layers

    def check_target(self, target) -> None:
        self.model.check_target(target)

    def bind(self, target, sampling, batch_size: int, generator=None) -> None:
        """Attach the model to `target` (if not already) and put it in eval mode (call `.train()` again to
        resume training). The drafter keeps its own dtype; it must sit on the target's device."""
        super().bind(target, sampling, batch_size, generator)
        if not self.model.attached_to(target):
            self.model.attach(target)
        device = target.get_input_embeddings().weight.device
        if self.model.device != device:
            raise ValueError(f"the drafter is on {self.model.device} but the target on {device}; move it with "
                             f"drafter.to({str(device)!r})")
        if device.type == "cpu" and self.model.dtype in (torch.float16, torch.bfloat16):
            warnings.warn(f"the drafter is {self.model.dtype} on CPU, where half-precision matmuls are slow and "
                          "its lean forward does not run; load it in fp32 (heads.load(..., dtype=torch.float32) "
                          "or drafter.float()). Shipped drafters loaded by name are fp32 already", stacklevel=3)
        self.model.eval()
