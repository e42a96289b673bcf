"""An interleaved A/B of the engine's options on one random target, in one process: which of two paths is faster at a
decoding step, with the memory's pace read before every run as `scripts/bench.py` reads it (the faster of a buffer's
sum and the step's own weights; it moves within minutes on a shared host), so that each step is set against the
floor of its own moment.

    python scripts/bench_options.py --random-target llama3-1b --dtype bfloat16 \
        --variant lean_verify=False --variant int8_argmax=False --variant "" --rounds 4

Each `--variant` is a `SelfSpecModel` keyword list (`name=value,...`; "" the defaults), every one an engine over the
same target (they share its packed weights), warmed once, then timed in turn, the order reversed every other round.
A run is one greedy `generate` of `--max-new-tokens` tokens after a 128-token prompt, drafting nothing (`none`); its
decoding step leaves the prompt's forward out. Prints a line a run and the medians; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPT_TOKENS = 128


def parse_variant(text: str) -> dict:
    """'name=value,name=value' -> SelfSpecModel keywords, the values Python literals ('' -> {})."""
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"--variant {text!r}: expected name=value pairs separated by commas, got {part!r}")
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--variant {text!r}: {value.strip()!r} is not a Python literal (True, 8, 'x')") from None
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-target", required=True, help="a shape of infer.random_target.SHAPES")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--variant", action="append", required=True,
                        help="SelfSpecModel keywords, 'name=value,...' ('' for the defaults); repeatable")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=33)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the runs and medians here as JSON")
    args = parser.parse_args(argv)
    variants = {text: parse_variant(text) for text in args.variant}  # refused before the target is built
    if len(variants) < 2:
        parser.error("give at least two different --variant")
    if args.rounds < 1 or args.max_new_tokens < 2:
        parser.error("--rounds must be >= 1 and --max-new-tokens >= 2")

    from infer import SelfSpecModel
    from infer.random_target import build_random_target

    from .gpu import step_bytes, step_readings_gb_s, step_weights

    torch.set_num_threads(args.threads)
    target = build_random_target(args.random_target, device="cpu", dtype=getattr(torch, args.dtype))
    vocab = target.config.vocab_size
    ids = torch.randint(10, min(1000, vocab), (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    gb = step_bytes(target) / 1e9
    engines = {text: SelfSpecModel(target, "none", **options) for text, options in variants.items()}
    for engine in engines.values():
        engine.generate(ids, max_new_tokens=4)
    runs = {text: [] for text in engines}
    for r in range(args.rounds):
        for text in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            bandwidth = max(step_readings_gb_s(step_weights(target)))  # as scripts/bench.py reads it
            engine = engines[text]
            tic = time.perf_counter()
            tokens = engine.generate(ids, max_new_tokens=args.max_new_tokens)[0, PROMPT_TOKENS:].tolist()
            seconds = time.perf_counter() - tic
            stats = engine.last_stats
            step_ms = (seconds - stats["prefill_seconds"]) / (stats["target_forwards"] - 1) * 1000
            floor_ms = gb / bandwidth * 1000
            runs[text].append({"round": r, "gb_s": bandwidth, "floor_ms": floor_ms, "step_ms": step_ms,
                               "verify_forward": stats["verify_forward"], "int8_argmax": stats.get("int8_argmax"),
                               "tokens": tokens})
            print(f"round {r} {text or 'defaults'!r:>32}: {bandwidth:5.1f} GB/s, floor {floor_ms:5.1f} ms | step "
                  f"{step_ms:6.2f} ms = {step_ms / floor_ms:.2f}x | {stats['verify_forward']}, int8_argmax "
                  f"{stats.get('int8_argmax')}", flush=True)
    summary = {}
    first = next(iter(runs.values()))[0]["tokens"]
    for text, rows in runs.items():
        summary[text] = {"median_step_ms": statistics.median(x["step_ms"] for x in rows),
                         "median_of_floor": statistics.median(x["step_ms"] / x["floor_ms"] for x in rows),
                         "same_tokens_as_first_variant": rows[0]["tokens"] == first}
        print(f"{text or 'defaults'!r:>32}: median step {summary[text]['median_step_ms']:.2f} ms, "
              f"{summary[text]['median_of_floor']:.3f}x its floor")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": shlex.join(["python", "scripts/bench_options.py", *argv]),
                                        "shape": args.random_target, "dtype": args.dtype, "gb_read_a_step": gb,
                                        "runs": runs, "summary": summary}, indent=1))
    return 0
