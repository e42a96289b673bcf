"""Every trainer's drafter measured by selfspec's engine: greedy, the drafter alone, at the same trees.

A drafter folder (selfspec's own, SpecForge's SGLang export, a speculators checkpoint) is imported by
`heads.load(folder, target=target)`, the same path `SelfSpecModel.from_pretrained` takes, and generates each
prompt's first turn greedily through `SelfSpecModel(target, drafter, tree=..., lookup_first=False,
int8_drafter=False)`: the drafter's own fp32 weights rank its drafts, so no drafter's quantized copy decides a
near-tie. The trees:

    chain7      a 7-token chain (depth 7, top-1), as the papers' anchors draft
    tree60      EAGLE-2's dynamic tree: depth 6, top-k 10, the 60 best drafted nodes kept
    calibrated  the tree `infer.tree_choice.choose` picks for this machine from the drafter's acceptance on the
                calibration prompts (held-out prompts not measured here) and this machine's verify and draft costs

tau = new tokens after the prefill's / decoding steps after the prefill (each step's accepted drafts plus its
bonus token), summed over a prompt set: the papers' mean accepted length.

Run alone, it measures any drafters (a shipped name, a folder, a hub id) the same way, e.g. the shipped drafter at
the anchors' trees for its model card:

    python scripts/bench_trees.py --drafter smollm2-135m-instruct-eagle3 --prompts 16 --out runs/trees
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

TREES = {
    "chain7": {"mode": "dynamic", "depth": 7, "top_k": 1, "total_tokens": 7, "min_confidence": 0.0},
    "tree60": {"mode": "dynamic", "depth": 6, "top_k": 10, "total_tokens": 60, "min_confidence": 0.0},
}
CALIBRATED = "calibrated"
SETTINGS = (*TREES, CALIBRATED)
TAU_FILE = "tau.json"
DATA = Path(__file__).resolve().parents[3] / "data"
DEFAULT_MT_BENCH = DATA / "mt_bench.jsonl"
DEFAULT_HELDOUT = DATA / "alpaca_heldout_prompts.jsonl"


def prompt_sets(tokenizer, mt_bench: str | Path, heldout: str | Path, count: int,
                calibration: int) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """({"mt_bench": ..., "alpaca_heldout": ...}, calibration prompts): MT-bench's first `count` questions, at
    most `count // 8` a category (first turns), and the first `count` held-out Alpaca prompts; the calibration
    prompts are the last `calibration` held-out ones, which no measurement uses."""
    from infer.tuning.acceptance import encode_prompts, load_prompts
    from train.apps.bench.harness import load_questions, render

    questions = load_questions(mt_bench, limit=count, per_category=max(1, count // 8))
    alpaca = load_prompts(heldout)
    if count + calibration > len(alpaca):
        raise ValueError(f"{heldout} holds {len(alpaca)} prompts: fewer than the {count} measured and the "
                         f"{calibration} calibration prompts, which must not overlap; lower --prompts or "
                         "--calibration-prompts")
    sets = {"mt_bench": [render(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions],
            "alpaca_heldout": encode_prompts(tokenizer, alpaca[:count])}
    return sets, encode_prompts(tokenizer, alpaca[len(alpaca) - calibration:])


def import_drafter(folder: Path, target):
    """(drafter, None), or (None, the error) where selfspec cannot import the checkpoint."""
    import heads

    try:
        return heads.load(str(folder), target=target).to(torch.float32).eval(), None
    except (ValueError, TypeError, KeyError, OSError, RuntimeError) as err:
        return None, f"{type(err).__name__}: {err}"


def tau(target, drafter, tree: dict, sets: dict[str, list[torch.Tensor]], max_new_tokens: int,
        tokenizer=None) -> dict:
    """Greedy generation of every prompt of every set with `tree` (one engine, so its set-up is paid once): per
    set, tau and what it is made of."""
    from infer import SelfSpecModel

    model = SelfSpecModel(target, drafter, tree=tree, lookup_first=False, int8_drafter=False, tokenizer=tokenizer)
    out = {}
    for name, prompts in sets.items():
        tokens = steps = 0
        tic = time.perf_counter()
        with torch.inference_mode():
            for ids in prompts:
                model.generate(ids.to(target.device), max_new_tokens=max_new_tokens, do_sample=False)
                stats = model.last_stats
                tokens += stats["new_tokens"] - 1  # the prefill's token is no decoding step's
                steps += stats["target_forwards"] - 1
        out[name] = {"tau": round(tokens / steps, 4) if steps else None, "tokens": tokens, "steps": steps,
                     "seconds": round(time.perf_counter() - tic, 1)}
    return out


def calibrated_tree(target, drafter, prompts: list[torch.Tensor], tokenizer=None) -> dict:
    from infer.tree_choice import choose

    return choose(target, drafter, prompts, lookup_first=False, tokenizer=tokenizer).tree


def measure(folder: Path, target, tokenizer, sets: dict[str, list[torch.Tensor]], calibration: list[torch.Tensor],
            max_new_tokens: int, out: Path, only: tuple[str, ...] = SETTINGS) -> dict:
    """tau of the drafter in `folder` at every setting (or those in `only`) on every prompt set, kept in `out` (a
    finished measurement with the same settings is read back, not repeated)."""
    settings = {"prompts": {name: len(p) for name, p in sets.items()}, "calibration_prompts": len(calibration),
                "max_new_tokens": max_new_tokens, "trees": TREES}
    if tuple(only) != SETTINGS:
        settings["only"] = list(only)
    if out.is_file():
        kept = json.loads(out.read_text())
        if kept.get("settings") == settings and "import_error" not in kept:  # an importer may be fixed since
            return kept
    drafter, error = import_drafter(folder, target)
    if drafter is None:
        result = {"settings": settings, "import_error": error}
    else:
        trees = {name: tree for name, tree in TREES.items() if name in only}
        if CALIBRATED in only:
            trees[CALIBRATED] = calibrated_tree(target, drafter, calibration, tokenizer)
        result = {"settings": settings, "trees": trees,
                  "tau": {setting: tau(target, drafter, tree, sets, max_new_tokens, tokenizer)
                          for setting, tree in trees.items()}}
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_measure_options(parser: argparse.ArgumentParser) -> None:
    """The prompt sets, their sizes and the new tokens of a measurement (`prompt_sets`, `measure`), for every command
    that measures drafters this way."""
    from train.apps.bench.cli import at_least

    parser.add_argument("--mt-bench", default=str(DEFAULT_MT_BENCH), help="MT-bench questions (jsonl)")
    parser.add_argument("--heldout", default=str(DEFAULT_HELDOUT), help="held-out prompts, never trained on")
    parser.add_argument("--prompts", type=at_least(1), default=16,
                        help="prompts measured per set (MT-bench: the first, at most prompts/8 a category)")
    parser.add_argument("--calibration-prompts", type=at_least(1), default=16,
                        help="the last held-out prompts, which the calibrated tree is chosen on")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)


def build_parser() -> argparse.ArgumentParser:
    from train.apps.bench.cli import at_least

    parser = argparse.ArgumentParser(description="Drafters measured by selfspec's engine at the anchors' trees (a "
                                     "7-token chain, EAGLE-2's 60-node tree) and the tree calibrated for this machine")
    parser.add_argument("--drafter", action="append", required=True,
                        help="a shipped drafter's name, a folder or a hub id (any format selfspec imports); repeatable")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="the target's name or folder")
    add_measure_options(parser)
    parser.add_argument("--trees", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="the trees measured (default: all)")
    parser.add_argument("--sets", nargs="+", choices=("mt_bench", "alpaca_heldout"),
                        default=["mt_bench", "alpaca_heldout"], help="the prompt sets measured (default: both)")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--out", default="runs/trees", help="folder for one tau file per drafter and results.json")
    return parser


def tau_file_name(drafter: str) -> str:
    """One tau file per drafter: a folder's path (trainers' exports are all named `drafter`), else its name or hub
    id, as a file name."""
    path = Path(drafter)
    key = str(path.resolve()) if path.is_dir() else drafter
    return "tau-" + key.strip("/").replace("/", "--") + ".json"


def main(argv=None) -> int:
    from infer.loading import resolve_target

    args = build_parser().parse_args(argv)
    for flag, path in (("--mt-bench", args.mt_bench), ("--heldout", args.heldout)):
        if not Path(path).is_file():
            raise SystemExit(f"{flag} {path} does not exist")
    torch.set_num_threads(args.threads)
    target, tokenizer = resolve_target(args.target)
    sets, calibration = prompt_sets(tokenizer, args.mt_bench, args.heldout, args.prompts, args.calibration_prompts)
    sets = {name: prompts for name, prompts in sets.items() if name in args.sets}
    only = tuple(s for s in SETTINGS if s in args.trees)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, False
    for drafter in args.drafter:
        results[drafter] = measure(drafter, target, tokenizer, sets, calibration, args.max_new_tokens,
                                   out / tau_file_name(drafter), only)
        failed |= "import_error" in results[drafter]
        tau_by_set = {setting: {s: v["tau"] for s, v in r.items()}
                      for setting, r in results[drafter].get("tau", {}).items()}
        print(f"{drafter}: {json.dumps(results[drafter].get('import_error') or tau_by_set)}", flush=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 1 if failed else 0
