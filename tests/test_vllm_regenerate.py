"""Self-distillation through vLLM (`train/regenerate.py --engine vllm`): the same file as the transformers
engine (greedy text, fields, multi-turn conversations answered turn by turn), resumable; tokens/s of both
engines are printed. Needs the vLLM environment (`make vllm`); the missing-environment error does not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from train.data import load_rows
from train.regenerate import regenerate
from train.vllm_engine import VLLMEngine, default_vllm_python

ROOT = Path(__file__).resolve().parent.parent


def test_missing_vllm_environment_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="make vllm"):
        VLLMEngine("smollm2-135m-instruct", vllm_python=tmp_path / "none" / "bin" / "python")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_writes_the_same_file_and_resumes(smollm2, tmp_path):
    python = Path(os.environ.get("SELFSPEC_VLLM_PYTHON", default_vllm_python()))
    if not python.exists():
        pytest.skip(f"no vLLM environment at {python}: run `make vllm` (CI's .ci/run does)")
    model, tokenizer = smollm2
    prompts = [json.loads(line)["turns"][0] for line in open(ROOT / "data" / "demo_prompts.jsonl")][100:108]
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(prompts)]
    rows[0]["messages"] += [{"role": "assistant", "content": "old"}, {"role": "user", "content": "Shorter, please."}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = dict(max_new_tokens=48, batch_size=8, progress=False)

    hf = regenerate(model, tokenizer, load_rows(str(data)), tmp_path / "hf.jsonl", **settings)
    with VLLMEngine("smollm2-135m-instruct", log=tmp_path / "vllm.log") as engine:
        first = regenerate(engine, tokenizer, load_rows(str(data)), tmp_path / "vllm.jsonl", max_samples=3, **settings)
        rest = regenerate(engine, tokenizer, load_rows(str(data)), tmp_path / "vllm.jsonl", **settings)
    print(f"\nregenerate, 8 prompts x 48 tokens, batch 8: transformers {hf['tokens_per_s']} tokens/s, "
          f"vLLM {rest['tokens_per_s']} tokens/s (5 prompts) and {first['tokens_per_s']} (3 prompts)")

    assert (first["written"], rest["skipped_done"], rest["written"]) == (3, 3, 5)
    ours = {r["id"]: r for r in map(json.loads, open(tmp_path / "hf.jsonl"))}
    theirs = {r["id"]: r for r in map(json.loads, open(tmp_path / "vllm.jsonl"))}
    assert ours == theirs  # same ids, fields, turns, greedy text and `finished` flags
    assert [m["role"] for m in theirs["q0"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert theirs["q0"]["messages"][1]["content"] != "old"
