"""Batched greedy generation: transformers' batched `generate` against selfspec with no drafts and a trained drafter
as it loads, which drafts a call of several rows only where drafting is predicted faster at that batch size
(`SelfSpecModel(draft_batches=None)`), and the same drafter drafting every batch (`draft_batches=True`).

    python scripts/bench_batches.py --questions data/mt_bench.jsonl --batches 2 4 8 --out batches.json

Questions are taken in order, as many a call as the batch size (left-padded), and every method runs each batch
before the next batch starts, so a slow phase of the machine hits all of them alike. The first batch of each size
is run once untimed first (a drafter's first call of a batch size times its prediction). Every selfspec output is
compared with transformers' output for the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from train.apps.bench.cli import at_least
from train.apps.bench.report import environment, memory_floor

AS_IT_LOADS = "drafter as it loads"


def new_tokens(out: torch.Tensor, width: int, eos: set[int]) -> int:
    """Tokens generated after a batch's `width` prompt columns, each row up to its first eos token (included)."""
    total = 0
    for row in out[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def run_batch(methods: dict, target, enc, max_new_tokens: int, rows: dict) -> dict | None:
    """Every method on one batch, transformers' first; returns the drafter's `batch_drafting` record."""
    tic = time.perf_counter()
    expected = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    rows["transformers"]["seconds"] += time.perf_counter() - tic
    eos = target.generation_config.eos_token_id
    rows["transformers"]["tokens"] += new_tokens(expected, enc["input_ids"].shape[1],
                                                 set(eos if isinstance(eos, list) else [eos]))
    choice = None
    for name, model in methods.items():
        tic = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_new_tokens)
        rows[name]["seconds"] += time.perf_counter() - tic
        stats = model.last_stats
        rows[name]["tokens"] += stats["new_tokens"]
        rows[name]["mismatches"] += int(not torch.equal(out, expected))
        for key in ("target_forwards", "row_forwards", "target_seconds", "draft_seconds"):
            rows[name][key] += stats[key]
        if name == AS_IT_LOADS:
            choice = stats["batch_drafting"]
    return choice


def bench_batch_size(methods: dict, target, tokenizer, texts: list[str], batch: int, max_new_tokens: int) -> dict:
    """Every method over all `texts`, `batch` of them a call: {"rows": per method, "drafter_choice": ...}."""
    rows = {"transformers": {"tokens": 0, "seconds": 0.0}} | {
        name: {"tokens": 0, "seconds": 0.0, "mismatches": 0, "target_forwards": 0, "row_forwards": 0,
               "target_seconds": 0.0, "draft_seconds": 0.0} for name in methods}
    choice = None
    for start in range(0, len(texts), batch):
        enc = tokenizer(texts[start:start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        if start == 0:  # untimed warm-up
            run_batch(methods, target, enc, 8, {name: dict(row) for name, row in rows.items()})
        choice = run_batch(methods, target, enc, max_new_tokens, rows) or choice  # a last short batch: one row
    baseline = rows["transformers"]["tokens"] / rows["transformers"]["seconds"]
    for row in rows.values():
        row["tokens_per_second"] = row["tokens"] / row["seconds"]
        row["speedup"] = row["tokens_per_second"] / baseline
        if "target_forwards" in row:  # ms per step (a forward over every row), the prefill included
            steps = row["target_forwards"]
            row["tau"] = row["tokens"] / row["row_forwards"]  # new tokens a row gets from a forward
            row["step_ms"] = {"whole": 1e3 * row["seconds"] / steps,
                              "target_forward": 1e3 * row["target_seconds"] / steps,
                              "drafter": 1e3 * row["draft_seconds"] / steps}
    print(f"batch {batch}: " + ", ".join(f"{name} {row['tokens_per_second']:.1f} tokens/s ({row['speedup']:.2f}x"
                                           + (f", {row['mismatches']} mismatches)" if "mismatches" in row else ")")
                                           for name, row in rows.items()),
          f"| {AS_IT_LOADS}: {choice}", flush=True)
    return {"rows": rows, "drafter_choice": choice}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", required=True, help="MT-bench style .jsonl (first turns are used)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="smollm2-135m-instruct-eagle3", help="a trained drafter: name or folder")
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)
    parser.add_argument("--limit", type=at_least(0), default=0, help="first N questions only (0 = all)")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--out", required=True, help="JSON file for the results")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from infer import SelfSpecModel
    from infer.loading import resolve_target
    from infer.tuning.acceptance import load_prompts

    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.questions)[: args.limit or None]
    target, tokenizer = resolve_target(args.target)
    tokenizer.padding_side = "left"  # as batched generation needs
    if target.generation_config.pad_token_id is None:
        target.generation_config.pad_token_id = tokenizer.pad_token_id
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    methods = {"none": SelfSpecModel(target, "none"),
               AS_IT_LOADS: SelfSpecModel.from_pretrained(args.drafter, target=target),
               "drafter, draft_batches=True": SelfSpecModel.from_pretrained(args.drafter, target=target,
                                                                           draft_batches=True)}
    result = {"command": " ".join(sys.argv if argv is None else argv), "environment": environment(target, args.threads),
              "memory_floor": memory_floor(target), "max_new_tokens": args.max_new_tokens, "questions": len(texts),
              "batches": {}}
    for batch in args.batches:
        result["batches"][batch] = bench_batch_size(methods, target, tokenizer, texts, batch, args.max_new_tokens)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
