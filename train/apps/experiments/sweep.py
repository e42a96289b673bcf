"""Which EAGLE-3 training settings pay on a CPU budget: train one drafter per setting, then measure each.

Every setting trains from the same data and the same offline feature cache (the settings here do not change
which target layers are read, so the cache is built once), for the same number of optimizer steps unless
the setting is the step count itself. Each trained drafter is then measured twice:
  - held-out top-1/top-3 per training-time-test step (teacher-forced, from the trainer's evaluation), and
  - tau, tokens per target forward, through `SelfSpecModel` on held-out prompts, greedy, all drafters with
    the same fixed tree, so tau compares the drafters and not their trees.

Resumable: a finished setting (its tau.json written) is skipped, a killed training resumes from its newest
checkpoint. Rows go to <out>/sweep.jsonl and a markdown table to <out>/sweep.md.

    python scripts/sweep.py --out runs/sweep                  # every setting in SETTINGS
    python scripts/sweep.py --out runs/sweep --only base lr3e-3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# name -> overrides of the base run (configs/smollm2_eagle3.yaml + BASE). One change per row.
SETTINGS = {
    "base": {},
    "vocab2k": {"drafter_options": {"draft_vocab_size": 2048}},
    "vocab32k": {"drafter_options": {"draft_vocab_size": 32000}},
    "ttt1": {"ttt_steps": 1},
    "ttt5": {"ttt_steps": 5},
    "lr3e-3": {"lr": 3e-3},
    "constant": {"lr_schedule": "constant"},
    "steps2x": {"max_steps": None},  # filled in: twice the base steps (more epochs over the same data)
    "layers2": {"drafter_options": {"draft_vocab_size": 8192, "num_layers": 2}},
    "soft": {"loss": "soft"},  # KL to the target's whole next-token distribution (its last layer is cached too)
}
FIXED_TREE = {"mode": "dynamic", "depth": 4, "top_k": 4, "total_tokens": 16, "min_confidence": 0.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "sweep")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_eagle3.yaml")
    p.add_argument("--data", default=str(ROOT / "data" / "alpaca_smollm2_regenerated.jsonl"))
    p.add_argument("--max-samples", type=int, default=1500, help="conversations (train + held-out split)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per setting (steps2x: twice)")
    p.add_argument("--prompts", default=str(ROOT / "data" / "alpaca_heldout_prompts.jsonl"),
                   help="held-out prompts for tau (never trained on)")
    p.add_argument("--tau-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all logical CPUs)")
    p.add_argument("--feature-cache", default=str(ROOT / ".cache" / "selfspec-features"),
                   help="offline feature cache root (shared by every setting reading the same layers)")
    p.add_argument("--only", nargs="*", default=None, choices=list(SETTINGS), help="run these settings only")
    return p


def overrides(name: str, args) -> dict:
    base = {"data": args.data, "max_samples": args.max_samples, "features": "offline", "max_steps": args.steps,
            "save_every": 50, "keep_checkpoints": 1, "progress_bar": False, "output_dir": str(args.out / name),
            "feature_cache_dir": args.feature_cache}
    change = dict(SETTINGS[name])
    if name == "steps2x":
        change["max_steps"] = 2 * args.steps
    return {**base, **change}


def train(name: str, args) -> dict:
    """Train (or resume) one setting in a child process, so every run starts from a clean interpreter."""
    out = args.out / name
    if (out / "result.json").is_file():
        return json.loads((out / "result.json").read_text())
    # strings as they are, the rest as YAML flow values (JSON is YAML), which the config parser reads
    settings = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides(name, args).items()]
    resume = ["--resume"] if (out / "checkpoints").is_dir() else []
    command = [sys.executable, str(ROOT / "train" / "train_heads.py"), "--config", str(args.config), *settings,
               *resume]
    print(f"[{name}] {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    return json.loads((out / "result.json").read_text())


def measure_tau(name: str, args, target, tokenizer, prompts) -> dict:
    """Tokens per target forward over the held-out prompts, greedy, with FIXED_TREE."""
    import heads
    from infer import SelfSpecModel

    drafter = heads.load(args.out / name / "drafter")
    model = SelfSpecModel(target, drafter, tokenizer=tokenizer, tree=dict(FIXED_TREE), lookup_first=False)
    new_tokens = forwards = 0
    tic = time.perf_counter()
    for ids in prompts:
        model.generate(ids, max_new_tokens=args.max_new_tokens)
        new_tokens += model.last_stats["new_tokens"]
        forwards += model.last_stats["row_forwards"]
    return {"tau": round(new_tokens / forwards, 3), "tau_new_tokens": new_tokens, "tau_forwards": forwards,
            "tau_seconds": round(time.perf_counter() - tic, 1)}


def row(name: str, args, result: dict, tau: dict) -> dict:
    ev = result["eval"]
    depth = sum(1 for k in ev if k.endswith("/top1"))
    return {"setting": name, "overrides": {k: v for k, v in overrides(name, args).items()
                                           if k not in ("output_dir", "progress_bar", "save_every",
                                                        "keep_checkpoints", "feature_cache_dir")},
            "steps": result["step"], "train_minutes": round(result["train_seconds"] / 60, 1),
            "top1": [ev[f"step{i}/top1"] for i in range(depth)], "top3": [ev[f"step{i}/top3"] for i in range(depth)],
            "est_accept_len": ev["est_accept_len"], **tau}


def markdown(rows: list[dict], args) -> str:
    lines = [f"Held-out top-1/top-3 by TTT step (teacher-forced), and tau on the first {args.tau_prompts} "
             f"held-out prompts at {args.max_new_tokens} new tokens with the tree {FIXED_TREE}.", "",
             "| setting | change | steps | train min | top-1 by step | top-3 by step | tau |",
             "| --- | --- | ---: | ---: | --- | --- | ---: |"]
    for r in rows:
        change = SETTINGS[r["setting"]] if r["setting"] != "steps2x" else {"max_steps": r["steps"]}
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        lines.append(f"| {r['setting']} | {json.dumps(change) if change else '-'} | {r['steps']} | "
                     f"{r['train_minutes']} | {fmt(r['top1'])} | {fmt(r['top3'])} | {r['tau']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from infer.loading import resolve_target
    from infer.tuning.acceptance import encode_prompts, load_prompts

    prompts_text = load_prompts(args.prompts)[: args.tau_prompts]  # bad input fails before any training
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SETTINGS)
    target = tokenizer = prompts = None
    for name in names:
        tau_file = args.out / name / "tau.json"
        if tau_file.is_file():
            continue
        result = train(name, args)
        if target is None:
            torch.set_num_threads(args.threads or os.cpu_count() or 1)
            target, tokenizer = resolve_target("smollm2-135m-instruct")
            prompts = encode_prompts(tokenizer, prompts_text)
        tau = measure_tau(name, args, target, tokenizer, prompts)
        tau_file.write_text(json.dumps(tau))
        print(f"[{name}] {json.dumps(row(name, args, result, tau))}", flush=True)
    rows = [row(n, args, json.loads((args.out / n / "result.json").read_text()),
                json.loads((args.out / n / "tau.json").read_text()))
            for n in SETTINGS if (args.out / n / "tau.json").is_file()]
    (args.out / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "sweep.md").write_text(markdown(rows, args))
    print(markdown(rows, args))
    return 0
