"""The int8 argmax head: the greedy token of the full fp32 LM head, found from an int8 copy and a proven
bound, and the engine reading it only where nothing but the argmax is used."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from transformers import GenerationConfig

from infer import SelfSpecModel
from infer.cpu import linear
from infer.cpu.argmax_head import ArgmaxHead

IDS = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])


@pytest.fixture(scope="module")
def kernel():
    built = linear.streamed_kernel()
    if built is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    return built


def _check(head: ArgmaxHead, x: torch.Tensor, bias: torch.Tensor | None):
    """head.logits(x) has the full head's argmax in every row, the full head's logits where finite, -inf
    elsewhere, and leaves most of the vocabulary out."""
    expected = F.linear(x, head.weight, bias)
    got = head.logits(x, bias)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    finite = torch.isfinite(got)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    assert (got[~finite] == -float("inf")).all()
    return finite


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_the_argmax_is_the_full_heads(kernel, rows, with_bias):
    # 4,099 tokens (not a multiple of the 4 rows the kernel streams together), 72 inputs (not of its lanes);
    # heavy-tailed rows, so per-row int8 scales differ widely
    torch.manual_seed(rows)
    weight = torch.randn(4099, 72) * torch.rand(4099, 1) * 0.2
    weight[::7, 3] = 1.5  # some rows with one large weight: coarse int8 steps for the rest of the row
    bias = torch.randn(4099) * 0.1 if with_bias else None
    head = ArgmaxHead(weight, kernel)
    x = torch.randn(rows, 72) * 3
    finite = _check(head, x, bias)
    assert finite.any(0).sum() < 0.125 * 4099


def test_a_token_the_int8_copy_ranks_wrong_is_still_the_one_found(kernel):
    # With x = 1, token 0's weights (0.1, and one 1.0 that sets its int8 step to 1/127) round up to 13/127,
    # so its int8 logit overshoots its true 4.1; token 1's weights sit on the int8 grid (true 397/127 + 1 =
    # 4.126). The int8 copy ranks token 0 first, the full head token 1.
    k = 32
    weight = torch.zeros(64, k)
    weight[0] = 0.1
    weight[0, 0] = 1.0
    weight[1, 0] = 1.0
    weight[1, 1:26] = 13 / 127
    weight[1, 26:] = 12 / 127
    weight[2:] = torch.randn(62, k) * 0.01
    x = torch.ones(1, k)
    head = ArgmaxHead(weight, kernel)
    assert int(kernel.int8_rows_linear(x, head.q, head.scale).argmax()) == 0  # the int8 copy alone is wrong
    assert int(F.linear(x, weight).argmax()) == 1
    assert int(head.logits(x).argmax()) == 1
    assert torch.isfinite(head.logits(x)[0, :2]).all()


def test_rows_that_are_not_finite_get_the_full_head(kernel):
    torch.manual_seed(0)
    head = ArgmaxHead(torch.randn(512, 32), kernel)
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    torch.testing.assert_close(head.logits(x), F.linear(x, head.weight), equal_nan=True)


def test_a_flat_head_is_scored_in_full(kernel):
    # every token within the bound of the best: no saving to be had, so the full head answers
    weight = torch.full((256, 16), 0.5) + torch.randn(256, 16) * 1e-4
    head = ArgmaxHead(weight, kernel)
    x = torch.randn(1, 16)
    torch.testing.assert_close(head.logits(x), F.linear(x, weight))


def test_bad_weights_are_refused(kernel):
    with pytest.raises(ValueError, match="fp32 or bf16 CPU weight"):
        ArgmaxHead(torch.randn(8, 4, dtype=torch.float16), kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_copy_and_radius_are_the_float64_ones(kernel, dtype):
    """The kernel's one pass (`int8_rows_radius`) makes the int8 rows `linear.int8_rows` makes, and the radius the
    bound needs, computed in float64 by torch: rounded up by the slack, never below it."""
    torch.manual_seed(0)
    weight = (torch.randn(1029, 72) * torch.rand(1029, 1) * 0.2).to(dtype)
    weight[::7, 3] = 1.5
    weight[5] = 0  # a zero row: the smallest normal scale, no error
    head = ArgmaxHead(weight, kernel)
    q, scale = linear.int8_rows(weight.float())
    assert torch.equal(head.q, q) and torch.equal(head.scale, scale)
    w, approx = weight.double(), q.double() * scale.double()[:, None]
    gamma = 74 * 2.0 ** -24 / (1 - 74 * 2.0 ** -24)
    rho = (w - approx).norm(dim=1) + gamma * (w.norm(dim=1) + approx.norm(dim=1))
    assert (head.rho.double() >= rho).all() and head.rho[5] == 0
    torch.testing.assert_close(head.rho.double(), rho * (1 + 2.0 ** -10), rtol=1e-7, atol=0)


def _bf16_head(kernel, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None):
    """A bf16 head's argmax logits and the full head's as the lean forward computes them on the kernel: fp32 sums
    of bf16 products, rounded to bf16."""
    full = kernel.few_rows_linear(x, weight, None if bias is None else bias.float()).to(torch.bfloat16)
    return ArgmaxHead(weight, kernel).logits(x, bias), full


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 9, 17])
def test_a_bf16_head_gives_the_full_heads_argmax_and_bits(kernel, rows, with_bias):
    torch.manual_seed(rows)
    weight = (torch.randn(4099, 96) * torch.rand(4099, 1) * 0.2).to(torch.bfloat16)
    weight[::7, 3] = 1.5
    bias = (torch.randn(4099) * 0.1).to(torch.bfloat16) if with_bias else None
    x = (torch.randn(rows, 96) * 3).to(torch.bfloat16)
    got, full = _bf16_head(kernel, weight, x, bias)
    assert got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    finite = torch.isfinite(got)
    assert torch.equal(got[finite], full.float()[finite])  # a candidate's logit: the full head's bits
    assert (got[~finite] == -float("inf")).all()
    assert finite.any(0).sum() < 0.125 * 4099


def test_a_bf16_tie_goes_to_the_first_token_as_in_the_full_head(kernel):
    # Rows on the int8 grid (integers, scale 1: the int8 copy is exact, so the bound is float rounding only).
    # With x = (1, 1/8), token 3's logit is 127 - 1/8 and token 5's 127: apart in fp32, both 127 in bf16, where the
    # first index wins. The candidates must include token 3 though its fp32 logit trails by far more than the bound.
    weight = torch.zeros(64, 32)
    weight[:, 0] = torch.arange(64) % 3
    weight[3, :2] = torch.tensor([127.0, -1.0])
    weight[5, 0] = 127.0
    weight = weight.to(torch.bfloat16)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([1.0, 0.125])
    got, full = _bf16_head(kernel, weight, x)
    assert full[0, 3] == full[0, 5] == 127 and full.argmax(-1).item() == 3
    assert got.argmax(-1).item() == 3
    assert torch.isfinite(got).sum() < 64


def test_a_flat_bf16_head_is_scored_in_full(kernel):
    weight = (torch.full((256, 32), 0.5) + torch.randn(256, 32) * 1e-3).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    got, full = _bf16_head(kernel, weight, x)
    assert torch.equal(got, full.float())


def test_a_bf16_head_wants_bf16_hidden_states(kernel):
    head = ArgmaxHead(torch.randn(64, 32).to(torch.bfloat16), kernel)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        head.logits(torch.randn(1, 32))


def _big_vocab_target():
    # a vocabulary large enough that the candidates are a small share of it (the head's whole point)
    return tiny_model("llama", vocab_size=2048)


def test_greedy_verify_reads_it_and_stays_exact(kernel):
    target = _big_vocab_target()
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 6:] = ids[:, :6]  # a repeat, so prompt lookup drafts
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    heads_made = []
    for int8_argmax in (True, False):
        model = SelfSpecModel(target, "ngram", int8_argmax=int8_argmax)
        assert torch.equal(model.generate(ids, max_new_tokens=30), expected)
        assert model.last_stats["verify_forward"] == "lean"
        assert model.last_stats["int8_argmax"] is int8_argmax
        heads_made.append(sum(isinstance(made, ArgmaxHead) for _, _, made in model._packed._derived.values()))
        del model  # the last engine over the target: its cache goes with it
        gc.collect()
    assert heads_made == [1, 0]  # the int8 copy lives in the engines' cache, not on the model


def test_it_stands_aside_where_more_than_the_argmax_is_read(kernel):
    target = _big_vocab_target()
    model = SelfSpecModel(target, "ngram")
    model.generate(IDS, max_new_tokens=8, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert model.last_stats["int8_argmax"] is False
    for config in (GenerationConfig(max_new_tokens=8, suppress_tokens=[3]),
                   GenerationConfig(max_new_tokens=8, min_new_tokens=4, eos_token_id=2)):
        expected = target.generate(IDS, generation_config=config, do_sample=False)
        assert torch.equal(model.generate(IDS, generation_config=config), expected)
        assert model.last_stats["int8_argmax"] is False
    typical = SelfSpecModel(target, "ngram", typical_acceptance=True)
    typical.generate(IDS, max_new_tokens=8, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert typical.last_stats["int8_argmax"] is False
    typical.generate(IDS, max_new_tokens=8)  # greedy: typical acceptance is greedy acceptance, argmax only
    assert typical.last_stats["int8_argmax"] is True


def test_a_head_weight_changed_in_place_is_requantized(kernel):
    target = _big_vocab_target()
    model = SelfSpecModel(target, "ngram")
    model.generate(IDS, max_new_tokens=8)
    with torch.no_grad():
        target.lm_head.weight.mul_(-1)  # in place: same tensor, new version
    expected = target.generate(IDS, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=20), expected)
    assert model.last_stats["int8_argmax"] is True


def test_int8_argmax_setting_is_checked():
    with pytest.raises(ValueError, match="int8_argmax must be True or False"):
        SelfSpecModel(tiny_model("llama"), "ngram", int8_argmax="yes")
