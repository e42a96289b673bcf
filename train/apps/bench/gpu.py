"""The engine on a random-weight target of a real model's shape, where only the device's speed matters:

    python scripts/bench.py --random-target llama3-8b --device cuda --dtype bfloat16 --out runs/bench/gpu
    python scripts/bench.py --random-target tiny --no-compile --max-new-tokens 32 --out /tmp/dry   # CPU dry run

Nothing is downloaded: the target is built on the device (infer/random_target.py). One prompt of random tokens,
greedy, batch 1; the rows, each set up and warmed up once, then timed in interleaved rounds (every row once a
round, so a slow phase of the machine hits all of them alike):

    hf_eager           transformers' generate, dynamic cache
    hf_static          transformers' generate with cache_implementation="static", which transformers compiles on
                       a GPU (torch.compile, CUDA graphs): the fastest plain decoding it offers (not on a CPU,
                       or with --no-compile)
    none               SelfSpecModel(target, "none"): the engine's own plain step
    none_captured      the same with the captured step (`captured_step=True`: CUDA graphs per node bucket)
    none_static        the same on its static cache, its verify forward compiled (not with --no-compile)
    none_captured_compiled  the captured step of the compiled forward (`compile=True` too: fused kernels, one
                       replay; not with --no-compile)
    oracle:<a>         OracleDrafter(a, depth 8): drafting free, acceptance set by a, chains
    oracle_tree:<a>    the oracle in a tree of EAGLE-2's size (depth 6, top-8, 60 nodes)
    oracle:<a>+static  the middle alpha's chain on the static, compiled path; +captured on the captured step
    eagle3_tree60      a random EAGLE-3 drafter's whole step, tree of 60 nodes (its acceptance is nil: the row
                       gives a trained drafter's cost per step, not its speed); +captured on the captured step
    verify_by_width    the verify forward alone, on the path the engine runs it, by node count (VERIFY_WIDTHS: 1-128
                       on a GPU, 1-32 on a CPU; infer.tuning.timing.block_costs)

Each row reports tokens/s, ms per step (per target forward, the prefill included), tau (new tokens per target
forward), a drafter's tokens per drafting step (the prefill and the last, cut-short step left out: what an
oracle's `expected_tau` predicts), what ran the verify forward (a row asking for a captured or compiled one that
fell back is an error), the memory floor of a step (the weights a step reads, read once: `step_bytes` /
bandwidth; --bandwidth-gbs, or the vendor's figure for a known GPU, BANDWIDTH_GB_S, or the measured read
bandwidth on a CPU) and the share of a step the floor is. Random
weights make near-ties whose argmax flips with a forward's shape, so outputs may differ from transformers' (the
first differing token is recorded, not an error) and the oracle follows what the target emits (`followed`).
Rows that would start after --budget-seconds are skipped and said so; the JSON is written after every row.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Memory bandwidth by GPU name, GB/s: the vendor's figures (H100 SXM HBM3, H200 HBM3e).
BANDWIDTH_GB_S = {"H100": 3350.0, "H200": 4800.0}
ORACLE_ALPHAS = (0.6, 0.8, 0.9)
ORACLE_DEPTH = 8
EAGLE2_TREE = {"depth": 6, "top_k": 8, "total_tokens": 60}  # EAGLE-2's default size
VERIFY_WIDTHS = {"cuda": (1, 8, 32, 64, 128), "cpu": (1, 2, 4, 8, 16, 32)}  # nodes a verify forward is timed at
SETTLE_RUNS = 3
STATIC_PATHS = {"+static": "static cache, compiled verify (uncompiled with --no-compile)",
                "+captured": "static cache, captured step (CUDA graphs on a GPU; uncaptured on a CPU)"}  # untimed oracle runs that move its answer to what the target emits with it


@dataclass
class Row:
    """A timed way to generate: `setup()` (untimed: models built, a warm-up run) returns the run to time, which
    returns (new token ids, stats), and the warm-up's new token ids."""

    name: str
    what: str
    setup: Callable[[], tuple[Callable[[], tuple[list[int], dict]], list[int]]]
    extra: dict = field(default_factory=dict)  # what the row adds to its record (an oracle's expected tau)


@dataclass
class Settings:
    new_tokens: int = 128
    repeats: int = 3
    compile: bool = True
    budget_seconds: float = 420.0
    alphas: tuple[float, ...] = ORACLE_ALPHAS
    depth: int = ORACLE_DEPTH
    tree: dict = field(default_factory=lambda: dict(EAGLE2_TREE))
    seed: int = 0
    trained_kind: str = "eagle3"  # the random trained drafter timed over the tree (the anchors' EAGLE-3 step)


def bandwidth(device: torch.device, given: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from) for the memory floor: given, or a known GPU's published figure (a CPU's is
    measured beside the rows: `run_random_target`)."""
    if given is not None:
        return given, "--bandwidth-gbs"
    name = torch.cuda.get_device_name(device)
    for gpu, gbs in BANDWIDTH_GB_S.items():
        if gpu in name:
            return gbs, f"{gpu}'s published bandwidth"
    return None, f"unknown for {name}: pass --bandwidth-gbs"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_row(target, ids, name: str, what: str, settings: Settings, **options) -> Row:
    def setup():
        def run():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.new_tokens,
                                  min_new_tokens=settings.new_tokens, do_sample=False, **options)
            return out[0, ids.shape[1]:].tolist(), {"target_forwards": settings.new_tokens}
        return run, run()[0]  # the warm-up pays for kernel selection and a static cache's compilation
    return Row(name, what, setup)


def engine_row(target, ids, name: str, what: str, settings: Settings, drafter, answers: dict, **options) -> Row:
    """SelfSpecModel(target, drafter(), **options); `drafter` builds the drafter at setup. An oracle drafts the
    engine's own output (`answers["none"]`, the `none` row's warm-up), moved by untimed runs to what the target
    emits with the oracle's trees (near-ties may flip with a block's shape)."""
    from infer import SelfSpecModel
    from infer.drafters.oracle import OracleDrafter

    def setup():
        own = drafter()
        model = SelfSpecModel(target, own, **options)
        oracle = isinstance(own, OracleDrafter)
        answer = answers.get("none") or answers.get("hf_eager")  # this row's own, once settled
        if oracle and answer is None:
            raise RuntimeError("the oracle drafts the none or hf_eager row's output, and neither row ran")

        def run():
            if oracle:
                own.expect([answer], seed=settings.seed)
            out = model.generate(ids, max_new_tokens=settings.new_tokens, eos_token_id=[])
            stats = dict(model.last_stats)
            if oracle:
                stats["followed"] = own.followed
            return out[0, ids.shape[1]:].tolist(), stats

        for _ in range(SETTLE_RUNS if oracle else 0):
            new, stats = run()
            if stats["followed"] == 0:
                break
            answer = new  # what the target emitted with this oracle's trees: the next run drafts it
        new, stats = run()  # the warm-up: allocations, kernel selection, compilation
        check_path(options, stats, target.device)
        return run, new
    return Row(name, what, setup)


def check_path(options: dict, stats: dict, device: torch.device) -> None:
    """Refuse a row whose warm-up did not run the verify path it asked for: a capture or compile that fell back to
    eager would be timed under the wrong label."""
    captured = "cuda graphs" if device.type == "cuda" else "static buffers"
    wanted = {captured + (" of the compiled forward" if options.get("compile") else "")} \
        if options.get("captured_step") else {"compiled"} if options.get("compile") and options.get("static_cache") \
        else None
    ran = stats.get("verify_forward")
    if wanted is not None and ran not in wanted:
        raise RuntimeError(f"asked for the {' or '.join(sorted(wanted))} verify forward, ran {ran!r}"
                           + (f" ({stats['verify_fallback']})" if "verify_fallback" in stats else ""))


def suite(target, ids, settings: Settings, answers: dict) -> list[Row]:
    """The rows in the order they run (see the module docstring)."""
    import heads
    from infer.drafters.oracle import OracleDrafter, expected_tokens_per_step

    compiled = settings.compile and target.device.type == "cuda"
    static = {"cache_implementation": "static"} | ({} if compiled else {"disable_compile": True})
    rows = [hf_row(target, ids, "hf_eager", "transformers generate, greedy, dynamic cache", settings),
            hf_row(target, ids, "hf_static", "transformers generate, static cache"
                   + (", compiled" if compiled else ", not compiled"), settings, **static),
            engine_row(target, ids, "none", "SelfSpecModel(target, 'none')", settings, lambda: "none", answers),
            # the captured rows before the compiled ones: compiling every bucket can use up the budget
            engine_row(target, ids, "none_captured", f"SelfSpecModel(target, 'none'), {STATIC_PATHS['+captured']}",
                       settings, lambda: "none", answers, static_cache=True, captured_step=True),
            engine_row(target, ids, "none_static", "SelfSpecModel(target, 'none'), static cache"
                       + (", compiled verify" if settings.compile else ""), settings, lambda: "none", answers,
                       static_cache=True, compile=settings.compile)]
    if settings.compile:  # the fused captured step: the graphs capture the compiled forward
        rows.append(engine_row(target, ids, "none_captured_compiled", "SelfSpecModel(target, 'none'), "
                               f"{STATIC_PATHS['+captured']}, the forward captured compiled", settings,
                               lambda: "none", answers, static_cache=True, captured_step=True, compile=True))
    for alpha in settings.alphas:
        rows.append(engine_row(target, ids, f"oracle:{alpha:g}", f"OracleDrafter({alpha:g}), chain of "
                               f"{settings.depth}", settings,
                               lambda a=alpha: OracleDrafter(a, settings.depth, follow=True), answers))
        rows[-1].extra["expected_tau"] = expected_tokens_per_step(alpha, settings.depth)
    tree = settings.tree
    for alpha in settings.alphas:
        rows.append(engine_row(target, ids, f"oracle_tree:{alpha:g}", f"OracleDrafter({alpha:g}), tree {tree}",
                               settings, lambda a=alpha: OracleDrafter(a, tree["depth"], top_k=tree["top_k"],
                                                                       total_tokens=tree["total_tokens"],
                                                                       follow=True), answers))
        rows[-1].extra["expected_tau"] = expected_tokens_per_step(alpha, tree["depth"], tree["top_k"],
                                                                  tree["total_tokens"])
    middle = settings.alphas[len(settings.alphas) // 2]
    for suffix, options in (("+captured", {"captured_step": True}), ("+static", {"compile": settings.compile})):
        rows.append(engine_row(target, ids, f"oracle:{middle:g}{suffix}", f"OracleDrafter({middle:g}), chain of "
                               f"{settings.depth}, {STATIC_PATHS[suffix]}", settings,
                               lambda: OracleDrafter(middle, settings.depth, follow=True), answers,
                               static_cache=True, **options))
        rows[-1].extra["expected_tau"] = expected_tokens_per_step(middle, settings.depth)
    for suffix, options in (("", {}), ("+captured", {"static_cache": True, "captured_step": True})):
        rows.append(engine_row(target, ids, f"{settings.trained_kind}_tree60{suffix}",
                               f"a random {settings.trained_kind} drafter, tree {tree}"
                               + (f", {STATIC_PATHS[suffix]}" if suffix else ""), settings,
                               lambda: heads.build(settings.trained_kind, target).to(target.device, target.dtype),
                               answers, tree=dict(tree), **options))
    return rows


def run_suite(target, rows: list[Row], settings: Settings, result: dict, answers: dict, save: Callable[[], None],
              started: float, probe: Callable[[], float] | None = None,
              run_probe: Callable[[], float] | None = None) -> None:
    """Set up every row, then time them in `settings.repeats` interleaved rounds, into `result["rows"]`;
    whatever would start after the budget is skipped. `answers` gets each row's warm-up output (the rows built
    by `suite` with the same dict read it). `save()` after every row. `probe` (a CPU's read bandwidth, GB/s) runs
    before every round, its readings into `result["bandwidth_readings_gb_s"]`: the memory's pace drifts on a shared
    host, and a floor read once, at another moment than the rows, moved a floor ratio by 1.4x. `run_probe` (the
    same, unrecorded there) runs before every row's run, into the row's `gb_s_all`: the pace can switch between a
    round's reading and the rows after it."""
    device, records, live = target.device, result["rows"], {}
    over = lambda: time.perf_counter() - started > settings.budget_seconds  # noqa: E731
    for row in rows:
        records[row.name] = {"what": row.what, **row.extra}
        if over():
            records[row.name]["skipped"] = f"past the {settings.budget_seconds:g} s budget"
        else:
            try:
                live[row.name], answers[row.name] = row.setup()
            # One row's failure (a compiler error, memory) must not cost the device call the other rows.
            except Exception as err:  # noqa: BLE001
                records[row.name]["error"] = f"{type(err).__name__}: {err}"[:2000]
                print(f"{row.name}: {records[row.name]['error']}", file=sys.stderr, flush=True)
        save()
    for _ in range(settings.repeats):
        if probe is not None and live and not over():
            result.setdefault("bandwidth_readings_gb_s", []).append(probe())
        for name, run in live.items():
            if over():
                records[name].setdefault("skipped_runs", 0)
                records[name]["skipped_runs"] += 1
                continue
            record = records[name]
            if run_probe is not None:
                record.setdefault("gb_s_all", []).append(run_probe())
            sync(device)
            tic = time.perf_counter()
            new, stats = run()
            sync(device)
            record.setdefault("seconds_all", []).append(time.perf_counter() - tic)
            if "prefill_seconds" in stats:  # the engine's: the prompt's forward, which no drafting speeds up
                record.setdefault("prefill_seconds_all", []).append(stats["prefill_seconds"])
            record.update(new_tokens=len(new), target_forwards=stats["target_forwards"],
                          verify_forward=stats.get("verify_forward", "transformers generate"),
                          first_difference_vs_hf=first_difference(new, answers["hf_eager"]))
            if "followed" in stats:
                record["followed"] = stats["followed"]
            if len(stats.get("accepted_lengths", ())) > 1:  # the last step may be cut short by the token budget
                record["accepted_per_step"] = statistics.mean(stats["accepted_lengths"][:-1])
            save()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (the shorter's length if one is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def summarize(result: dict) -> None:
    """Per timed row: median seconds, tokens/s, ms per step, tau, speed-ups, the floor's share of a step, and an
    oracle's ideal (its tau in tokens for the price of one `none` step)."""
    rows, floor_ms = result["rows"], result["memory_floor_ms"]
    for r in rows.values():
        if not r.get("seconds_all"):
            continue
        r["seconds"] = statistics.median(r["seconds_all"])
        r["tokens_per_s"] = r["new_tokens"] / r["seconds"]
        r["ms_per_step"] = 1000 * r["seconds"] / r["target_forwards"]
        r["tau"] = r["new_tokens"] / r["target_forwards"]
        if floor_ms is not None:
            r["floor_share"] = floor_ms / r["ms_per_step"]
        prefill = r.get("prefill_seconds_all")
        if prefill and r["target_forwards"] > 1:  # decoding alone: the prompt's forward and its token left out
            decoding = statistics.median(t - p for t, p in zip(r["seconds_all"], prefill, strict=True))
            r["prefill_ms"] = 1000 * statistics.median(prefill)
            r["decode_ms_per_step"] = 1000 * decoding / (r["target_forwards"] - 1)
            r["decode_tokens_per_s"] = (r["new_tokens"] - 1) / decoding
            r["decode_tau"] = (r["new_tokens"] - 1) / (r["target_forwards"] - 1)
            if r.get("gb_s_all"):  # each run's decoding step against the floor read just before it
                r["decode_of_floor_all"] = [(t - p) / (r["target_forwards"] - 1) * gb_s / result["step_weight_gb"]
                                            for t, p, gb_s in zip(r["seconds_all"], prefill, r["gb_s_all"],
                                                                  strict=True)]
    for r in rows.values():
        for ref in ("hf_eager", "hf_static", "none"):
            if "tokens_per_s" in r and "tokens_per_s" in rows.get(ref, {}):
                r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / rows[ref]["tokens_per_s"]
        if "expected_tau" in r and "tokens_per_s" in r and "tokens_per_s" in rows.get("none", {}):
            r["fraction_of_ideal"] = r["tokens_per_s"] / (r["tau"] * rows["none"]["tokens_per_s"])
            if "decode_tokens_per_s" in r and "decode_tokens_per_s" in rows["none"]:
                # the same, decoding alone: its tau in tokens for the price of one `none` decoding step
                r["decode_fraction_of_ideal"] = r["decode_tokens_per_s"] / (
                    r["decode_tau"] * rows["none"]["decode_tokens_per_s"])


def verify_by_width(target, context: int, repeats: int) -> dict:
    """ms of the verify forward (mask, forward, cache writes) on a chain of n new nodes after `context` tokens, on
    the path `SelfSpecModel(target, "none")` verifies with (`path`: the lean forward, prepacked or streamed linears
    on a CPU); widths by device (VERIFY_WIDTHS)."""
    from infer import SelfSpecModel
    from infer.tuning.timing import block_costs

    engine = SelfSpecModel(target, "none")
    with engine.verify_path() as (forward, path):
        costs = block_costs(target, forward, context, list(VERIFY_WIDTHS[target.device.type]), repeats)
    return {"path": path, **{str(n): 1000 * s for n, s in costs.items()}}


def step_weights(target) -> list[torch.Tensor]:
    """The weights one decoding step reads: every parameter, less an input embedding the LM head does not share (a
    step looks up one row of it)."""
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    untied = head is None or head.weight is not embedding
    return [p for p in target.parameters() if not (untied and p is embedding)]


def step_bytes(target) -> int:
    """Bytes of weights one decoding step reads (`step_weights`)."""
    return sum(p.numel() * p.element_size() for p in step_weights(target))


def step_readings_gb_s(weights: list[torch.Tensor]) -> tuple[float, float]:
    """A CPU's read bandwidth two ways, GB/s: a 512 MB buffer's sum, and `weights` (a step's own) read once. A step's
    floor is its bytes at the faster."""
    from .report import read_bandwidth_gb_s

    return read_bandwidth_gb_s(), weights_read_gb_s(weights)


def weights_read_gb_s(weights: list[torch.Tensor], passes: int = 3) -> float:
    """GB/s of torch reading exactly these tensors once, in their own pages (the best of `passes`): the step's own
    bytes, where a fresh buffer's reading may differ. 2-byte weights are summed as fp32 pairs (a bf16 sum runs a
    conversion per element; an fp32 one keeps pace with the memory)."""
    views = [w.detach().reshape(-1).view(torch.float32) if w.element_size() == 2 and w.numel() % 2 == 0
             and w.is_contiguous() else w.detach().reshape(-1) for w in weights]
    total = sum(v.numel() * v.element_size() for v in views)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(passes + 1):  # the first pass is a warm-up
            tic = time.perf_counter()
            for v in views:
                v.sum()
            best = min(best, time.perf_counter() - tic)
    return total / best / 1e9


def to_markdown(result: dict) -> str:
    floor = result["memory_floor_ms"]
    lines = [f"{result['shape']} ({result['parameters'] / 1e9:.2f} B parameters, {result['step_weight_gb']:.2f} GB "
             f"read a step in {result['dtype']}) on {result['environment']['device_name']}; memory floor of a step "
             + (f"{floor:.2f} ms ({result['bandwidth_source']}, {result['bandwidth_gb_s']:g} GB/s)" if floor else
                f"unknown ({result['bandwidth_source']})"), "",
             "| row | tokens/s | ms/step | tau | tokens per drafting step | expected | vs hf_eager | vs hf_static | "
             "floor share | prefill ms | decoding ms/step | of ideal | of ideal, decoding | first diff vs hf |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["rows"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('error', 'not run')} |" + " |" * 13)
            continue
        cells = [_cell(r, key, fmt) for key, fmt in (("accepted_per_step", ".2f"), ("expected_tau", ".2f"), ("speedup_vs_hf_eager", ".2f"),
                                                     ("speedup_vs_hf_static", ".2f"), ("floor_share", ".0%"),
                                                     ("prefill_ms", ".1f"), ("decode_ms_per_step", ".2f"),
                                                     ("fraction_of_ideal", ".0%"), ("decode_fraction_of_ideal", ".0%"),
                                                     ("first_difference_vs_hf", "d"))]
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | {r['tau']:.2f} | "
                     + " | ".join(cells) + " |")
    by_run = [f"{name} " + " / ".join(f"{x:.2f}x" for x in r["decode_of_floor_all"])
              for name, r in result["rows"].items() if r.get("decode_of_floor_all")]
    if by_run:
        lines += ["", "decoding step against the floor read just before it, run by run: " + "; ".join(by_run)]
    widths = result.get("verify_ms_by_width")
    if isinstance(widths, dict) and "error" not in widths and "skipped" not in widths:
        lines += ["", f"verify forward by width ({widths.get('path', 'transformers')}; nodes: ms): "
                  + ", ".join(f"{n}: {ms:.2f}" for n, ms in widths.items() if n != "path")]
    return "\n".join(lines) + "\n"


def _cell(record: dict, key: str, fmt: str) -> str:
    return format(record[key], fmt) if record.get(key) is not None else "-"


def settings_from(args) -> Settings:
    """The suite's settings from scripts/bench.py's arguments; a --tree must give depth, top_k and total_tokens."""
    from train.apps.bench.methods import parse_tree

    tree = {**EAGLE2_TREE, **parse_tree(args.tree)}
    unknown = set(tree) - set(EAGLE2_TREE)
    if unknown:
        raise ValueError(f"--tree {args.tree}: with --random-target the tree takes depth, top_k and total_tokens "
                         f"only, not {sorted(unknown)}")
    return Settings(new_tokens=args.max_new_tokens, repeats=args.repeats, compile=not args.no_compile,
                    budget_seconds=args.budget_seconds, alphas=tuple(args.oracle) or ORACLE_ALPHAS,
                    depth=args.oracle_depth, tree=tree, seed=args.seed)


def run_random_target(args, argv=None) -> int:
    """`scripts/bench.py --random-target SHAPE`: build the target, run the suite, write results.json/.md."""
    import transformers

    from infer.random_target import build_random_target, shape_config

    started = time.perf_counter()
    settings = settings_from(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build_random_target(args.random_target, device, dtype, seed=args.seed)  # refuses what cannot fit
    parameters = sum(p.numel() for p in target.parameters())
    weight_bytes = step_bytes(target)
    measured = device.type == "cpu" and args.bandwidth_gbs is None  # read before the rows and every round, below
    gbs, source = (None, "measured read bandwidth (CPU)") if measured else bandwidth(device, args.bandwidth_gbs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
              "shape": args.random_target, "config": {k: v for k, v in shape_config(args.random_target).to_dict().items()
                                                      if k in ("model_type", "hidden_size", "num_hidden_layers",
                                                               "vocab_size", "tie_word_embeddings")},
              "dtype": args.dtype, "parameters": parameters, "step_weight_gb": weight_bytes / 1e9,
              "bandwidth_gb_s": gbs, "bandwidth_source": source,
              "memory_floor_ms": 1000 * weight_bytes / (gbs * 1e9) if gbs else None,
              "build_seconds": time.perf_counter() - started,
              "settings": {**vars(settings), "prompt_tokens": args.prompt_tokens, "batch_size": 1, "greedy": True},
              "environment": {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "transformers": transformers.__version__,
                              "torch_threads": torch.get_num_threads()},
              "rows": {}}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")

    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, target.config.vocab_size, (1, args.prompt_tokens), generator=generator).to(device)
    answers = {}
    if measured:
        weights = step_weights(target)

        def probe() -> float:  # both readings; the faster is the floor's
            buffer, own = step_readings_gb_s(weights)
            result.setdefault("weights_read_gb_s", []).append(own)
            return max(buffer, own)

        def run_reading() -> float:  # the same, before each row's run: its own floor, not the headline's
            return max(step_readings_gb_s(weights))

        result["bandwidth_readings_gb_s"] = [probe()]
        result["bandwidth_gb_s"] = result["bandwidth_readings_gb_s"][0]
        result["memory_floor_ms"] = 1000 * weight_bytes / (result["bandwidth_gb_s"] * 1e9)
    run_suite(target, suite(target, ids, settings, answers), settings, result, answers, save, started,
              probe=probe if measured else None,
              run_probe=run_reading if measured else None)
    if measured:  # the floor from the fastest reading: the hardest to meet, read beside the rows it judges
        readings = result["bandwidth_readings_gb_s"]
        result["bandwidth_gb_s"] = max(readings)
        result["memory_floor_ms"] = 1000 * weight_bytes / (max(readings) * 1e9)
        result["bandwidth_source"] = (f"measured read bandwidth (CPU), the best of {len(readings)} readings, one "
                                      f"before the rows and one before each round, each the faster of a 512 MB "
                                      f"buffer's sum and the step's own weights read once: {min(readings):.1f}-"
                                      f"{max(readings):.1f} GB/s")
    if time.perf_counter() - started > settings.budget_seconds:
        result["verify_ms_by_width"] = {"skipped": f"past the {settings.budget_seconds:g} s budget"}
    else:
        result["verify_ms_by_width"] = verify_by_width(target, args.prompt_tokens, settings.repeats)
    result["seconds"] = time.perf_counter() - started
    summarize(result)
    save()
    (out / "results.md").write_text(to_markdown(result))
    print(to_markdown(result))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    failed = [name for name, r in result["rows"].items() if "error" in r]
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)} (their errors are in results.json); exit code 1",
              file=sys.stderr)
    return 1 if failed else 0
