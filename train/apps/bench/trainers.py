"""Trainers side by side: selfspec, SpecForge and speculators train EAGLE-3 drafters for one target on the same rows,
and selfspec's engine measures every drafter the same way.

One command does all of it, in a work folder it can be run again on (finished steps are kept, a killed run
resumes):

 1. rows: the target's own answers (`--data`), tokenized once with the target's chat template (the assistant-only
    loss mask, cut at `--max-length`), in file order until they hold `--budget` assistant tokens
    (train/apps/bench/trainer_data.py);
 2. features: one forward of the target per row, written in each trainer's layout;
 3. training: every framework (`--frameworks`) at every seed (`--seeds`), one epoch over the rows at TTT depth 7,
    each otherwise at its recommended settings; the peers in their own environment (`make peers`) with the CPU
    patches of train/apps/bench/peer_cpu/ (train/apps/bench/trainer_frameworks.py); wall time and peak memory of each run
    (train/apps/bench/trainer_runs.py);
 4. measurement: each drafter imported by selfspec (heads.load, the peers' checkpoints in their own formats) and
    timed greedily alone at a 7-token chain, the 60-node tree and the tree calibrated for this machine, on MT-bench
    and on held-out Alpaca prompts (train/apps/bench/trainer_eval.py);
 5. results.md and results.json in the work folder: one row per run, the mean and spread per framework, notes.

    make peers
    python scripts/bench_trainers.py --work runs/bench_trainers --budget 100000
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

from train.apps.bench.cli import at_least
from train.apps.bench.trainer_eval import add_measure_options
from train.apps.bench.trainer_frameworks import (
    FRAMEWORKS,
    PATCHES,
    PEERS,
    ROOT,
    Setup,
    runner,
    selfspec_label,
)

DEFAULT_WORK = "runs/bench_trainers"
DEFAULT_DATA = ROOT / "data" / "alpaca_smollm2_distill_29k.jsonl.gz"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=DEFAULT_WORK, help="folder for rows, features, runs and results")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="the embedded target's name or a local folder (the peers load it as a plain HF folder)")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="the target's own answers (OpenAI messages rows)")
    parser.add_argument("--budget", type=at_least(1), default=100_000, help="assistant tokens every run trains on")
    parser.add_argument("--max-length", type=at_least(2), default=384, help="tokens per row (longer rows are cut)")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--seeds", nargs="+", type=at_least(0), default=[0, 1])
    add_measure_options(parser)
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch threads of every run and measurement")
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                        help="the peers' environment's python (`make peers`)")
    parser.add_argument("--speculators-seq-len", type=at_least(16), default=2048,
                        help="speculators' packed tokens a step (--total-seq-len; its GPU default 8192 would make a "
                             "CPU budget a handful of steps)")
    parser.add_argument("--selfspec-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="a variant of selfspec's recipe: train/train_heads.py settings after the recipe's (e.g. "
                             "batch_size=2 mixed_precision=bf16); its runs are named selfspec[KEY=VALUE,...] and sit "
                             "beside the recipe's in the same work folder, on the same rows")
    parser.add_argument("--no-measure", action="store_true", help="train only; measure on a later call")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if PEERS & set(args.frameworks) and not Path(args.peers_python).is_file():
        parser.error(f"--peers-python {args.peers_python} does not exist: build the peers' environment with "
                     "`make peers`, or leave out --frameworks " + " ".join(sorted(PEERS & set(args.frameworks))))
    bad = [o for o in args.selfspec_set if "=" not in o or o.startswith("=")]
    if bad:
        parser.error(f"--selfspec-set takes KEY=VALUE settings of train/train_heads.py, not {bad}")
    for flag, path in (("--data", args.data), ("--mt-bench", args.mt_bench), ("--heldout", args.heldout)):
        if not args.no_measure or flag == "--data":
            if not Path(path).is_file():
                parser.error(f"{flag} {path} does not exist")
    torch.set_num_threads(args.threads)
    work = Path(args.work).resolve()
    setup, rows, target, tokenizer = prepare(args, work)
    records = train_all(args, setup, work)
    if args.no_measure:
        print(f"trained; measure with the same command without --no-measure ({work})")
        return 0
    return report(args, setup, rows, target, records, measure_all(args, setup, target, tokenizer, records))


def prepare(args, work: Path):
    """Rows, the peers' target folder and every layout's features, kept where an earlier call made them."""
    from infer.embedded import EMBEDDED_NAME, embedded_folder
    from train.apps.bench.trainer_data import capture, layouts, peer_target, prepare_rows, write_rows
    from train.target import load_target

    source = embedded_folder() if args.target == EMBEDDED_NAME else Path(args.target)
    if not (source / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: give {EMBEDDED_NAME!r} or a local folder holding config.json "
                         "and model.safetensors (the peers load the target from a folder)")
    target, tokenizer = load_target(args.target)
    rows = prepare_rows(args.data, tokenizer, args.budget, args.max_length)
    check_manifest(work, {"target": args.target, "data": str(Path(args.data).resolve()), "budget": args.budget,
                          "max_length": args.max_length, "samples": rows.fingerprint, "rows": len(rows.samples),
                          "assistant_tokens": rows.assistant_tokens, "tokens": rows.tokens})
    rows_file = write_rows(rows, work / "rows")
    where = layouts(work, target, args.target, rows, soft=soft_variant(args.selfspec_set))
    print(f"[rows] {len(rows.samples)} rows, {rows.assistant_tokens} assistant tokens, {rows.tokens} tokens; "
          f"features: {json.dumps(capture(target, rows, where))}", flush=True)
    setup = Setup(work=work, rows_file=rows_file, rows=len(rows.samples), layouts=where, target_name=args.target,
                  peer_target=peer_target(source, work / "target"),
                  target_config=json.loads((source / "config.json").read_text()), max_length=args.max_length,
                  threads=args.threads, peers_python=Path(args.peers_python).absolute(),
                  speculators_seq_len=args.speculators_seq_len, selfspec_overrides=tuple(args.selfspec_set))
    return setup, rows, target, tokenizer


def soft_variant(overrides: list[str]) -> bool:
    """Whether selfspec's run, its recipe with `overrides` read as train/train_heads.py reads them (an unknown key
    refused here, before any capture), trains on the target's distribution (`loss` soft or both), which needs the
    target's last layer in its feature cache."""
    from train.apps.bench.trainer_frameworks import SELFSPEC_CONFIG
    from train.config import load_config

    return load_config(SELFSPEC_CONFIG, list(overrides)).loss != "hard"


def check_manifest(work: Path, manifest: dict) -> None:
    """A work folder holds the runs of one set of rows: another budget, data or target is refused by name."""
    path = work / "rows" / "manifest.json"
    if path.is_file():
        old = json.loads(path.read_text())
        changed = sorted(k for k in manifest if old.get(k) != manifest[k])
        if changed:
            raise SystemExit(f"{work} holds runs on other rows ({', '.join(changed)} differ: "
                             f"{ {k: old.get(k) for k in changed} } there); give another --work, or remove it")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def train_all(args, setup: Setup, work: Path) -> dict:
    """Every (framework, seed) run, one after another; a failed one is recorded and the rest go on."""
    from train.apps.bench.trainer_runs import read_run, run

    records = {}
    for framework in args.frameworks:
        for seed in args.seeds:
            label = selfspec_label(setup.selfspec_overrides) if framework == "selfspec" else framework
            folder = work / "runs" / f"{label}-seed{seed}"
            print(f"[train] {framework} seed {seed}: {folder}", flush=True)
            try:
                record = run(runner(framework, setup, seed), folder, {"seed": seed})
            except RuntimeError as err:
                print(f"[train] {framework} seed {seed} failed: {err}", file=sys.stderr, flush=True)
                record = {**(read_run(folder) or {}), "error": str(err)}
            else:
                print(f"[train] {framework} seed {seed}: {'kept' if record.get('kept') else 'done'}, "
                      f"{record['wall_seconds']} s, peak {record['peak_rss_mb']} MB", flush=True)
            records[(framework, seed)] = (folder, record)
    return records


def measure_all(args, setup: Setup, target, tokenizer, records: dict) -> dict:
    from train.apps.bench.trainer_eval import measure, prompt_sets

    sets, calibration = prompt_sets(tokenizer, args.mt_bench, args.heldout, args.prompts, args.calibration_prompts)
    measured = {}
    for (framework, seed), (folder, record) in records.items():
        if record.get("status") != "done":
            continue
        drafter = runner(framework, setup, seed).drafter(folder)
        print(f"[measure] {framework} seed {seed}: {drafter}", flush=True)
        try:
            measured[(framework, seed)] = measure(drafter, target, tokenizer, sets, calibration,
                                                  args.max_new_tokens, folder / "tau.json")
        except Exception as err:  # noqa: BLE001 (one drafter's failure is reported; the others are still measured)
            traceback.print_exc()
            measured[(framework, seed)] = {"error": f"measuring failed: {type(err).__name__}: {err}"}
    return measured


def report(args, setup: Setup, rows, target, records: dict, measured: dict) -> int:
    from train.apps.bench.report import environment
    from train.apps.bench.trainer_report import run_row, summary, to_markdown

    label = lambda f: selfspec_label(setup.selfspec_overrides) if f == "selfspec" else f  # noqa: E731
    table = [run_row(label(framework), seed, record, measured.get((framework, seed)), rows.tokens)
             for (framework, seed), (_, record) in records.items()]
    env = environment(target, args.threads)
    notes = [f"{len(rows.samples)} rows of {Path(args.data).name}, {rows.assistant_tokens} assistant tokens "
             f"({rows.tokens} in all), max_length {args.max_length}; one epoch, TTT depth 7, draft vocabulary 8192",
             f"tau: greedy, the drafter alone (fp32 drafts), {args.max_new_tokens} new tokens, first turns; MT-bench: "
             f"{args.prompts} questions; held-out: the first {args.prompts} of {Path(args.heldout).name}; calibrated "
             f"tree chosen on its last {args.calibration_prompts}",
             "train tokens/s: every token of the rows over the run's wall time (start-up and saving included)",
             f"machine: {env['cpu']}, {args.threads} threads, torch {env['torch']}, commit {env['git_commit']}, "
             f"{env['date']}, load {env['load_average']}",
             *[f"CPU patches, {f}: {PATCHES[f]}" for f in args.frameworks]]
    markdown = to_markdown(table, notes)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    (setup.work / "results.md").write_text(f"```\n{command}\n```\n\n{markdown}")
    (setup.work / "results.json").write_text(json.dumps(
        {"command": command, "settings": {k: v for k, v in vars(args).items()}, "environment": env, "runs": table,
         "summary": summary(table), "notes": notes}, indent=2, default=str) + "\n")
    print(markdown)
    print(f"wrote {setup.work / 'results.md'} and results.json", flush=True)
    return 1 if any(r.get("error") for r in table) else 0
