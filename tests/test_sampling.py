"""Sampling is lossless: speculative samples follow the target's own (processed) distribution.

On a vocabulary of 8 tokens we enumerate the exact joint probability of the first two new tokens
P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) with transformers' own warpers, draw thousands of
generations through SelfSpecModel (one batch, one row per sample) and compare with a chi-square test.
The second token is where speculation happens (a draft accepted, or the residual after rejections), so
`max_new_tokens=3` leaves room for a draft at that position.

`test_wrong_sampler_is_caught` shows the test has teeth: sampling the bonus token from p instead of the
residual after a rejection (a real bug class) is rejected by the same test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import heads
import infer.engine
import infer.sampling
from infer import DraftModelDrafter, DraftTree, LookupFirstDrafter, SelfSpecModel
from infer.drafting import Drafter
from infer.sampling import SamplingParams, logits_to_probs, sample
from infer.verify import _path_to

V = 8
SAMPLES = 4000


def exact_joint(target, prompt: list[int], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warp.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warp.append(TopPLogitsWarper(top_p))

    def probs(ids):
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[:, -1].float()
        return torch.softmax(warp(None, logits), -1)[0].double()

    first = probs(prompt)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        if first[t1] > 0:
            joint[t1] = first[t1] * probs(prompt + [t1])
    return joint


def chi_square_p(joint: torch.Tensor, samples: torch.Tensor) -> float:
    """p-value of observed (t1, t2) pairs against the exact joint; sparse cells pooled."""
    expected = (joint.flatten() * len(samples)).numpy()
    observed = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).double().numpy()
    assert observed[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
    big = expected >= 5
    exp = list(expected[big]) + [expected[~big].sum()]
    obs = list(observed[big]) + [observed[~big].sum()]
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    total = sum(obs)
    exp = [e * total / sum(exp) for e in exp]  # the joint sums to 1 only up to rounding
    return float(chisquare(obs, exp).pvalue)


class FixedTree(Drafter):
    """Deterministic tree: three distinct children of the root, two grandchildren under the first."""

    def __init__(self, children: list[int], grandchildren: list[int]):
        self.children, self.grandchildren = children, grandchildren

    def observe(self, step):
        self.root = step.next_tokens

    def propose(self, budget):
        b = self.root.shape[0]
        tokens = torch.tensor([0] + self.children + self.grandchildren).repeat(b, 1)
        tokens[:, 0] = self.root
        parents = torch.tensor([-1, 0, 0, 0, 1, 1]).repeat(b, 1)
        return DraftTree(tokens=tokens, parents=parents, valid=torch.ones_like(tokens, dtype=torch.bool))

    def select_rows(self, rows):
        self.root = self.root[rows]


PROMPT = [3, 5, 4, 6, 3, 5]  # repeats, so n-gram lookup finds something to propose


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=V, init_std=0.2)


def sampled_pairs(model, temperature, top_k, top_p, seed=0) -> torch.Tensor:
    ids = torch.tensor([PROMPT]).repeat(SAMPLES, 1)
    out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k,
                         top_p=top_p, eos_token_id=[], generator=torch.Generator().manual_seed(seed))
    return out[:, len(PROMPT):len(PROMPT) + 2]


def drafters(target):
    joint = exact_joint(target, PROMPT, 1.0, 0, 1.0)
    likely = joint.sum(0).argsort(descending=True).tolist()  # most likely second tokens first
    return {
        "tree": FixedTree(children=likely[:3], grandchildren=likely[:2]),
        "ngram": "ngram",
        "draft_model": perturbed_copy(target, scale=0.3, seed=5),
        # rows switch between a one-hot lookup chain and sampled drafts with their q, step by step
        "lookup_first": LookupFirstDrafter(DraftModelDrafter(perturbed_copy(target, scale=0.3, seed=5)),
                                           min_match=2),
        # the target's own weights: a quantized copy and its first layer, drafting real distributions
        "int8": "int8",
        "early_exit": "early_exit:1",
        "int4": "int4",
        "layerskip": "layerskip",
        # suffix matches in the prompt (one-hot trees), mixed row by row with early exit's sampled drafts
        "suffix": "suffix",
        "suffix_fallback": "suffix:early_exit:1",
        # n-grams from the prompt and the Jacobi window: one-hot guesses, the window scored beside them
        "lookahead": "lookahead:4,3,4",
        # a trained kind's block: a chain sampled from its own q, and a deterministic top-k tree
        "dflash": heads.build("dflash", target, block_size=4),
        "dflash_tree": heads.build("dflash", target, block_size=4, tree={"top_k": 3}),
    }


@pytest.mark.parametrize("kind", ["tree", "ngram", "draft_model", "lookup_first", "int8", "early_exit", "int4", "layerskip", "suffix",
                                  "suffix_fallback", "lookahead", "dflash", "dflash_tree"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.85)])
def test_sampling_matches_target_distribution(target, kind, temperature, top_k, top_p):
    model = SelfSpecModel(target, drafters(target)[kind])
    pairs = sampled_pairs(model, temperature, top_k, top_p)
    # Speculation really happened: some second tokens came from accepted drafts.
    assert max(model.last_stats["accepted_lengths"]) >= 2
    p = chi_square_p(exact_joint(target, PROMPT, temperature, top_k, top_p), pairs)
    assert p > 1e-3, f"speculative samples differ from the target's distribution (chi-square p={p:.2e})"


def test_wrong_sampler_is_caught(target, monkeypatch):
    """A classic bug: after a rejection, sample the bonus from the target's p instead of the residual
    normalize(max(0, p - q)). It over-weights the drafted tokens; the same chi-square test must reject
    it while accepting the right sampler on the same setup."""

    def no_residual(tree, logits, ancestors, params, generator=None):
        probs = logits_to_probs(logits, params)
        ends, bonus = [], []
        for row in range(probs.shape[0]):
            node = 0
            while True:  # a chain: node + 1 is the only child
                p = probs[row, node]
                child = node + 1
                if child < tree.num_nodes and tree.valid[row, child]:
                    x = int(tree.tokens[row, child])
                    qx = 1.0 if tree.q is None else float(tree.q[row, child, x])
                    if torch.rand((), generator=generator) * qx <= p[x]:
                        node = child
                        continue
                bonus.append(torch.multinomial(p, 1, generator=generator))  # BUG: p, not the residual
                ends.append(node)
                break
        acc = _path_to(torch.tensor(ends), ancestors)
        acc.bonus = torch.cat(bonus)
        return acc

    joint = exact_joint(target, PROMPT, 1.0, 0, 1.0)
    draft = perturbed_copy(target, scale=0.3, seed=5)
    right = chi_square_p(joint, sampled_pairs(SelfSpecModel(target, draft), 1.0, 0, 1.0, seed=1))
    monkeypatch.setattr(infer.engine, "accept_sampled", no_residual)
    wrong = chi_square_p(joint, sampled_pairs(SelfSpecModel(target, draft), 1.0, 0, 1.0, seed=1))
    assert right > 1e-3
    assert wrong < 1e-6, f"the biased sampler went unnoticed (p={wrong:.2e})"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 0, 0.95), (1.3, 50, 0.8), (0.7, 40, 1.0),
                                                     (1.0, 0, 0.5)])
def test_logits_to_probs_is_transformers_warpers(temperature, top_k, top_p):
    """The nucleus found from the head of the distribution is the one transformers' TopPLogitsWarper finds by
    sorting the whole vocabulary (SmolLM2's 49,152 tokens), on peaked rows (a nucleus of a few tokens), flat ones (a
    nucleus past NUCLEUS_WIDTH: widened) and one flat over the whole vocabulary (past a quarter of it: transformers'
    warper itself), with top-k before it and a tie at top-k's edge."""
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    peaked = torch.randn(3, vocab, generator=g) * 4
    flat = torch.randn(2, vocab, generator=g) * 0.5
    even = torch.zeros(1, vocab)
    logits = torch.cat([peaked, flat, even])
    logits[0, 7] = logits[0, 9] = logits[0].topk(40).values[-1]  # ties at the 40th value
    params = SamplingParams(True, temperature, top_k, top_p)
    expected = torch.softmax(params.warpers()(None, logits.clone()), -1)
    got = logits_to_probs(logits.view(2, 3, vocab), params).view(6, vocab)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_sample_draws_each_token_with_its_probability_and_never_a_zero_one():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]).repeat(20000, 1)
    tokens = sample(probs.view(100, 200, 6), torch.Generator().manual_seed(0))
    assert tokens.shape == (100, 200)
    counts = torch.bincount(tokens.flatten(), minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    assert float(chisquare(counts[[1, 3, 4]].numpy(), (torch.tensor([0.5, 0.2, 0.3]) * 20000).numpy()).pvalue) > 1e-3
    # unnormalized rows are read as their own total
    assert sample(torch.tensor([[0.0, 3.0]]), torch.Generator().manual_seed(1)).item() == 1


def test_sample_takes_the_last_possible_token_when_the_draw_rounds_up_to_the_total(monkeypatch):
    monkeypatch.setattr(infer.sampling.torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=torch.float64))
    assert sample(torch.tensor([[0.25, 0.75, 0.0, 0.0]])).item() == 1


@pytest.mark.parametrize("row", [[0.5, float("nan")], [0.5, -0.1], [0.0, 0.0], [float("inf"), 1.0]])
def test_sample_refuses_rows_that_are_not_distributions(row):
    with pytest.raises(ValueError, match="finite, non-negative and not all zero"):
        sample(torch.tensor([row]))
