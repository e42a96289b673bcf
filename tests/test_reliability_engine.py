"""The engine's options and a target shared between threads: nothing silently wrong (issue #47).

Greedy typical acceptance is greedy; two SelfSpecModels over one target generate from two threads with the
target left as it was; a static cache never outgrows the target's context; generation settings come from the
target's own generation_config as transformers takes them, and what generate cannot return is refused by name.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import greedy_reference, left_padded_prompts, perturbed_copy, tiny_model
from transformers import GenerationConfig

from infer import SelfSpecModel
from infer.kv import VERIFY_ROOM
from infer.sampling import SamplingParams
from infer.target import HOOK_DICTS
from infer.tree import DraftTree
from infer.verify import accept_greedy, accept_typical

IDS = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def greedy(target, ids, n):
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_typical_acceptance_under_greedy_decoding_is_greedy(target, drafter):
    """Typical acceptance loosens sampling; with do_sample False the output is the target's greedy output, every
    call (the bonus token was drawn at temperature 1)."""
    model = SelfSpecModel(target, perturbed_copy(target, scale=0.3) if drafter == "draft_model" else drafter,
                          typical_acceptance=True)
    expected = greedy(target, IDS, 24)
    for _ in range(5):
        assert torch.equal(model.generate(IDS, max_new_tokens=24), expected)


def test_typical_acceptance_with_greedy_settings_is_greedy_acceptance():
    """accept_typical itself, given greedy settings: the path and bonus of accept_greedy, never a draw."""
    torch.manual_seed(0)
    tree = DraftTree(tokens=torch.tensor([[3, 7, 1, 4]] * 2), parents=torch.tensor([[-1, 0, 0, 1]] * 2),
                     valid=torch.ones(2, 4, dtype=torch.bool))
    depth, ancestors = tree.depth_and_ancestors()
    logits = torch.randn(2, 4, 16)
    logits[0, 0, 7] = logits[0, 1, 4] = 9.0  # row 0 takes the whole path 3 -> 7 -> 4
    want = accept_greedy(tree, logits, ancestors, depth)
    for seed in range(5):
        got = accept_typical(tree, logits, ancestors, depth, SamplingParams(),
                             generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got.path, want.path) and torch.equal(got.length, want.length)
        assert torch.equal(got.bonus, want.bonus)
    assert want.length.tolist()[0] == 3


# ------------------------------------------------------------------ one target, two threads
def module_state(model) -> list:
    return [(name, sorted(m.__dict__), m.training, {d: sorted(getattr(m, d, {})) for d in HOOK_DICTS})
            for name, m in model.named_modules()]


PROMPTS = [torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]]), torch.tensor([[7, 3, 7, 3, 7, 3, 11]]),
           torch.tensor([[40, 41, 42, 40, 41, 42, 40]])]


@pytest.mark.parametrize("cpu_prepack", [None, True])
def test_two_models_share_a_target_across_threads(cpu_prepack):
    target = tiny_model("llama").train()  # a user mid-training: the mode must survive
    target.model.layers[1].eval()
    impl = target.config._attn_implementation
    expected = [greedy(target.eval(), ids, 16) for ids in PROMPTS]
    target.train()
    target.model.layers[1].eval()
    before = module_state(target)
    models = [SelfSpecModel(target, "ngram", cpu_prepack=cpu_prepack),
              SelfSpecModel(target, perturbed_copy(target, scale=0.3), cpu_prepack=cpu_prepack)]
    for model in models:  # one thread first: the reference the threaded calls must match
        assert all(torch.equal(model.generate(ids, max_new_tokens=16), want)
                   for ids, want in zip(PROMPTS, expected, strict=True))
    errors, wrong = [], []
    start = threading.Barrier(2)

    def work(model, offset):
        start.wait()
        for call in range(20):
            k = (call + offset) % len(PROMPTS)
            try:
                out = model.generate(PROMPTS[k], max_new_tokens=16)
            except Exception as err:  # noqa: BLE001 -- every failure is reported by the test
                errors.append(repr(err))
                continue
            if not torch.equal(out, expected[k]):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(m, i)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not wrong
    assert module_state(target) == before  # train flags, no attribute or hook left behind
    assert target.config._attn_implementation == impl


# ------------------------------------------------------------------ static cache bounded by the context
def test_static_cache_larger_than_the_context_is_refused(target):
    with pytest.raises(ValueError, match="context of 256 positions"):
        SelfSpecModel(target, "ngram", static_cache=10**9)
    assert SelfSpecModel(target, "ngram", static_cache=256).static_cache == 256


def test_static_cache_sized_per_call_stays_within_the_context(target):
    model = SelfSpecModel(target, "ngram", static_cache=True)
    with pytest.warns(UserWarning, match="does not fit the target's context"):
        out = model.generate(IDS, max_new_tokens=10**6)
    assert model._cache.capacity <= 256 + VERIFY_ROOM
    assert out.shape[1] <= 256


# ------------------------------------------------------------------ generation settings
def test_target_config_that_samples_is_sampled_with_its_settings():
    """transformers' target.generate samples where the target's generation_config says so, with its settings;
    so does SelfSpecModel (passing do_sample=False still decodes greedily)."""
    target = tiny_model("llama")
    want = greedy(target, IDS, 12)
    target.generation_config.do_sample = True
    target.generation_config.temperature = 50.0
    model = SelfSpecModel(target, "ngram")
    runs = [model.generate(IDS, max_new_tokens=12, eos_token_id=[], generator=torch.Generator().manual_seed(s))
            for s in range(3)]
    assert not any(torch.equal(r, want) for r in runs)
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    target.generation_config.top_k = 1  # the config's top_k is applied too: sampling from one token is greedy
    assert torch.equal(model.generate(IDS, max_new_tokens=12, generator=torch.Generator().manual_seed(0)), want)


def test_sampling_defaults_are_transformers_defaults(target):
    """do_sample=True alone samples as target.generate(do_sample=True) does: with transformers' default top_k."""
    from infer.request import TRANSFORMERS_DEFAULTS

    assert TRANSFORMERS_DEFAULTS == {k: GenerationConfig._get_default_generation_params()[k]
                                     for k in TRANSFORMERS_DEFAULTS}
    logits = target(IDS).logits[0, -1]
    allowed = set(logits.topk(TRANSFORMERS_DEFAULTS["top_k"]).indices.tolist())
    model = SelfSpecModel(target, "ngram")
    firsts = [int(model.generate(IDS, max_new_tokens=1, do_sample=True, temperature=1000.0,
                                 generator=torch.Generator().manual_seed(s))[0, -1]) for s in range(40)]
    assert set(firsts) <= allowed


@pytest.mark.parametrize("setting", [{"output_scores": True}, {"return_dict_in_generate": True},
                                     {"output_logits": True}, {"max_time": 5.0}, {"output_hidden_states": True},
                                     {"output_attentions": True}])
def test_what_generate_cannot_return_is_refused_by_name(target, setting):
    name = next(iter(setting))
    model = SelfSpecModel(target, "ngram")
    with pytest.raises(ValueError, match=name):
        model.generate(IDS, generation_config=GenerationConfig(max_new_tokens=4, **setting))
    with pytest.raises(ValueError, match=name):
        model.generate(IDS, max_new_tokens=4, **setting)


def test_generation_keywords_are_taken_as_transformers_takes_them(target):
    model = SelfSpecModel(target, "ngram")
    got = model.generate(IDS, max_new_tokens=8, min_new_tokens=8, eos_token_id=int(greedy(target, IDS, 1)[0, -1]))
    assert got.shape[1] == IDS.shape[1] + 8
    with pytest.raises(TypeError, match="max_new_token"):
        model.generate(IDS, max_new_token=8)


def test_eos_and_pad_given_as_none_mean_what_they_mean_to_transformers():
    """transformers sets the call's keywords over every config: eos_token_id=None is no eos (not the config's), and
    pad_token_id=None pads with the first eos (not the config's pad); left out, both come from the config."""
    target = tiny_model("llama")
    ids, mask = left_padded_prompts(2)
    free = greedy_reference(target, ids, mask, 12)[:, ids.shape[1]:]
    eos = next(t for t in free[0, 1:].tolist() if t not in free[1].tolist() and t != 0)  # row 0 stops, row 1 runs
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = eos, 0
    model = SelfSpecModel(target, "ngram")
    outputs = []
    for given in ({}, {"eos_token_id": None}, {"pad_token_id": None}):
        want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, **given)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, **given)
        assert torch.equal(got, want), given
        outputs.append(got)
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])  # three answers
