"""Benchmark speculative decoding against transformers' own greedy and prompt-lookup decoding.

For every question (MT-bench / Spec-Bench jsonl: `question_id`, `category`, `turns`) the prompt is rendered
with the target's chat template and generated at batch 1, greedy, by each method in turn, interleaved per
question so that every method sees the same machine state:

    baseline   target.generate(do_sample=False)                       -- transformers greedy
    pld        target.generate(prompt_lookup_num_tokens=N)             -- transformers prompt lookup
    <drafter>  SelfSpecModel(target, drafter, lookup_first=False).generate(...) -- one per --drafter: the
                       drafter alone, even where its config makes prompt lookup first its default
    <drafter>+lookup   the same with lookup_first=True: prompt lookup on rows whose context repeats
    <drafter>+fp32argmax  the same with the target's whole fp32 LM head in a greedy verify (int8_argmax off)
    <drafter>+fp32draft   the same drafting from the drafter's fp32 weights (int8_drafter off); the suffixes
                       +compile, +static and +modules set the other SelfSpecModel options of their names
    oracle:<alpha>     SelfSpecModel drafting the baseline's own answer, each token wrong with probability
                       1 - alpha (`--oracle`): acceptance is set, drafting is free, so tokens/s against the
                       ideal (1 - alpha^(K+1)) / (1 - alpha) tokens per plain step is the engine's overhead
    vllm[-<method>]    vLLM's offline engine from its own environment (`make vllm`), one per --vllm: plain
                       decoding, its n-gram or suffix drafting, or a trained drafter exported as
                       scripts/serve.py exports it; tau and acceptance by draft position from vLLM's own
                       spec-decode counters

Workloads: first turns (default), all turns (`--turns 2`), MT-bench second turns only (`--second-turns`: the
first turn's reply, part of the prompt, is the target's own greedy one, generated untimed), and repeated
requests (`--passes 2`: every question asked again after all of them, so a drafter that keeps earlier
responses, such as `suffix`, can reuse the first pass; each pass gets its own rows in the table).

Per category it reports the mean accepted length tau (new tokens per target forward, the prefill forward
included; greedy is 1.0 by definition), tokens/s, and speedups over both transformers methods, from the
median time over `--repeats`. Every greedy output must equal the baseline's token for token; mismatches are
printed loudly, and `--strict` turns them into a nonzero exit.

`--sample` times sampled generation instead (`--temperature`, `--top-p`, `--top-k`; the baseline is
transformers' `generate(do_sample=True)` with the same settings). Sampled outputs are not compared: they
follow the target's distribution, which tests/test_sampling.py checks; every method's run of a question starts
from the same seed (`--seed` plus the question's place in the run), vLLM rows' too.

    python scripts/bench.py --target smollm2-135m-instruct --questions data/mt_bench.jsonl \\
        --drafter ngram --drafter runs/demo/drafter --out runs/bench/mt_bench

Writes `results.json`, `results.md`, `speedup.png` and `accepted_lengths.png` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from infer.random_target import SHAPES, shape_config
from train.apps.bench.harness import load_questions, run_bench
from train.apps.bench.methods import (
    BASELINE,
    COMPILE_SUFFIX,
    FP32_ARGMAX_SUFFIX,
    FP32_DRAFT_SUFFIX,
    LOOKUP_SUFFIX,
    MODULES_SUFFIX,
    PLD,
    STATIC_SUFFIX,
    check_drafter_spec,
    drafter_method,
    hf_method,
    is_trained,
    oracle_method,
    parse_tree,
    vllm_method,
)
from train.apps.bench.records import RECORDS, earlier_records, measured_settings, write_settings
from train.apps.bench.report import environment, memory_floor, report_mismatches, to_markdown, write_outputs


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {value}")
        return value
    return parse


def number_in(low: float, high: float | None = None, open_low: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, ...] with `open_low`; no upper bound: None)."""
    span = (f"in {'(' if open_low else '['}{low:g}, {high:g}]" if high is not None
            else f"{'>' if open_low else '>='} {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {span}, got {text!r}") from None
        above = low < value if open_low else low <= value
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text}")
        return value
    return parse


def device(text: str) -> str:
    """An argparse type: the CPU or a CUDA device this machine has (cpu, cuda, cuda:1)."""
    try:
        where = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; write cpu, cuda or cuda:<index>") from None
    if where.type not in ("cpu", "cuda"):  # the engine's kernels and captured step are built for these two only
        raise argparse.ArgumentTypeError(f"{text}: the benchmark runs on the CPU or a CUDA GPU, not on {where.type} "
                                         "devices; write cpu, cuda or cuda:<index>")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                                         "write cpu, or an index below that")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    parser.add_argument("--questions", help="jsonl with question_id, category, turns (required unless --random-target)")
    parser.add_argument("--drafter", action="append", default=[],
                        help="a drafter name (ngram, gguf[:<file>], int8, bf16, early_exit:<k>, ...) | "
                             "path/to/drafter_folder | draft-model:<path>, each optionally suffixed "
                             f"{LOOKUP_SUFFIX!r} (prompt lookup first), {COMPILE_SUFFIX!r} (the drafter's "
                             f"forwards compiled; with {STATIC_SUFFIX!r} the verify too), {STATIC_SUFFIX!r} "
                             f"(the target's static KV cache), {MODULES_SUFFIX!r} (verify through the "
                             f"model's own modules, not the lean forward), {FP32_ARGMAX_SUFFIX!r} (the target's "
                             f"whole fp32 LM head in a greedy verify) and/or {FP32_DRAFT_SUFFIX!r} (drafting "
                             "from the drafter's fp32 weights, not int8 copies); repeat for several")
    parser.add_argument("--out", default="runs/bench/latest", help="folder for results.json/.md and plots")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)
    parser.add_argument("--repeats", type=at_least(1), default=None,
                        help="timed runs per question and method (median; default 1, with --random-target 3)")
    parser.add_argument("--turns", type=at_least(1), default=1, help="how many turns of each question to run")
    parser.add_argument("--second-turns", action="store_true",
                        help="MT-bench second turns only: the first turn is answered by the baseline (untimed) "
                             "and is part of the timed second turn's prompt")
    parser.add_argument("--passes", type=at_least(1), default=1,
                        help="run the question list this many times in a row; 2 = the repeated-request workload")
    parser.add_argument("--limit", type=at_least(0), default=0, help="first N questions only (0 = all)")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--per-category", type=at_least(0), default=0, help="first N questions of each category (0 = all)")
    parser.add_argument("--tree", default=None,
                        help="override trained drafters' tree settings, e.g. depth=4,top_k=4,total_tokens=16")
    parser.add_argument("--pld-tokens", type=at_least(1), default=10, help="prompt_lookup_num_tokens for the PLD baseline")
    parser.add_argument("--no-pld", action="store_true", help="skip the transformers prompt-lookup baseline")
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0 = all logical CPUs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", type=device, default="cpu", help="where the target and drafters run, e.g. cuda")
    parser.add_argument("--oracle", action="append", type=number_in(0, 1), default=[], metavar="ALPHA",
                        help="a row drafting the baseline's own answer, each token wrong with probability "
                             "1 - ALPHA (chains of --oracle-depth): engine cost against the ideal; repeatable")
    parser.add_argument("--oracle-depth", type=at_least(1), default=8, help="chain length of --oracle rows")
    parser.add_argument("--oracle-static", action="store_true",
                        help="each --oracle row also with the static KV cache (oracle:ALPHA+static)")
    parser.add_argument("--vllm", action="append", default=[], metavar="plain|ngram|suffix|DRAFTER",
                        help="a vLLM row (vLLM's CPU build from `make vllm`, or --vllm-python): plain decoding, "
                             "its ngram or suffix drafting, or a drafter folder exported for vLLM; repeatable")
    parser.add_argument("--sample", action="store_true",
                        help="time sampled generation (transformers' sampling as the baseline), not greedy")
    parser.add_argument("--temperature", type=number_in(0, open_low=True), default=None,
                        help=f"with --sample (default {SAMPLING_DEFAULTS['temperature']})")
    parser.add_argument("--top-p", type=number_in(0, 1, open_low=True), default=None,
                        help=f"with --sample (1 = no nucleus filter; default {SAMPLING_DEFAULTS['top_p']})")
    parser.add_argument("--top-k", type=at_least(0), default=None, help="with --sample (0 = no top-k filter, the default)")
    parser.add_argument("--seed", type=int, default=None,
                        help="with --sample: the first generation's torch seed (default 0); with --random-target: "
                             "the random weights' seed")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if any selfspec or transformers greedy output differs")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="keep the questions an interrupted run with the same methods wrote to --out's "
                             "records.jsonl and measure only the rest")
    gpu = parser.add_argument_group("the engine on a random-weight target (train/apps/bench/gpu.py; nothing downloaded)")
    gpu.add_argument("--random-target", type=random_shape, metavar="SHAPE",
                     help="time transformers' and selfspec's decoding, the oracle and a random EAGLE-3 drafter on a "
                          "random-weight target of this shape, built on --device: "
                          f"{', '.join(SHAPES)} ('tiny' is a CPU dry run)")
    gpu.add_argument("--budget-seconds", type=number_in(0, open_low=True), default=420.0,
                     help="rows that would start after this many seconds are skipped (the JSON is written as it goes)")
    gpu.add_argument("--bandwidth-gbs", type=number_in(0, open_low=True), default=None,
                     help="the device's memory bandwidth in GB/s for the memory floor (default: H100 3350, H200 "
                          "4800, measured on a CPU)")
    gpu.add_argument("--prompt-tokens", type=at_least(1), default=128, help="length of the random prompt")
    gpu.add_argument("--no-compile", action="store_true",
                     help="leave the static-cache rows uncompiled (a CPU dry run in seconds)")
    return parser


def random_shape(text: str) -> str:
    """An argparse type: a shape of infer.random_target.SHAPES."""
    if text not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown random target shape {text!r}; the shapes are: {', '.join(SHAPES)}")
    return text


# --sample's settings where the command line leaves them out
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 0}


def settle_sampling(parser: argparse.ArgumentParser, args) -> None:
    """--temperature, --top-p, --top-k (and, with questions, --seed) set sampled generation: given without
    --sample they would be ignored and greedy decoding timed, so they are refused; left out, their defaults."""
    flags = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k"}
    if not args.random_target:
        flags["seed"] = "--seed"  # the random target's weights take the seed without --sample
    given = [flag for name, flag in flags.items() if getattr(args, name) is not None]
    if given and not args.sample:
        fix = "leave them out: --random-target times greedy decoding" if args.random_target else \
            "add --sample to time sampled generation, or leave them out (greedy decoding ignores them)"
        parser.error(f"{', '.join(given)} without --sample: {fix}")
    for name, value in SAMPLING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """Refuse an --out the results cannot be written into, before any model loads: a file, a folder under a
    file, or a place without write permission. Nothing is created here."""
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        parser.error(f"--out {out} is a file; give a folder for results.json, results.md and the plots")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        parser.error(f"--out {out} is under {existing}, which is a file, not a folder; give a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"--out {out}: {existing} is not writable; give a folder you can write to")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    settle_sampling(parser, args)
    if args.random_target:
        return _random_target(parser, args, argv)
    if not args.questions:
        parser.error("--questions is required (or --random-target SHAPE for the engine on a random-weight target)")
    args.repeats = args.repeats or 1

    from infer.loading import resolve_target

    threads = args.threads or os.cpu_count() or 1
    questions = load_questions(args.questions, args.limit, args.categories, args.per_category)
    if not questions:
        parser.error("no questions selected")
    if args.second_turns and not any(len(q["turns"]) > 1 for q in questions):
        parser.error(f"--second-turns times second turns, but none of the {len(questions)} questions selected has "
                     "one; give questions with two turns (MT-bench's), or leave --second-turns out")
    tree = parse_tree(args.tree)
    for spec in args.drafter:
        check_drafter_spec(spec)
    if tree and not any(is_trained(spec) for spec in args.drafter):
        parser.error(f"--tree {args.tree} sets trained drafters' trees, but no --drafter is a trained drafter "
                     f"({', '.join(args.drafter) or 'none given'}); give a drafter folder, or leave --tree out")
    settings = measured_settings(args, threads)
    done = earlier_records(args.out, settings, args.resume)  # before anything loads: what a resume keeps
    torch.set_num_threads(threads)
    sampling = None
    if args.sample:
        if args.oracle:
            parser.error("--sample: an --oracle row drafts the greedy answer; leave it out")
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    target, tokenizer = resolve_target(args.target, dtype=getattr(torch, args.dtype))
    target.to(args.device)
    methods = [hf_method(target, BASELINE, sampling)]
    if not args.no_pld:
        methods.append(hf_method(target, PLD, sampling, prompt_lookup_num_tokens=args.pld_tokens))
    for spec in args.drafter:
        methods.append(drafter_method(spec, target, tree, sampling))
    methods += [oracle_method(target, alpha, args.oracle_depth) for alpha in args.oracle]
    if args.oracle_static:
        methods += [oracle_method(target, alpha, args.oracle_depth, static_cache=True) for alpha in args.oracle]
    try:
        for spec in args.vllm:
            methods.append(vllm_method(spec, args.target, args.dtype, threads, Path(args.out), sampling))
        return _run(args, argv, target, tokenizer, questions, methods, sampling, (settings, done))
    finally:
        for m in methods:
            if m.close is not None:
                m.close()


def _random_target(parser, args, argv) -> int:
    from train.apps.bench.gpu import run_random_target

    for flag, given in (("--drafter", args.drafter), ("--vllm", args.vllm), ("--sample", args.sample),
                        ("--questions", args.questions), ("--resume", args.resume)):
        if given:
            parser.error(f"{flag} needs a real target; --random-target runs its own rows (train/apps/bench/gpu.py)")
    args.repeats = args.repeats or 3
    context = shape_config(args.random_target).max_position_embeddings
    if args.prompt_tokens + args.max_new_tokens > context:
        parser.error(f"--prompt-tokens {args.prompt_tokens} + --max-new-tokens {args.max_new_tokens} do not fit "
                     f"the {context}-position context of the {args.random_target!r} shape; keep their sum at most "
                     f"{context}")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    return run_random_target(args, argv)


def _run(args, argv, target, tokenizer, questions, methods, sampling: dict | None, earlier: tuple) -> int:
    """`earlier`: the run's measured settings and the records a resumed run keeps (`earlier_records`)."""
    print(f"{len(questions)} questions, methods: {', '.join(m.name for m in methods)}, "
          f"torch threads: {torch.get_num_threads()}")

    load_before = environment(target, torch.get_num_threads())["load_average"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    partial = Path(args.out) / RECORDS  # one line per question as it finishes
    settings, done = earlier
    if done:
        print(f"resuming: {len(done)} records measured earlier in {partial}")
    else:
        partial.write_text("")
    write_settings(args.out, settings, done=False)

    def keep(record: dict) -> None:
        with open(partial, "a") as f:
            f.write(json.dumps(record) + "\n")

    turns, timed_from = (max(args.turns, 2), 2) if args.second_turns else (args.turns, 1)
    result = run_bench(target, tokenizer, questions, methods, max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, turns=turns, on_record=keep, timed_from_turn=timed_from,
                       passes=args.passes, done=done, sampling=sampling, seed=args.seed)
    result["environment"] = environment(target, torch.get_num_threads())
    result["environment"]["load_average_before"] = load_before
    if done:  # the earlier part ran on another day or under another load: say so beside the numbers
        result["environment"]["resumed"] = {"records_measured_before": len(done),
                                            "resumed_at": result["environment"]["date"]}
    result["environment"].update(memory_floor(target))
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv)
    result["settings"].update(target=args.target, questions=args.questions, pld_tokens=None if args.no_pld else
                              args.pld_tokens, drafters=args.drafter, vllm=args.vllm or None,
                              oracle=args.oracle or None, oracle_depth=args.oracle_depth if args.oracle else None,
                              tree=parse_tree(args.tree) or None)
    paths = write_outputs(result, args.out, plots=not args.no_plots)
    write_settings(args.out, settings, done=True)
    print(to_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    report_mismatches(result)
    ours = [m for m in result["mismatches"] if m.get("engine") != "vllm"]
    return 1 if args.strict and ours else 0

