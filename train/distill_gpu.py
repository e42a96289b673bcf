"""Self-distillation at scale on one GPU, inside a time budget: the target writes several sampled answers to
each training prompt, then the EAGLE-3 drafter trains on them and on the greedy answers in data/.

    python scripts/distill_gpu.py --prompts tatsu-lab/alpaca --out runs/gpu_distill \\
        --regen-minutes 3 --train-minutes 3.5

1. `train.regenerate --samples N` on the first `--max-prompts` prompts (the rest are the held-out prompts of
   data/alpaca_heldout_prompts.jsonl), stopped at the regeneration budget; it appends a batch at a time, so a
   stop keeps every finished batch and a rerun resumes.
2. Training inside the rest of the budget (train/budget.py): the warm-up steps time the pace, then the run
   resumes with as many steps as fit, so the learning-rate schedule ends in time.
Everything lands under --out: sampled.jsonl, train.jsonl, run/ (run/drafter is the drafter) and distill.json
(what was measured).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def regenerate(args, sampled: Path) -> dict:
    command = [sys.executable, "-m", "train.regenerate", "--target", args.target, "--data", args.prompts,
               "--out", str(sampled), "--max_samples", str(args.max_prompts), "--samples", str(args.samples),
               "--temperature", str(args.temperature), "--top_p", str(args.top_p), "--dtype", args.regen_dtype,
               "--max_new_tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    tic = time.perf_counter()
    report = {"stopped_by_budget": False, "failed_batch_sizes": []}
    for batch_size in (args.batch_size, max(1, args.batch_size // 4)):  # a smaller batch if the first runs out of memory
        left = 60 * args.regen_minutes - (time.perf_counter() - tic)
        if left <= 0:
            break
        try:
            subprocess.run(command + ["--batch_size", str(batch_size)], cwd=ROOT, check=True, timeout=left)
            break
        except subprocess.TimeoutExpired:
            report["stopped_by_budget"] = True  # every finished batch is on disk; a rerun resumes from there
            break
        except subprocess.CalledProcessError:
            report["failed_batch_sizes"].append(batch_size)  # resumes: the batches written are kept
    report["seconds"] = round(time.perf_counter() - tic, 1)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="Alpaca-style prompts: a local file or a hub dataset (tatsu-lab/alpaca)")
    parser.add_argument("--out", required=True, help="folder for the data, the runs and distill.json")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_eagle3_gpu.yaml"))
    parser.add_argument("--greedy", default=str(ROOT / "data" / "alpaca_smollm2_regenerated.jsonl"),
                        help="greedy answers to train on beside the sampled ones ('' for none)")
    parser.add_argument("--max-prompts", type=int, default=4900)
    parser.add_argument("--samples", type=int, default=5, help="sampled answers per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed; another seed draws other answers to the same prompts (their ids are "
                             "<id>#k again, like those of seed 0)")
    parser.add_argument("--regen-dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--regen-minutes", type=float, default=3.0)
    parser.add_argument("--train-minutes", type=float, default=3.5, help="training, setup included")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from .budget import train_within
    from .config import load_config
    from .regenerate import merge_files, read_done_ids

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "args": vars(args)}
    sampled, merged = out / "sampled.jsonl", out / "train.jsonl"

    report["regenerate"] = regenerate(args, sampled)
    sources = ([Path(args.greedy)] if args.greedy else []) + [sampled]
    report["regenerate"]["sampled_answers"] = len(read_done_ids(sampled))
    report["train_rows"] = merge_files(sources, merged)
    print(f"[distill] {json.dumps(report['regenerate'])}; {report['train_rows']} training rows", flush=True)

    base = [f"target={args.target}", f"data={merged}", f"output_dir={out / 'run'}", *args.overrides]
    run = train_within(args.train_minutes, lambda extra: load_config(args.config, base + [
        f"{k}={v}" for k, v in extra.items()]), reserve_seconds=20)
    report["run"] = {k: v for k, v in run.items() if k != "history"}
    (out / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[distill] done: {json.dumps(report['run'])}", flush=True)
    return 0
