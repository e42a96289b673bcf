"""The trainer benchmark's results: one row per run, one per framework (the mean over its seeds and their
spread), as markdown and JSON."""

from __future__ import annotations

import statistics

from train.apps.bench.trainer_eval import SETTINGS

SETS = ("mt_bench", "alpaca_heldout")
SET_LABELS = {"mt_bench": "MT", "alpaca_heldout": "held-out"}
SETTING_LABELS = {"chain7": "chain 7", "tree60": "60-node tree", "calibrated": "calibrated"}


def run_row(framework: str, seed: int, record: dict | None, measured: dict | None, tokens: int) -> dict:
    """One run's line: tau per setting and prompt set, training tokens/s (every token of the rows, prompt and reply,
    over the run's wall time), wall time and peak memory; `error` where it did not train or import."""
    record, measured = record or {}, measured or {}
    row = {"framework": framework, "seed": seed, "status": record.get("status", "not run"),
           "wall_seconds": record.get("wall_seconds"), "peak_rss_mb": record.get("peak_rss_mb"),
           "resumed": any(a.get("resumed") for a in record.get("attempts", []))}
    if row["wall_seconds"]:
        row["train_tokens_per_s"] = round(tokens / row["wall_seconds"], 1)
    for setting in SETTINGS:
        for name in SETS:
            row[f"tau/{setting}/{name}"] = ((measured.get("tau") or {}).get(setting) or {}).get(name, {}).get("tau")
    if "trees" in measured:
        row["calibrated_tree"] = measured["trees"].get("calibrated")
    row["error"] = record.get("error") or measured.get("import_error") or measured.get("error")
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per framework: the mean of each number over its seeds, and the spread (max - min) of each tau."""
    out = []
    for framework in dict.fromkeys(r["framework"] for r in rows):
        mine = [r for r in rows if r["framework"] == framework]
        line = {"framework": framework, "seeds": len(mine)}
        for key in mine[0]:
            values = [r[key] for r in mine if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
            if key in ("seed",) or not values:
                continue
            line[key] = round(statistics.fmean(values), 4)
            if key.startswith("tau/") and len(values) > 1:
                line[f"spread/{key}"] = round(max(values) - min(values), 4)
        out.append(line)
    return out


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def to_markdown(rows: list[dict], notes: list[str]) -> str:
    columns = [f"τ {SETTING_LABELS[s]} {SET_LABELS[n]}" for s in SETTINGS for n in SETS]
    head = ["framework", "seed", *columns, "train tokens/s", "wall min", "peak MB"]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | " + " | ".join(["---:"] * (len(head) - 2)) + " |"]
    for r in rows:
        taus = [_number(r.get(f"tau/{s}/{n}")) for s in SETTINGS for n in SETS]
        wall = None if r.get("wall_seconds") is None else r["wall_seconds"] / 60
        lines.append("| " + " | ".join([r["framework"], str(r["seed"]), *taus, _number(r.get("train_tokens_per_s"), 0),
                                        _number(wall, 1), _number(r.get("peak_rss_mb"), 0)]) + " |")
    for line in summary(rows):
        if line["seeds"] < 2:
            continue
        taus = [f"{_number(line.get(f'tau/{s}/{n}'))} ± {_number(line.get(f'spread/tau/{s}/{n}'))}"
                if line.get(f"spread/tau/{s}/{n}") is not None else _number(line.get(f"tau/{s}/{n}"))
                for s in SETTINGS for n in SETS]
        wall = None if line.get("wall_seconds") is None else line["wall_seconds"] / 60
        lines.append("| " + " | ".join([f"**{line['framework']}** (mean, ± spread)", "-", *taus,
                                        _number(line.get("train_tokens_per_s"), 0), _number(wall, 1),
                                        _number(line.get("peak_rss_mb"), 0)]) + " |")
    errors = [f"- {r['framework']} seed {r['seed']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join([*lines, "", *[f"- {n}" for n in notes], *(["", "Not measured:", *errors] if errors else [])]) + "\n"
