"""`selfspec <verb>`: one command for every job, as the anchors give one (`vllm serve`, `speculators train`).

    selfspec train --config configs/smollm2_eagle3.yaml max_steps=200     # accelerate launch -m train.cli train ...
    selfspec regenerate --target smollm2-135m-instruct --data data/alpaca_smollm2_regenerated.jsonl --out a.jsonl
    selfspec calibrate --drafter runs/smollm2_eagle3/drafter --write
    selfspec bench --questions data/mt_bench.jsonl --drafter smollm2-135m-instruct-eagle3
    selfspec export runs/smollm2_eagle3/drafter exported/ --format speculators
    selfspec import <another project's checkpoint> --target <target> --out <folder>
    selfspec serve | push | demo | synthesize ...

Each verb is the module a script in scripts/ also runs, and `selfspec <verb> --help` is that module's own help.
Multi-process training runs the same verb under a launcher: `accelerate launch -m train.cli train ...` or
`torchrun --nproc_per_node 2 -m train.cli train ...`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# verb: (the function it runs, "module" for module.main or "module:function", one line for the verb list)
VERBS = {
    "train": ("train.train_heads", "train a drafter on a frozen target (key=value overrides; accelerate, torchrun)"),
    "regenerate": ("train.regenerate", "self-distillation data: the target answers a dataset's prompts"),
    "synthesize": ("train.synthesize_prompts", "have the target write prompts where there are few"),
    "calibrate": ("heads.calibrate_cli", "choose a drafter's tree for this machine and write it into its config"),
    "bench": ("train.apps.bench", "benchmark drafters against the target on MT-bench or any prompts"),
    "serve": ("train.apps.serve", "serve a drafter with vLLM (an OpenAI-compatible server)"),
    "export": ("heads.export_cli", "write a drafter in another project's format (speculators, SGLang, vLLM Medusa)"),
    "import": ("train.cli:import_main", "read another project's checkpoint (EAGLE, SpecForge, speculators, Medusa, DFlash) "
                            "and save it as a selfspec drafter"),
    "push": ("heads.publish", "upload a drafter to the Hugging Face Hub with its model card"),
    "demo": ("train.apps.demo", "the whole loop on the embedded target: distill, train, calibrate, benchmark"),
}


def import_main(argv=None) -> int:
    """`selfspec import`: a drafter in another project's format, checked against its target, saved as ours."""
    import heads
    from heads.folders import written_whole
    from infer.loading import resolve_target

    parser = argparse.ArgumentParser(prog="selfspec import", description=VERBS["import"][1])
    parser.add_argument("source", help="the checkpoint: a local folder or a hub id")
    parser.add_argument("--target", required=True, help="the target it drafts for: a folder, hub id or short name")
    parser.add_argument("--out", required=True, help="a new folder for the selfspec drafter (must not exist)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.error(f"--out {str(out)!r} exists: give a new folder, so that nothing there is replaced")
    if out.parent.exists() and not out.parent.is_dir():
        parser.error(f"--out {str(out)!r} is under a file, not a folder")
    if heads.imported_format(args.source) is None:
        parser.error(f"{args.source!r} is a selfspec drafter already: use it as it is")
    target, _ = resolve_target(args.target)
    drafter = heads.load(args.source, target=target)
    with written_whole(out) as partial:  # renamed into place once whole: a kill leaves no half folder
        drafter.save_pretrained(partial)
    print(f"imported {args.source} as a {drafter.config.model_type} drafter: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfspec", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Self-speculative decoding: train, measure, export and serve drafters.",
        epilog="verbs:\n" + "\n".join(f"  {verb:<11} {line}" for verb, (_, line) in VERBS.items())
        + "\n\n`selfspec <verb> --help` lists each verb's options.")
    parser.add_argument("verb", choices=sorted(VERBS), metavar="verb", help="one of the verbs below")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        build_parser().parse_args([verb])  # exits naming the verbs
    module, _, function = VERBS[verb][0].partition(":")
    run = getattr(importlib.import_module(module), function or "main")
    sys.argv[0] = f"selfspec {verb}"  # argparse's prog: the help and errors name the verb
    return run(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
