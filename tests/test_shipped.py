"""The drafters shipped inside the package (heads/shipped/): loaded by name and offline, within the size the
issue allows, exact on the embedded target they were trained for, with the measurements their card claims."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import chat

import heads
from infer import SelfSpecModel
from train.apps.bench import batches

PROMPTS = ["Give three tips for staying healthy.", "Write a haiku about the sea, then explain it."]


@pytest.mark.slow
@pytest.mark.parametrize("name", heads.shipped_drafters())
def test_shipped_drafter_by_name_is_exact_on_its_target(name, smollm2):
    folder = heads.SHIPPED_DIR / name
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 40e6
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in folder.iterdir()}
    drafter = heads.load(name)
    assert drafter.dtype == torch.float32  # stored in half precision, run in the target's fp32
    assert drafter.config.base_model_name_or_path == "smollm2-135m-instruct"
    assert {"mean_accepted_length", "speedup_vs_transformers_greedy"} <= set(drafter.config.metrics)
    assert "command" in drafter.config.training

    model, tokenizer = smollm2
    # the target, too, comes by name: the embedded one; drafting at two rows whatever is predicted there
    spec = SelfSpecModel.from_pretrained(name, draft_batches=True)
    enc = chat(tokenizer, PROMPTS)
    got = spec.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=32)
    assert torch.equal(got, model.generate(**enc, max_new_tokens=32, do_sample=False))


@pytest.mark.slow
def test_the_batch_benchmark_stands_the_shipped_drafter_down_only_by_prediction(smollm2, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"turns": [text]}) + "\n" for text in PROMPTS + ["Name a blue fruit."]))
    out = tmp_path / "batches.json"
    batches.main(["--questions", str(questions), "--batches", "2", "--max-new-tokens", "8", "--out", str(out),
                        "--threads", str(torch.get_num_threads())])
    result = json.loads(out.read_text())["batches"]["2"]
    rows = result["rows"]
    assert set(rows) == {"transformers", "none", "drafter as it loads", "drafter, draft_batches=True"}
    assert all(row.get("mismatches", 0) == 0 and row["tokens"] > 0 for row in rows.values())
    choice = result["drafter_choice"]  # the two-row batch's: the last one holds one row, which always drafts
    assert (choice["batch"], choice["why"]) == (2, "predicted")
    predicted = choice["predicted_tokens_per_second"]
    assert choice["drafts"] == (predicted["drafting"] > choice["margin"] * predicted["no_drafts"])
