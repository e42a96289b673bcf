"""The engine on a real pretrained target: SmolLM2-135M-Instruct (the embedded target), real text."""

from __future__ import annotations

import pytest
import torch
from conftest import chat

from infer import SelfSpecModel

pytestmark = pytest.mark.slow

PROMPTS = [
    "List the days of the week, then list them again in reverse order.",
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France? Answer in one sentence.",
    "Explain why the sky is blue to a ten year old.",
]


@pytest.mark.parametrize("drafter", ["ngram", "self_copy"])
def test_greedy_matches_generate_on_real_text(smollm2, drafter):
    model, tokenizer = smollm2
    draft = "ngram" if drafter == "ngram" else model  # the target drafting for itself: everything accepted
    spec = SelfSpecModel(model, draft)
    taus = []
    for text in PROMPTS if drafter == "ngram" else PROMPTS[:2]:
        enc = chat(tokenizer, [text])
        expected = model.generate(**enc, max_new_tokens=48, do_sample=False)
        got = spec.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=48)
        assert tokenizer.decode(got[0]) == tokenizer.decode(expected[0])
        assert torch.equal(got, expected)
        taus.append(spec.last_stats["mean_accepted_length"])
    if drafter == "self_copy":  # 4 drafts per step, all accepted; the prefill and a short last step pull it down
        assert min(taus) > 3.5, taus


def test_padded_batch_matches_generate_on_real_text(smollm2):
    model, tokenizer = smollm2
    enc = chat(tokenizer, PROMPTS[:3])
    expected = model.generate(**enc, max_new_tokens=32, do_sample=False)
    got = SelfSpecModel(model, "ngram").generate(enc.input_ids, attention_mask=enc.attention_mask,
                                                  max_new_tokens=32)
    assert torch.equal(got, expected)


def test_ngram_speculates_on_real_repetition(smollm2):
    model, tokenizer = smollm2
    text = ("Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
            "apple, banana, cherry, date, elderberry, fig, grape, honeydew.")
    enc = chat(tokenizer, [text])
    spec = SelfSpecModel(model, "ngram")
    got = spec.generate(enc.input_ids, max_new_tokens=48)
    assert torch.equal(got, model.generate(**enc, max_new_tokens=48, do_sample=False))
    assert spec.last_stats["mean_accepted_length"] > 1.5, spec.last_stats
