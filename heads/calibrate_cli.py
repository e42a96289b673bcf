"""Calibrate a trained drafter's tree to its acceptance on held-out prompts and to this machine's costs.

The drafter drafts a wide tree on the prompts (greedy, through SelfSpecModel), which gives how often each
node of it is accepted; this machine's verify forward is timed for 1..64 drafted nodes and the drafter's
step for every candidate tree. The table gives, per tree size N, the expected accepted drafts per step,
the costs and the predicted tokens/s = (1 + E_acc) / (draft + verify); the best tree is printed, and with
--write stored in the drafter's config.json with the statistics, which `SelfSpecModel(..., tree=
"calibrated")` uses to choose the tree again on another machine. Then the chosen tree generates the prompts
alone and with prompt lookup first, timed and interleaved; with --write, whether lookup first was faster is
stored as the drafter's default (`lookup_first` in config.json). Greedy output depends on neither.

    python scripts/calibrate.py --drafter runs/demo/drafter --prompts held_out.jsonl --write
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

# the smallest value each numeric flag takes
LOWEST = {"limit": 0, "max_new_tokens": 1, "top_k": 1, "depth": 1, "wide": 1, "max_nodes": 1, "context": 1,
          "repeats": 1, "threads": 0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True,
                        help="a saved drafter folder (Medusa, EAGLE, EAGLE-3) or a shipped drafter's name")
    parser.add_argument("--prompts", required=True,
                        help="held-out prompts, not seen in training: .jsonl (one JSON string or object with "
                             "'turns', 'prompt' or 'instruction' per line) or a .json array of them")
    parser.add_argument("--target", default=None, help="the target (default: the one the drafter records)")
    parser.add_argument("--limit", type=int, default=0, help="use the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", choices=["static", "dynamic"], default=None,
                        help="the tree kind to calibrate (default: the drafter's; Medusa is static)")
    parser.add_argument("--top-k", type=int, action="append", default=None,
                        help="dynamic: branching to measure, repeatable, one measuring run each (default: the "
                             "drafter's)")
    parser.add_argument("--depth", type=int, default=None, help="depth of the measured tree (default: the drafter's)")
    parser.add_argument("--wide", type=int, default=128, help="drafted nodes of the measured tree")
    parser.add_argument("--max-nodes", type=int, default=64, help="the largest tree to consider")
    parser.add_argument("--context", type=int, default=256, help="context length the costs are timed at")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cost (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all logical CPUs)")
    parser.add_argument("--no-lookup-first", action="store_true",
                        help="do not measure prompt lookup first (with --write, the drafter's default is kept)")
    parser.add_argument("--write", action="store_true",
                        help="store the chosen tree and the statistics in the drafter's config.json")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, low in LOWEST.items():
        given = getattr(args, flag)
        for value in given if isinstance(given, list) else [given]:  # --top-k repeats
            if value is not None and value < low:
                parser.error(f"argument --{flag.replace('_', '-')}: must be >= {low}, got {value}")
    if args.max_nodes > args.wide:
        parser.error(f"argument --max-nodes: must be <= --wide ({args.wide}): candidate trees are subsets of the "
                     f"measured one; got {args.max_nodes}")
    return args


def main(argv=None) -> int:
    import heads
    from heads.card import write_calibration
    from infer.loading import resolve_target
    from infer.tree_choice import choose
    from infer.tuning.acceptance import encode_prompts, load_prompts

    args = parse_args(argv)
    prompts = load_prompts(args.prompts)  # bad input fails here, before any model loads
    if args.limit:
        prompts = prompts[: args.limit]
    folder = Path(heads.resolve_drafter(args.drafter))  # a shipped drafter's name is its folder
    if args.write and not folder.is_dir():
        raise SystemExit(f"--write updates a local drafter folder; {args.drafter} is not one")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    drafter = heads.load(args.drafter)  # by name, a shipped drafter runs in fp32
    name = args.target or drafter.config.base_model_name_or_path
    if not name:
        raise SystemExit(f"{args.drafter} records no target; pass --target")
    target, tokenizer = resolve_target(name)
    choice = choose(target, drafter, encode_prompts(tokenizer, prompts), lookup_first=not args.no_lookup_first,
                    mode=args.mode, top_k=args.top_k, depth=args.depth, wide=args.wide, max_nodes=args.max_nodes,
                    max_new_tokens=args.max_new_tokens, context=args.context, repeats=args.repeats,
                    tokenizer=tokenizer)
    steps = sum(m["steps"] for m in choice.calibration["measured"])
    print(f"{drafter.kind} drafter {args.drafter} on {name}: {len(prompts)} prompts, {steps} verify steps "
          f"measured; {torch.get_num_threads()} threads, costs at context {args.context}")
    print(report(choice))
    if args.write:
        write_calibration(folder, drafter, choice.calibration, choice.tree, choice.lookup_first)
        print(f"wrote the tree and the statistics to {folder / 'config.json'}")
    return 0


def report(choice) -> str:
    """What `infer.tree_choice.choose` found, for the terminal: the table, the best tree and, where measured,
    whether prompt lookup first and drafting at all pay."""
    best = choice.best
    lines = [table(choice.predictions, best, choice.no_drafts),
             f"best: {best.candidate.nodes} nodes, {describe(choice.tree)}, predicted "
             f"{best.tokens_per_second:.1f} tokens/s; no drafts predicted {choice.no_drafts.tokens_per_second:.1f} "
             f"tokens/s (engine {best.engine_seconds * 1e3:.2f} ms a step besides the forward and the drafter)"]
    if choice.lookup_first is not None:
        alone, first = choice.lookup_first["alone"], choice.lookup_first["lookup_first"]
        lines.append(f"with this tree: alone {alone['tokens_per_second']:.1f} tokens/s (tau "
                     f"{alone['new_tokens'] / alone['target_forwards']:.2f}), prompt lookup first "
                     f"{first['tokens_per_second']:.1f} tokens/s (tau "
                     f"{first['new_tokens'] / first['target_forwards']:.2f}): "
                     f"lookup first {'pays' if choice.lookup_first['pays'] else 'does not pay'}")
        none = choice.lookup_first["no_drafts"]["tokens_per_second"]
        lines.append(f"no drafts (one token a forward, the same engine): {none:.1f} tokens/s: drafting "
                     + ("pays" if choice.lookup_first["drafting_pays"] else
                        "does not pay on this machine, whose forward alone is faster than drafting with this "
                        "drafter"))
    return "\n".join(lines)


def table(predictions, best, no_drafts=None) -> str:
    """A markdown table: per tree size, the fastest tree of that size; the chosen one marked; no drafts (N = 0)
    first where given."""
    fastest = {} if no_drafts is None else {0: no_drafts}
    for p in predictions:
        n = p.candidate.nodes
        if n not in fastest or p.tokens_per_second > fastest[n].tokens_per_second:
            fastest[n] = p
    lines = ["| N | E_acc | verify ms | draft ms | predicted tokens/s | tree |", "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for n in sorted(fastest):
        p = fastest[n]
        mark = " **best**" if p is best else ""
        lines.append(f"| {n} | {p.candidate.expected_accepted:.3f} | {p.verify_seconds * 1e3:.1f} | "
                     f"{p.draft_seconds * 1e3:.1f} | {p.tokens_per_second:.1f}{mark} | {describe(p.candidate.tree)} |")
    return "\n".join(lines)


def describe(tree: dict) -> str:
    """Depth and branching of a tree's settings, in a few words."""
    if not tree:
        return "no drafts"
    if tree.get("mode", "static") == "dynamic":
        return f"dynamic, depth {tree['depth']}, top-{tree['top_k']}, {tree['total_tokens']} kept"
    paths = tree["paths"]
    depth = max(len(p) for p in paths)
    width = [sum(len(p) == d for p in paths) for d in range(1, depth + 1)]
    return f"static, depth {depth}, nodes per depth {width}"
