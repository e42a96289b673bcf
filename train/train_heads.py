"""Train a drafter (Medusa heads, EAGLE-1/2 or EAGLE-3) for a frozen target with accelerate.

    accelerate launch train/train_heads.py --config configs/smollm2_eagle.yaml [key=value ...]
    python train/train_heads.py --config configs/smollm2_eagle.yaml max_steps=200 --resume

One process on CPU, DDP over several (`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 ...`; accelerate's
own multi-CPU launch needs MPI), DeepSpeed ZeRO-2/3 and bf16/fp16 on GPUs through the accelerate config
files in configs/. Every field is documented in train/config.py.

The loop: validate config and data, build the drafter, prepare features (online, or an offline cache),
then repeat {batch (one sample a row, or packed rows: train/packing.py) -> target features -> objective ->
optimizer step}, evaluating on the held-out split (the drafter with the best simulated acceptance kept in
<output_dir>/best, the run ended early when it stops rising, if asked) and checkpointing every N steps; a
checkpoint holds model, optimizer, scheduler, RNG, data position, history and counters, so `--resume`
continues exactly where a killed run stopped.

Runs are never lost or mixed: a new run in an output_dir that holds one is refused unless `--resume` or
`--overwrite`, and `--overwrite` moves the old run aside only once the new run's data and target have loaded,
deleting it when the new run has saved a checkpoint or its drafter. Each checkpoint ends with a manifest (its
files, their sizes, the run's settings, fingerprints of its data and target), so a checkpoint torn by a kill
during its save is skipped for the previous intact one, and resuming with settings that change the training,
or after the data or the target's weights changed, is refused by name.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable, not train/ itself
    _root = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [_root] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402

import heads  # noqa: E402
from heads.folders import written_whole  # noqa: E402
from heads.hub import check_push  # noqa: E402
from heads.losses import StepStats  # noqa: E402
from train.config import TrainConfig, load_config, to_dict, validate  # noqa: E402
from train.data import (  # noqa: E402
    collate,
    conversations_fingerprint,
    epoch_batches,
    load_rows,
    read_conversations,
    samples_fingerprint,
    split_samples,
    tokenize_conversations,
)
from train.features import FeatureCache, OfflineFeatures, OnlineFeatures, cache_key, needed_layers  # noqa: E402
from train.objectives import build_objective  # noqa: E402
from train.packing import pack_collate  # noqa: E402
from train.sharding import check_sharding, place_target  # noqa: E402
from train.target import load_target, target_fingerprint  # noqa: E402

ESTIMATE_NOTE = ("estimated from teacher-forced held-out text (per-step top-1 accuracy), not measured by "
                 "speculative decoding")
BEST = "best"  # <output_dir>/best: the drafter of the evaluation with the highest simulated_tau (keep_best)
RUN_FILES = ("checkpoints", "drafter", BEST, "history.jsonl", "result.json")  # what makes an output_dir used
UNTIMED_STEPS = 3  # optimizer steps left out of the measured pace (result["seconds_per_step"])
MANIFEST = "checkpoint.json"  # written last in a checkpoint: its files and sizes, the run's settings and inputs
PREVIOUS_RUN = "previous_run"  # overwrite=true moves the old run here until the new run has saved something
# Settings a resumed run may change: they decide logging, evaluation and where files go, not the weights.
RESUMABLE_CHANGES = {"resume", "overwrite", "output_dir", "log_every", "eval_every", "save_every",
                     "keep_checkpoints", "halt_after_steps", "max_train_minutes", "report_to", "wandb_project", "run_name",
                     "push_to_hub", "progress_bar", "feature_cache_dir", "max_eval_samples", "eval_steps_depth",
                     "keep_best", "early_stop_patience"}
# Settings a resumed run may change with a warning: extending (or shortening) a run is a common wish, and only
# the learning-rate schedule after the checkpoint differs (it follows the new total).
WARNED_CHANGES = {"max_steps", "epochs"}


@dataclass
class Progress:
    """Where the loop is; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # next micro-batch index within the epoch
    assistant_tokens_seen: int = 0  # trained (loss-mask) tokens, this process
    history: list = field(default_factory=list)  # one record per optimizer step
    best_tau: float = 0.0  # the highest simulated_tau of an evaluation so far (keep_best, early_stop_patience)
    best_step: int = 0  # the step it was measured at (0 = none yet)
    evals_since_best: int = 0  # evaluations since then that did not beat it

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in state:  # a checkpoint saved before a field existed keeps its default
                setattr(self, f.name, state[f.name])


def make_accelerator(config: TrainConfig):
    from accelerate import Accelerator

    kwargs = {}
    if config.report_to == "wandb":
        kwargs["log_with"] = "wandb"
    return Accelerator(gradient_accumulation_steps=config.grad_accum,
                       mixed_precision=resolve_mixed_precision(config.mixed_precision),
                       step_scheduler_with_optimizer=False, project_dir=config.output_dir, **kwargs)


def resolve_mixed_precision(setting: str) -> str:
    """accelerate's mixed precision for `setting`: "auto" is bf16 where the hardware multiplies bf16 natively (a CUDA
    GPU that supports it; a CPU with AVX512-BF16 or AMX, where bf16 autocast trained the SmolLM2 EAGLE-3 drafter 2.3x
    faster than fp32 with the same losses, docs/benchmarks.md) and no elsewhere (emulated bf16 is slower than fp32)."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_multiplies_bf16() else "no"


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 multiply instructions (x86 AVX512-BF16 or AMX-BF16)."""
    from infer.cpu.linear import cpu_flags

    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def make_drafter(config: TrainConfig, target, tokenizer, train_set):
    """A fresh drafter for the target (or the saved one in `drafter_init`), checked against it."""
    if config.drafter_init:
        drafter = heads.load(config.drafter_init)
        if drafter.kind != config.drafter:
            raise ValueError(f"drafter_init {config.drafter_init!r} holds a {drafter.kind} drafter, but the "
                             f"config says drafter: {config.drafter}")
        drafter.check_target(target, tokenizer)
        drafter.attach(target, tokenizer)
        # What was measured on or recorded for the starting weights does not describe the trained ones: its
        # provenance moves under initialized_from, and its calibration (tree statistics, the lookup-first
        # default) and metrics are dropped, so calibrate the new drafter again (scripts/calibrate.py --write).
        c = drafter.config
        c.training = {"initialized_from": {"drafter": str(config.drafter_init), "training": c.training,
                                           "metrics": c.metrics}}
        c.calibration, c.lookup_first, c.metrics = None, None, None
        return drafter.to(target.device)
    drafter = heads.build(config.drafter, target, tokenizer=tokenizer, **config.drafter_options)
    # The name the user gave (a short name, hub id or folder), not the folder it resolved to.
    drafter.config.base_model_name_or_path = config.target
    prepare = heads.get_kind(drafter.kind).prepare
    if prepare is not None:
        prepare(drafter, target, train_set)  # fitted to the training data (e.g. a draft vocabulary)
    return drafter


def add_lora(config: TrainConfig, target):
    """Medusa-2: LoRA adapters on the target, trained with the heads."""
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in target.named_modules()]
    missing = [m for m in config.lora_target_modules if not any(n == m or n.endswith("." + m) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"config key 'lora_target_modules' names {missing}, which match no module of the target; "
                         f"its linear layers are {linear}")
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), bias="none")
    return get_peft_model(target, lora)


def make_features(config, accelerator, target, drafter, samples, pad_id, split: str, fingerprint: str):
    soft = config.loss != "hard"
    layers = needed_layers(drafter, drafter.config.target_num_layers, soft)
    if config.lora_r > 0:
        return None  # Medusa-2 runs its adapted target inside the objective
    # A sharded target's forward is collective, and processes evaluate unequal numbers of batches: its held-out
    # features are cached, and every process builds a cache with the others (train/sharding.py).
    sharded = config.target_sharding != "none"
    if config.features == "online" and not (sharded and split == "eval"):
        return OnlineFeatures(target, layers)
    key = cache_key(f"{config.target}:{fingerprint}", samples, layers, config.feature_dtype)
    with contextlib.nullcontext() if sharded else accelerator.main_process_first():
        cache = FeatureCache.build(target, samples, layers, config.feature_cache_dir, key,
                                   dtype=config.feature_dtype, batch_size=config.batch_size, pad_id=pad_id,
                                   progress=config.progress_bar and accelerator.is_main_process,
                                   description=f"{split} features")
    if accelerator.is_main_process:
        print(f"[features] {split}: {len(samples)} samples cached at {cache.folder}", flush=True)
    return OfflineFeatures(cache, accelerator.device)


def make_scheduler(config: TrainConfig, optimizer, total_steps: int):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.lr_schedule == "constant":
            return 1.0
        done = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        if config.lr_schedule == "linear":
            return max(0.0, 1.0 - done)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def move(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def feature_batch(features, batch):
    if features is None:
        return {}
    return {k: v.float() for k, v in features.batch(batch).items()}


@torch.no_grad()
def evaluate(config, accelerator, objective, eval_set, features, pad_id) -> dict:
    """Per-step (per-head) top-1/top-3, the estimated accepted length and the simulated acceptance of the
    drafter's own tree (`simulated_tau`, heads.losses.simulated_tau) on the held-out split."""
    if not eval_set:
        return {}
    objective = accelerator.unwrap_model(objective)
    was_training = objective.training
    objective.eval()
    kind = heads.get_kind(objective.drafter.kind)
    steps = kind.eval_depth(objective.drafter, config)
    stats = StepStats(steps, device=accelerator.device)
    lengths = [len(s.input_ids) for s in eval_set]
    batches = epoch_batches(lengths, config.batch_size, 0, 0, True)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for indices in batches[accelerator.process_index::accelerator.num_processes]:
        batch = make_batch(config, eval_set, indices, pad_id, accelerator.device)
        with accelerator.autocast():
            loss, _ = objective(batch, feature_batch(features, batch), stats=stats, steps=steps)
        loss_sum[0] += loss.detach().double() * len(indices)
        loss_sum[1] += len(indices)
    packed = accelerator.reduce(torch.cat([stats.tensor(), loss_sum]), reduction="sum")
    stats = StepStats.from_tensor(packed[:-2].cpu())
    out = stats.summary(kind.depth_label, objective.drafter.config.tree)
    out["eval_loss"] = round(float(packed[-2] / packed[-1].clamp(min=1)), 5)
    objective.train(was_training)
    return out


def checkpoints(config: TrainConfig) -> list[Path]:
    """The step_<n> folders in <output_dir>/checkpoints, oldest first, intact or not."""
    folder = Path(config.output_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if re.fullmatch(r"step_\d+", p.name))


def torn_reason(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (a kill during its save, a lost file), or None."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST}, so its save did not finish"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{MANIFEST} is damaged"
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} is {(path / name).stat().st_size} bytes, but {size} were written"
    return None


def save_checkpoint(config, accelerator, step: int, fingerprints: dict) -> None:
    """accelerate's state (model, optimizer, scheduler, RNG, `Progress`), then the manifest that marks it whole:
    its files, the run's settings and the `fingerprints` of its inputs, which a resume checks."""
    path = Path(config.output_dir) / "checkpoints" / f"step_{step:08d}"
    if accelerator.is_main_process and path.exists():
        shutil.rmtree(path)  # torn by a kill during this same save in an earlier attempt
    accelerator.wait_for_everyone()
    with disk_full_named(config, path, f"the checkpoint of step {step}", partial=path):
        accelerator.save_state(str(path))
    accelerator.wait_for_everyone()  # every process has written its RNG state
    if accelerator.is_main_process:
        files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
        with disk_full_named(config, path, f"the checkpoint of step {step}", partial=path):
            write_atomic(path / MANIFEST, json.dumps({"step": step, "config": to_dict(config), "files": files,
                                                      "inputs": fingerprints}, indent=1) + "\n")
        intact = [p for p in checkpoints(config) if torn_reason(p) is None]
        for old in checkpoints(config):
            if old not in intact[-config.keep_checkpoints:]:
                shutil.rmtree(old)
        drop_previous_run(config)
    accelerator.wait_for_everyone()


# How a full disk surfaces: errno from Python's own writes, torch's zip writer's messages (it checks the
# position after each write, so a short write reads as an "unexpected pos") and safetensors' Rust I/O error.
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DISK_FULL_MESSAGES = ("unexpected pos", "file write failed", "No space left on device", "StorageFull")
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def is_disk_full(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
        return True
    return any(m in str(err) for m in DISK_FULL_MESSAGES)


@contextlib.contextmanager
def disk_full_named(config: TrainConfig, folder: Path, what: str, partial: Path | None = None):
    """A full disk while writing `what` into `folder`, said as such and where, rather than as torch's writer
    error. `partial`, the half-written folder, is removed: it frees the space it took, and the previous
    checkpoint (or best/) stays the newest intact one."""
    try:
        yield
    except WRITE_ERRORS as err:
        if not is_disk_full(err):
            raise
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        out = Path(config.output_dir)
        free = shutil.disk_usage(out).free if out.is_dir() else 0
        intact = [p for p in checkpoints(config) if torn_reason(p) is None]
        kept = f"The newest intact checkpoint is {intact[-1]}" if intact else "No checkpoint was saved before it"
        removed = f"; the partial {partial.name} was removed" if partial is not None else ""
        raise OSError(errno.ENOSPC, f"writing {what} into {folder} failed: the disk is full ({free / 2**20:.0f} MiB "
                      f"free on the filesystem of {out}; {err}){removed}. {kept}. Free space there (fewer "
                      "keep_checkpoints, or output_dir on a larger disk), then continue with resume=true") from err


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file and rename it: a kill leaves the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resume_checkpoint(config: TrainConfig) -> Path:
    """The newest intact checkpoint, made with the same settings; torn newer ones are skipped with a warning."""
    folder = Path(config.output_dir) / "checkpoints"
    found = checkpoints(config)
    if not found:
        aside = Path(config.output_dir) / PREVIOUS_RUN
        hint = f" ({aside} holds the run that overwrite=true replaced: move its files back to resume it)" \
            if aside.exists() else ""
        raise ValueError(f"resume=true but no checkpoint in {folder}; start the run without resume{hint}")
    torn = []
    for path in reversed(found):
        reason = torn_reason(path)
        if reason is None:
            break
        torn.append(f"{path.name} ({reason})")
    else:
        raise ValueError(f"resume=true but no intact checkpoint in {folder}: {'; '.join(torn)}. Start again with "
                         "overwrite=true")
    if torn:
        warnings.warn(f"resuming from {path.name}, the newest intact checkpoint in {folder}; skipped torn "
                      f"{'; '.join(torn)}, which the next checkpoint save removes", stacklevel=2)
    saved = json.loads((path / MANIFEST).read_text())["config"]
    changed = {k: f"{k}: {saved[k]!r} -> {v!r}" for k, v in to_dict(config).items()
               if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v}
    refused = [text for k, text in changed.items() if k not in WARNED_CHANGES]
    if refused:
        raise ValueError(f"resume=true, but these settings differ from the run saved in {path}: "
                         f"{', '.join(refused)}. They change the training, so resume with the run's values, or "
                         "start a new run (another output_dir, or overwrite=true).")
    if changed:
        warnings.warn(f"resuming {path} with {', '.join(changed.values())}: the run's length changed, so the "
                      "learning-rate schedule after the checkpoint follows the new total", stacklevel=2)
    if saved.get("save_every") and not config.save_every:
        warnings.warn(f"resuming {path}, a run that saved a checkpoint every {saved['save_every']} steps, with "
                      "save_every=0: this run saves no checkpoint, so a kill loses every step after "
                      f"{path.name}. Pass save_every={saved['save_every']} to keep checkpointing", stacklevel=2)
    return path


def prepare_output_dir(config: TrainConfig, accelerator) -> Path | None:
    """Check output_dir before anything expensive; returns the checkpoint to resume from, if resuming.

    A new run never lands on another run's files (a later --resume would pick up the old checkpoints, and
    the old history would be overwritten) unless overwrite=true, which moves them aside once every input of
    the new run has loaded (`set_aside_old_run`).
    """
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} is a file, not a folder; choose another output_dir")
    resume_from = resume_checkpoint(config) if config.resume else None
    used = [name for name in (*RUN_FILES, PREVIOUS_RUN) if (out / name).exists()]
    if used and not (config.resume or config.overwrite):
        raise ValueError(f"output_dir {str(out)!r} already holds a run ({', '.join(used)}): continue it with "
                         "resume=true (--resume), replace it with overwrite=true (--overwrite), or choose "
                         "another output_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"output_dir {str(out)!r} cannot be created ({err}); choose another output_dir") from None
    accelerator.wait_for_everyone()
    return resume_from


def set_aside_old_run(config: TrainConfig, accelerator) -> None:
    """overwrite=true: move the old run's files into <output_dir>/previous_run, called once the new run's data,
    target and drafter have loaded and been checked. They are deleted when the new run saves a checkpoint or
    its drafter (`drop_previous_run`), so a new run that fails before then leaves the old one to move back."""
    out = Path(config.output_dir)
    used = [name for name in RUN_FILES if (out / name).exists()]
    if config.overwrite and used and accelerator.is_main_process:
        aside = out / PREVIOUS_RUN
        if aside.exists() and not holds_saved_work(config):
            # An earlier overwrite stopped before saving anything: the run worth keeping is the one aside.
            print(f"[output] overwrite=true: deleting {', '.join(used)} in {out}, left by a run that saved "
                  f"nothing; the run before it stays in {aside}", flush=True)
            for name in used:
                if (out / name).is_dir():
                    shutil.rmtree(out / name)
                else:
                    (out / name).unlink()
        else:
            shutil.rmtree(aside, ignore_errors=True)
            aside.mkdir()
            for name in used:
                os.replace(out / name, aside / name)
            print(f"[output] overwrite=true: moved {', '.join(used)} to {aside}; deleted once this run saves a "
                  "checkpoint or its drafter", flush=True)
    accelerator.wait_for_everyone()


def holds_saved_work(config: TrainConfig) -> bool:
    """Whether output_dir holds an intact checkpoint or a saved drafter (not just a history)."""
    drafter = Path(config.output_dir) / "drafter" / "config.json"
    return drafter.is_file() or any(torn_reason(p) is None for p in checkpoints(config))


def drop_previous_run(config: TrainConfig) -> None:
    """The new run has saved something to resume or use: the run it replaces (overwrite=true) goes."""
    aside = Path(config.output_dir) / PREVIOUS_RUN
    if aside.exists():
        shutil.rmtree(aside)
        print(f"[output] deleted the replaced run in {aside}", flush=True)


def save_drafter(config, accelerator, objective, lora_target, result: dict, data_info: dict,
                 folder: Path | None = None) -> Path:
    """The drafter (and Medusa-2's target adapter) with its training record and held-out metrics, into
    `folder` (<output_dir>/drafter)."""
    out = folder or Path(config.output_dir) / "drafter"
    if not accelerator.is_main_process:
        return out
    drafter = accelerator.unwrap_model(objective).drafter
    training = dict(drafter.config.training or {})
    training.update(data_info)
    training.update({
        "kind": config.drafter, "steps": result["step"], "loss": config.loss, "features": config.features,
        "ttt_steps": config.ttt_steps if heads.get_kind(config.drafter).unrolled else None,
        "world_size": accelerator.num_processes, "wall_seconds": result["wall_seconds"],
        "train_config": to_dict(config),
    })
    if lora_target is not None:
        training["target_adapter"] = "target_adapter"  # LoRA on the target: the heads need it (Medusa-2)
        training["requires_lora_target"] = True
    drafter.config.training = training
    drafter.config.metrics = {**result.get("eval", {}), "note": ESTIMATE_NOTE} if result.get("eval") else None
    drafter.save_pretrained(out)
    if lora_target is not None:
        accelerator.unwrap_model(objective).lora_target.save_pretrained(out / "target_adapter")
    return out


@dataclass
class Inputs:
    """Everything the loop reads, prepared and checked before any training starts."""

    target: object
    tokenizer: object
    train_set: list
    eval_set: list
    data_stats: object
    pad_id: int
    drafter: object
    lora_target: object
    train_features: object
    eval_features: object
    feature_seconds: float
    total_steps: int  # optimizer steps the run makes
    fingerprints: dict  # of the data, the target's weights and the tokenized samples; checkpoints record them


def prepare_inputs(config: TrainConfig, accelerator, checkpoint: Path | None = None) -> Inputs:
    # Data, then target and drafter: every check that can fail does so before the target loads (data) or
    # before features are computed (everything else). Resuming, each input must be the checkpoint's.
    check_sharding(config.target_sharding, accelerator.num_processes, lora_r=config.lora_r)
    recorded = recorded_inputs(checkpoint)
    conversations, data_stats = read_conversations(load_rows(config.data, config.data_split), config.max_samples)
    fingerprints = {"data": conversations_fingerprint(conversations)}
    check_unchanged(recorded, fingerprints, config, checkpoint)
    if config.drafter_init:
        heads.check_source(config.drafter_init)
    target, tokenizer = load_target(config.target, config.target_dtype)
    fingerprints["target"] = target_fingerprint(target)
    check_unchanged(recorded, fingerprints, config, checkpoint)
    place_target(target, config.target_sharding, accelerator)
    samples, data_stats = tokenize_conversations(conversations, data_stats, tokenizer, config.max_length)
    check_context(config, target, samples)
    fingerprints["samples"] = samples_fingerprint(samples)
    check_unchanged(recorded, fingerprints, config, checkpoint)
    train_set, eval_set = split_samples(samples, config.eval_fraction, config.max_eval_samples, config.seed)
    if config.eval_every and config.eval_fraction > 0 and not eval_set:
        raise ValueError(f"eval_every={config.eval_every} evaluates on held-out samples, but the {len(samples)} "
                         "training sample leaves none to hold out, so every evaluation would measure nothing (and "
                         "keep_best would write no best/): add data, or set eval_every: 0")
    data_stats.train, data_stats.eval = len(train_set), len(eval_set)
    total_steps = total_optimizer_steps(config, accelerator, [len(s.input_ids) for s in train_set])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    drafter = make_drafter(config, target, tokenizer, train_set)
    lora_target = add_lora(config, target) if config.lora_r > 0 else None
    if accelerator.is_main_process:
        print(f"[data] {json.dumps(asdict(data_stats))}", flush=True)
    tic = time.perf_counter()
    train_features = make_features(config, accelerator, target, drafter, train_set, pad_id, "train",
                                   fingerprints["target"])
    eval_features = make_features(config, accelerator, target, drafter, eval_set, pad_id, "eval",
                                  fingerprints["target"]) \
        if eval_set else None
    return Inputs(target, tokenizer, train_set, eval_set, data_stats, pad_id, drafter, lora_target,
                  train_features, eval_features, time.perf_counter() - tic, total_steps, fingerprints)


def check_context(config: TrainConfig, target, samples) -> None:
    """A sample longer than the target's context would train on positions the target never saw (and index
    past a learned position table): refuse it, naming max_length. Packed rows and sliding-window layers too."""
    text = target.config.get_text_config()
    context = getattr(text, "max_position_embeddings", None)
    longest = max(len(s.input_ids) for s in samples)
    if context and longest > context:
        raise ValueError(f"samples of up to {longest} tokens (max_length={config.max_length}) are longer than the "
                         f"target's context of {context} tokens (max_position_embeddings); set max_length <= "
                         f"{context}")
    sliding = [t for t in (getattr(text, "layer_types", None) or []) if "sliding" in t] or \
        (getattr(text, "layer_types", None) is None and getattr(text, "use_sliding_window", True))
    window = getattr(text, "sliding_window", None)
    if config.pack and sliding and window and window < config.max_length:
        raise ValueError(f"pack=true gives the target one block-diagonal mask for every layer, but its sliding-window "
                         f"layers see only {window} tokens and samples may be {config.max_length}: set max_length <= "
                         f"{window}, or pack: false")


# What differs when a fingerprint of `prepare_inputs` does, and what to restore.
INPUT_CHANGES = {
    "data": ("the data {data!r} changed", "the data the run started with"),
    "target": ("the target {target!r} has other weights or config", "the target's weights the run started with"),
    "samples": ("the same conversations tokenize differently: the target {target!r}'s tokenizer or chat template "
                "changed", "the target's tokenizer files the run started with"),
}


def recorded_inputs(checkpoint: Path | None) -> dict | None:
    """The fingerprints in a checkpoint's manifest; None when not resuming, or (warned) for a checkpoint saved
    before manifests held them."""
    if checkpoint is None:
        return None
    recorded = json.loads((checkpoint / MANIFEST).read_text()).get("inputs")
    if recorded is None:
        warnings.warn(f"resuming {checkpoint}, saved without fingerprints of its data and target: whether they "
                      "changed since cannot be checked; make sure they are the run's", stacklevel=3)
    return recorded


def check_unchanged(recorded: dict | None, fingerprints: dict, config: TrainConfig, checkpoint: Path | None) -> None:
    """Refuse a resume whose data, target weights or tokenization differ from its checkpoint's: the weights,
    optimizer and data position saved there belong to the old inputs."""
    for name, now in fingerprints.items():
        then = (recorded or {}).get(name)
        if then is None or then == now:
            continue
        what, restore = INPUT_CHANGES[name]
        raise ValueError(f"resume=true, but {what.format(data=config.data, target=config.target)} since {checkpoint} "
                         f"was saved ({name}: {then} -> {now}). Restore {restore}, or start a new run (another "
                         "output_dir, or overwrite=true).")


def total_optimizer_steps(config: TrainConfig, accelerator, lengths: list[int]) -> int:
    per_epoch = len(epoch_batches(lengths, config.batch_size, config.seed, 0, config.group_by_length,
                                  accelerator.process_index, accelerator.num_processes)) // config.grad_accum
    if per_epoch == 0:
        raise ValueError(f"{len(lengths)} training samples make less than one optimizer step "
                         f"(batch_size={config.batch_size}, grad_accum={config.grad_accum}, "
                         f"processes={accelerator.num_processes})")
    return config.max_steps or per_epoch * config.epochs


def resume(accelerator, checkpoint: Path | None, progress: Progress) -> None:
    if checkpoint is None:
        return
    accelerator.load_state(str(checkpoint))  # model, optimizer, scheduler, RNG states and `progress`
    if accelerator.is_main_process:
        print(f"[resume] from {checkpoint} at step {progress.step}", flush=True)


def open_history(config: TrainConfig, progress: Progress):
    """history.jsonl holds the records up to `progress` (a resumed run drops the steps after its
    checkpoint); the loop appends one line per step."""
    path = Path(config.output_dir) / "history.jsonl"
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in progress.history))
    return open(path, "a")


def micro_step(config, accelerator, run, batch, feats, step: int):
    """Forward and backward one micro-batch; the optimizer steps only when gradients are synced, and only on
    a finite loss and gradient (`check_finite`). Returns the loss as a float at a synced step (else None)
    and the objective's logs."""
    with accelerator.accumulate(run.objective):
        loss, logs = run.objective(batch, feats)
        accelerator.backward(loss)
        value = None
        if accelerator.sync_gradients:
            # max_grad_norm=0 clips nothing (an infinite bound) but still measures the norm the check reads.
            norm = accelerator.clip_grad_norm_(run.params, config.max_grad_norm or math.inf)
            value = check_finite(config, accelerator, step, loss, norm)
        run.optimizer.step()
        run.optimizer.zero_grad()
    return value, logs


def check_finite(config, accelerator, step: int, loss, norm) -> float:
    """The step's loss as a float, read together with the gradient norm (the step's one host read). A
    non-finite either stops the run before the optimizer applies it: the weights, checkpoints and drafter stay
    those of the last good step. The norm covers every micro-batch of the step; under fp16's loss scaling an
    overflowing gradient is normal (the scaler skips that step and lowers its scale), so only the loss counts
    there, as with DeepSpeed, which reports no norm before its step."""
    measured = [loss.detach().float().reshape(())]
    if torch.is_tensor(norm) and accelerator.scaler is None:
        measured.append(norm.detach().float().reshape(()).to(measured[0].device))
    values = torch.stack(measured).tolist()
    if all(math.isfinite(v) for v in values):
        return values[0]
    what = f"the loss is {values[0]}" + (f" and the gradient norm {values[1]}" if len(values) > 1 else "")
    raise FloatingPointError(diverged(config, step, what, "nothing of this step was applied or saved"))


def diverged(config: TrainConfig, step: int, what: str, kept: str) -> str:
    """Why a run stopped on a non-finite number at `step`, what it kept and the fixes."""
    intact = [p for p in checkpoints(config) if torn_reason(p) is None]
    last = f"the last checkpoint, {intact[-1]}, is as it was" if intact else "no checkpoint was saved before it"
    if step <= 1:  # nothing has been learned yet: the inputs, not the learning rate
        causes = ("It failed at the first step, before any update: look at the inputs. A float16 target overflows "
                  "(target_dtype: bfloat16 or float32), as can mixed_precision: fp16 (use bf16 or no); a drafter_init "
                  "may hold non-finite weights")
    else:
        causes = (f"The run diverged: lower lr (now {config.lr}), raise warmup_steps (now {config.warmup_steps})"
                  + ("" if config.max_grad_norm else ", clip gradients with max_grad_norm > 0 (now 0)")
                  + "; start again with overwrite=true, since a resume keeps the run's lr")
    return f"training stopped at step {step}: {what} (not finite); {kept}, and {last}. {causes}."


def check_weights(config: TrainConfig, run, step: int) -> None:
    """Before a save: the trainable weights are finite (one host read), so no checkpoint or drafter holds
    NaN or inf. An optimizer step can overflow them from a finite gradient when lr is huge."""
    if not run.params or torch.stack([torch.isfinite(p.detach()).all() for p in run.params]).all():
        return
    raise FloatingPointError(diverged(config, step, "some of the drafter's weights are NaN or inf after the "
                                      "optimizer step", "nothing of it was saved"))


def data_info(config: TrainConfig, inputs: Inputs) -> dict:
    return {"data": config.data, "train_samples": len(inputs.train_set), "eval_samples": len(inputs.eval_set),
            "max_length": config.max_length, "pack": config.pack, "data_stats": asdict(inputs.data_stats)}


def write_outputs(config, accelerator, objective, inputs: Inputs, result: dict) -> None:
    """The drafter folder and result.json, then the upload (push_to_hub), whose outcome result.json records:
    an upload that fails loses none of the training's results (`train` reports it once the run has ended)."""
    with disk_full_named(config, Path(config.output_dir) / "drafter", "the trained drafter"):
        result["drafter_dir"] = str(save_drafter(config, accelerator, objective, inputs.lora_target, result,
                                                 data_info(config, inputs)))
    if not accelerator.is_main_process:
        return
    write_result(config, result)
    drop_previous_run(config)
    if config.push_to_hub:
        result["push_to_hub"] = upload(config, accelerator.unwrap_model(objective).drafter)
        write_result(config, result)


def write_result(config: TrainConfig, result: dict) -> None:
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "result.json", json.dumps({k: v for k, v in result.items() if k != "history"}, indent=2) + "\n")


def upload(config: TrainConfig, drafter) -> dict:
    """Push the trained drafter to push_to_hub; what happened, for result.json (a failure is not raised here,
    so the caller has written the run's results first)."""
    from huggingface_hub.errors import HTTPError

    try:
        url = drafter.push_to_hub(config.push_to_hub)
    except (OSError, ValueError, HTTPError) as err:  # the Hub's answers, the network's failures
        return {"repo_id": config.push_to_hub, "error": f"{type(err).__name__}: {err}"}
    print(f"[hub] pushed the drafter to https://huggingface.co/{config.push_to_hub}: {url}", flush=True)
    return {"repo_id": config.push_to_hub, "commit": url}


def check_uploaded(config: TrainConfig, result: dict) -> None:
    """Say that the upload failed, after training and its results were kept."""
    error = (result.get("push_to_hub") or {}).get("error")
    if error:
        raise RuntimeError(f"training finished and its drafter is saved in {result['drafter_dir']} (results in "
                           f"{Path(config.output_dir) / 'result.json'}), but uploading it to the Hub repo "
                           f"{config.push_to_hub} failed: {error}. Upload it again with: python scripts/push_to_hub.py "
                           f"{config.output_dir} --repo-id {config.push_to_hub}")


@dataclass
class Run:
    """What the optimizer steps change, prepared by accelerate; `progress` is saved with every checkpoint."""

    objective: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list
    progress: Progress
    t_start: float  # when train() began: the best drafter's wall_seconds


def setup_run(config: TrainConfig, accelerator, inputs: Inputs, checkpoint: Path | None, t_start: float) -> Run:
    """Objective, optimizer and schedule, prepared by accelerate; resumed from `checkpoint` if given; trackers."""
    objective = build_objective(inputs.drafter, config, inputs.lora_target).train()
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = make_scheduler(config, optimizer, inputs.total_steps)
    if accelerator.distributed_type.name == "DEEPSPEED":
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = config.batch_size
    objective, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resume(accelerator, checkpoint, progress)
    set_aside_old_run(config, accelerator)  # overwrite=true: every input has loaded, so the old run may go
    if config.report_to == "wandb":
        accelerator.init_trackers(config.wandb_project, config=to_dict(config), init_kwargs={"wandb": {
            "name": config.run_name or f"{config.drafter}-{Path(config.target).name}", "dir": config.output_dir}})
    return Run(objective, optimizer, scheduler, params, progress, t_start)


class Pace:
    """Wall time of the optimizer steps and the tokens they trained on, this process.

    `seconds_per_step` leaves out the first steps: kernel choice and allocator warm-up make them several times
    slower on a GPU, and a budget sized from them would stop far short (train/budget.py). Tokens per second
    count the micro-batches' tokens (padding not counted) over the time from a step's first batch to its
    optimizer step (evaluations and checkpoint saves are not training time), over the steps since the last
    log line: a timing differs between two runs of the same steps, so it goes only into logged records, and
    a resumed run's history (log_every=0) stays that of the uninterrupted one.
    """

    def __init__(self, step: int):
        self.t_train = time.perf_counter()
        self.untimed = step + UNTIMED_STEPS
        self.t_steady: float | None = None
        self.t_step: float | None = None
        self.step_tokens = 0
        self.window = [0, 0.0]  # tokens and seconds since the last log line
        self.total = [0, 0.0]

    def batch(self, batch: dict) -> None:
        if self.t_step is None:
            self.t_step = time.perf_counter()
        self.step_tokens += int(batch["attention_mask"].sum())

    def stepped(self, step: int) -> dict:
        """Record fields of the optimizer step just made: the tokens it trained on."""
        seconds = max(time.perf_counter() - self.t_step, 1e-9)
        for acc in (self.window, self.total):
            acc[0], acc[1] = acc[0] + self.step_tokens, acc[1] + seconds
        record = {"tokens": self.step_tokens}
        self.t_step, self.step_tokens = None, 0
        if step == self.untimed:
            self.t_steady = time.perf_counter()
        return record

    def rate(self) -> float:
        """Tokens per second since the last call."""
        tokens, seconds = self.window
        self.window = [0, 0.0]
        return round(tokens / max(seconds, 1e-9), 1)

    def result(self, step: int) -> dict:
        out = {"train_seconds": round(time.perf_counter() - self.t_train, 1)}
        if self.t_steady is not None and step > self.untimed:
            out["seconds_per_step"] = round((time.perf_counter() - self.t_steady) / (step - self.untimed), 4)
        if self.total[1]:
            out["tokens_per_second"] = round(self.total[0] / self.total[1], 1)  # per process
        return out


class StepLog:
    """history.jsonl (one record per optimizer step), the progress bar and its log lines."""

    def __init__(self, config: TrainConfig, accelerator, progress: Progress, total: int):
        from tqdm.auto import tqdm

        self.config, self.accelerator, self.total = config, accelerator, total
        self.main = accelerator.is_main_process
        self.file = open_history(config, progress) if self.main else None
        self.bar = tqdm(total=total, initial=progress.step, disable=not (self.main and config.progress_bar),
                        desc="train")

    def write(self, progress: Progress, record: dict, pace: Pace) -> None:
        logged = self.config.log_every and progress.step % self.config.log_every == 0
        if logged:
            record["tokens_per_second"] = pace.rate()  # this process's, since the last log line
        progress.history.append(record)
        self.bar.update(1)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if logged:
            self.accelerator.log(record, step=progress.step)
            self.say(f"[train] step {progress.step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                     f"{record['tokens_per_second']:.0f} tokens/s")

    def say(self, line: str) -> None:
        if self.main:
            self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def make_batch(config: TrainConfig, samples: list, indices: list[int], pad_id: int, device) -> dict:
    """The micro-batch of samples[indices]: packed rows of max_length tokens (pack=true), or one sample a row."""
    chosen = [samples[i] for i in indices]
    batch = pack_collate(chosen, indices, pad_id, config.max_length) if config.pack else \
        collate(chosen, indices, pad_id)
    return move(batch, device)


def track_best(config: TrainConfig, accelerator, inputs: Inputs, run: Run, metrics: dict, say) -> bool:
    """After an evaluation: keep the drafter in <output_dir>/best when its simulated acceptance beats every
    earlier evaluation's (keep_best); True when early_stop_patience evaluations in a row did not."""
    tau, progress = metrics.get("simulated_tau"), run.progress
    if tau is None:
        return False
    if tau > progress.best_tau:
        progress.best_tau, progress.best_step, progress.evals_since_best = tau, progress.step, 0
        if config.keep_best:
            save_best(config, accelerator, run, inputs, metrics)
        return False
    progress.evals_since_best += 1
    if config.early_stop_patience and progress.evals_since_best >= config.early_stop_patience:
        say(f"[eval] simulated_tau has not beaten {progress.best_tau} (step {progress.best_step}) in "
                f"{progress.evals_since_best} evaluations (early_stop_patience): ending the run here")
        return True
    return False


def save_best(config: TrainConfig, accelerator, run: Run, inputs: Inputs, metrics: dict) -> None:
    """The drafter as it is now into <output_dir>/best, swapped in whole (`heads.folders.written_whole`): a kill
    leaves the previous best and never half of one."""
    best = Path(config.output_dir) / BEST
    if accelerator.is_main_process:
        record = {"step": run.progress.step, "eval": metrics,
                  "wall_seconds": round(time.perf_counter() - run.t_start, 1)}
        with written_whole(best) as partial, disk_full_named(config, best, "the best drafter", partial=partial):
            save_drafter(config, accelerator, run.objective, inputs.lora_target, record, data_info(config, inputs),
                         folder=partial)
    accelerator.wait_for_everyone()


def after_step(config: TrainConfig, accelerator, inputs: Inputs, run: Run, log: StepLog, pace: Pace,
               record: dict) -> str | None:
    """Evaluate, log, checkpoint, keep the best; the reason to stop the loop here, if any."""
    progress, total = run.progress, inputs.total_steps
    stop = None
    evaluating = config.eval_every and progress.step % config.eval_every == 0 and progress.step < total
    saving = config.save_every and progress.step % config.save_every == 0
    if evaluating or saving:
        check_weights(config, run, progress.step)
    if evaluating:
        metrics = checked_evaluation(config, accelerator, inputs, run)
        record.update({f"eval/{k}": v for k, v in metrics.items()})
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=progress.step)
        log.say(f"[eval] step {progress.step}: {json.dumps(metrics)} ({ESTIMATE_NOTE})")
        if track_best(config, accelerator, inputs, run, metrics, log.say):
            stop = "stopped_early"
    log.write(progress, record, pace)
    if saving:
        save_checkpoint(config, accelerator, progress.step, inputs.fingerprints)
    if config.halt_after_steps and progress.step >= config.halt_after_steps:
        return "halted"  # as if killed: no final evaluation, no drafter folder
    if config.max_train_minutes and out_of_time(accelerator, pace, config.max_train_minutes):
        log.say(f"[train] max_train_minutes={config.max_train_minutes} spent at step {progress.step}/{total}: "
                "ending the run here")
        return "out_of_time"  # ends like max_steps: final evaluation and drafter folder
    return stop


def out_of_time(accelerator, pace: Pace, minutes: float) -> bool:
    """Whether the time budget is spent, decided by all processes together: each reads its own clock, and one that
    left the loop alone would leave the others waiting in their next collective for ever."""
    spent = time.perf_counter() - pace.t_train >= 60 * minutes
    if accelerator.num_processes == 1:
        return spent
    return bool(accelerator.reduce(torch.tensor([float(spent)], device=accelerator.device), reduction="sum").item())


def checked_evaluation(config: TrainConfig, accelerator, inputs: Inputs, run: Run) -> dict:
    """`evaluate` on the held-out split; a non-finite eval_loss stops the run as a non-finite training loss
    does, rather than reporting the simulated_tau of 1.0 that NaN predictions score."""
    metrics = evaluate(config, accelerator, run.objective, inputs.eval_set, inputs.eval_features, inputs.pad_id)
    loss = metrics.get("eval_loss")
    if loss is not None and not math.isfinite(loss):
        raise FloatingPointError(diverged(config, run.progress.step, f"the held-out eval_loss is {loss}",
                                          "this evaluation's drafter was not kept"))
    return metrics


def train_loop(config: TrainConfig, accelerator, inputs: Inputs, run: Run) -> dict:
    """Micro-batches in each epoch's fixed order, from where a resumed run left off, until the run's steps are
    done or something stops it; returns the loop's part of the result."""
    progress, total = run.progress, inputs.total_steps
    lengths = [len(s.input_ids) for s in inputs.train_set]
    log, pace = StepLog(config, accelerator, progress, total), Pace(progress.step)
    stop = None
    while progress.step < total and stop is None:
        batches = epoch_batches(lengths, config.batch_size, config.seed, progress.epoch, config.group_by_length,
                                accelerator.process_index, accelerator.num_processes)
        usable = len(batches) - len(batches) % config.grad_accum
        while progress.batch < usable and progress.step < total and stop is None:
            batch = make_batch(config, inputs.train_set, batches[progress.batch], inputs.pad_id, accelerator.device)
            pace.batch(batch)
            loss, logs = micro_step(config, accelerator, run, batch, feature_batch(inputs.train_features, batch),
                                    progress.step + 1)
            progress.batch += 1
            progress.assistant_tokens_seen += int(batch["loss_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            run.scheduler.step()
            progress.step += 1
            record = {"step": progress.step, "loss": loss, "lr": run.scheduler.get_last_lr()[0],
                      **pace.stepped(progress.step), **{k: float(v) for k, v in logs.items()}}
            stop = after_step(config, accelerator, inputs, run, log, pace, record)
        if progress.batch >= usable:
            progress.epoch, progress.batch = progress.epoch + 1, 0
    log.close()
    result = {"halted": stop == "halted", **pace.result(progress.step)}
    if stop == "out_of_time":
        result["stopped_by_time_budget"] = {"max_train_minutes": config.max_train_minutes, "planned_steps": total}
    if stop == "stopped_early":
        result["stopped_early"] = {"early_stop_patience": config.early_stop_patience, "planned_steps": total}
    return result


def finish(config: TrainConfig, accelerator, inputs: Inputs, run: Run, result: dict) -> None:
    """The final evaluation (which may still be the best) and the drafter folder."""
    progress = run.progress
    check_weights(config, run, progress.step)
    metrics = checked_evaluation(config, accelerator, inputs, run)
    result.update(eval=metrics, wall_seconds=round(time.perf_counter() - run.t_start, 1))
    if accelerator.is_main_process and metrics:
        print(f"[eval] final step {progress.step}: {json.dumps(metrics)}\n[eval] est_accept_len* and "
              f"simulated_tau are {ESTIMATE_NOTE}", flush=True)
    accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=progress.step)
    if config.eval_every:  # the last weights may be the best
        track_best(config, accelerator, inputs, run, metrics, lambda line: None)
    if progress.best_step:
        result["best"] = {"step": progress.best_step, "simulated_tau": progress.best_tau,
                          "drafter_dir": str(Path(config.output_dir) / BEST) if config.keep_best else None}
    write_outputs(config, accelerator, run.objective, inputs, result)


def train(config: TrainConfig) -> dict:
    """Run a training; returns {"step", "history", "eval", "drafter_dir", ...}."""
    from accelerate.utils import set_seed

    t_start = time.perf_counter()
    validate(config)  # again: a TrainConfig built in Python has not been through load_config
    accelerator = make_accelerator(config)
    if config.push_to_hub and accelerator.is_main_process:
        check_push(config.push_to_hub)  # the Hub answers and takes the token, before the run's hours
    checkpoint = prepare_output_dir(config, accelerator)
    set_seed(config.seed)
    # 1. data, target, drafter and features (online, or an offline cache built once).
    inputs = prepare_inputs(config, accelerator, checkpoint)
    # 2. objective, optimizer, schedule; resume if asked.
    run = setup_run(config, accelerator, inputs, checkpoint, t_start)
    # 3. the loop.
    result = train_loop(config, accelerator, inputs, run)
    result.update(step=run.progress.step, history=run.progress.history,
                  feature_seconds=round(inputs.feature_seconds, 1),
                  assistant_tokens_seen=run.progress.assistant_tokens_seen)
    # 4. final evaluation and the drafter folder, unless halted as a kill would.
    if not result["halted"]:
        finish(config, accelerator, inputs, run, result)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    check_uploaded(config, result)
    return result


def config_keys_help() -> str:
    """Every key=value setting with its default and the comment beside it in TrainConfig, for --help."""
    source = inspect.getsource(TrainConfig)
    lines = ["settings (key=value, or keys of a --config YAML file):"]
    for match in re.finditer(r"^    (\w+): [^=\n]+= (.+?)(?:  # (.*))?$", source, flags=re.MULTILINE):
        name, default, comment = match.groups()
        lines.append(f"  {name} = {default.strip()}" + (f"\n      {comment}" if comment else ""))
    return "\n".join(lines)


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(description="Train a drafter for a frozen target (see train/config.py).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=config_keys_help())
    parser.add_argument("--config", help="YAML file of overrides to the defaults in train/config.py")
    parser.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in a used output_dir, replacing the old run's checkpoints and drafter")
    parser.add_argument("--push_to_hub", metavar="REPO_ID", help="push the trained drafter to this repo")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, type-checked")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.resume:
        overrides.append("resume=true")
    if args.overwrite:
        overrides.append("overwrite=true")
    if args.push_to_hub:
        overrides.append(f"push_to_hub={args.push_to_hub}")
    return load_config(args.config, overrides)


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
