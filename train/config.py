"""Training configuration: one dataclass of defaults; YAML files and `key=value` arguments override it.

A YAML file holds only the fields it changes. Unknown keys are an error that names the key and the
closest known ones, and every override is checked against the field's type, so a typo never trains
with a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class TrainConfig:
    # --- what to train ---
    target: str = "smollm2-135m-instruct"  # target model: a local folder, a hub id, or the short name of the embedded SmolLM2
    target_dtype: str = "float32"  # dtype the frozen target runs in: float32 | bfloat16 | float16
    drafter: str = "eagle"  # drafter kind, one registered in heads/: medusa | eagle | eagle3 | dflash
    drafter_options: dict = field(default_factory=dict)  # passed to heads.build (e.g. num_heads, num_layers, draft_vocab_size)
    drafter_init: str = ""  # continue training a saved drafter (folder or hub id) instead of building a fresh one

    # --- data ---
    data: str = ""  # a hub dataset id or a local .json/.jsonl/.parquet file (ShareGPT, OpenAI messages or Alpaca rows)
    data_split: str = "train"  # split to read from a hub dataset
    max_samples: int = 0  # use only the first N conversations (0 = all)
    max_length: int = 512  # tokens per sample; longer ones are truncated, and dropped if no assistant token is left
    eval_fraction: float = 0.05  # share of conversations held out for evaluation
    max_eval_samples: int = 200  # cap on the held-out split (evaluation runs often)
    group_by_length: bool = True  # batch samples of similar length together (less padding)
    pack: bool = False  # pack each micro-batch's samples into rows of max_length tokens (train/packing.py): no padding between them, attention and labels never cross a sample, the same loss and gradients as one sample per row

    # --- target features ---
    features: str = "online"  # online: run the frozen target in the loop; offline: compute once and cache on disk
    feature_cache_dir: str = ".cache/selfspec-features"  # offline cache root; entries are keyed by target+data+max_length
    feature_dtype: str = "float32"  # dtype of cached features: float32 | bfloat16 | float16
    target_sharding: str = "none"  # none: every process holds the whole frozen target; fsdp: its decoder layers split across the processes (FSDP2), for a target too large for one device (train/sharding.py)

    # --- losses ---
    loss: str = "hard"  # hard: CE on the data's tokens; soft: KL to the target's next-token distribution; both: their sum
    head_decay: float = 0.8  # Medusa: weight of head k is head_decay**k
    feature_loss_weight: float = 1.0  # EAGLE: smooth-L1 on predicted features (the EAGLE paper uses 1.0)
    token_loss_weight: float = 0.1  # EAGLE: CE/KL on predicted tokens (the EAGLE paper uses 0.1)
    feature_noise: float = 0.0  # EAGLE: uniform noise U(-a, a) added to input features during training (the paper uses 0.1 for 7B+ targets)
    ttt_steps: int = 1  # EAGLE/EAGLE-3: steps unrolled on the drafter's own outputs (training-time test); 1 = teacher forcing only
    ttt_decay: float = 0.8  # EAGLE/EAGLE-3: weight of unrolled step s is ttt_decay**s
    eval_steps_depth: int = 4  # EAGLE/EAGLE-3: depth of the unrolled chain measured at evaluation

    # --- Medusa-2: LoRA on the target, trained jointly with the heads ---
    lora_r: int = 0  # LoRA rank on the target (0 = frozen target, Medusa-1)
    lora_alpha: int = 16  # LoRA scaling numerator
    lora_dropout: float = 0.0  # LoRA dropout
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "v_proj"])  # target modules that get adapters
    target_kl_weight: float = 1.0  # weight of KL(original target || adapted target), keeping the target's outputs unchanged

    # --- optimisation ---
    batch_size: int = 4  # samples per process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: int = 1  # passes over the training split (ignored when max_steps > 0)
    max_steps: int = 0  # optimizer steps in total (0 = derived from epochs)
    lr: float = 3e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear warm-up steps
    lr_schedule: str = "cosine"  # after warm-up: cosine | linear | constant
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    mixed_precision: str = "no"  # accelerate mixed precision: no | bf16 | fp16 (fp16 needs a GPU) | auto (bf16 where the hardware multiplies bf16 natively: a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX; else no)
    seed: int = 0  # seeds model init, data order and noise

    # --- logging, evaluation, checkpoints ---
    output_dir: str = "runs/drafter"  # checkpoints go to <output_dir>/checkpoints, the trained drafter to <output_dir>/drafter
    log_every: int = 10  # optimizer steps between log lines
    eval_every: int = 0  # optimizer steps between evaluations (0 = only at the end)
    keep_best: bool = True  # with eval_every: the drafter of the evaluation with the highest simulated_tau (the drafter's tree's expected acceptance) is kept in <output_dir>/best
    early_stop_patience: int = 0  # with eval_every: end the run (final evaluation, drafter folder) after this many evaluations without a higher simulated_tau (0 = never)
    save_every: int = 0  # optimizer steps between checkpoints (0 = none)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    resume: bool = False  # continue from the newest intact checkpoint in <output_dir>/checkpoints, with the same settings
    overwrite: bool = False  # start a new run in a used output_dir; the old run waits in previous_run/ until the new one first saves
    halt_after_steps: int = 0  # stop after this many steps without the final save, as a kill would (tests, preemption drills)
    max_train_minutes: float = 0.0  # a wall-clock budget for the loop (0 = none): when spent, the run ends as at max_steps (final evaluation, drafter folder) with its schedule cut where it stood; for leased machines
    report_to: str = "none"  # none | wandb (WANDB_MODE=offline/disabled is honoured)
    wandb_project: str = "selfspec"  # wandb project name
    run_name: str = ""  # wandb run name (empty: derived from drafter kind and target)
    push_to_hub: str = ""  # repo id to push the trained drafter to (empty = don't)
    progress_bar: bool = True  # tqdm bars on the main process


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _field_type(name: str):
    hints = typing.get_type_hints(TrainConfig)
    return hints[name]


def _unknown_key_error(key: str, source: str) -> ValueError:
    close = difflib.get_close_matches(key, list(_fields()), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown config key {key!r} in {source}{hint}")


def _coerce(name: str, value, source: str):
    """Check `value` against the field's type; strings from the command line are parsed as YAML scalars."""
    typ = _field_type(name)
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        raise AssertionError(f"union field types are not supported ({name})")
    origin = typing.get_origin(typ) or typ
    if isinstance(value, str) and origin is not str:
        try:
            value = yaml.safe_load(value) if value != "" else value
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or err
            raise ValueError(f"config key {name!r} in {source}: {value!r} is not a YAML value ({problem}); write "
                             f"it as YAML, e.g. lr=3e-4, lora_target_modules=[q_proj,v_proj], "
                             "drafter_options={num_heads: 3}") from None
    if isinstance(value, str) and origin is float:  # YAML 1.1 reads "2e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if value is None and origin is str:
        value = ""
    if not TYPE_CHECKS[origin](value):
        raise TypeError(f"config key {name!r} in {source} expects {origin.__name__}, got {value!r}")
    return float(value) if origin is float else value


# What each field type accepts (an int is a float too; a bool is no number).
TYPE_CHECKS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    list: lambda v: isinstance(v, list),
    dict: lambda v: isinstance(v, dict),
}


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Defaults, then the YAML file at `path`, then `overrides` (`["key=value", ...]` or a dict)."""
    values: dict = {}
    if path:
        path = Path(path)
        loaded = _read_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of overrides")
        for key, value in loaded.items():
            if key not in _fields():
                raise _unknown_key_error(key, str(path))
            values[key] = _coerce(key, value, str(path))
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for arg in overrides or []:
            if "=" not in arg:
                raise ValueError(f"override {arg!r} must look like key=value")
            key, value = arg.split("=", 1)
            items.append((key.lstrip("-"), value))
    for key, value in items:
        if key not in _fields():
            raise _unknown_key_error(key, "overrides")
        values[key] = _coerce(key, value, "overrides")
    config = TrainConfig(**values)
    validate(config)
    # keep_best is on by default, so only a run that asks for it (and will not evaluate) is told it gets no best/.
    if values.get("keep_best") is True and not (config.eval_every and config.eval_fraction > 0):
        raise ValueError(f"keep_best=true keeps the drafter of the best held-out evaluation, but eval_every="
                         f"{config.eval_every} and eval_fraction={config.eval_fraction} make no evaluation during "
                         "the run, so no best/ would be written: set eval_every > 0 and eval_fraction > 0, or "
                         "keep_best: false")
    return config


class DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one mapping of a config file."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last without a word, so the
    setting a user reads first in the file would be silently overridden."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise DuplicateKey(problem=f"sets {key_node.value!r} twice (lines {seen[key] + 1} and "
                                       f"{key_node.start_mark.line + 1})", problem_mark=key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path):
    """The YAML file at `path`, parsed; what is wrong with it (a folder, binary, a syntax error at a line) named."""
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a folder; give the YAML file of overrides (e.g. "
                         "configs/smollm2_eagle.yaml)")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:  # a stream, so that YAML's messages name the file, not a string
            return yaml.load(f, Loader=_UniqueKeyLoader)
    except DuplicateKey as err:
        raise ValueError(f"config file {str(path)!r} {err.problem}; keep the one you mean and delete the other") \
            from None
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (it holds the byte {err.object[err.start]:#04x}); "
                         "give the YAML file of overrides, not a binary file") from None
    except yaml.reader.ReaderError as err:
        raise ValueError(f"config file {str(path)!r} holds the character {chr(err.character)!r}, which YAML does not "
                         "allow; give the YAML file of overrides, not a binary file") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise ValueError(f"config file {str(path)!r} is not valid YAML at {where}: {err.problem or err.context} "
                         "(check that line and the one before it: indentation, 'key: value', closed brackets and "
                         "quotes)") from None
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    except OSError as err:
        raise ValueError(f"config file {str(path)!r} cannot be read ({err.strerror})") from None


# Fields that must be >= 0, with what 0 means (or why negative makes no sense).
NON_NEGATIVE = {
    "max_samples": "0 = all conversations",
    "max_eval_samples": "a cap on the held-out split",
    "max_steps": "0 = derived from epochs",
    "warmup_steps": "0 = no warm-up",
    "weight_decay": "0 = none",
    "max_grad_norm": "0 = no clipping",
    "feature_noise": "the half-width of uniform noise; 0 = none",
    "feature_loss_weight": "a loss weight",
    "token_loss_weight": "a loss weight",
    "target_kl_weight": "a loss weight",
    "lora_r": "0 = frozen target",
    "log_every": "0 = no log lines",
    "eval_every": "0 = only at the end",
    "early_stop_patience": "0 = never stop early",
    "save_every": "0 = no checkpoints",
    "halt_after_steps": "0 = never halt",
    "max_train_minutes": "0 = no time budget",
}
# Unrolled steps (ttt_steps, eval_steps_depth): each one attends to all earlier ones and keeps its activations
# for the backward pass, so memory grows with the square of their number; a typo's thousands exhaust any machine.
MAX_UNROLLED_STEPS = 64
SEEDS = 2**32  # numpy, which accelerate's set_seed seeds too, takes seeds in [0, 2**32)
# AdamW's bias-corrected first step is a multiple of lr that torch converts to float32: a larger lr fails inside
# the optimizer with a bare overflow error instead of diverging where the loop's finite checks can name it.
MAX_LR = 1e37


def validate(config: TrainConfig) -> None:
    """Checks that need no model or data; raise before anything expensive runs."""
    import heads

    for name in _fields():  # a TrainConfig built in Python has not been through `_coerce`
        origin = typing.get_origin(_field_type(name)) or _field_type(name)
        if not TYPE_CHECKS[origin](getattr(config, name)):
            raise TypeError(f"config key {name!r} expects {origin.__name__}, got {getattr(config, name)!r}")
    choices = {
        "drafter": tuple(heads.REGISTRY),
        "features": ("online", "offline"),
        "loss": ("hard", "soft", "both"),
        "lr_schedule": ("cosine", "linear", "constant"),
        "mixed_precision": ("no", "bf16", "fp16", "auto"),
        "report_to": ("none", "wandb"),
        "target_dtype": ("float32", "bfloat16", "float16"),
        "feature_dtype": ("float32", "bfloat16", "float16"),
        "target_sharding": ("none", "fsdp"),
    }
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"config key {name!r} must be one of {allowed}, got {getattr(config, name)!r}")
    if not config.data:
        raise ValueError("config key 'data' is empty: give a hub dataset id or a .json/.jsonl/.parquet file")
    for name, fix in (("target", "give a local folder, a hub id (owner/name) or 'smollm2-135m-instruct'"),
                      ("data_split", "name the hub dataset's split, e.g. train")):
        if not getattr(config, name):
            raise ValueError(f"config key {name!r} is empty: {fix}")
    if config.features == "offline" and not config.feature_cache_dir:
        raise ValueError("config key 'feature_cache_dir' is empty with features: offline; give the folder for the "
                         "feature cache")
    if config.features == "offline" and Path(config.feature_cache_dir).is_file():
        raise ValueError(f"config key 'feature_cache_dir' {config.feature_cache_dir!r} is a file; give a folder for "
                         "the feature cache")
    check_ranges(config)
    if config.eval_every and config.eval_fraction > 0 and config.max_eval_samples == 0:
        raise ValueError(f"eval_every={config.eval_every} evaluates on held-out samples, but max_eval_samples=0 holds "
                         "none out, so every evaluation would measure nothing: set max_eval_samples > 0 (e.g. 200), "
                         "or eval_every: 0")
    if config.early_stop_patience and not (config.eval_every and config.eval_fraction > 0):
        raise ValueError(f"early_stop_patience={config.early_stop_patience} stops on held-out evaluations: set "
                         "eval_every > 0 and eval_fraction > 0, or early_stop_patience: 0")
    if config.keep_best and config.eval_every and not config.eval_fraction > 0:
        raise ValueError(f"keep_best=true keeps the drafter of the best held-out evaluation, but eval_fraction=0 holds "
                         f"nothing out, so eval_every={config.eval_every} evaluates nothing and no best/ is written: "
                         "set eval_fraction > 0, or keep_best: false")
    if config.lora_r > 0 and config.lora_alpha <= 0:
        raise ValueError(f"config key 'lora_alpha' must be > 0 with lora_r > 0, got {config.lora_alpha}")
    if not config.output_dir:
        raise ValueError("config key 'output_dir' is empty: give the folder for checkpoints and the drafter")
    if config.push_to_hub:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(config.push_to_hub)
        except HFValidationError as err:
            raise ValueError(f"config key 'push_to_hub' must be a Hub repo id (owner/name): {err}") from None
    if config.resume and config.overwrite:
        raise ValueError("resume=true and overwrite=true contradict each other: resume continues the run in "
                         "output_dir, overwrite replaces it; set only one")
    if config.lora_r > 0 and not heads.REGISTRY[config.drafter].trains_target_lora:
        able = " | ".join(k.name for k in heads.REGISTRY.values() if k.trains_target_lora)
        raise ValueError(f"lora_r > 0 (LoRA on the target, trained with the drafter) is only supported with "
                         f"drafter: {able}")
    if config.lora_r > 0 and config.features == "offline":
        raise ValueError("lora_r > 0 trains the target, so its features change every step: use features: online")
    if config.lora_r > 0 and not (config.lora_target_modules
                                  and all(isinstance(m, str) and m for m in config.lora_target_modules)):
        raise ValueError(f"config key 'lora_target_modules' must list the names of the target's modules that get "
                         f"adapters (e.g. [q_proj, v_proj]), got {config.lora_target_modules!r}")
    check_drafter_options(config.drafter, config.drafter_options)


def check_ranges(config: TrainConfig) -> None:
    """Every number within its range: finite, and >= 0, >= 1 or > 0 as the field means."""
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config key {f.name!r} must be a finite number, got {value}")
    if not 0 <= config.seed < SEEDS:
        raise ValueError(f"config key 'seed' must be in [0, 2**32), got {config.seed}")
    for name in ("max_length", "batch_size", "grad_accum", "epochs", "ttt_steps", "eval_steps_depth",
                 "keep_checkpoints"):
        if getattr(config, name) < 1:
            raise ValueError(f"config key {name!r} must be >= 1, got {getattr(config, name)}")
    for name in ("ttt_steps", "eval_steps_depth"):
        if getattr(config, name) > MAX_UNROLLED_STEPS:
            raise ValueError(f"config key {name!r} must be <= {MAX_UNROLLED_STEPS}, got {getattr(config, name)}: "
                             "every unrolled step keeps its activations and attends to all earlier ones")
    for name, meaning in NON_NEGATIVE.items():
        if not getattr(config, name) >= 0:
            raise ValueError(f"config key {name!r} must be >= 0 ({meaning}), got {getattr(config, name)}")
    for name in ("lr", "head_decay", "ttt_decay"):
        if not getattr(config, name) > 0:  # also refuses NaN
            raise ValueError(f"config key {name!r} must be > 0, got {getattr(config, name)}")
    if config.lr > MAX_LR:
        raise ValueError(f"config key 'lr' must be <= {MAX_LR:g}, got {config.lr:g}: AdamW's first step would overflow "
                         "float32. Drafters train at lr of about 1e-4 to 1e-2")
    if not 0.0 <= config.eval_fraction < 1.0:
        raise ValueError(f"config key 'eval_fraction' must be in [0, 1), got {config.eval_fraction}")
    if not 0.0 <= config.lora_dropout < 1.0:
        raise ValueError(f"config key 'lora_dropout' must be in [0, 1), got {config.lora_dropout}")


def check_drafter_options(kind: str, options: dict) -> None:
    """drafter_options name fields of the kind's config, and a tree is a mapping; values are checked by the
    kind's config when the drafter is built, once the target has loaded."""
    import heads

    config_cls = heads.REGISTRY[kind].config_cls
    known = list(config_cls.__dataclass_fields__)
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = sorted({c for k in unknown for c in difflib.get_close_matches(k, known, n=1)})
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"config key 'drafter_options': unknown {kind} options {unknown}{hint}")
    if "tree" in options and not isinstance(options["tree"], dict | None):
        raise TypeError(f"config key 'drafter_options' gives tree as {type(options['tree']).__name__} "
                        f"{options['tree']!r}; it is a mapping of tree settings, e.g. {{top_k: 4}}")


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)
