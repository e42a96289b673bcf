"""One training run of the trainer benchmark as a child process: skipped when finished, resumed when killed,
measured (wall time, peak memory of its whole process tree) in `<run>/run.json`.

A run's folder holds run.json (its status, command and every attempt), train.log (the child's output, appended
per attempt) and whatever the trainer writes. A run whose run.json says "done" and whose drafter folder exists is
kept as it is; otherwise the trainer is started again, with its own resume switch where its folder holds a
checkpoint (`Runner.checkpointed`), from scratch where it does not. Training, then the export commands, run as
children of this process in their own process group, which gets SIGTERM when this process dies: a killed
benchmark leaves no trainer behind, and the next call picks the run up.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RUN_FILE = "run.json"
LOG_FILE = "train.log"
POLL_SECONDS = 1.0  # how often the child's process tree is measured, once it has run a second


@dataclass
class Runner:
    """How one framework trains a drafter into a run folder.

    `train(folder, resume)` is the training command; `checkpointed(folder)` whether the folder holds a checkpoint
    its trainer resumes from; `exports(folder)` the commands that turn its output into the folder selfspec
    imports, `drafter(folder)`; `fresh(folder)` clears what a run killed before its first checkpoint left;
    `verify(folder)` what is wrong with a finished training (None: nothing)."""

    name: str
    train: Callable[[Path, bool], list[str]]
    checkpointed: Callable[[Path], bool]
    drafter: Callable[[Path], Path]
    exports: Callable[[Path], list[list[str]]] = lambda folder: []
    fresh: Callable[[Path], None] = lambda folder: None
    verify: Callable[[Path], str | None] = lambda folder: None
    env: dict = field(default_factory=dict)
    cwd: Path | None = None


def read_run(folder: Path) -> dict | None:
    path = folder / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_run(folder: Path, record: dict) -> None:
    tmp = folder / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, folder / RUN_FILE)  # a kill mid-write leaves the previous record


def is_done(folder: Path, runner: Runner) -> bool:
    record = read_run(folder)
    return bool(record and record.get("status") == "done" and runner.drafter(folder).is_dir())


def run(runner: Runner, folder: Path, info: dict | None = None) -> dict:
    """Train (or resume, or keep) the run in `folder`; its run.json record. A failed command raises, naming its
    log; the record keeps the failed attempt."""
    folder.mkdir(parents=True, exist_ok=True)
    if is_done(folder, runner):
        return {**read_run(folder), "kept": True}
    record = read_run(folder) or {"framework": runner.name, **(info or {}), "attempts": []}
    if record.get("status") != "trained" or not runner.drafter(folder).is_dir():
        resume = runner.checkpointed(folder)
        if not resume:
            runner.fresh(folder)
        record["status"] = "training"
        argv = runner.train(folder, resume)
        attempt = {"command": argv, "resumed": resume, "started": now()}
        record["attempts"].append(attempt)
        write_run(folder, record)
        attempt.update(measure(argv, folder / LOG_FILE, runner.env, runner.cwd or folder))
        write_run(folder, record)
        check(attempt, folder, "training")
        problem = runner.verify(folder)
        if problem:
            record.update(status="failed", error=problem)
            write_run(folder, record)
            raise RuntimeError(f"{runner.name}: {problem}")
        record["status"] = "trained"
    for argv in runner.exports(folder):
        step = measure(argv, folder / LOG_FILE, runner.env, runner.cwd or folder)
        record.setdefault("exports", []).append({"command": argv, **step})
        write_run(folder, record)
        check(step, folder, "export")
    if not runner.drafter(folder).is_dir():
        record["status"] = "failed"
        write_run(folder, record)
        raise RuntimeError(f"{runner.name}: training ended without its drafter folder {runner.drafter(folder)}; "
                           f"see {folder / LOG_FILE}")
    record.update(status="done", **totals(record["attempts"]))
    write_run(folder, record)
    return record


def check(step: dict, folder: Path, what: str) -> None:
    if step["returncode"] != 0:
        raise RuntimeError(f"{what} in {folder} exited with {step['returncode']}; see the end of "
                           f"{folder / LOG_FILE}, then run the benchmark again (the run resumes)")


def totals(attempts: list[dict]) -> dict:
    """A run's wall time (all its attempts) and peak memory (the largest attempt's)."""
    return {"wall_seconds": round(sum(a.get("wall_seconds", 0.0) for a in attempts), 1),
            "peak_rss_mb": max((a.get("peak_rss_mb", 0.0) for a in attempts), default=0.0)}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def measure(argv: list[str], log: Path, env: dict, cwd: Path) -> dict:
    """Run `argv` to its end, its output appended to `log`: its exit code, wall seconds and the peak of the summed
    resident memory of its process tree (sampled every POLL_SECONDS)."""
    import psutil

    from train.vllm_engine import die_with_parent, stop_group

    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        tic = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **env},
                                start_new_session=True, preexec_fn=die_with_parent)
        peak, wait = 0, 0.01
        try:
            while proc.poll() is None:
                peak = max(peak, tree_rss(psutil, proc.pid))
                time.sleep(wait)
                wait = min(2 * wait, POLL_SECONDS)  # often at first: a short child is measured too
        finally:
            if proc.poll() is None:  # interrupted here: the trainer goes too, and resumes next time
                stop_group(proc, grace=30.0)
    return {"returncode": proc.returncode, "wall_seconds": round(time.perf_counter() - tic, 1),
            "peak_rss_mb": round(peak / 2**20, 1)}


def tree_rss(psutil, pid: int) -> int:
    """Resident bytes of a process and all its descendants (a child that ends mid-count counts nothing)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended (or a zombie) since it was listed
            pass
    return total


def clear(folder: Path, keep: tuple[str, ...] = (RUN_FILE, LOG_FILE)) -> None:
    """Everything in `folder` but the run's record and log: a start from scratch."""
    for child in folder.iterdir():
        if child.name in keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
