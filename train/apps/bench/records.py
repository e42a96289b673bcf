"""The records an interrupted benchmark resumes from: `<out>/records.jsonl` (one measured question turn a line)
and `<out>/records.settings.json` (the settings that decide what was measured, and whether the run finished).

A resume keeps the records and measures only the rest, so the records must have been measured with the settings
of the resumed run: another target, token limit, sampling or tree would join two different measurements in one
table without a word. A run without --resume starts the records again, so it refuses to do that to a run that
did not finish (hours of measuring). Both are checked before any model loads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

RECORDS = "records.jsonl"
SETTINGS = "records.settings.json"


def measured_settings(args, threads: int) -> dict:
    """What decides the records' numbers (not --limit, --categories or the plots: a resume may change those)."""
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed} \
        if args.sample else None
    from train.apps.bench.methods import parse_tree

    return {"target": args.target, "questions": str(Path(args.questions).resolve()), "dtype": args.dtype,
            "device": args.device, "threads": threads, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "turns": args.turns, "second_turns": args.second_turns, "passes": args.passes,
            "sampling": sampling, "tree": parse_tree(args.tree) or None,
            "pld_tokens": None if args.no_pld else args.pld_tokens,
            "oracle_depth": args.oracle_depth if args.oracle else None}


def read_records(path: Path) -> list[dict]:
    """The records in `path`; a last line cut short by a kill is dropped from the file (the resume measures that
    turn again), any other line that is not a record is refused naming it."""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, keep = [], 0
    for i, line in enumerate(lines):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{path}: line {i + 1} is not JSON, so the records cannot be resumed; delete that "
                                 "line (its turn is measured again), or start again without --resume") from None
            if not (isinstance(record, dict) and {"question_id", "turn", "results"} <= record.keys()):
                raise ValueError(f"{path}: line {i + 1} is not a record of a benchmark run (question_id, turn, "
                                 "results); --out must be a folder the benchmark wrote, or a new one")
            records.append(record)
        keep += len(line) + 1
    if keep < len(raw):
        with path.open("r+b") as f:
            f.truncate(keep)
    return records


def earlier_records(out: str | Path, settings: dict, resume: bool) -> list[dict]:
    """The records a resumed run keeps, checked against `settings`; [] for a new run, which must not replace the
    records of a run that did not finish."""
    path, saved = Path(out) / RECORDS, read_settings(Path(out) / SETTINGS)
    holds = path.is_file() and path.read_text(errors="replace").strip() != ""
    if not resume:
        if holds and not finished(Path(out), saved):
            count = sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
            raise ValueError(f"--out {out} holds {count} records of a run that did not finish ({path}): add --resume "
                             f"to measure only the rest, or delete {path.name} (or choose another --out) to start "
                             "again. Nothing was changed.")
        return []
    if not holds:
        return []
    if saved is None:
        warnings.warn(f"{path} has no {SETTINGS} beside it (written before settings were recorded): whether its "
                      "records were measured with these settings cannot be checked", stacklevel=2)
    else:
        changed = [f"{name} {saved['settings'][name]!r} -> {value!r}" for name, value in settings.items()
                   if name in saved["settings"] and saved["settings"][name] != value
                   and not (name == "pld_tokens" and None in (value, saved["settings"][name]))]
        if changed:
            raise ValueError(f"--resume: {path} was measured with other settings ({'; '.join(changed)}): resume "
                             "with the settings it was measured with, or start again without --resume. Nothing "
                             "was changed.")
    return read_records(path)


def read_settings(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        saved = None
    if not (isinstance(saved, dict) and isinstance(saved.get("settings"), dict)):
        raise ValueError(f"{path} is damaged, so whether the records beside it were measured with these settings "
                         f"cannot be checked; delete it and {RECORDS} to start again")
    return saved


def finished(out: Path, saved: dict | None) -> bool:
    """Whether the run that wrote `out`'s records finished; one from before the settings were recorded did where
    its results.json is newer than its records."""
    if saved is not None:
        return bool(saved.get("finished"))
    results = out / "results.json"
    return results.is_file() and results.stat().st_mtime >= (out / RECORDS).stat().st_mtime


def write_settings(out: str | Path, settings: dict, done: bool) -> None:
    path = Path(out) / SETTINGS
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"settings": settings, "finished": done}, indent=1) + "\n")
    tmp.replace(path)
