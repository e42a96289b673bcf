"""The drafters shipped inside the package (heads/shipped/): loaded by name and offline, within the size the
issue allows, exact on the embedded target they were trained for, with the measurements their card claims."""

from __future__ import annotations

import pytest
import torch
from conftest import chat

import heads
from infer import SelfSpecModel

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
