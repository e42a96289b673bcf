"""An interleaved A/B of the engine at two revisions: the same generate calls timed in turn at each, one fresh
process per run, so that a claim "no slower than <commit>" is measured on this machine, in one sitting.

    python scripts/bench_ab.py --base 808992d --drafter none --drafter smollm2-135m-instruct-eagle3 \
        --questions data/mt_bench.jsonl --per-category 1 --max-new-tokens 96 --rounds 3

The base revision is checked out once (`git worktree add --detach`, under --work) and the head is this working
tree as it is (or `--head <revision>`, checked out the same way). Every run is this machine's Python with the
checkout first on its path (train/apps/bench/ab_run.py, which reads nothing else of this repository), timing
`SelfSpecModel.generate` greedily over the questions' first turns after one warm-up call. Each round runs every
drafter at both revisions, the order alternating from round to round (A B, then B A), so a drift of the machine
falls on both. The report gives tokens/s per run and per revision (the median over rounds), tau, and whether the
two revisions generated the same tokens, which they must.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from train.apps.bench.cli import at_least

ROOT = Path(__file__).resolve().parents[3]
RUN = Path(__file__).resolve().with_name("ab_run.py")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("--head", default=None, help="the revision measured (default: this working tree as it is)")
    parser.add_argument("--drafter", action="append", required=True,
                        help="'none', a drafter name or folder; '+alone' turns prompt lookup first off; repeatable")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="the target's name or folder")
    parser.add_argument("--questions", default=str(ROOT / "data" / "mt_bench.jsonl"), help="MT-bench-style jsonl")
    parser.add_argument("--per-category", type=at_least(0), default=1, help="first N questions a category (0 = all)")
    parser.add_argument("--limit", type=at_least(0), default=0, help="first N questions only (0 = all)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=96)
    parser.add_argument("--rounds", type=at_least(1), default=3, help="runs of every drafter at each revision")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--work", default="runs/bench_ab", help="folder for the base's checkout and the results")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    revisions = {"base": checkout(args.base, work), "head": checkout(args.head, work) if args.head else ROOT}
    names = {"base": args.base, "head": args.head or "working tree"}
    job = jobs(args)
    runs = []
    for r in range(args.rounds):
        order = ("base", "head") if r % 2 == 0 else ("head", "base")
        for drafter in args.drafter:
            for side in order:
                result = run(revisions[side], job[drafter], work)
                runs.append({"round": r, "revision": side, "drafter": drafter, **result})
                print(f"[ab] round {r} {drafter} {side} ({names[side]}): {result['tokens_per_s']:.1f} tokens/s, "
                      f"tau {result['tau']:.2f}", flush=True)
    table = summary(runs, args.drafter)
    report(args, names, runs, table, work)
    return 1 if any(not row["same_tokens"] for row in table) else 0


def checkout(revision: str, work: Path) -> Path:
    """A detached checkout of `revision` under `work`, made once and kept (git worktree)."""
    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}").strip()
    folder = work / f"checkout-{commit[:12]}"
    if not (folder / "infer").is_dir():
        git("worktree", "add", "--detach", "--force", str(folder), commit)
    return folder


def git(*argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def jobs(args) -> dict[str, dict]:
    """Per drafter, what a run is given: the prompts as token ids (rendered once, here, so both revisions time
    the same ids)."""
    from infer.loading import resolve_target
    from train.apps.bench.harness import load_questions, render

    _, tokenizer = resolve_target(args.target)
    questions = load_questions(args.questions, limit=args.limit, per_category=args.per_category)
    prompts = [render(tokenizer, [{"role": "user", "content": q["turns"][0]}])[0].tolist() for q in questions]
    out = {}
    for drafter in args.drafter:
        name, alone = (drafter[: -len("+alone")], True) if drafter.endswith("+alone") else (drafter, False)
        out[drafter] = {"drafter": name, "alone": alone, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                        "threads": args.threads, "target": args.target}
    return out


def run(checkout: Path, job: dict, work: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=work, delete=False) as f:
        json.dump(job, f)
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(job["threads"])}
    try:
        done = subprocess.run([sys.executable, str(RUN), str(checkout), f.name], capture_output=True, text=True,
                              env=env, cwd=checkout)
    finally:
        os.unlink(f.name)
    if done.returncode:
        raise SystemExit(f"the run at {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "tokens_per_s": result["new_tokens"] / result["seconds"],
            "tau": result["new_tokens"] / result["target_forwards"]}


def summary(runs: list[dict], drafters: list[str]) -> list[dict]:
    table = []
    for drafter in drafters:
        side = {s: [r for r in runs if r["drafter"] == drafter and r["revision"] == s] for s in ("base", "head")}
        base, head = (statistics.median(r["tokens_per_s"] for r in side[s]) for s in ("base", "head"))
        table.append({"drafter": drafter, "base_tokens_per_s": round(base, 1), "head_tokens_per_s": round(head, 1),
                      "change": round(head / base - 1, 4),
                      "base_runs": [round(r["tokens_per_s"], 1) for r in side["base"]],
                      "head_runs": [round(r["tokens_per_s"], 1) for r in side["head"]],
                      "tau": round(side["head"][0]["tau"], 3),
                      "same_tokens": len({r["outputs"] for r in side["base"] + side["head"]}) == 1})
    return table


def report(args, names: dict, runs: list[dict], table: list[dict], work: Path) -> None:
    from train.apps.bench.report import machine

    lines = [f"| drafter | {names['base']} tokens/s | {names['head']} tokens/s | change | runs (base; head) | tau | "
             "same tokens |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for row in table:
        lines.append(f"| {row['drafter']} | {row['base_tokens_per_s']} | {row['head_tokens_per_s']} | "
                     f"{100 * row['change']:+.1f}% | {row['base_runs']}; {row['head_runs']} | {row['tau']} | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    env = machine(args.threads)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    text = (f"```\n{command}\n```\n\n" + "\n".join(lines) + f"\n\nmedian of {args.rounds} runs per revision, "
            f"interleaved; {env['cpu']}, {args.threads} threads, {env['date']}, load {env['load_average']}\n")
    (work / "results.md").write_text(text)
    (work / "results.json").write_text(json.dumps({"command": command, "settings": vars(args), "machine": env,
                                                   "revisions": names, "table": table, "runs": runs}, indent=2) + "\n")
    print(text, flush=True)
