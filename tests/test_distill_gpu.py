"""train/distill_gpu.py (scripts/distill_gpu.py) end to end on a tiny target on the CPU: sampled answers regenerated and joined to
the greedy ones, then a budgeted training run that leaves a drafter and a report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from train_fixtures import conversations, save_tiny_target, write_alpaca, write_messages

import heads
from train import distill_gpu

ROOT = Path(__file__).resolve().parent.parent


def test_distill_gpu_end_to_end_on_a_tiny_target(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    prompts = write_alpaca(tmp_path / "prompts.json", conversations(12))
    greedy = write_messages(tmp_path / "greedy.jsonl", conversations(6))
    config = tmp_path / "tiny.yaml"
    config.write_text("drafter: eagle\nbatch_size: 4\nlr: 3.0e-3\nwarmup_steps: 5\neval_fraction: 0.2\n"
                      "progress_bar: false\nlog_every: 0\neval_steps_depth: 2\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "scripts/distill_gpu.py", "--prompts", prompts, "--out", str(out),
                    "--target", target, "--config", str(config), "--greedy", greedy, "--max-prompts", "10",
                    "--samples", "2", "--temperature", "1.0", "--batch-size", "8", "--max-new-tokens", "8",
                    "--regen-minutes", "2", "--train-minutes", "0.3"], cwd=ROOT, check=True, timeout=600)
    report = json.loads((out / "distill.json").read_text())
    assert report["regenerate"]["sampled_answers"] == 20 and not report["regenerate"]["stopped_by_budget"]
    assert report["train_rows"] == 6 + 20
    lines = (out / "train.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines[:6]] == [f"c{i}" for i in range(6)]  # greedy first
    assert {json.loads(line)["id"] for line in lines[6:]} == {f"{i}#{k}" for i in range(10) for k in range(2)}
    run = report["run"]
    assert run["budget"]["probe_steps"] == 5 and run["step"] == run["budget"]["planned_steps"] > 5
    assert heads.load(out / "run" / "drafter").kind == "eagle"


def test_the_sampling_seed_reaches_regenerate(monkeypatch, tmp_path):
    # a later GPU session draws new answers to the same prompts with another seed
    commands = []
    monkeypatch.setattr(distill_gpu.subprocess, "run", lambda command, **_: commands.append(command))
    args = argparse.Namespace(target="t", prompts="p.json", max_prompts=3, samples=2, temperature=0.7, top_p=0.9,
                              regen_dtype="float32", max_new_tokens=8, batch_size=4, regen_minutes=1.0, seed=7)
    distill_gpu.regenerate(args, tmp_path / "sampled.jsonl")
    assert len(commands) == 1 and commands[0][commands[0].index("--seed") + 1] == "7"
