"""What a benchmark run reports: per-category aggregates, the markdown table, plots, the machine it ran on.

tokens/s = total new tokens / total median seconds; tau = new tokens per target forward (the prefill
included); per selfspec row, where a step's time goes; per oracle row, the ideal it falls short of.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from train.apps.bench.methods import BASELINE, PLD

ROOT = Path(__file__).resolve().parents[3]


def aggregate(records: list[dict], names: list[str], ideals: dict[str, float] | None = None) -> dict:
    """Per category (and 'overall'): tokens/s = total new tokens / total median seconds; speedups are ratios
    of tokens/s; tau = total new tokens / total target forwards. For selfspec rows, per step: drafting,
    verifying, the target's forwards and the engine's own time (the rest). For an oracle row (`ideals`:
    its expected tokens per step), the ideal tokens/s, that many tokens per plain greedy step."""
    ideals = ideals or {}
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec["category"], []).append(rec)
    several_passes = any(rec.get("pass", 1) > 1 for rec in records)
    if several_passes:  # the repeated workload: each pass on its own
        for rec in records:
            groups.setdefault(f"pass {rec['pass']}", []).append(rec)
    if len({rec["turn"] for rec in records}) > 1:  # each turn on its own (per pass when there are several)
        for rec in records:
            label = f"turn {rec['turn']}" + (f", pass {rec['pass']}" if several_passes else "")
            groups.setdefault(label, []).append(rec)
    groups["overall"] = records
    table = {}
    for cat, recs in groups.items():
        row = {}
        for name in names:
            tokens = sum(r["results"][name]["new_tokens"] for r in recs)
            seconds = sum(r["results"][name]["seconds"] for r in recs)
            forwards = sum(r["results"][name]["target_forwards"] for r in recs)
            row[name] = {"questions": len(recs), "new_tokens": tokens, "seconds": round(seconds, 4),
                         "tokens_per_s": tokens / seconds if seconds else 0.0,
                         "tau": tokens / forwards if forwards else 0.0,
                         "mismatches": sum(r["results"][name]["matches_baseline"] is False for r in recs)}
            by_position = acceptance_by_position([r["results"][name] for r in recs])
            if by_position:
                row[name]["acceptance_by_position"] = by_position
            if all(r["results"][name].get("draft_seconds") is not None for r in recs) and forwards:
                # per target forward, the prefill included (as in tau)
                row[name]["draft_ms_per_step"] = 1000 * sum(r["results"][name]["draft_seconds"] for r in recs) / forwards
                row[name]["verify_ms_per_step"] = 1000 * sum(r["results"][name]["verify_seconds"] for r in recs) / forwards
                if all(r["results"][name].get("target_seconds") is not None for r in recs):
                    target_s = sum(r["results"][name]["target_seconds"] for r in recs)
                    draft_s = sum(r["results"][name]["draft_seconds"] for r in recs)
                    row[name]["target_ms_per_step"] = 1000 * target_s / forwards
                    # what neither the target's forwards nor the drafter took: masks, acceptance, cache commits
                    row[name]["engine_ms_per_step"] = 1000 * (seconds - target_s - draft_s) / forwards
        for name in names:
            for ref, key in ((BASELINE, "speedup_vs_greedy"), (PLD, "speedup_vs_pld")):
                if ref in row and row[ref]["tokens_per_s"]:
                    row[name][key] = row[name]["tokens_per_s"] / row[ref]["tokens_per_s"]
            if name in ideals and row[BASELINE]["tokens_per_s"]:
                # a plain step's cost is the baseline's seconds per token (tau 1)
                ideal = ideals[name] * row[BASELINE]["tokens_per_s"]
                row[name].update(ideal_tokens_per_step=ideals[name], ideal_tokens_per_s=ideal,
                                 fraction_of_ideal=row[name]["tokens_per_s"] / ideal)
        table[cat] = row
    return table


def acceptance_by_position(results: list[dict]) -> list[float]:
    """Per draft position i, the fraction of drafting steps whose draft at position i was accepted (and all
    before it): from selfspec's accepted lengths (every step after the prefill; a step emitting L tokens
    accepted positions 0..L-2) or from vLLM's per-position counters over its drafts. Empty if neither."""
    if results and all("accepted_by_position" in r for r in results):
        drafts = sum(r["drafts"] for r in results)
        width = max(len(r["accepted_by_position"]) for r in results)
        totals = [sum(r["accepted_by_position"][i] for r in results if i < len(r["accepted_by_position"]))
                  for i in range(width)]
        return [t / drafts for t in totals] if drafts else []
    lengths = [a for r in results for a in r.get("accepted_lengths", [])]
    if not lengths:
        return []
    return [sum(a - 1 > i for a in lengths) / len(lengths) for i in range(max(lengths) - 1)]


def to_markdown(result: dict) -> str:
    methods, cats = result["methods"], list(result["per_category"])
    s = result["settings"]
    sampling = s.get("sampling")
    versus = "speedup vs transformers sampling" if sampling else "speedup vs greedy"
    lines = [f"| category | method | tau | tokens/s | {versus} | speedup vs PLD | draft ms/step | "
             "verify ms/step | mismatches |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cat in cats:
        for name in methods:
            r = result["per_category"][cat][name]
            vs_pld = f"{r['speedup_vs_pld']:.2f}x" if "speedup_vs_pld" in r else "-"
            label = f"**{cat}**" if cat == "overall" else cat
            draft = f"{r['draft_ms_per_step']:.0f}" if "draft_ms_per_step" in r else "-"
            verify = f"{r['verify_ms_per_step']:.0f}" if "verify_ms_per_step" in r else "-"
            lines.append(f"| {label} | {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup_vs_greedy']:.2f}x | {vs_pld} | {draft} | {verify} | {r['mismatches']} |")
    env = result.get("environment", {})
    how = "greedy"
    if sampling:
        how = (f"sampled (temperature {sampling['temperature']}, top-p {sampling['top_p']}, top-k {sampling['top_k']}, "
               f"seed {sampling['seed']}; outputs not compared)")
    foot = (f"\n{len(result['questions'])} generations, batch 1, {how}, max {s['max_new_tokens']} new tokens, "
            f"median of {s['repeats']} repeat(s)")
    if s.get("timed_from_turn", 1) > 1:
        foot += f", turn {s['timed_from_turn']} onwards timed (earlier turns answered by the baseline, untimed)"
    if s.get("passes", 1) > 1:
        foot += f", {s['passes']} passes over the questions (each question asked again after all of them)"
    if env:
        foot += f"; {env.get('cpu')}, {env.get('torch_threads')} torch threads, {env.get('dtype')}"
        if env.get("memory_floor_ms"):
            foot += (f"; memory floor of one target forward {env['memory_floor_ms']:.1f} ms "
                     f"({env['weight_mb']:.0f} MB of weights at {env['read_gb_per_s']:.1f} GB/s measured read "
                     "bandwidth)")
        if env.get("load_average"):
            foot += f", load average {env['load_average'][0]:.2f} at the end"
    foot += ". tau = new tokens per target forward (prefill included).\n"
    if result["mismatches"]:
        foot += f"\n**{len(result['mismatches'])} greedy output(s) differ from the baseline.**\n"
    overall = result["per_category"]["overall"]
    timed = [m for m in methods if "engine_ms_per_step" in overall[m]]
    if timed:
        foot += ("\nWhere a step's time goes (overall, ms per target forward): the target's forwards, the "
                 "drafter, and the engine's own rest (masks, acceptance, cache commits).\n\n| method | step | "
                 "target forward | drafter | engine | engine share | ideal tokens/s | of ideal |\n"
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for m in timed:
            r = overall[m]
            step = r["target_ms_per_step"] + r["draft_ms_per_step"] + r["engine_ms_per_step"]
            ideal = f"{r['ideal_tokens_per_s']:.1f} | {r['fraction_of_ideal']:.0%}" if "ideal_tokens_per_s" in r else "- | -"
            foot += (f"| {m} | {step:.1f} | {r['target_ms_per_step']:.1f} | {r['draft_ms_per_step']:.1f} | "
                     f"{r['engine_ms_per_step']:.1f} | {r['engine_ms_per_step'] / step:.1%} | {ideal} |\n")
    accepting = [m for m in methods if overall[m].get("acceptance_by_position")]
    if accepting:
        width = min(8, max(len(overall[m]["acceptance_by_position"]) for m in accepting))
        foot += ("\nAcceptance by draft position (overall): the fraction of drafting steps whose draft at that "
                 "position was accepted, with every draft before it.\n\n| method | "
                 + " | ".join(str(i) for i in range(width)) + " |\n| --- |" + " ---: |" * width + "\n")
        for m in accepting:
            acc = overall[m]["acceptance_by_position"]
            foot += f"| {m} | " + " | ".join(f"{acc[i]:.2f}" if i < len(acc) else "-" for i in range(width)) + " |\n"
    return "\n".join(lines) + "\n" + foot


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = [m for m in result["methods"] if m != BASELINE]
    cats = list(result["per_category"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, name in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [result["per_category"][c][name]["speedup_vs_greedy"] for c in cats], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs transformers " + ("sampling" if result["settings"].get("sampling") else "greedy"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    hist = {name: [a for rec in result["questions"] for a in rec["results"][name].get("accepted_lengths", [])]
            for name in methods}
    hist = {k: v for k, v in hist.items() if v}
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        top = max(max(v) for v in hist.values())
        bins = [x - 0.5 for x in range(1, top + 2)]
        for name, values in hist.items():
            ax.hist(values, bins=bins, alpha=0.5, density=True, label=f"{name} (mean {statistics.mean(values):.2f})")
        ax.set_xlabel("tokens emitted per verification step (accepted drafts + bonus)")
        ax.set_ylabel("fraction of steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "accepted_lengths.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write_outputs(result: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["markdown"].write_text(to_markdown(result))
    if plots:
        try:
            made = plot(result, out_dir)
        except ModuleNotFoundError as err:  # results.json and results.md are written: the run is kept without them
            if err.name != "matplotlib":
                raise
            print("plots skipped: matplotlib is not installed (pip install matplotlib to draw them, or pass "
                  "--no-plots)", file=sys.stderr)
            made = []
        for p in made:
            paths[p.stem] = p
    return paths


def environment(target, threads: int) -> dict:
    """`machine`'s facts and where the target runs."""
    return {**machine(threads), "device": str(target.device), "dtype": str(target.dtype).replace("torch.", "")}


def machine(threads: int) -> dict:
    """The CPU, the commit measured (`-dirty` where infer/ or heads/ differ from it), the versions, the date and
    the load."""
    import transformers

    from infer.tuning.cache import device_name

    cpu = device_name(torch.device("cpu"))  # model name, family and model: one bare name can cover two CPUs
    try:
        git = dict(capture_output=True, text=True, cwd=ROOT, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip() or None
        if commit and subprocess.run(["git", "status", "--porcelain", "infer", "heads"], **git).stdout.strip():
            commit += "-dirty"  # the engine or drafters measured differ from the commit
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "git_commit": commit, "torch_threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            # Other processes on the machine distort every timing; the 1/5/15-minute load says how much.
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}


def memory_floor(target) -> dict:
    """The least time one forward can take: every weight read once at the measured read bandwidth (CPU only)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    if target.device.type != "cpu":
        return {"weight_mb": weight_bytes / 1e6}
    gbs = read_bandwidth_gb_s()
    return {"weight_mb": weight_bytes / 1e6, "read_gb_per_s": gbs, "memory_floor_ms": weight_bytes / gbs / 1e6}


def read_bandwidth_gb_s() -> float:
    """The host's read bandwidth: the best of five sums over a buffer far past the caches."""
    big = torch.ones(2**27)  # 512 MB
    big.sum()
    times = []
    for _ in range(5):
        tic = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - tic)
    return big.numel() * 4 / min(times) / 1e9


def report_mismatches(result: dict) -> None:
    if result["settings"].get("sampling"):
        print("sampled: outputs are not compared (they follow the target's distribution: tests/test_sampling.py)")
        return
    if not result["mismatches"]:
        print("greedy check: every output equals transformers' greedy output")
        return
    print(f"\n!!! GREEDY MISMATCH: {len(result['mismatches'])} output(s) differ from transformers' greedy output "
          "!!!", file=sys.stderr)
    for m in result["mismatches"]:
        whose = " (vLLM's own output: not selfspec's exactness)" if m.get("engine") == "vllm" else ""
        print(f"!!!   question {m['question_id']} turn {m['turn']}: {m['method']} differs from token "
              f"{m['first_differing_token']}{whose}", file=sys.stderr)

