"""The captured step (`SelfSpecModel(..., static_cache=True, captured_step=True)`): the target's verify forward over
static input buffers per node bucket (`infer.cuda.StepGraphs`), captured as CUDA graphs on a GPU, and drafting
without host reads. On a CPU the same buffers run uncaptured: greedy output is the target's own on every drafter
shape and on architectures with masks per layer type, batch 1 and a left-padded batch; sampling stays lossless.
The `gpu` tests capture for real: fp32 greedy identical to transformers', bf16's mismatch rate recorded."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from test_infer import left_pad, prompts
from test_sampling import PROMPT, V, chi_square_p, drafters, exact_joint

import heads
import infer.engine
from infer import SelfSpecModel
from infer.cuda import StepGraphs
from infer.cuda.graphs import _pointers
from infer.kv import VERIFY_BUCKETS
from infer.options import EngineOptions
from infer.policy import captured_step
from infer.sampling import _nucleus

CAPTURED_DRAFTERS = {
    "none": lambda target: "none",
    "ngram": lambda target: "ngram",
    "draft_model": lambda target: perturbed_copy(target),
    "lookahead": lambda target: "lookahead:4,3,4",  # scored nodes beside the tree
    "eagle": lambda target: heads.build("eagle", target),  # a dynamic tree of a fixed size (sync_free)
    "eagle3": lambda target: heads.build("eagle3", target),
    "medusa": lambda target: heads.build("medusa", target),  # a static tree, whole (sync_free)
    "dflash": lambda target: heads.build("dflash", target, block_size=4, tree={"top_k": 3}),  # a block's tree
}


def captured(target, drafter, **options) -> SelfSpecModel:
    return SelfSpecModel(target, drafter, static_cache=True, captured_step=True, **options)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", list(CAPTURED_DRAFTERS))
@pytest.mark.parametrize("arch_name", ["llama", "gemma3_text"])  # one mask for all layers; masks per layer type
def test_captured_step_is_greedy_exact(arch_name, drafter, batch):
    target = tiny_model(arch_name)
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = captured(target, CAPTURED_DRAFTERS[drafter](target))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture would fall back to eager with a warning: not here
        for _ in range(2):  # the second call reuses the cache, its buffers and so its graphs
            got = model.generate(ids, attention_mask=mask, max_new_tokens=24)
            assert torch.equal(got, expected)
    assert model.last_stats["verify_forward"] == "static buffers"
    assert not model.plan.host_acceptance  # acceptance on the device, as on a GPU
    graphs = model._verify_forward
    assert isinstance(graphs, StepGraphs) and graphs._graphs
    # one set of buffers per bucket
    assert {g.inputs["input_ids"].shape[1] for g in graphs._graphs.values()} <= set(VERIFY_BUCKETS)
    if drafter in ("eagle", "eagle3"):  # the drafter's forwards after the prompt's ran on the seam too
        assert model.drafter._captured.calls > 0 and model.drafter._captured._graphs


def test_the_verify_forward_runs_on_the_kept_buffers():
    """Every verify forward reads its inputs from the buffers kept for its bucket, not from the tensors it was
    given: the path a capture replays. They are reused step after step and call after call."""
    target = tiny_model("llama")
    model = captured(target, "ngram")
    seen = []  # the token ids' address of every target forward
    target.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].data_ptr()),
                                     with_kwargs=True)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5]])
    for _ in range(2):
        assert torch.equal(model.generate(ids, max_new_tokens=20), target.generate(ids, max_new_tokens=20,
                                                                                    do_sample=False))
    kept = {g.inputs["input_ids"].data_ptr() for g in model._verify_forward._graphs.values()}
    verify = [ptr for ptr in seen if ptr in kept]
    assert len(verify) == 2 * (model.last_stats["target_forwards"] - 1)  # every forward but the prefills
    assert len(kept) < len(verify)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_the_drafter_forwards_run_on_the_kept_buffers(kind):
    """Every drafter forward but the prompt's (one per call) enters the seam once and reads its inputs from the
    buffers kept for its shape, not from the tensors it was given; its shapes are fixed: a few block widths (the
    draft depths' frontier, observe's padded buckets), and every mask spans the whole static cache, whatever the
    context's length. The cache and its graphs are kept from call to call, and the output is the target's."""
    target = tiny_model("llama")
    drafter = heads.build(kind, target)
    model = captured(target, drafter)
    seen = []  # (token ids' address, token ids' shape, mask's shape) of every drafter forward
    drafter.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0].data_ptr(), tuple(args[0].shape),
                                                  tuple(kwargs["attention_mask"].shape))), with_kwargs=True)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5]])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    own = model.drafter
    for call in range(2):
        assert torch.equal(model.generate(ids, max_new_tokens=20), expected)
        if call == 0:
            kv, graphs = own.kv, dict(own._captured._graphs)
    assert own.kv is kv and own._captured._graphs == graphs  # the second call reused the cache and its graphs
    kept = {g.args[0].data_ptr() for g in graphs.values()}
    on_seam = [s for s in seen if s[0] in kept]
    assert len(on_seam) == own._captured.calls == len(seen) - 2  # all but the two prompts'
    assert len(kept) < len(on_seam) and len(kept) == len(graphs)
    assert {mask[-1] for _, _, mask in on_seam} == {kv.capacity}
    frontier = set(own.pass_rows())
    assert {shape[1] for _, shape, _ in on_seam} <= frontier | {1, 2, 4, 8}
    assert own.sync_free and own.net is own.model  # no lean forward (a CPU's) where forwards are captured


def test_a_static_drafter_cache_grows_between_steps():
    """A context longer than the drafter's first static cache grows it before a step (by doubling, whole steps
    of slots), never inside one; the output stays the target's."""
    from heads.eagle.drafter import STATIC_STEP

    target = tiny_model("llama")
    model = captured(target, heads.build("eagle3", target))
    ids = torch.tensor([[5, 9, 14, 22, 31, 7, 8] * 30])[:, :200]  # with 40 new and a step's drafts: past 256
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=40), expected)
    assert model.drafter.kv.capacity > STATIC_STEP and model.drafter.kv.capacity % STATIC_STEP == 0


def test_the_layers_share_one_buffer_and_one_counter():
    """The static layers' keys and values are views of one buffer (a commit moves every layer's kept slots in one
    gather) and their write counters views of one tensor (set in one op), at addresses kept from call to call, as a
    captured forward needs; the output is still the target's."""
    target = tiny_model("llama")
    model = captured(target, "lookahead:4,3,4")  # guesses off the first branch: commits that move slots
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5]])
    model.generate(ids, max_new_tokens=24)
    kv = model._cache
    layers = kv.cache.layers
    counters = [layer.cumulative_length for layer in layers]
    assert len({c.untyped_storage().data_ptr() for c in counters}) == 1 and len(counters) == 4
    assert [int(c) for c in counters] == [kv.size] * 4
    assert len({t.untyped_storage().data_ptr() for layer in layers for t in (layer.keys, layer.values)}) == 1
    addresses = [(layer.keys.data_ptr(), layer.cumulative_length.data_ptr()) for layer in layers]
    assert torch.equal(model.generate(ids, max_new_tokens=24), target.generate(ids, max_new_tokens=24,
                                                                                do_sample=False))
    assert [(layer.keys.data_ptr(), layer.cumulative_length.data_ptr()) for layer in layers] == addresses


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_model("llama", vocab_size=V, init_std=0.2)


@pytest.mark.parametrize("kind", ["tree", "draft_model", "eagle3"])
def test_captured_step_sampling_is_lossless(sampling_target, kind, monkeypatch):
    monkeypatch.setattr(infer.engine, "VERIFY_ROOM", 32)  # 2,000 rows: small static buffers
    drafter = heads.build("eagle3", sampling_target) if kind == "eagle3" else drafters(sampling_target)[kind]
    model = captured(sampling_target, drafter)
    ids = torch.tensor([PROMPT]).repeat(2000, 1)
    out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, eos_token_id=[],
                         generator=torch.Generator().manual_seed(0))
    assert max(model.last_stats["accepted_lengths"]) >= 2
    p = chi_square_p(exact_joint(sampling_target, PROMPT, 0.7, 5, 1.0), out[:, len(PROMPT):len(PROMPT) + 2])
    assert p > 1e-3, f"captured-step samples differ from the target's distribution (chi-square p={p:.2e})"


@pytest.mark.parametrize("drafter", ["none", "suffix", "eagle3"])
def test_a_seeded_sample_is_the_one_without_drafts(drafter):
    """Deterministic drafts are accepted on the device from draws made before the walk (`accept_drawn`), and the
    draws past the kept path are put back: at batch 1 a seeded sample is the one the host walk draws with no drafts,
    whatever was drafted."""
    target = tiny_model("llama")
    prompt = torch.tensor([[5, 9, 14, 5, 9, 20, 5, 9, 14, 5, 9, 31, 7, 5, 9, 14]])

    def sampled(model, seed):
        out = model.generate(prompt, max_new_tokens=40, do_sample=True, top_p=0.9, eos_token_id=[],
                             generator=torch.Generator().manual_seed(seed))
        return out[0, prompt.shape[1]:].tolist()

    spec = CAPTURED_DRAFTERS[drafter](target) if drafter in CAPTURED_DRAFTERS else drafter
    model = captured(target, spec)
    for seed in range(3):
        assert sampled(model, seed) == sampled(SelfSpecModel(target, "none"), seed)
    if drafter == "suffix":  # drafts were accepted: the rewind was tested, not only the walk
        sampled(model, 0)
        assert model.last_stats["mean_accepted_length"] > 1.5


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_without_a_read_is_the_one_from_the_head(top_p):
    """The sync-free nucleus ranks the whole vocabulary at once: the tokens it keeps are those the head-first search
    keeps, on peaked rows (a nucleus of a few tokens) and flat ones (wider than the first width tried)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.cat([torch.randn(8, 4096, generator=g) * 6, torch.randn(8, 4096, generator=g) * 0.3])
    assert torch.equal(_nucleus(scores, top_p, sync_free=True), _nucleus(scores, top_p))


def test_captured_step_options_are_checked_and_settled():
    with pytest.raises(ValueError, match="captured_step=True needs static_cache"):
        EngineOptions(captured_step=True, static_cache=False)
    with pytest.raises(ValueError, match="captured_step must be True, False or None"):
        EngineOptions(captured_step="yes", static_cache=True)
    target = tiny_model("llama")
    assert not captured_step(target, EngineOptions(static_cache=True))  # None: off on a CPU
    assert not captured_step(target, EngineOptions(static_cache=True, compile=True))
    assert captured_step(target, EngineOptions(static_cache=True, captured_step=True))
    with pytest.raises(ValueError, match="a CUDA graph needs a CUDA target"):
        StepGraphs(target, capture=True)


@pytest.mark.parametrize("drafter", ["none", "eagle3"])
def test_the_fused_captured_step_is_greedy_exact(drafter):
    """`compile=True` with the captured step: the forward its graphs capture is the target's compiled one (inductor,
    no CUDA graphs of its own), run here on the kept buffers uncaptured. Greedy output is the target's own, call after
    call (the second reuses the buffers and their compiled forwards), and the path says what ran."""
    target = tiny_model("llama")
    ids, mask = left_pad(prompts(1))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    model = captured(target, CAPTURED_DRAFTERS[drafter](target), compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile that failed would fall back to eager with a warning: not here
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=16), expected)
    assert model.last_stats["verify_forward"] == "static buffers of the compiled forward"
    graphs = model._verify_forward
    assert graphs.compiled and graphs._run is not target and graphs._graphs
    assert "verify_fallback" not in model.last_stats


# ---------------------------------------------------------------- on a GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("drafter", ["none", "eagle3", "lookahead"])
def test_captured_step_fp32_is_greedy_exact_on_a_gpu(drafter):
    target = tiny_model("llama").cuda()
    ids, mask = left_pad(prompts(3))
    ids, mask = ids.cuda(), mask.cuda()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    model = SelfSpecModel(target, CAPTURED_DRAFTERS[drafter](target), static_cache=True)  # captured by default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=32), expected)
    assert model.last_stats["verify_forward"] == "cuda graphs"
    graphs = model._verify_forward
    assert all(g.graph is not None for g in graphs._graphs.values())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("drafter", ["none", "eagle3"])
def test_the_fused_captured_step_is_greedy_exact_on_a_gpu(drafter):
    """fp32: the graphs replay the compiled forward (`compile=True`, the default captured step on a GPU), and give
    transformers' output, call after call."""
    target = tiny_model("llama").cuda()
    ids, mask = left_pad(prompts(3))
    ids, mask = ids.cuda(), mask.cuda()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    model = SelfSpecModel(target, CAPTURED_DRAFTERS[drafter](target), static_cache=True, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=32), expected)
    assert model.last_stats["verify_forward"] == "cuda graphs of the compiled forward"
    assert all(g.graph is not None for g in model._verify_forward._graphs.values())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_the_captured_drafter_is_the_uncaptured_one_on_a_gpu(kind):
    """fp32 greedy: the drafter's forwards replayed as CUDA graphs give the output of the same step uncaptured
    (and transformers'), call after call, on a batch whose rows finish at different steps (rows dropped: a new
    cache, captured anew)."""
    target = tiny_model("llama").cuda()
    ids, mask = left_pad(prompts(3))
    ids, mask = ids.cuda(), mask.cuda()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    drafter = heads.build(kind, target).cuda()
    plain = SelfSpecModel(target, drafter, static_cache=True, captured_step=False)
    assert torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=32), expected)
    model = SelfSpecModel(target, drafter, static_cache=True)  # captured by default on a GPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=32), expected)
    graphs = model.drafter._captured
    assert graphs.capture and graphs.calls > 0 and all(g.graph is not None for g in graphs._graphs.values())


@pytest.mark.gpu
@gpu
def test_captured_step_bf16_mismatch_rate_on_a_gpu(record_property):
    """bf16 verifies many nodes in one forward where generate runs one: kernels reduce in another order and near
    ties can flip. Not asserted identical; the share of prompts whose output differs is recorded."""
    target = tiny_model("llama").cuda().to(torch.bfloat16)
    model = SelfSpecModel(target, "lookahead:4,3,4", static_cache=True)  # blocks of many nodes: the case at risk
    differ = 0
    for seed in range(8):
        ids = torch.tensor([prompts(1, seed=seed)[0]], device="cuda")
        expected = target.generate(ids, max_new_tokens=32, do_sample=False)
        differ += not torch.equal(model.generate(ids, max_new_tokens=32), expected)
    record_property("bf16_prompts_differing", f"{differ}/8")
    print(f"bf16 captured step: {differ}/8 prompts differ from transformers' greedy")


def test_the_captured_static_path_is_the_default_on_one_cuda_device_only(monkeypatch):
    """Settled without a GPU: the policy reads the devices the weights lie on (`target_devices`), stood in for here."""
    from dataclasses import replace

    from infer import policy
    from infer.options import EngineOptions
    from infer.tuning import plan

    target = tiny_model("llama")
    def on(*names):
        for module in (plan, policy):
            monkeypatch.setattr(module, "target_devices", lambda t: {torch.device(n) for n in names})

    options = EngineOptions()
    assert options.static_cache is None
    on("cuda:0")
    assert plan.static_cache_for(target, options) is True
    assert policy.captured_step(target, replace(options, static_cache=True))
    # with compile, the graphs capture the compiled forward: the fused captured step
    assert policy.captured_step(target, replace(options, static_cache=True, compile=True))
    assert plan.static_cache_for(target, replace(options, static_cache=False)) is False  # as asked
    for spread in (("cuda:0", "cuda:1"), ("cuda:0", "cpu")):  # split, or offloaded by accelerate's device_map
        on(*spread)
        assert plan.static_cache_for(target, options) is False
        assert not policy.captured_step(target, replace(options, static_cache=True))
        with pytest.raises(ValueError, match="a CUDA graph replays one device's work"):
            policy.captured_step(target, replace(options, static_cache=True, captured_step=True))
    on("cpu")
    assert plan.static_cache_for(target, options) is False and not policy.captured_step(target, options)
    assert plan.static_cache_for(target, replace(options, captured_step=True)) is True  # what capture needs


def test_an_offloaded_target_counts_its_offload_device():
    from infer.tuning.plan import target_devices

    target = tiny_model("llama")
    assert target_devices(target) == {torch.device("cpu")}
    target.hf_device_map = {"model.layers.0": 0, "model.layers.1": "disk"}
    assert torch.device("cpu") in target_devices(target)


def test_free_cache_frees_the_kv_memory_the_graphs_held():
    """A replay's output holds the cache it wrote (the model output's past_key_values): free_cache drops the graphs
    and the drafter's captured forwards with the cache, so the KV buffers are freed."""
    import gc
    import weakref

    target = tiny_model("llama")
    model = captured(target, heads.build("eagle3", target))
    ids, mask = left_pad(prompts(2))
    first = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    keys = weakref.ref(model._cache.cache.layers[0].keys)
    drafter_cache = weakref.ref(model.drafter._static_kv)
    model.free_cache()
    gc.collect()
    assert keys() is None and drafter_cache() is None
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12), first)  # a fresh cache and seam


class PoolStandIn(StepGraphs):
    """What a shared CUDA graph pool may do, on a CPU: every forward through the seam leaves the outputs of all
    earlier forwards (any graph's, its own included) overwritten, here with NaN, as a replay may overwrite memory
    the pool gives another graph's outputs; and each kept graph's inputs stay at the addresses they had when it
    was made, as a captured graph reads them."""

    poisoned = 0  # outputs overwritten, over all instances: a test that poisoned nothing tested nothing

    def __call__(self, *args, **inputs):
        for graph in self._graphs.values():
            for tensor in _output_tensors(graph.output):
                tensor.fill_(float("nan"))
                PoolStandIn.poisoned += 1
            assert getattr(graph, "frozen", None) in (None, _pointers([*graph.args, *graph.inputs.values()]))
        return super().__call__(*args, **inputs)

    def _forward(self, graph, *rest):
        graph.output = super()._forward(graph, *rest)
        graph.frozen = _pointers([*graph.args, *graph.inputs.values()])
        return graph.output


def _output_tensors(output) -> list[torch.Tensor]:
    """The logits and hidden states of a model output (never its cache, which the step commits from)."""
    if output is None:
        return []
    found = [output.logits] if getattr(output, "logits", None) is not None else []
    for name in ("hidden_states", "last_hidden_state"):
        value = getattr(output, name, None)
        found += [value] if isinstance(value, torch.Tensor) else list(value or ())
    return [t for t in found if t.is_floating_point()]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", list(CAPTURED_DRAFTERS))
def test_the_step_never_reads_an_output_a_later_forward_may_have_overwritten(drafter, batch, monkeypatch):
    monkeypatch.setattr(infer.cuda, "StepGraphs", PoolStandIn)
    target = tiny_model("llama")
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = captured(target, CAPTURED_DRAFTERS[drafter](target))
    assert isinstance(model._verify_forward, PoolStandIn)
    before = PoolStandIn.poisoned
    for _ in range(2):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24), expected)
    assert PoolStandIn.poisoned > before


def test_the_pool_stand_in_overwrites_what_an_earlier_forward_returned():
    """The stand-in bites: an output kept past the next forward through the seam reads NaN."""
    target = tiny_model("llama")
    model = captured(target, "none")
    model._verify_forward = seam = PoolStandIn(target)
    ids = torch.tensor([[5, 9, 14]])
    model.generate(ids, max_new_tokens=3)
    kept = next(g.output.logits for g in seam._graphs.values() if g.output is not None)
    assert not kept.isnan().any()
    model.generate(ids, max_new_tokens=3)
    assert kept.isnan().all()
