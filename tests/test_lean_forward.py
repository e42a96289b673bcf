"""The lean verify forward: the model's own function (logits, hidden states, K/V written), used by generate
wherever it can run, and left to transformers wherever it cannot or a user's hook must see the forwards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import on_gguf_grid, tiny_model
from torch import nn

from heads.eagle3.lean import LeanEagle3
from heads.eagle3.lean import why_not as eagle3_why_not
from infer import SelfSpecModel
from infer.attention import prompt_tree
from infer.cpu import lean_forward, linear
from infer.drafters import self_draft
from infer.kv import KVState, forward_block

LEAN = ["llama", "qwen2", "mistral", "qwen3"]
IDS = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])


def _kernel():
    kernel = linear.streamed_kernel()
    if kernel is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    return kernel


def _after_prompt(model, prompt, mask, roomy: bool = True):
    kv = KVState(prompt.shape[0], prompt.device, model.config, roomy=roomy)
    depth, ancestors, valid = prompt_tree(mask)
    forward_block(model, kv, depth, ancestors, valid, input_ids=prompt)
    kv.commit_block(0, valid)
    return kv


def _spy_whole_layers(monkeypatch) -> list:
    """A list that gets the lean forward of each `LeanLayers._whole_layer` call (a layer in one kernel call)."""
    calls = []
    whole_layer = lean_forward.LeanLayers._whole_layer
    monkeypatch.setattr(lean_forward.LeanLayers, "_whole_layer",
                        lambda self, *args: calls.append(self) or whole_layer(self, *args))
    return calls


def _lean_target(arch: str):
    """A tiny target of `arch`; "llama-biases": every linear with a random bias (transformers initializes them
    to 0)."""
    if arch != "llama-biases":
        return tiny_model(arch)
    target = tiny_model("llama", attention_bias=True, mlp_bias=True)
    biases = [m.bias for m in target.model.layers.modules() if isinstance(m, nn.Linear)]
    assert len(biases) == 7 * target.config.num_hidden_layers and all(b is not None for b in biases)
    with torch.no_grad():
        for b in biases:
            b.normal_(0, 0.5)
    return target


def _forwards_after_prompt(reference, models, block, depth, ancestors, valid, roomy: bool = True):
    """Each of `models` on `block` after a two-row prompt (the first left-padded) whose K/V `reference` wrote: their
    outputs (hidden states included) and caches (the engine's growing one, or with `roomy=False` transformers')."""
    prompt = torch.tensor([[0, 0, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    outs, caches = [], []
    with torch.no_grad():
        for model in models:
            kv = _after_prompt(reference, prompt, mask, roomy)
            outs.append(forward_block(model, kv, depth, ancestors, valid, input_ids=block, output_hidden_states=True))
            caches.append(kv.cache)
    return outs, caches


def _assert_same_forward(reference, lean, block, depth, ancestors, valid):
    """`lean` on `block` after a two-row prompt (the first left-padded) gives the logits, hidden states and K/V
    `reference` computes, to float rounding: both within 1e-5 of the tensor's scale of the function in float64 (sums
    run in another order in each). Measured against float64 rather than against each other, because two fp32 orders
    can differ by twice what either is off: with random biases and 24 rows, torch's fp32 forward was 4e-6 of the
    last hidden state's scale off, the lean one 8e-6, and they differed by 1.2e-5 (2026-11-27, a Zen 5 EPYC)."""
    exact = copy.deepcopy(reference).double()
    (expected, got), caches = _forwards_after_prompt(reference, (reference, lean), block, depth, ancestors, valid)
    (truth,), (truth_cache,) = _forwards_after_prompt(exact, (exact,), block, depth, ancestors, valid)

    def close(a, b):
        b = b.double()
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))

    assert len(got.hidden_states) == len(expected.hidden_states) == reference.config.num_hidden_layers + 1
    for out, cache in ((expected, caches[0]), (got, caches[1])):
        close(out.logits, truth.logits)
        for h, h_truth in zip(out.hidden_states, truth.hidden_states, strict=True):
            close(h, h_truth)
        for layer, layer_truth in zip(cache.layers, truth_cache.layers, strict=True):
            close(layer.keys, layer_truth.keys)
            close(layer.values, layer_truth.values)


@pytest.mark.parametrize("stream_rows", [16, 0], ids=["kernel", "torch"])
@pytest.mark.parametrize("arch", [*LEAN, "llama-biases"])
def test_same_logits_hidden_states_and_cache_as_the_model(arch, stream_rows, monkeypatch):
    whole_layers = []  # with the kernel, each layer is one call that writes K/V into the cache's buffers
    if stream_rows:
        _kernel()
        whole_layers = _spy_whole_layers(monkeypatch)
    target = _lean_target(arch)
    lean = lean_forward.LeanForward(target, stream_rows, linear.PackCache())
    # a tree block after the prompt: root, two children of it, a grandchild
    depth = torch.tensor([[0, 1, 1, 2]] * 2)
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None].repeat(2, 1, 1)
    valid = torch.ones(2, 4, dtype=torch.bool)
    block = torch.tensor([[11, 12, 13, 14], [15, 16, 17, 18]])
    _assert_same_forward(target, lean, block, depth, ancestors, valid)
    fused = stream_rows and arch != "qwen3"  # Qwen3's q/k norms: op by op, its linears still on the kernel
    assert len(whole_layers) == (target.config.num_hidden_layers if fused else 0)


@pytest.mark.parametrize("stream_rows", [16, 0], ids=["kernel", "torch"])
def test_a_one_row_block_is_the_models(stream_rows):
    # one row takes ATen's linear (the GEMV) inside the kernel's attention_tail, not the streamed kernel
    if stream_rows:
        _kernel()
    target = tiny_model("qwen2")  # q/k/v biases
    lean = lean_forward.LeanForward(target, stream_rows, linear.PackCache())
    prompt, block = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[8]])
    outs = []
    with torch.no_grad():
        for model in (target, lean):
            kv = _after_prompt(target, prompt, torch.ones_like(prompt))
            outs.append(forward_block(model, kv, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.bool),
                                      torch.ones(1, 1, dtype=torch.bool), input_ids=block, output_hidden_states=True))
    expected, got = outs
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5 * float(expected.logits.abs().max()))
    torch.testing.assert_close(got.hidden_states[-1], expected.hidden_states[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("roomy", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("arch", [*LEAN, "llama-biases"])
def test_a_bf16_target_gets_its_modules_bits(arch, rows, roomy):
    """A bf16 target runs lean: the logits, hidden states and K/V its modules compute in bf16 with their linears on
    the streamed kernel (the engine's path for it without the lean forward), bit for bit, one row or a tree, on the
    engine's growing cache or transformers' own."""
    _kernel()
    target = _lean_target(arch).to(torch.bfloat16)
    lean = lean_forward.LeanForward(target, 16, linear.PackCache())  # the full logits (no int8 head)
    assert lean.argmax_head is None and not lean.fused
    depth = torch.tensor([[0, 1, 1, 2][:rows]] * 2)
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                             dtype=torch.bool)[:rows, :rows][None].repeat(2, 1, 1)
    valid = torch.ones(2, rows, dtype=torch.bool)
    block = torch.tensor([[11, 12, 13, 14][:rows], [15, 16, 17, 18][:rows]])
    calls = []
    kernel = lean.kernel

    class Spy:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(kernel, name)(*a)

    lean.kernel = Spy()
    with linear.prepacked_linears(target, stream_rows=16):
        (expected, got), caches = _forwards_after_prompt(target, (target, lean), block, depth, ancestors, valid,
                                                         roomy)
    assert calls == ["few_rows_linear_cat"] * (4 * target.config.num_hidden_layers + 1)  # q/k/v, o, gate/up, down; head
    assert got.logits.dtype == expected.logits.dtype == torch.bfloat16
    assert torch.equal(got.logits, expected.logits)
    for h, h_expected in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert torch.equal(h, h_expected)
    for layer, layer_expected in zip(caches[1].layers, caches[0].layers, strict=True):
        assert torch.equal(layer.keys, layer_expected.keys) and torch.equal(layer.values, layer_expected.values)


def test_a_bf16_target_generates_lean_as_through_its_modules():
    _kernel()
    target = tiny_model("llama").to(torch.bfloat16)
    outputs = {}
    for lean in (True, False):
        model = SelfSpecModel(target, "ngram", lean_verify=lean)
        outputs[lean] = model.generate(IDS, max_new_tokens=30)
        assert model.last_stats["verify_forward"] == ("lean" if lean else "transformers")
        assert model.last_stats["int8_argmax"] == lean  # greedy: the lean forward's int8 copy of the bf16 head
    assert torch.equal(outputs[True], outputs[False])
    assert torch.equal(SelfSpecModel(target, "ngram").generate(IDS, max_new_tokens=30), outputs[True])  # the default


@pytest.mark.parametrize("arch", LEAN)
def test_generate_runs_it_and_stays_exact(arch):
    target = tiny_model(arch)
    expected = target.generate(IDS, max_new_tokens=30, do_sample=False)
    for drafter in ("ngram", "int8"):
        model = SelfSpecModel(target, drafter)
        assert torch.equal(model.generate(IDS, max_new_tokens=30), expected), drafter
        assert model.last_stats["verify_forward"] == "lean"
        assert model.last_stats["target_seconds"] > 0


def test_batch_with_padding_stays_exact():
    target = tiny_model("llama")
    ids = torch.tensor([[0, 0, 0, 5, 9, 14, 5, 9], [3, 4, 5, 6, 3, 4, 5, 6]])
    mask = (ids != 0).long()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    model = SelfSpecModel(target, "ngram")
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0), expected)
    assert model.last_stats["verify_forward"] == "lean"


def test_a_users_hook_sees_every_forward():
    target = tiny_model("llama")
    expected = target.generate(IDS, max_new_tokens=20, do_sample=False)
    model = SelfSpecModel(target, "ngram")
    calls = []
    handle = target.model.layers[1].register_forward_hook(lambda *args: calls.append(1))
    try:
        assert torch.equal(model.generate(IDS, max_new_tokens=20), expected)
    finally:
        handle.remove()
    assert model.last_stats["verify_forward"] == "transformers"
    assert len(calls) == model.last_stats["target_forwards"]
    model.generate(IDS, max_new_tokens=20)  # the hook is gone: lean again
    assert model.last_stats["verify_forward"] == "lean"


def test_a_layer_adapted_after_construction_goes_back_to_the_modules():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "ngram")
    attn = target.model.layers[2].self_attn
    with torch.no_grad():  # an adapter-like wrapper that changes the layer's output
        attn.q_proj = nn.Sequential(attn.q_proj, nn.Tanh())
    expected = target.generate(IDS, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=20), expected)
    assert model.last_stats["verify_forward"] == "transformers"


def test_a_weight_replaced_after_construction_is_the_one_used():
    target = tiny_model("llama")
    model = SelfSpecModel(target, "ngram")
    model.generate(IDS, max_new_tokens=8)
    mlp = target.model.layers[1].mlp
    with torch.no_grad():  # a new tensor, not an in-place copy: the last call's references are stale
        mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight * -3)
    expected = target.generate(IDS, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(IDS, max_new_tokens=20), expected)
    assert model.last_stats["verify_forward"] == "lean"


def test_transformers_own_capture_hooks_do_not_count():
    target = tiny_model("llama")
    target(IDS, output_hidden_states=True)  # transformers leaves its output-capture hooks on the layers
    assert any(m._forward_hooks for m in target.modules())
    assert not lean_forward.user_hooks(target)


@pytest.mark.parametrize("arch, reason", [("gemma2", "activation"),
                                          ("gpt2", "Llama module layout"), ("phi3", "Phi3DecoderLayer")])
def test_other_targets_are_left_to_transformers(arch, reason):
    target = tiny_model(arch)
    assert reason in lean_forward.why_not(target)
    model = SelfSpecModel(target, "ngram")
    model.generate(IDS, max_new_tokens=8)
    assert model.last_stats["verify_forward"] == "transformers"
    with pytest.raises(ValueError, match=f"lean_verify=True cannot run.*{reason}"):
        SelfSpecModel(target, "ngram", lean_verify=True)


def test_adapted_or_non_cpu_fp32_targets_are_refused_by_why_not():
    target = tiny_model("llama")
    assert lean_forward.why_not(target) is None
    assert lean_forward.why_not(tiny_model("llama").to(torch.bfloat16)) is None
    assert "fp32" in lean_forward.why_not(tiny_model("llama").to(torch.float16))
    mixed = tiny_model("llama").to(torch.bfloat16)
    mixed.model.norm.float()
    assert "other dtypes" in lean_forward.why_not(mixed)
    adapted = tiny_model("llama")
    adapted.model.layers[0].self_attn.q_proj = nn.Sequential(adapted.model.layers[0].self_attn.q_proj)
    assert "adapted or quantized" in lean_forward.why_not(adapted)


def test_lean_verify_setting():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="lean_verify must be True, False or None"):
        SelfSpecModel(target, "ngram", lean_verify="yes")
    model = SelfSpecModel(target, "ngram", lean_verify=False)
    model.generate(IDS, max_new_tokens=8)
    assert model.last_stats["verify_forward"] == "transformers"
    with pytest.raises(ValueError, match="cpu_prepack is off"):
        SelfSpecModel(target, "ngram", cpu_prepack=False, lean_verify=True)


def test_the_users_model_is_left_as_it_was():
    target = tiny_model("llama")
    before = {name: set(m.__dict__) for name, m in target.named_modules()}
    SelfSpecModel(target, "ngram").generate(IDS, max_new_tokens=12)
    assert {name: set(m.__dict__) for name, m in target.named_modules()} == before


# ------------------------------------------------------------------------------------ the kernel's pieces
@pytest.mark.parametrize("rows", [2, 3, 5, 9])
def test_several_weights_in_one_pass_match_their_linears(rows):
    kernel = _kernel()
    torch.manual_seed(rows)
    layers = [nn.Linear(40, 24, bias=True), nn.Linear(40, 7, bias=False), nn.Linear(40, 13, bias=True)]
    x = torch.randn(rows, 40)
    with torch.no_grad():
        expected = torch.cat([layer(x) for layer in layers], dim=-1)
        got = kernel.few_rows_linear_cat(x, [m.weight for m in layers], [m.bias for m in layers])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_the_models():
    kernel = _kernel()
    target = tiny_model("llama")
    norm = target.model.layers[0].input_layernorm
    x = torch.randn(5, target.config.hidden_size) * 3
    with torch.no_grad():
        torch.testing.assert_close(kernel.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x),
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: weight \\[K\\]"):
        kernel.rms_norm(x, torch.ones(3), 1e-6)


@pytest.mark.parametrize("rows", [1, 4])
def test_rope_in_place_matches_the_models(rows):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    kernel = _kernel()
    target = tiny_model("llama")
    config = target.config
    h, kvh = config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // h
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (h + 2 * kvh) * hd)
    position_ids = torch.arange(7, 7 + rows)[None]
    cos, sin = target.model.rotary_emb(qkv[None], position_ids)  # [1, rows, hd]
    heads = qkv.view(1, rows, h + 2 * kvh, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(heads[:, :h], heads[:, h:h + kvh], cos, sin)
    v = heads[:, h + kvh:].clone()
    kernel.rope_(qkv, cos[0], sin[0], h + kvh)
    got = qkv.view(1, rows, h + 2 * kvh, hd).transpose(1, 2)
    torch.testing.assert_close(got[:, :h], q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, h:h + kvh], k, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, h + kvh:], v)  # values are not rotated
    with pytest.raises(RuntimeError, match="do not fit"):
        kernel.rope_(qkv, cos[0], sin[0], h + 2 * kvh + 1)


def test_silu_mul_matches_torch_at_the_extremes():
    kernel = _kernel()
    intermediate = 37  # not a whole number of vector lanes: the scalar tail runs too
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * intermediate) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -88.5, -30.0, 30.0, 88.5, 200.0])  # e^-|g| under float's range
    gate_up[1, 5] = float("nan")
    gate, up = gate_up.chunk(2, -1)
    got = kernel.silu_mul(gate_up, intermediate)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert got[1, 5].isnan() and not got[1, 6:].isnan().any()
    with pytest.raises(RuntimeError, match="silu_mul: gate_up"):
        kernel.silu_mul(gate_up, intermediate + 1)


def test_write_kv_places_the_block_after_the_slots_in_use():
    kernel = _kernel()
    batch, heads, kv_heads, head_dim, rows, size, capacity = 2, 4, 2, 8, 3, 5, 12
    torch.manual_seed(0)
    qkv = torch.randn(batch * rows, (heads + 2 * kv_heads) * head_dim)
    keys, values = torch.randn(batch, kv_heads, capacity, head_dim), torch.randn(batch, kv_heads, capacity, head_dim)
    before = keys.clone(), values.clone()
    got = kernel.write_kv(qkv, keys, values, size, heads)
    block = qkv.view(batch, rows, -1, head_dim).transpose(1, 2)  # [B, heads + 2 KVH, N, D]
    for buffer, old, view, written in zip((keys, values), before, got, (block[:, heads:heads + kv_heads],
                                                                         block[:, heads + kv_heads:]), strict=True):
        assert view.data_ptr() == buffer.data_ptr() and view.shape == (batch, kv_heads, size + rows, head_dim)
        assert torch.equal(buffer[:, :, size:size + rows], written)
        assert torch.equal(buffer[:, :, :size], old[:, :, :size])  # the slots in use and the room after: untouched
        assert torch.equal(buffer[:, :, size + rows:], old[:, :, size + rows:])
    with pytest.raises(RuntimeError, match="do not fit buffers of 12"):
        kernel.write_kv(qkv, keys, values, capacity - rows + 1, heads)
    with pytest.raises(RuntimeError, match="5 rows of qkv for a batch of 2"):
        kernel.write_kv(qkv[:5], keys, values, 0, heads)
    with pytest.raises(RuntimeError, match="do not fit in qkv rows"):
        kernel.write_kv(qkv, keys, values, 0, heads + 1)
    with pytest.raises(RuntimeError, match="of one shape"):
        kernel.write_kv(qkv, keys, values[:, :, :-1], 0, heads)


def test_a_roomy_cache_layer_keeps_its_buffer_until_it_is_full_or_replaced():
    from infer.kv import RoomyLayer

    layer = RoomyLayer()
    torch.manual_seed(0)
    first = torch.randn(2, 3, 4, 8)
    keys, _ = layer.update(first, first + 1)
    assert torch.equal(keys, first)
    key_buffer, value_buffer, size = layer.reserve(first, 2, 3, 5, 8)  # room for 5 more: the same buffer
    assert size == 4 and key_buffer.data_ptr() == keys.data_ptr() and key_buffer.shape[2] >= 9
    assert torch.equal(value_buffer[:, :, :4], first + 1)
    layer.crop(-1)  # a leading slice still: kept
    assert layer.reserve(first, 2, 3, 1, 8)[0].data_ptr() == key_buffer.data_ptr()
    layer.batch_select_indices(torch.tensor([1]))  # a new tensor: adopted into a new buffer, rows kept
    selected, selected_values, size = layer.reserve(first, 1, 3, 1, 8)
    assert size == 3 and selected.data_ptr() != key_buffer.data_ptr() and torch.equal(selected[:, :, :3], first[1:, :, :3])
    layer.keys, layer.values = selected[:, :, :3], selected_values[:, :, :3]  # as a caller that wrote nothing sets them
    assert layer.reserve(first, 1, 3, 1, 8)[0].data_ptr() == selected.data_ptr()
    room = selected.shape[2]
    grown, _, size = layer.reserve(first, 1, 3, room, 8)  # more than it has room for: grown, what it held carried over
    assert size == 3 and grown.data_ptr() != selected.data_ptr() and grown.shape[2] >= room + 3
    assert torch.equal(grown[:, :, :3], first[1:, :, :3])


def _attention_case(heads: int, kv_heads: int, head_dim: int, rows: int, slots: int, seed: int = 0):
    """A verify block's attention inputs: q's heads first in a fused projection, the cache's K/V as views of
    larger buffers (as the engine's cache holds them), and a tree mask that hides some slots."""
    torch.manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim) * 2
    keys = torch.randn(1, kv_heads, slots + 40, head_dim)[:, :, :slots]
    values = torch.randn(1, kv_heads, slots + 40, head_dim)[:, :, :slots]
    hidden = torch.rand(1, 1, rows, slots) < 0.3
    hidden[..., -1] = False  # every row sees at least itself
    mask = torch.zeros(1, 1, rows, slots).masked_fill(hidden, float("-inf"))
    return qkv, keys, values, mask


def _sdpa(qkv, keys, values, mask, heads):
    rows, head_dim = qkv.shape[0], keys.shape[-1]
    q = qkv.view(1, rows, -1, head_dim)[:, :, :heads].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=head_dim ** -0.5,
                                         enable_gqa=keys.shape[1] != heads)
    return out.transpose(1, 2).reshape(rows, heads * head_dim)


@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize(("rows", "slots"), [(1, 5), (4, 37), (9, 300)])
def test_few_rows_attention_matches_sdpa(head_dim, rows, slots):
    kernel = _kernel()
    for heads, kv_heads in ((9, 3), (4, 4)):  # SmolLM2's grouping, and one K/V head per query head
        qkv, keys, values, mask = _attention_case(heads, kv_heads, head_dim, rows, slots, seed=rows)
        got = kernel.few_rows_attention(qkv, keys, values, mask, heads, head_dim ** -0.5).double()
        exact = _sdpa(qkv.double(), keys.double(), values.double(), mask.double(), heads)
        sdpa_error = (_sdpa(qkv, keys, values, mask, heads).double() - exact).abs().max()
        assert (got - exact).abs().max() <= 2 * sdpa_error + 1e-7  # as close to exact as SDPA in float


def test_few_rows_attention_edge_rows_and_bad_input():
    kernel = _kernel()
    qkv, keys, values, mask = _attention_case(2, 1, 16, 3, 20)
    mask[0, 0, 1] = float("-inf")  # a row that sees nothing: zeros
    mask[0, 0, 2, :-1] = float("-inf")  # a row that sees one slot: that slot's values, in both heads
    got = kernel.few_rows_attention(qkv, keys, values, mask, 2, 0.25)
    assert torch.equal(got[1], torch.zeros(32))
    torch.testing.assert_close(got[2], values[0, 0, -1].repeat(2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0], _sdpa(qkv, keys, values, mask, 2)[0], rtol=1e-5, atol=1e-6)
    qkv[0, 3] = float("nan")  # a NaN in row 0's first head: that head's output is NaN, as SDPA's, the other not
    got = kernel.few_rows_attention(qkv, keys, values, mask, 2, 0.25)
    assert got[0, :16].isnan().all() and not got[0, 16:].isnan().any()
    with pytest.raises(RuntimeError, match="few_rows_attention: qkv"):
        kernel.few_rows_attention(qkv, keys, values, mask[..., :-1], 2, 0.25)  # mask one slot short


def test_few_rows_attention_in_the_avx2_code():
    if "avx512f" not in linear.cpu_flags().split():
        pytest.skip("no AVX-512 here: the tests above run the AVX2 code")
    kernel = linear.build_kernel(("-mno-avx512f",))
    if kernel is None:
        pytest.skip("the streamed kernel could not be built here (no C++ compiler)")
    for head_dim in (8, 64):
        qkv, keys, values, mask = _attention_case(9, 3, head_dim, 4, 45)
        got = kernel.few_rows_attention(qkv, keys, values, mask, 9, head_dim ** -0.5)
        torch.testing.assert_close(got, _sdpa(qkv, keys, values, mask, 9), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_lean_forward_with_heads_the_attention_kernel_takes(head_dim):
    # the tiny models' heads (8 wide) are too narrow for the AVX-512 build's attention; these are not
    _kernel()
    target = tiny_model("llama", hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1)
    lean = lean_forward.LeanForward(target, 16, linear.PackCache())
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    depth, valid = torch.tensor([[0, 1, 1, 2]]), torch.ones(1, 4, dtype=torch.bool)
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None]
    outs = []
    with torch.no_grad():
        for model in (target, lean):
            kv = _after_prompt(target, prompt, torch.ones_like(prompt))
            outs.append(forward_block(model, kv, depth, ancestors, valid, input_ids=torch.tensor([[11, 12, 13, 14]])))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5 * float(outs[0].logits.abs().max()))
    # the K/V the lean forward wrote, as the cache hands them to attention_tail, are inputs the kernel takes
    layer = kv.cache.layers[0]
    slots = layer.keys.shape[2]
    kernel = linear.streamed_kernel()
    out = kernel.few_rows_attention(torch.randn(4, 4 * head_dim), layer.keys, layer.values,
                                    torch.zeros(1, 1, 4, slots), 2, head_dim ** -0.5)
    assert out.shape == (4, 2 * head_dim)


# ------------------------------------------------------------------------- the EAGLE-3 drafter's forward
def _eagle3(target, **options):
    import heads

    torch.manual_seed(1)
    drafter = heads.build("eagle3", target, **options).eval()
    with torch.no_grad():  # trained-like scales: random norms and biases-free linears well away from init
        for p in drafter.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    drafter.attach(target)
    return drafter


@pytest.mark.parametrize("stream_rows", [16, 0], ids=["kernel", "torch"])
@pytest.mark.parametrize("options", [{}, {"num_layers": 2, "norm_before_residual": True},
                                     {"norm_before_fc": True, "norm_output": True}, {"layer_style": "target"}],
                         ids=["one", "two", "speculators", "qwen3-layer"])
def test_eagle3_lean_forward_is_the_drafters(stream_rows, options):
    if stream_rows:
        _kernel()
    target = tiny_model("qwen3" if options.get("layer_style") == "target" else "llama")  # Qwen3's layer: q/k norms
    drafter = _eagle3(target, **options)
    lean = LeanEagle3(drafter, stream_rows)
    d, width = target.config.hidden_size, drafter.fc.in_features
    torch.manual_seed(2)
    prompt, features = torch.randint(0, 50, (2, 6)), torch.randn(2, 6, width)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    # a draft step: three nodes fed the drafter's own hidden state, the third a child of the first
    depth = torch.tensor([[0, 0, 1]] * 2)
    ancestors = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)[None].repeat(2, 1, 1)
    block, own = torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.randn(2, 3, d)
    outs, caches = [], []
    with torch.no_grad():
        for net in (drafter, lean):
            kv = KVState(2, prompt.device)
            p_depth, p_ancestors, p_valid = prompt_tree(mask)
            first = kv.forward_tree(net, p_depth, p_ancestors, p_valid, prompt, features)
            kv.commit_block(0, p_valid)
            outs.append((*first, *kv.forward_tree(net, depth, ancestors, torch.ones(2, 3, dtype=torch.bool), block, own)))
            caches.append(kv.cache)
    for got, expected in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    for layer_got, layer_expected in zip(caches[1].layers, caches[0].layers, strict=True):
        torch.testing.assert_close(layer_got.keys, layer_expected.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer_got.values, layer_expected.values, rtol=1e-5, atol=1e-5)


def test_eagle3_int8_head_scores_the_draft_vocabulary_from_one_kept_copy():
    _kernel()
    target = tiny_model("llama")
    drafter = _eagle3(target)
    cache = linear.PackCache()
    fp32, int8 = LeanEagle3(drafter, 16), LeanEagle3(drafter, 16, int8=cache)
    again = LeanEagle3(drafter, 16, int8=cache)  # every int8 copy made once, kept in the cache
    assert again.head_rows is int8.head_rows and again.fc_int8.weights[0] is int8.fc_int8.weights[0]
    assert again.compact[0].qkv.weights[0] is int8.compact[0].qkv.weights[0]
    torch.manual_seed(2)
    y = torch.randn(2, 5, target.config.hidden_size)
    expected, got = fp32._head(y), int8._head(y)
    assert got.shape == expected.shape
    q, scale = int8.head_rows
    torch.testing.assert_close(got, y @ (q.float() * scale[:, None]).T, rtol=1e-5, atol=1e-5)  # the int8 copy's
    # and close to the fp32 head's: at most half an int8 step per weight, summed over the row
    bound = y.abs().sum(-1, keepdim=True) * scale / 2
    assert ((got - expected).abs() <= bound * 1.001 + 1e-6).all()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("stream_rows", [16, 0])
def test_eagle3_int8_draft_steps_run_the_int8_weights_and_a_prompt_the_fp32_ones(stream_rows, arch):
    """With int8 copies, a block of up to 16 rows (a draft step) runs `fc`, the layers and the head on int8 rows:
    the function of the weights those rows hold. A longer block (a prompt) runs `fc` and the layers in fp32, on
    the kernel or not as `stream_rows` says. Qwen3's layer (q/k norms) too, op by op."""
    _kernel()
    target = tiny_model(arch)
    style = {"layer_style": "target"} if arch == "qwen3" else {}
    drafter, dequantized = _eagle3(target, **style), _eagle3(target, **style)  # the same weights
    with torch.no_grad():
        for m in dequantized.modules():
            if isinstance(m, nn.Linear):
                q, scale = linear.int8_rows(m.weight)
                m.weight.copy_(q.float() * scale[:, None])
    int8 = LeanEagle3(drafter, stream_rows, int8=linear.PackCache())
    assert int8.compact[0].qkv.weights[0].dtype == torch.int8 and int8.fc_int8.weights[0].dtype == torch.int8
    torch.manual_seed(2)

    def run(net, tokens, features):
        kv = KVState(2, tokens.device)
        depth, ancestors, valid = prompt_tree(torch.ones_like(tokens, dtype=torch.bool))
        with torch.no_grad():
            return kv.forward_tree(net, depth, ancestors, valid, tokens, features)

    width = drafter.fc.in_features
    draft_step = torch.randint(0, 50, (2, 5)), torch.randn(2, 5, width)  # 10 rows
    for got, expected in zip(run(int8, *draft_step), run(LeanEagle3(dequantized, stream_rows), *draft_step), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    prompt = torch.randint(0, 50, (2, 10)), torch.randn(2, 10, width)  # 20 rows
    got, expected = run(int8, *prompt)[0], run(LeanEagle3(drafter, stream_rows), *prompt)[0]  # hidden: fp32 weights
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_generate_drafts_with_the_lean_eagle3_forward_and_stays_exact():
    target = tiny_model("llama")
    drafter = _eagle3(target)
    expected = target.generate(IDS, max_new_tokens=24, do_sample=False)
    for lean_verify, int8_drafter, net in ((None, True, LeanEagle3), (None, False, LeanEagle3),
                                           (False, True, type(drafter))):
        model = SelfSpecModel(target, drafter, lean_verify=lean_verify, int8_drafter=int8_drafter)
        assert torch.equal(model.generate(IDS, max_new_tokens=24), expected)
        assert type(model.drafter.net) is net
        if net is LeanEagle3:
            assert (model.drafter.net.head_rows is not None) is int8_drafter
            assert (model.drafter.net.compact[0] is not None) is int8_drafter
    calls = []
    handle = drafter.lm_head.register_forward_hook(lambda *args: calls.append(1))
    try:  # a hook of the user's on the drafter: its forwards go through the modules, which the hook sees
        model = SelfSpecModel(target, drafter)
        assert torch.equal(model.generate(IDS, max_new_tokens=24), expected)
    finally:
        handle.remove()
    assert type(model.drafter.net) is type(drafter) and calls


def test_which_drafters_the_lean_eagle3_forward_refuses():
    import heads

    target = tiny_model("llama")
    assert eagle3_why_not(_eagle3(target)) is None
    assert getattr(heads.build("eagle", target), "lean_forward", None) is None  # EAGLE-1 has none
    assert "input_mode 'project'" in eagle3_why_not(_eagle3(target, input_mode="project"))
    assert "fp32" in eagle3_why_not(_eagle3(target).to(torch.bfloat16))
    assert _eagle3(target).to(torch.bfloat16).lean_forward(16) is None
    with pytest.raises(ValueError, match="LeanEagle3 cannot run this drafter: input_mode 'project'"):
        LeanEagle3(_eagle3(target, input_mode="project"), 0)


def test_a_half_precision_drafter_on_cpu_is_warned_about():
    target = tiny_model("llama")
    model = SelfSpecModel(target, _eagle3(target).half())
    with pytest.warns(UserWarning, match="float16 on CPU, where half-precision matmuls are slow"):
        model.generate(IDS, max_new_tokens=4)


# --------------------------------------------------------------------------- the int8 and int4 self-drafters
def _held(target, draft):
    """The target with each linear weight (the LM head's too, untied from the embedding) replaced by the fp32
    weight its quantized copy in `draft` holds: the function a lean forward of the draft computes, up to rounding."""
    reference = copy.deepcopy(target)
    quantized = {name: m for name, m in draft.named_modules() if isinstance(m, lean_forward.QUANTIZED)}
    assert quantized and all(type(m) is not nn.Linear for m in draft.modules())  # every linear is quantized
    with torch.no_grad():
        for name, module in quantized.items():
            reference.get_submodule(name).weight = nn.Parameter(module.weight_fp32())
    return reference


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [4, 24], ids=["few-rows", "more-than-the-linears-kernel-rows"])
@pytest.mark.parametrize("arch", [*LEAN, "llama-biases"])
def test_quantized_lean_forward_computes_the_quantized_models_function(arch, rows, kind, monkeypatch):
    """The `int8` and `int4` drafters' copies of the target run lean: every layer one kernel call over int8 rows
    or 4-bit groups, at any block size (the modules run blocks of more than 16 rows on torch's int8 kernel with bf16
    activations or the fp32 weight), and the same logits, hidden states and K/V as their weights would give in
    fp32."""
    _kernel()
    whole_layers = _spy_whole_layers(monkeypatch)
    target = _lean_target(arch)
    draft = getattr(self_draft, kind)("", target).model
    if kind == "int4":  # 4-bit groups in the layers, int8 groups in the head
        assert all(type(m) is linear.Int4Linear for m in draft.model.layers.modules() if hasattr(m, "q"))
        assert draft.get_output_embeddings().group
    lean = lean_forward.LeanForward(draft, 0, None, quantized=True)
    block = torch.arange(rows).remainder(90).add(2).view(2, rows // 2)
    depth, ancestors, valid = prompt_tree(torch.ones_like(block, dtype=torch.bool))
    _assert_same_forward(_held(target, draft), lean, block, depth, ancestors, valid)
    assert len(whole_layers) == (0 if arch == "qwen3" else target.config.num_hidden_layers)  # q/k norms: op by op


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_quantized_drafters_draft_lean_and_stay_exact(kind, monkeypatch):
    _kernel()
    target = tiny_model("llama")
    expected = target.generate(IDS, max_new_tokens=30, do_sample=False)
    whole_layers = _spy_whole_layers(monkeypatch)
    model = SelfSpecModel(target, kind)
    assert torch.equal(model.generate(IDS, max_new_tokens=30), expected)
    assert isinstance(model.drafter.lean, lean_forward.LeanForward) and model.drafter.lean.target is model.drafter.model
    # the drafter's lean forward's layers (the target's own verify makes the others): two draft forwards at least
    assert sum(lean is model.drafter.lean for lean in whole_layers) >= 2 * target.config.num_hidden_layers
    # the drafter's own forward where the lean one cannot run it: a GPT-2 target, drafting through its modules
    gpt2 = tiny_model("gpt2")
    model = SelfSpecModel(gpt2, kind)
    assert torch.equal(model.generate(IDS, max_new_tokens=20), gpt2.generate(IDS, max_new_tokens=20, do_sample=False))
    assert model.drafter.lean is None


def _on_gguf_grids(target, layers: str = "q4_1"):
    """`target` with its layers' weights on a GGUF grid (`layers`: Q4_1's, as the embedded SmolLM2's are, or Q8_0's)
    and its LM head on Q8_0's."""
    with torch.no_grad():
        for module in [m for m in target.modules() if type(m) is nn.Linear]:
            module.weight.copy_(on_gguf_grid(module.weight, "q8_0" if module is target.get_output_embeddings()
                                             else layers))
    return target


def test_int4_drafts_the_targets_own_tokens_from_a_gguf_grid():
    """A target whose weights are on GGUF's grids (Q4_1 layers, a Q8_0 head, as the embedded SmolLM2's are) is held
    again exactly by the `int4` drafter, so its drafts are the target's greedy tokens but for float rounding."""
    _kernel()
    target = _on_gguf_grids(tiny_model("llama"))
    draft = self_draft.int4("", target).model
    for name, module in draft.named_modules():
        if isinstance(module, lean_forward.QUANTIZED):
            assert torch.equal(module.weight_fp32(), target.get_submodule(name).weight)
    expected = target.generate(IDS, max_new_tokens=40, do_sample=False)

    def steps_of(kind: str) -> list[tuple[int, int]]:
        """Per verify step of `kind` drafting: the chain's nodes (its root and drafts), and how many were accepted."""
        model, steps = SelfSpecModel(target, kind), []
        model.step_observer = lambda tree, acceptance, budget: steps.append((tree.tokens.shape[1],
                                                                            int(acceptance.length)))
        assert torch.equal(model.generate(IDS, max_new_tokens=40), expected)
        return steps

    steps = steps_of("int4")
    assert steps and all(accepted == nodes for nodes, accepted in steps), steps  # every draft was the target's
    steps = steps_of("int8")  # int8 rows are not GGUF's grid: some of its drafts are not
    assert any(accepted < nodes for nodes, accepted in steps), steps


@pytest.mark.parametrize("layers,stored", [("q4_1", torch.uint8), ("q8_0", torch.int8)])
@pytest.mark.parametrize("rows", [2, 5, 9, 16])
def test_a_target_on_gguf_grids_is_verified_on_them_for_the_same_bits(rows, layers, stored):
    """Blocks of up to 16 rows read a target's layers (4-bit or int8 groups) and its LM head (int8 groups) on the
    GGUF grids they lie on: the same logits, hidden states and K/V, bit for bit, as the kernel gives from the fp32
    weights."""
    _kernel()
    target = _on_gguf_grids(tiny_model("llama"), layers)
    grid = lean_forward.LeanForward(target, 16, linear.PackCache())
    assert all(layer is not None and layer.qkv.weights[0].dtype == stored for layer in grid.compact)
    assert grid.lm_head_grid.weights[0].dtype == torch.int8
    fp32 = lean_forward.LeanForward(target, 16, None)  # no cache to keep the grids in: the fp32 weights
    assert fp32.compact == [None] * target.config.num_hidden_layers and fp32.lm_head_grid is None
    block = torch.arange(2 * rows).remainder(90).add(2).view(2, rows)
    depth, ancestors, valid = prompt_tree(torch.ones_like(block, dtype=torch.bool))
    outs, caches = _forwards_after_prompt(target, (fp32, grid), block, depth, ancestors, valid)
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].hidden_states, outs[1].hidden_states, strict=True))
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_one_row_reads_the_lm_head_on_its_grid_for_the_fp32_kernels_bits():
    """Where the full logits are read (sampling), one row too takes the LM head's int8 groups: the bits the kernel
    gives from the fp32 head, from a quarter of its bytes. An argmax-only forward keeps its int8 argmax head."""
    kernel = _kernel()
    target = _on_gguf_grids(tiny_model("llama"))
    grid = lean_forward.LeanForward(target, 16, linear.PackCache())
    block = torch.tensor([[11], [12]])
    depth, ancestors, valid = prompt_tree(torch.ones_like(block, dtype=torch.bool))
    (out,), _ = _forwards_after_prompt(target, (grid,), block, depth, ancestors, valid)
    final = out.hidden_states[-1].reshape(2, -1)  # after the final norm
    head = target.get_output_embeddings().weight
    assert torch.equal(out.logits.view(2, -1), kernel.few_rows_linear_cat(final, [head], [None]))
    argmax_only = lean_forward.LeanForward(target, 16, linear.PackCache(), argmax_only=True)
    (out,), _ = _forwards_after_prompt(target, (argmax_only,), block, depth, ancestors, valid)
    assert argmax_only.argmax_head is not None and out.logits.isinf().any()  # -inf where no argmax could be
    assert argmax_only.lm_head_grid is None  # and no second copy of the head


def test_generate_verifies_on_the_grids_and_stays_exact(monkeypatch):
    _kernel()
    target = _on_gguf_grids(tiny_model("llama"))
    grids = []
    whole_layer = lean_forward.LeanLayers._whole_layer
    monkeypatch.setattr(lean_forward.LeanLayers, "_whole_layer",
                        lambda self, x, y, layer, *args: grids.append(layer.qkv.weights[0].dtype == torch.uint8)
                        or whole_layer(self, x, y, layer, *args))
    model = SelfSpecModel(target, "ngram")
    assert torch.equal(model.generate(IDS, max_new_tokens=30), target.generate(IDS, max_new_tokens=30, do_sample=False))
    assert grids and all(grids)  # every verify block, one row or a chain, read the grids
    assert all(lean_forward.LeanForward(tiny_model("llama"), 16, linear.PackCache()).compact[i] is None
               for i in range(target.config.num_hidden_layers))  # random weights: no grid


def test_an_int8_lean_forward_refuses_what_it_cannot_run():
    _kernel()
    target = tiny_model("llama")
    with pytest.raises(lean_forward.Unsupported,
                       match="cannot run this quantized model: an LM head other than an int8 or 4-bit one"):
        lean_forward.LeanForward(target, 0, None, quantized=True)  # fp32 linears where quantized ones were promised
    with pytest.raises(lean_forward.Unsupported, match="cannot run this target: a non-standard embedding or lm_head"):
        lean_forward.LeanForward(self_draft.int8("", target).model, 16, linear.PackCache())
    with pytest.raises(ValueError, match="argmax_only"):
        lean_forward.LeanForward(self_draft.int8("", target).model, 0, None, argmax_only=True, quantized=True)
