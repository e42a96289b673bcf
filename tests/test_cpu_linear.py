"""Prepacked CPU linears: same numbers as `nn.Linear`, only inside the block, and greedy output unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import on_gguf_grid, tiny_model
from torch import nn

from infer import SelfSpecModel
from infer.cpu import linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="torch built without oneDNN")


def test_packed_rows_match_plain_linear_and_one_row_is_untouched():
    torch.manual_seed(0)
    layer = nn.Linear(48, 80)
    rows, one = torch.randn(2, 5, 48), torch.randn(1, 1, 48)
    with torch.no_grad():
        plain_rows, plain_one = layer(rows), layer(one)
    cache = linear.PackCache()
    before = set(layer.__dict__)
    with torch.no_grad(), linear.prepacked_linears(layer, cache=cache):
        packed_rows, packed_one = layer(rows), layer(one)
        assert "forward" in layer.__dict__
    assert set(layer.__dict__) == before  # restored on exit, nothing cached on the module
    torch.testing.assert_close(packed_rows, plain_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed_one, plain_one)  # one row: the plain GEMV path
    assert len(cache) == 1  # the multi-row call really went through a packed weight


def test_weight_change_repacks_and_autograd_stays_plain():
    torch.manual_seed(0)
    layer = nn.Linear(16, 24)
    x = torch.randn(4, 16)
    with linear.prepacked_linears(layer):
        with torch.no_grad():
            before = layer(x)
            layer.weight.mul_(2)
            after = layer(x)
        torch.testing.assert_close(after - layer.bias, 2 * (before - layer.bias), rtol=1e-5, atol=1e-5)
        y = layer(x.requires_grad_())  # grad enabled: the plain path, so backward works
        y.sum().backward()
    assert layer.weight.grad is not None


def test_shared_module_is_patched_once():
    head = nn.Linear(8, 8)
    a, b = nn.Sequential(head), nn.Sequential(head, nn.Linear(8, 8))
    with linear.prepacked_linears(a, b, None):
        pass
    assert "forward" not in head.__dict__


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_engine_output_same_with_and_without_prepack(arch):
    target = tiny_model(arch)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    for prepack in (False, True):
        model = SelfSpecModel(target, "ngram", cpu_prepack=prepack)
        assert model.cpu_prepack is prepack
        assert torch.equal(model.generate(ids, max_new_tokens=20), expected)
    assert not any("forward" in m.__dict__ for m in target.modules())  # the target is left as it was


def test_default_policy_is_cpu_fp32_and_bf16():
    model = tiny_model("llama")
    assert linear.worth_it(model)
    assert linear.worth_it(model.to(torch.bfloat16))  # streamed in place: no copy to fit
    assert not linear.worth_it(model.to(torch.float16))
    assert not linear.worth_it(nn.Module())


# ------------------------------------------------------------------------------------ the streamed kernel
def _kernel():
    kernel = linear.streamed_kernel()
    if kernel is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    return kernel


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 13, 14, 16])  # 9-14: one pass of wide tiles
@pytest.mark.parametrize("shape", [(48, 80, True), (37, 18, False), (64, 3, True)])  # in, out (tails), bias
def test_streamed_rows_match_plain_linear(rows, shape):
    _kernel()
    in_features, out_features, bias = shape
    torch.manual_seed(rows)
    layer = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(1, rows, 2 * in_features)[..., ::2]  # not contiguous
    with torch.no_grad():
        expected = layer(x)
    cache = linear.PackCache()
    with torch.no_grad(), linear.prepacked_linears(layer, cache=cache, stream_rows=16):
        got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(cache) == 0  # the streamed kernel ran, not oneDNN's packed GEMM


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("shape", [(48, 80, True), (37, 18, False)])  # in, out (tails), bias
def test_bf16_rows_stream_as_fp32_sums_rounded_once(rows, shape):
    """A bf16 layer's rows (one included) run on the streamed kernel: bf16 products, fp32 sums, one rounding to bf16;
    blocks past stream_rows stay torch's."""
    kernel = _kernel()
    in_features, out_features, bias = shape
    torch.manual_seed(rows)
    layer = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 2 * in_features).to(torch.bfloat16)[..., ::2]  # not contiguous
    exact = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    with torch.no_grad(), linear.prepacked_linears(layer, stream_rows=16):
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    # within one bf16 rounding of the exact product (fp32 sums in another order than the double reference)
    torch.testing.assert_close(got.double(), exact.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(got[0], kernel.few_rows_linear(x[0].contiguous(), layer.weight,
                                                      layer.bias.float() if bias else None).to(torch.bfloat16))
    with torch.no_grad(), linear.prepacked_linears(layer, stream_rows=rows - 1 if rows > 1 else 0):
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))  # torch's own


@pytest.mark.parametrize("in_features", [64, 96, 37])  # whole 32-pairs, a tail of 32, a tail of 5
def test_bf16_inputs_give_every_row_the_sums_it_gets_alone(in_features):
    """bf16 inputs against bf16 weights (the pairs' products on AVX512-BF16, the widened fp32 path elsewhere): every
    row's output is the one it gets alone, whatever the rows beside it (a verify's nodes get the bits of a step
    of one), and within fp32 rounding of the widened inputs' path, on every build."""
    torch.manual_seed(in_features)
    weights = [torch.randn(out, in_features).to(torch.bfloat16) for out in (9, 4, 1)]  # blocks of 3 or 4, tail rows
    x = torch.randn(20, in_features).to(torch.bfloat16)
    for kernel in _builds():
        alone = torch.cat([kernel.few_rows_linear_cat(x[r:r + 1], weights, []) for r in range(20)])
        widened = kernel.few_rows_linear_cat(x.float(), weights, [])
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 16, 20):  # one pass of 4 or of 3 x 5..9, passes of 4
            got = kernel.few_rows_linear_cat(x[:rows], weights, [])
            assert got.dtype == torch.float32 and torch.equal(got, alone[:rows])
        torch.testing.assert_close(alone, widened, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_need_bf16_weights():
    kernel = _kernel()
    with pytest.raises(RuntimeError, match="a bfloat16 x goes with bfloat16 weights only"):
        kernel.few_rows_linear(torch.randn(2, 32).to(torch.bfloat16), torch.randn(8, 32), None)


def test_blocks_above_stream_rows_go_to_onednn():
    _kernel()
    layer = nn.Linear(32, 32)
    cache = linear.PackCache()
    with torch.no_grad(), linear.prepacked_linears(layer, cache=cache, stream_rows=4):
        layer(torch.randn(4, 32))
        assert len(cache) == 0
        layer(torch.randn(5, 32))
        assert len(cache) == 1


def test_stream_rows_is_measured_once_per_machine(monkeypatch, tmp_path):
    from infer.tuning import plan

    _kernel()
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    rows = plan.stream_rows(model, repeats=1)
    assert rows == 0 or rows in plan.STREAM_SIZES
    (entry,) = (tmp_path / "calibration").glob("stream_rows-*.json")
    written = json.loads(entry.read_text())
    assert set(written["seconds"]) == {"streamed", "onednn", "one_row"}  # fp32: one row against torch's GEMV too
    assert set(written["seconds"]["one_row"]) == {"streamed", "gemv"}
    assert written["one_row"] is plan.choose_one_row(written["seconds"])
    monkeypatch.setattr(linear, "streamed_kernel", lambda: pytest.fail("measured again"))
    assert plan.stream_rows(model) == rows  # read from the cache
    assert plan.stream_one_row(model) is written["one_row"]


def test_one_fp32_row_leaves_torchs_gemv_only_where_the_kernel_is_clearly_faster():
    from infer.tuning.plan import ONE_ROW_SHARE, choose_one_row

    # a 1B fp32 model's weights on this project's Zen 5 host, 2026-11-29 (torch's GEMV 23 GB/s, the kernel 38)
    assert choose_one_row({"one_row": {"streamed": 0.130, "gemv": 0.215}})
    assert not choose_one_row({"one_row": {"streamed": 0.100, "gemv": 0.105}})  # a near tie keeps transformers' sums
    assert choose_one_row({"one_row": {"streamed": ONE_ROW_SHARE, "gemv": 1.0}})
    assert not choose_one_row({"streamed": {}, "onednn": {}})  # bf16: one row is in stream_rows


@pytest.mark.parametrize("bias", [False, True])
def test_one_fp32_row_runs_on_the_kernel_where_asked(bias):
    """With `one_row`, one fp32 row runs on the streamed kernel (fp32 sums in its own order, close to torch's);
    without it, torch's own GEMV, bit for bit."""
    kernel = _kernel()
    torch.manual_seed(0)
    layer = nn.Linear(96, 40, bias=bias)
    x = torch.randn(1, 1, 96)
    with torch.no_grad(), linear.prepacked_linears(layer, stream_rows=0, one_row=True):
        got = layer(x)
    assert torch.equal(got[0], kernel.few_rows_linear(x[0], layer.weight, layer.bias))
    torch.testing.assert_close(got, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad(), linear.prepacked_linears(layer, stream_rows=16):
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("lean", [True, False])
def test_an_engine_streaming_one_row_stays_exact(lean, monkeypatch):
    """Where the plan sends one fp32 row to the streamed kernel, the steps without drafts run there (the lean
    forward's layers in one kernel call, or the modules' linears) and greedy output is still transformers'."""
    from infer.tuning import plan

    kernel = _kernel()
    monkeypatch.setattr(plan, "stream_one_row", lambda model, **_: True)
    calls = []
    spy = type("Spy", (), {"__getattr__": lambda self, name: getattr(kernel, name),
                           "few_rows_linear": lambda self, x, *a: calls.append(x.shape[0]) or kernel.few_rows_linear(x, *a),
                           "decoder_layer": lambda self, x, *a: calls.append((x.shape[0] * x.shape[1], a[-1]))
                           or kernel.decoder_layer(x, *a)})()
    monkeypatch.setattr(linear, "streamed_kernel", lambda: spy)
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    model = SelfSpecModel(target, "none", lean_verify=lean)
    assert torch.equal(model.generate(ids, max_new_tokens=20), expected)
    assert model.last_stats["verify_forward"] == ("lean" if lean else "transformers")
    assert (1, True) in calls if lean else 1 in calls  # a row's layer in one call, its linears streamed; a row


def test_stream_rows_gives_near_ties_to_the_streamed_kernel():
    from infer.tuning.plan import choose_stream_rows

    ms = lambda streamed, onednn: {"streamed": dict(zip((2, 4, 8, 16, 32), streamed, strict=True)),  # noqa: E731
                                   "onednn": dict(zip((2, 4, 8, 16, 32), onednn, strict=True))}
    # measured on this project's 2-core Xeon, 2026-11-26 (ms): the 2-row tie once set 0 rows
    assert choose_stream_rows(ms([27.8, 24.7, 30.1, 42.0, 66.8], [27.5, 29.3, 34.5, 40.2, 79.7])) == 32
    assert choose_stream_rows(ms([25.6, 23.4, 29.0, 41.0, 62.3], [28.2, 30.0, 35.1, 44.2, 60.0])) == 32
    assert choose_stream_rows(ms([22.8, 25.0, 31.9, 44.9, 71.8], [31.7, 34.3, 41.5, 46.4, 63.2])) == 16
    assert choose_stream_rows(ms([35.0, 20.0, 20.0, 20.0, 20.0], [30.0, 30.0, 30.0, 30.0, 30.0])) == 0


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'x': c++: command not found")

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with pytest.warns(UserWarning, match="c\\+\\+: command not found.*oneDNN"):
        assert linear.streamed_kernel.__wrapped__() is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_output_same_on_the_streamed_kernel(arch, monkeypatch):
    from infer.tuning import plan

    kernel = _kernel()
    calls = []
    monkeypatch.setattr(plan, "stream_rows", lambda model: 16)  # whatever this machine measured
    monkeypatch.setattr(linear, "streamed_kernel",
                        lambda: type("Spy", (), {"few_rows_linear": lambda self, *a: calls.append(1)
                                                 or kernel.few_rows_linear(*a)})())
    target = tiny_model(arch)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    model = SelfSpecModel(target, "ngram", lean_verify=False)  # the model's own linears, patched
    assert torch.equal(model.generate(ids, max_new_tokens=20), expected)
    assert calls  # verify blocks ran on it


@pytest.mark.slow  # builds a second copy of the kernel, for AVX2 only
def test_the_avx2_code_matches_plain_linear_too():
    """The kernel keeps a narrower tile without AVX-512 (16 vector registers, not 32). On an AVX-512 machine
    that code is built with -mno-avx512f and checked here; elsewhere the native build is that code."""
    if "avx512f" not in linear.cpu_flags().split():
        pytest.skip("no AVX-512 here: the tests above run the AVX2 code")
    kernel = linear.build_kernel(("-mno-avx512f",))
    if kernel is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    torch.manual_seed(0)
    layers = [nn.Linear(40, 24, bias=True), nn.Linear(40, 7, bias=False)]
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 40)
        with torch.no_grad():
            expected = torch.cat([layer(x) for layer in layers], dim=-1)
            got = kernel.few_rows_linear_cat(x, [m.weight for m in layers], [m.bias for m in layers])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # int8 rows (widened as loaded) and the argmax head built on them (infer/cpu/argmax_head.py)
    from infer.cpu.argmax_head import ArgmaxHead

    weight = torch.randn(301, 40) * 0.3
    head = ArgmaxHead(weight, kernel)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 40)
        dequantized = head.q.float() * head.scale[:, None]
        torch.testing.assert_close(kernel.int8_rows_linear(x, head.q, head.scale), x @ dequantized.T,
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(head.logits(x).argmax(-1), (x @ weight.T).argmax(-1))


def test_int8_rows_match_their_dequantized_weights():
    kernel = linear.streamed_kernel()
    if kernel is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (37, 50), dtype=torch.int8)  # 37 rows: 9 blocks of 4 and one left over
    scale = torch.rand(37) * 0.01
    for rows in (1, 2, 3, 4, 5, 9, 14):
        x = torch.randn(rows, 50)
        torch.testing.assert_close(kernel.int8_rows_linear(x, q, scale), x @ (q.float() * scale[:, None]).T,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="int8 contiguous"):
        kernel.int8_rows_linear(torch.randn(1, 50), q.float(), scale)


def test_int8_and_fp32_weights_side_by_side_in_one_pass():
    """few_rows_linear_cat takes int8 rows (with their scales) beside fp32 weights, as the int8 drafter's
    lean forward passes its q/k/v and gate/up; a missing or misplaced scale is refused by name."""
    kernel = _kernel()
    torch.manual_seed(0)
    fp32, bias = torch.randn(24, 40), torch.randn(24)
    q, scale = linear.int8_rows(torch.randn(13, 40))  # 13 rows: 3 blocks of 4 and one left over
    for rows in (1, 3, 4, 9, 33):
        x = torch.randn(rows, 40)
        got = kernel.few_rows_linear_cat(x, [fp32, q], [bias, None], [None, scale])
        expected = torch.cat([x @ fp32.T + bias, x @ (q.float() * scale[:, None]).T], dim=-1)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="an int8 weight of 13 rows needs a scale"):
        kernel.few_rows_linear_cat(x, [q], [None])
    with pytest.raises(RuntimeError, match="a scale or low is given for a float32 weight"):
        kernel.few_rows_linear_cat(x, [fp32], [None], [scale])
    with pytest.raises(RuntimeError, match="needs a scale \\[13\\]"):
        kernel.few_rows_linear_cat(x, [q], [None], [scale[:5]])
    with pytest.raises(RuntimeError, match="one scale \\(or None\\) per weight"):
        kernel.few_rows_linear_cat(x, [fp32, q], [None, None], [scale])
    with pytest.raises(RuntimeError, match="float32, bfloat16, int8 or 4-bit \\(uint8\\) weights only"):
        kernel.few_rows_linear_cat(x, [fp32.double()], [None])


def test_int8_linear_runs_fp32_rows_on_the_kernel_and_others_on_torchs_int8_kernel():
    kernel = _kernel()
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 64), torch.randn(40)
    layer = linear.Int8Linear(weight, bias)
    held = layer.q.double() * layer.scale.double()[:, None]  # the weight as the int8 rows hold it

    def exact(x):
        return x.double() @ held.T + bias.double()

    few = torch.randn(2, 3, 64)  # 6 rows: the kernel, fp32 products
    assert torch.equal(layer(few), kernel.int8_rows_linear(few.reshape(6, 64), layer.q, layer.scale).view(2, 3, 40)
                       + bias)
    torch.testing.assert_close(layer(few).double(), exact(few), rtol=1e-5, atol=1e-5)
    many = torch.randn(layer.KERNEL_ROWS + 1, 64)  # torch's kernel, bf16 activations: close, not as close
    got = layer(many)
    assert got.dtype == torch.float32 and not torch.allclose(got.double(), exact(many), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), exact(many), rtol=0.05, atol=0.1)
    half = layer(few.to(torch.bfloat16))  # bf16 input: torch's kernel, bf16 out
    assert half.dtype == torch.bfloat16 and half.shape == (2, 3, 40)


# ------------------------------------------------------------------ weights in groups (the int4 self-drafter's)
def test_groups_hold_a_gguf_grid_exactly_and_other_weights_within_half_a_step():
    torch.manual_seed(0)
    q4_1, q8_0 = on_gguf_grid(torch.randn(37, 96), "q4_1"), on_gguf_grid(torch.randn(37, 96), "q8_0")
    q, scale, low = linear.int4_groups(q4_1)
    assert q.dtype == torch.uint8 and q.shape == (37, 48) and scale.shape == low.shape == (37, 3)
    assert torch.equal(linear.int4_weight(q, scale, low), q4_1)
    q, scale = linear.int8_groups(q8_0)
    assert torch.equal((q.float().view(37, 3, 32) * scale[..., None]).view(37, 96), q8_0)
    other = torch.randn(37, 96)
    q, scale, low = linear.int4_groups(other)
    error = (linear.int4_weight(q, scale, low) - other).abs().view(37, 3, 32)
    assert (error <= scale[..., None] / 2 * (1 + 1e-5)).all()


def _builds():
    """The native build, and on an AVX-512 machine the AVX2 code built with -mno-avx512f as well."""
    builds = [_kernel()]
    if "avx512f" in linear.cpu_flags().split():
        avx2 = linear.build_kernel(("-mno-avx512f",))
        builds += [avx2] if avx2 is not None else []
    return builds


def test_grouped_weights_give_the_bits_of_the_fp32_weights_they_hold_beside_fp32_and_int8_rows():
    """4-bit groups (a scale and a low each) and int8 groups (a scale each) in one pass with fp32 weights and int8
    rows, 1 to 20 input rows (one pass, pairs of weight rows, passes of 4), 37 output rows (9 blocks of 4 and one left
    over): each grouped weight gives the same bits as the fp32 weight it holds would, and so a target dequantized from
    a GGUF grid can be read on it losslessly."""
    torch.manual_seed(0)
    q4_1, q8_0 = on_gguf_grid(torch.randn(37, 96), "q4_1"), on_gguf_grid(torch.randn(37, 96), "q8_0")
    q4, scale4, low4 = linear.int4_groups(q4_1)
    q8, scale8 = linear.int8_groups(q8_0)
    rows_q, rows_scale = linear.int8_rows(torch.randn(13, 96))
    fp32, bias = torch.randn(11, 96), torch.randn(11)
    for kernel in _builds():
        for rows in (1, 3, 4, 5, 8, 9, 13, 14, 15, 20):
            x = torch.randn(rows, 96)
            got = kernel.few_rows_linear_cat(x, [q4, fp32, q8, rows_q], [None, bias, None, None],
                                             [scale4, None, scale8, rows_scale], [low4, None, None, None])
            as_fp32 = kernel.few_rows_linear_cat(x, [q4_1, fp32, q8_0], [None, bias, None])
            assert torch.equal(got[:, :85], as_fp32), rows  # 37 + 11 + 37 columns
            expected = torch.cat([x @ q4_1.T, x @ fp32.T + bias, x @ q8_0.T,
                                  x @ (rows_q.float() * rows_scale[:, None]).T], dim=-1)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)  # sums of ~1,000: float rounding


@pytest.mark.parametrize("kind,exact,rebuild,stored", [
    ("q4_1", linear.int4_exact, linear.int4_weight, torch.uint8),
    ("q8_0", linear.int8_exact, linear.int8_weight, torch.int8)])
def test_exact_groups_find_a_gguf_grid_and_refuse_other_weights(kind, exact, rebuild, stored):
    torch.manual_seed(0)
    grid = on_gguf_grid(torch.randn(37, 96), kind)
    groups = exact(grid)
    assert groups[0].dtype == stored and torch.equal(rebuild(*groups), grid)
    near = grid.clone()
    near[20, 50] = torch.nextafter(near[20, 50], torch.tensor(1.0))  # one weight one bit off its grid
    assert exact(near) is None
    assert exact(torch.randn(37, 96)) is None
    assert exact(grid[:, :80]) is None  # 80 inputs: not groups of 32
    assert exact(grid.double()) is None
    assert linear.exact_groups(near) is None


def test_exact_groups_take_the_fewest_bytes():
    """4-bit groups first where they hold the weight (a fifth of fp32's bytes), else int8 groups, else none."""
    torch.manual_seed(0)
    q8_0, q4_1 = on_gguf_grid(torch.randn(37, 96), "q8_0"), on_gguf_grid(torch.randn(37, 96), "q4_1")
    assert linear.exact_groups(q4_1)[0].dtype == torch.uint8
    q, scale, low = linear.exact_groups(q8_0)
    assert q.dtype == torch.int8 and low is None and torch.equal(linear.int8_weight(q, scale), q8_0)
    assert linear.exact_groups(torch.randn(37, 96)) is None


def test_grouped_weights_are_refused_by_name_when_malformed():
    kernel = _kernel()
    q4, scale, low = linear.int4_groups(torch.randn(8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="a 4-bit weight of 8 rows needs a scale and a low \\[8, 2\\]"):
        kernel.few_rows_linear_cat(x, [q4], [None], [scale], [None])
    with pytest.raises(RuntimeError, match="a 4-bit weight of 8 rows needs a scale and a low \\[8, 2\\]"):
        kernel.few_rows_linear_cat(x, [q4], [None], [scale[:, :1].contiguous()], [low])
    with pytest.raises(RuntimeError, match="a 4-bit weight \\[N, K / 2\\] of uint8 with K = 40 a multiple of 32"):
        kernel.few_rows_linear_cat(torch.randn(2, 40), [torch.zeros(8, 20, dtype=torch.uint8)], [None],
                                   [torch.zeros(8, 1)], [torch.zeros(8, 1)])
    with pytest.raises(RuntimeError, match="a low is given for int8 rows"):
        kernel.few_rows_linear_cat(x, [torch.zeros(8, 64, dtype=torch.int8)], [None], [torch.ones(8)], [low])
    with pytest.raises(RuntimeError, match="one a group of 32 inputs \\(K a multiple of 32\\)"):
        kernel.few_rows_linear_cat(torch.randn(2, 40), [torch.zeros(8, 40, dtype=torch.int8)], [None],
                                   [torch.ones(8, 1)])
    with pytest.raises(RuntimeError, match="one low \\(or None\\) per weight"):
        kernel.few_rows_linear_cat(x, [q4], [None], [scale], [low, low])


@pytest.mark.parametrize("layer_of", [lambda w, b: linear.Int4Linear(w, b),
                                      lambda w, b: linear.Int8Linear(w, b, group=True)], ids=["int4", "int8-groups"])
def test_grouped_linears_run_fp32_rows_on_the_kernel_and_others_on_their_fp32_weight(layer_of):
    kernel = _kernel()
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 64), torch.randn(40)
    layer = layer_of(weight, bias)
    held = layer.weight_fp32()
    torch.testing.assert_close(held, weight, rtol=0, atol=0.3)  # 4 bits of randn: half a step is up to ~0.25
    few = torch.randn(2, 3, 64)  # 6 rows: the kernel
    lows = [layer.low] if isinstance(layer, linear.Int4Linear) else []
    on_kernel = kernel.few_rows_linear_cat(few.reshape(6, 64), [layer.q], [None], [layer.scale], lows)
    assert torch.equal(layer(few), on_kernel.view(2, 3, 40) + bias)
    torch.testing.assert_close(layer(few), few @ held.T + bias, rtol=1e-5, atol=1e-5)
    many = torch.randn(layer.KERNEL_ROWS + 1, 64)  # the fp32 weight it holds, made for the call
    assert torch.equal(layer(many), torch.nn.functional.linear(many, held) + bias)
    half = layer(few.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half.shape == (2, 3, 40)


def test_grouped_linears_need_inputs_in_groups():
    with pytest.raises(ValueError, match="int4 needs in_features divisible by 32; got \\(8, 40\\)"):
        linear.Int4Linear(torch.randn(8, 40))
    with pytest.raises(ValueError, match="int8 groups need in_features divisible by 32; got \\(8, 40\\)"):
        linear.Int8Linear(torch.randn(8, 40), group=True)
    assert linear.Int8Linear(torch.randn(8, 40)).scale.shape == (8,)  # rows: any width


def test_engines_over_one_target_share_its_packed_copies_and_free_them_with_the_last():
    """Every engine over one target holds the same packed copies (one per weight, however many engines: a
    benchmark's dozen engines over an fp32 1B target each packing its own ran 24 GB out); the last one dropped frees
    them, and another target gets its own."""
    import gc
    import weakref

    target = tiny_model("llama")
    ids = torch.randint(3, 60, (1, 80), generator=torch.Generator().manual_seed(0))  # more rows than are streamed
    first, second = SelfSpecModel(target, "none", lean_verify=False), SelfSpecModel(target, "ngram", lean_verify=False)
    other = SelfSpecModel(tiny_model("llama"), "none", lean_verify=False)
    for model in (first, second, other):
        model.generate(ids, max_new_tokens=2)  # the prompt's 80 rows run on packed weights
    cache = first._packed
    assert cache is second._packed and cache is not other._packed
    assert len(cache) == len(other._packed) > 0  # each weight packed once
    freed = weakref.ref(cache)
    del first, second, cache
    gc.collect()
    assert freed() is None
