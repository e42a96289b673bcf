"""The engine's plan where no generation needs timing: the drafter made from what the user passed, prepacked
weights, the streamed kernel's block sizes (`stream_rows`, timed once per machine) and the lean verify forward.

`infer.policy.settle` adds what does need generation timed (a calibrated tree, drafting at several rows); the
measurements that run the engine themselves (`infer.tuning.timing`, `infer.tuning.acceptance`) take their plan
from `engine` here, with the tree they measure given.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..cpu import lean_forward, linear
from ..drafters import DraftModelDrafter, LookupFirstDrafter, NgramDrafter, build_drafter, known
from ..drafting import Drafter
from ..engine import Engine
from ..loading import target_tokenizer
from ..options import EngineOptions, Plan
from ..target import check_maskable, max_positions
from .cache import device_name, digest, fingerprint, read_cache, write_cache


def check_target(target, options: EngineOptions) -> None:
    """A transformers causal LM whose context holds the static cache asked for and whose attention takes a tree mask."""
    if not isinstance(target, PreTrainedModel) or not hasattr(target, "generate"):
        raise TypeError(f"target must be a transformers causal LM, got {type(target).__name__}")
    max_len = max_positions(target.config)
    static = options.static_cache
    if static not in (True, None) and max_len and static > max_len:
        raise ValueError(f"static_cache={static} tokens is more than the target's context of {max_len} "
                         f"positions can use: pass at most {max_len}, or True (sized per call)")
    check_maskable(target)


def check_drafter(drafter) -> None:
    """Refuse a drafter class passed where a drafter is meant (its classmethods and attributes would half-work)."""
    if isinstance(drafter, type):
        raise TypeError(f"drafter is the class {drafter.__name__}, not a drafter: pass an instance (a trained "
                        "drafter from heads.load(<folder>) or heads.build(<kind>, target); an infer.Drafter made "
                        "by calling its class)")


def prepack_for(target, cpu_prepack: bool | None) -> bool:
    """Whether multi-row matmuls run prepacked: as asked, or for an fp32 CPU target that fits them (None)."""
    prepack = linear.worth_it(target) if cpu_prepack is None else cpu_prepack
    if prepack and not linear.available():
        raise ValueError("cpu_prepack=True needs torch built with oneDNN (mkldnn); pass cpu_prepack=False")
    return prepack


def prepack_default(target, prepack: bool | None) -> bool:
    """The measurements' reading of `prepack`: the engine's default for None, never where oneDNN is missing."""
    return linear.worth_it(target) if prepack is None else bool(prepack) and linear.available()


def as_drafter(drafter, target, tokenizer=None, lookup_first: bool | None = None,
               tree: dict | None = None) -> Drafter:
    """Turn what the user passed into a `Drafter`: a name from `infer.drafters.DRAFTERS` ("ngram", "gguf",
    "int8", "early_exit:8", ...), a heads model, a draft LM, or a Drafter.

    With `tokenizer`, a heads drafter also checks the tokenizer fingerprint it was trained with. With
    `lookup_first`, rows whose context repeats itself take a prompt-lookup chain instead; None = what a heads
    drafter's config says (`scripts/calibrate.py --write` measures it), off for any other drafter. `tree`
    overrides a heads drafter's saved tree settings."""
    check_drafter(drafter)
    if tree is not None and not hasattr(drafter, "as_drafter"):
        raise ValueError(f"tree= sets the drafting tree of a trained drafter (heads model); a "
                         f"{type(drafter).__name__} has none: drop tree=")
    if isinstance(drafter, Drafter):
        out = drafter
    elif isinstance(drafter, str):
        out = build_drafter(drafter, target, tokenizer)
    elif hasattr(drafter, "as_drafter"):  # a trained drafter from `heads`
        if tokenizer is None and drafter.config.tokenizer_fingerprint is not None:
            tokenizer = target_tokenizer(target)
            if tokenizer is None:
                warnings.warn("the drafter records the tokenizer it was trained with, but the target's could "
                              "not be found to compare; pass tokenizer= to SelfSpecModel", stacklevel=5)
        drafter.attach(target, tokenizer)
        out = drafter.as_drafter(**(tree or {}))
        if lookup_first is None:
            lookup_first = bool(drafter.config.lookup_first)
    elif isinstance(drafter, PreTrainedModel) and hasattr(drafter, "generate"):
        out = DraftModelDrafter(drafter)
    else:
        raise TypeError(f"cannot draft with a {type(drafter).__name__}: pass a drafter name ({known()}), a "
                        "heads model, a causal LM sharing the target's tokenizer, or an infer.Drafter")
    if lookup_first and not isinstance(out, (NgramDrafter, LookupFirstDrafter)):
        out = LookupFirstDrafter(out)
    out.check_target(target)
    return out


def plan(target, drafter, options: EngineOptions, prepack: bool, tree: dict | str | None) -> Plan:
    """The plan for `drafter` drafting `tree` (a trained drafter's settings, chosen already) on a checked target:
    the streamed kernel's rows and the lean verify forward where `prepack` and the options allow them. Calls of
    several rows draft unless `draft_batches=False` (predicting it is `infer.policy`'s)."""
    options = replace(options, static_cache=static_cache_for(target, options))
    drafting = as_drafter(drafter, target, options.tokenizer, options.lookup_first, tree)
    rows = stream_rows(target) if prepack else 0
    lean = options.lean_verify is not False and _lean_problem(target, options, prepack) is None
    return Plan(options, drafting, prepack, rows, lean, stream_one_row=prepack and stream_one_row(target),
                # the drafter's lean forward takes fp32 features: a bf16 target's (streamed too) would not do
                drafter_stream_rows=rows if options.lean_verify is not False and prepack
                and target.dtype == torch.float32 else None,
                batch_drafting=_never_several_rows if options.draft_batches is False else None)


def target_devices(target) -> set[torch.device]:
    """The devices the target's weights lie on (several where accelerate's device_map spreads or offloads it)."""
    devices = {p.device for p in target.parameters()}
    offloaded = {d for d in (getattr(target, "hf_device_map", None) or {}).values() if d in ("cpu", "disk")}
    return devices | {torch.device("cpu") for _ in offloaded}


def static_cache_for(target, options: EngineOptions) -> bool | int:
    """`static_cache` as asked, or (None) on for a target whose weights lie on one CUDA device: the captured step,
    the fast path there, runs over the preallocated cache; a CPU's growing cache costs it nothing."""
    if options.static_cache is not None:
        return options.static_cache
    if options.captured_step:
        return True  # the captured step runs over the preallocated cache
    devices = target_devices(target)
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def _lean_problem(target, options: EngineOptions, prepack: bool) -> str | None:
    """Why the lean verify forward cannot run (None: it can); `lean_verify=True` where it cannot is an error."""
    problem = lean_forward.why_not(target) if prepack else "cpu_prepack is off"
    if problem is None and options.compile and options.static_cache:
        problem = "the verify forward is compiled (compile=True with static_cache)"
    if problem is not None and options.lean_verify:
        raise ValueError(f"lean_verify=True cannot run for this target: {problem}. Pass lean_verify=None "
                         "to use it where it can, or False")
    return problem


def _never_several_rows(batch: int) -> dict:
    return {"batch": batch, "drafts": False, "why": "draft_batches=False"}


def engine(target, drafter, **options) -> Engine:
    """An engine as `SelfSpecModel` sets it up, for the measurements that run it: `tree` given (not "calibrated"),
    and calls of several rows drafting unless `draft_batches=False`."""
    checked = EngineOptions.of(**options)
    check_target(target, checked)
    return Engine(target, plan(target, drafter, checked, prepack_for(target, checked.cpu_prepack), checked.tree))


# ------------------------------------------------------------------------------ the streamed kernel's rows
STREAM_SIZES = (2, 4, 8, 16, 32)  # block rows at which the two multi-row kernels are compared
# A near-tie goes to the streamed kernel: this comparison times each weight alone, but the verify forward also
# fuses q/k/v and gate/up into one streamed call and runs its norms and rotary in the same kernel, none of which
# oneDNN's path has; a 2-row tie lost by 1% here has cost the whole verify step far more (docs/benchmarks.md,
# "The engine's cost on a CPU").
STREAM_TIE = 0.05
# One fp32 row leaves torch's GEMV, whose sums are transformers' own, for the streamed kernel only where that is
# clearly faster (its time at most this share of the GEMV's): torch's GEMV read fp32 weights at 16-28 GB/s on a Zen 5
# host whose memory gave 45 (the kernel 34-41), while on other CPUs it keeps pace with the memory.
ONE_ROW_SHARE = 0.8


def stream_rows(model, *, repeats: int = 3) -> int:
    """Up to how many rows the streamed kernel (`linear.few_rows_linear`) multiplies `model`'s linear
    weights faster than oneDNN's packed GEMM on this machine (0: at none, or it could not be built).

    Every linear weight of the model is multiplied by a block of n random rows, in model order, so the
    weights stream from memory as in a forward; each kernel is timed at n in STREAM_SIZES, the median of
    `repeats` runs after a warm-up, the two kernels alternating. The answer is `choose_stream_rows`'s,
    cached per model shape, device, threads and kernel source."""
    return _stream_choice(model, repeats)["rows"]


def stream_one_row(model, *, repeats: int = 3) -> bool:
    """Whether one row of an fp32 `model` goes to the streamed kernel rather than torch's GEMV on this machine
    (`choose_one_row`, from the same timing and cache as `stream_rows`). A bf16 model's one row is in
    `stream_rows` already (it is 1 or more where the kernel wins there)."""
    return _stream_choice(model, repeats)["one_row"]


def _stream_choice(model, repeats: int) -> dict:
    """{"rows": stream_rows's answer, "one_row": stream_one_row's}: timed once, cached."""
    weights = [m.weight.detach() for m in model.modules()
               if type(m) is torch.nn.Linear and linear._plain(m.weight)]
    if not weights or weights[0].device.type != "cpu" or not linear.available():
        return {"rows": 0, "one_row": False}
    fields = {"model": fingerprint(model), "device": device_name(weights[0].device),
              "threads": torch.get_num_threads(), "kernel": digest(linear.KERNEL_SOURCE.read_text()),
              "tie": STREAM_TIE, "one_row": ONE_ROW_SHARE}  # a cache written under another rule is measured anew
    cached = read_cache("stream_rows", fields)
    if cached is not None:
        return cached
    kernel = linear.streamed_kernel()
    if kernel is None:
        return {"rows": 0, "one_row": False}
    seconds = _time_kernels(weights, kernel, repeats)
    choice = {"rows": choose_stream_rows(seconds), "one_row": choose_one_row(seconds), "seconds": seconds}
    write_cache("stream_rows", fields, choice)
    return choice


def _time_kernels(weights: list[torch.Tensor], kernel, repeats: int) -> dict[str, dict]:
    """Median seconds of every weight times n random rows, per kernel and n in STREAM_SIZES; bf16 weights from one
    row on, against torch's own bf16 matmul (they are never packed: the streamed kernel reads them in place); fp32
    weights at one row too, against torch's GEMV (`one_row`)."""
    packed = linear.PackCache()
    seconds = {"streamed": {}, "onednn": {}}
    bf16 = weights[0].dtype == torch.bfloat16
    streamed = lambda inputs: [kernel.few_rows_linear(inputs[w.shape[1]], w, None) for w in weights]  # noqa: E731
    plain = lambda inputs: [F.linear(inputs[w.shape[1]], w) for w in weights]  # noqa: E731
    runs = {  # inputs: in_features -> [n, in_features]
        "streamed": streamed,
        "onednn": plain if bf16 else
                  (lambda inputs: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed.get(w), None,
                                                                      "none", [], "") for w in weights]),
    }

    def median_seconds(runs: dict, n: int) -> dict[str, float]:
        inputs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=weights[0].dtype) for w in weights}
        times = {name: [] for name in runs}
        for _ in range(repeats + 1):  # the kernels alternate, so a slow spell of the machine hits both
            for name, run in runs.items():
                tic = time.perf_counter()
                run(inputs)
                times[name].append(time.perf_counter() - tic)
        # the first run is a warm-up (it packs oneDNN's weights)
        return {name: statistics.median(times[name][1:]) for name in runs}

    with torch.inference_mode():
        for n in ((1, *STREAM_SIZES) if bf16 else STREAM_SIZES):
            for name, t in median_seconds(runs, n).items():
                seconds[name][n] = t
        if not bf16:
            seconds["one_row"] = median_seconds({"streamed": streamed, "gemv": plain}, 1)
    return seconds


def choose_one_row(seconds: dict) -> bool:
    """Whether the streamed kernel took at most ONE_ROW_SHARE of torch's GEMV's time on one fp32 row."""
    one = seconds.get("one_row")
    return one is not None and one["streamed"] <= ONE_ROW_SHARE * one["gemv"]


def choose_stream_rows(seconds: dict[str, dict[int, float]]) -> int:
    """The largest n up to which the streamed kernel was faster than oneDNN, or within STREAM_TIE of it, at
    every size measured (0 if it lost clearly at the smallest)."""
    rows = 0
    for n in sorted(seconds["streamed"]):
        if seconds["streamed"][n] > seconds["onednn"][n] * (1 + STREAM_TIE):
            break
        rows = n
    return rows
