"""sdpa for grouped K/V heads on CPU: the same numbers as transformers' sdpa, used only inside generate."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from infer import SelfSpecModel
from infer.cpu import gqa_attention


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_same_output_as_transformers_sdpa(mask_kind):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    query, key, value = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    allowed = torch.rand(2, 1, 5, 12) > 0.4
    allowed[..., 0] = True  # every query sees at least one key
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = gqa_attention.cpu_gqa_sdpa(module, query, key, value, mask, scaling=0.3)
    assert got.shape == expected.shape == (2, 5, 6, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_runs_during_generate_only(monkeypatch):
    calls = []
    inner = gqa_attention.cpu_gqa_sdpa

    def spy(*args, **kwargs):
        calls.append(args[1].shape[2])  # query rows
        return inner(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, gqa_attention.NAME, spy)
    target = tiny_model("llama")
    assert target.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert not calls
    # through the model's modules (the lean forward, the default here, runs no attention module at all)
    model = SelfSpecModel(target, "ngram", lean_verify=False)
    assert torch.equal(model.generate(ids, max_new_tokens=20), expected)
    assert len(calls) == model.last_stats["target_forwards"] * target.config.num_hidden_layers
    assert any(1 < rows < ids.shape[1] for rows in calls)  # verify blocks, not only the prefill, went through it
    assert target.config._attn_implementation == "sdpa"  # and the user's setting is back
