"""The GGUF drafter: llama.cpp running the embedded target's own Q4_1 file drafts for the fp32 target.

The tests use the real SmolLM2-135M GGUF (the embedded target is read from it), so the drafts are those
of a close quantized copy: greedy output must equal the target's own `generate`, at batch 1 and in a
left-padded batch, and acceptance must be high, which it only is if llama.cpp's cache is cut back to
exactly what the target committed after every step. Sampling is checked against the exact joint of the
first two tokens under top-k (chi-square), since the drafter samples from its own distribution q.
"""

from __future__ import annotations

import pytest
import torch
from conftest import chat, tiny_model
from scipy.stats import chisquare

from infer import SelfSpecModel

llama_cpp = pytest.importorskip("llama_cpp", reason="the gguf drafter needs llama-cpp-python")
from infer.drafters.gguf import GGUFDrafter, default_gguf  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "Explain why the sky is blue to a ten year old.",
    "List three facts about the Moon.",
]


class Drafts:
    """A step observer counting, over the steps that drafted, the drafted and the accepted tokens."""

    def __init__(self):
        self.drafted = self.accepted = self.steps = 0

    def __call__(self, tree, acc, budget):
        drafted = int(tree.valid[0].sum()) - 1  # the root is the token committed last step
        if drafted > 0:
            self.steps += 1
            self.drafted += drafted
            self.accepted += int(acc.length[0]) - 1  # the bonus token is the target's, not a draft


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_matches_generate_and_drafts_are_accepted(smollm2, adaptive):
    model, tokenizer = smollm2
    drafts = Drafts()
    spec = SelfSpecModel(model, GGUFDrafter(max_tokens=6, adaptive=adaptive, n_ctx=512), tokenizer=tokenizer,
                         step_observer=drafts)
    taus = []
    for text in PROMPTS[:2]:  # the second call reuses the llama.cpp context of the first
        enc = chat(tokenizer, [text])
        expected = model.generate(**enc, max_new_tokens=64, do_sample=False)
        got = spec.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=64)
        assert torch.equal(got, expected)
        taus.append(spec.last_stats["mean_accepted_length"])
    # A 4-bit copy of the target agrees on ~97% of tokens; a cache out of step with the target's would
    # draft from the wrong context and be rejected almost always. Adaptive drafting sizes its chains and
    # decides whether to draft from measured wall time, so its tau depends on the machine's load; the
    # share of drafted tokens accepted does not.
    assert drafts.steps > 0
    assert drafts.accepted / drafts.drafted > 0.6, (drafts.accepted, drafts.drafted, taus)
    if not adaptive:
        assert min(taus) > 3.0, taus


def test_target_is_left_as_it_was(smollm2):
    import copy
    import io
    import pickle

    model, tokenizer = smollm2
    before = [(name, sorted(m.__dict__), m.training) for name, m in model.named_modules()]
    enc = chat(tokenizer, PROMPTS[:1])
    got = SelfSpecModel(model, GGUFDrafter(max_tokens=4, n_ctx=256), tokenizer=tokenizer).generate(
        enc.input_ids, max_new_tokens=8)
    assert [(name, sorted(m.__dict__), m.training) for name, m in model.named_modules()] == before
    copy.deepcopy(model)
    pickle.dumps(model)
    torch.save(model, io.BytesIO())
    assert torch.equal(model.generate(**enc, max_new_tokens=8, do_sample=False), got)


def test_padded_batch_matches_generate(smollm2):
    model, tokenizer = smollm2
    enc = chat(tokenizer, PROMPTS)
    expected = model.generate(**enc, max_new_tokens=40, do_sample=False)
    spec = SelfSpecModel(model, GGUFDrafter(max_tokens=5, n_ctx=512), tokenizer=tokenizer)
    got = spec.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=40)
    assert torch.equal(got, expected)
    assert spec.last_stats["mean_accepted_length"] > 2.5


def test_by_name_uses_the_embedded_gguf(smollm2):
    model, tokenizer = smollm2
    spec = SelfSpecModel(model, "gguf", tokenizer=tokenizer)
    assert spec.drafter.path == default_gguf()
    enc = chat(tokenizer, PROMPTS[:1])
    got = spec.generate(enc.input_ids, max_new_tokens=16)
    assert torch.equal(got, model.generate(**enc, max_new_tokens=16, do_sample=False))


def test_sampling_matches_target_distribution(smollm2):
    """Joint of the first two new tokens under top_k=3 sampling, exact vs 480 speculative samples."""
    model, tokenizer = smollm2
    k, rows, rounds = 3, 16, 30
    enc = chat(tokenizer, ["Name a colour."])
    prompt = enc.input_ids

    def top_probs(ids):
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        top = logits.topk(k)
        return top.indices, torch.softmax(top.values, -1).double()

    ids1, p1 = top_probs(prompt)
    cells, expected = [], []
    for t1, pt1 in zip(ids1.tolist(), p1.tolist(), strict=True):
        ids2, p2 = top_probs(torch.cat([prompt, torch.tensor([[t1]])], 1))
        for t2, pt2 in zip(ids2.tolist(), p2.tolist(), strict=True):
            cells.append((t1, t2))
            expected.append(pt1 * pt2)
    spec = SelfSpecModel(model, GGUFDrafter(max_tokens=3, n_ctx=128), tokenizer=tokenizer)
    g = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(cells, 0)
    accepted = []
    for _ in range(rounds):
        out = spec.generate(prompt.repeat(rows, 1), max_new_tokens=3, do_sample=True, top_k=k, eos_token_id=[],
                            generator=g)
        for t1, t2 in out[:, prompt.shape[1]:prompt.shape[1] + 2].tolist():
            counts[(t1, t2)] += 1  # a pair outside the exact support raises KeyError: a real failure
        accepted += spec.last_stats["accepted_lengths"]
    assert max(accepted) >= 2  # drafts were accepted: the second token is where speculation happened
    n = rows * rounds
    big = [i for i, e in enumerate(expected) if e * n >= 5]
    obs = [counts[cells[i]] for i in big] + [n - sum(counts[cells[i]] for i in big)]
    exp = [expected[i] * n for i in big] + [n * (1 - sum(expected[i] for i in big))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    p = chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue
    assert p > 1e-3, f"GGUF-drafted samples differ from the target's distribution (p={p:.2e})"


def test_a_gguf_of_another_vocabulary_is_refused():
    target = tiny_model("llama")  # 96 tokens
    with pytest.raises(ValueError, match="has 49152 tokens but the target only 96"):
        SelfSpecModel(target, GGUFDrafter(n_ctx=64))


def test_a_different_tokenizer_is_refused(smollm2):
    model, tokenizer = smollm2

    class Shifted:  # the target's vocabulary, every token moved by one id
        def convert_ids_to_tokens(self, ids):
            return tokenizer.convert_ids_to_tokens([(i + 1) % len(tokenizer) for i in ids])

    with pytest.raises(ValueError, match="does not use the target's tokenizer: token 0"):
        SelfSpecModel(model, GGUFDrafter(n_ctx=64, tokenizer=Shifted()))


def test_missing_file_and_missing_package(monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        GGUFDrafter(tmp_path / "nope.gguf")
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)
    with pytest.raises(ImportError, match="pip install 'llama-cpp-python=="):
        GGUFDrafter()
