"""The target's verify forward as one CUDA graph per node bucket, over the static KV cache.

A verify step of a transformers model launches hundreds of small kernels from Python (a few per layer per op), and
on a GPU at batch 1 their launches, not the weights' bytes, bound the step. Captured once per block shape and
replayed, the whole forward is one launch. What a capture needs, the static cache gives: the KV buffers, the layers'
write counters (`StaticLayer.cumulative_length`, device tensors) and the attention masks
(`infer.kv.KVState.mask` writes each block size's into one kept buffer) keep their addresses from step to step, and
a verify block is padded to one of a few node counts (`infer.engine.VERIFY_BUCKETS`). The rest of the forward's
inputs (token ids, position ids, cache positions) are copied into buffers kept per bucket.

With `compiled`, the forward captured is the target's compiled one (`torch.compile`, inductor's fused kernels without
its own CUDA graphs): a verify forward of a few fused kernels instead of ~1,200 small ones, replayed as one launch.

`StepGraphs` stands where the target's forward would: `KVState.forward` calls it with the target's keywords. An
EAGLE drafter's forwards go through one of their own the same way (`heads.eagle.drafter.EagleDrafter.capture_forwards`):
a draft depth's block has the tree's fixed frontier width and observe's is padded to a power of two, over a static
drafter cache, so they too are a few shapes.
Without CUDA (`capture=False`), it runs the target on the same kept buffers uncaptured: the path the tests check on
a CPU, token for token against transformers' generate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Uncaptured runs before a capture: kernels that pick an algorithm or allocate a workspace on first use (cuBLAS,
# sdpa) do so outside the graph.
WARMUP_RUNS = 2


@dataclass
class _Graph:
    """One bucket's kept input buffers, and its graph (None: run uncaptured) with the outputs it writes."""

    args: tuple  # the forward's positional tensors (a drafter's token ids and hidden states), each [B, S, ...]
    inputs: dict  # its tensor keywords: input_ids, position_ids [B, S]; cache_position [S]
    graph: torch.cuda.CUDAGraph | None = None
    output: object = None  # the model output whose tensors the graph overwrites at every replay


class StepGraphs:
    """A model's forward over a static KV cache, captured per block shape (`capture`, default: on a CUDA device):
    the target's verify forward, or an EAGLE drafter's forwards (`heads.eagle.drafter.EagleDrafter`).

    Called as the model is by `infer.kv.KVState.forward`: positional tensors, the attention mask (a kept buffer per
    block size), the cache under the model's keyword, and tensor keywords (token ids, position ids, cache
    positions), each copied into a buffer kept per key. A graph is kept per (input shapes, mask buffers, other
    keywords such as the hidden states asked) over one cache's buffers: a new static cache (another batch size, a
    grown cache, rows dropped) drops them all and captures anew, and so does a new mask buffer, so a replay never
    writes into buffers that are gone. The output of a replay is overwritten by the next one of any of its graphs
    (they share one memory pool): read it before the next forward."""

    def __init__(self, target, capture: bool | None = None, compiled: bool = False):
        self._orig_mod = target  # where `infer.kv.cache_argument` looks for the model class
        self.capture = target.device.type == "cuda" if capture is None else capture
        if self.capture and target.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA target; this one is on {target.device}")
        # `compiled`: the forward captured is the target's through torch.compile, fixed shapes (a graph per block
        # shape, as the capture keys them), inductor's fused kernels without its own CUDA graphs, which would capture
        # the same forward a second time. A function calling the target is compiled, not the module, which would
        # leave a flag on the user's model.
        self.compiled = compiled
        self._run = torch.compile(lambda *args, **kwargs: target(*args, **kwargs), dynamic=False) if compiled \
            else target
        self._graphs: dict[tuple, _Graph] = {}  # by input shapes, mask buffers and other keywords
        self._cache_key: tuple | None = None  # the KV buffers and counters the graphs were captured over
        self._pool = None  # one memory pool for all keys: one forward replays one graph, whose outputs it reads first
        self.calls = 0  # forwards run through the kept buffers (replayed or not), for tests

    @property
    def dtype(self) -> torch.dtype:
        return self._orig_mod.dtype

    def release(self) -> None:
        """Forget every graph, its kept buffers and outputs, and the memory pool: what they held is freed once
        nothing else holds it (the engine's `free_cache`)."""
        self._graphs.clear()
        self._cache_key = None
        self._pool = None

    def __call__(self, *args, attention_mask, **inputs):
        # args: positional tensors [B, S, ...]; attention_mask: [B, 1, S, capacity] or one per layer type; inputs:
        # the cache (under the model's keyword), tensor keywords (input_ids, position_ids [B, S], cache_position
        # [S]) and plain ones (use_cache, output_hidden_states)
        name = next(k for k in inputs if k in ("cache", "past_key_values"))
        cache = inputs.pop(name)
        # the KV buffers and write counters by the first layer's and the last one's: the cache replaces all or none
        # of them (a new cache, a grown one, rows dropped), and a look at every layer would be a loop over layers
        # each step
        layers = cache.layers
        buffers = [t for layer in (layers[0], layers[-1]) for t in (layer.keys, layer.values, layer.cumulative_length)] \
            if layers and all(getattr(layer, "is_initialized", False) for layer in (layers[0], layers[-1])) else []
        cache_key = _pointers(buffers)
        if cache_key != self._cache_key:  # graphs over another cache's buffers never replay again: free them
            self._graphs.clear()
            self._cache_key = cache_key
        tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        plain = tuple(sorted((k, v) for k, v in inputs.items() if k not in tensors))
        key = (tuple((tuple(a.shape), a.dtype) for a in args), tuple((k, tuple(v.shape), v.dtype)
                                                                    for k, v in sorted(tensors.items())),
               _pointers(attention_mask), plain)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(tuple(a.clone() for a in args),
                                               {k: v.clone() for k, v in tensors.items()})
            if self.capture:
                self._record(graph, attention_mask, cache, name, dict(plain))
        for kept, given in zip(graph.args, args, strict=True):
            kept.copy_(given)
        for k, given in tensors.items():
            graph.inputs[k].copy_(given)
        self.calls += 1
        if graph.graph is None:
            return self._forward(graph, attention_mask, cache, name, dict(plain))
        graph.graph.replay()
        return graph.output

    def _forward(self, graph: _Graph, attention_mask, cache, name: str, plain: dict):
        return self._run(*graph.args, attention_mask=attention_mask, **{name: cache}, **graph.inputs, **plain)

    def _record(self, graph: _Graph, attention_mask, cache, name: str, plain: dict) -> None:
        """Warm up on a side stream, then capture one forward. Both advance the layers' write counters and write
        the block's slots, which are uncommitted: the counters are put back, and the replay that follows writes
        the slots anew."""
        with torch.cuda.device(self._orig_mod.device):  # the target's device, not the current one (cuda:1 ...)
            self._capture(graph, attention_mask, cache, name, plain)

    def _capture(self, graph: _Graph, attention_mask, cache, name: str, plain: dict) -> None:
        counters = [layer.cumulative_length for layer in cache.layers if hasattr(layer, "cumulative_length")]
        saved = [c.clone() for c in counters]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._forward(graph, attention_mask, cache, name, plain)
                for c, s in zip(counters, saved, strict=True):
                    c.copy_(s)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=self._pool):
            graph.output = self._forward(graph, attention_mask, cache, name, plain)
        for c, s in zip(counters, saved, strict=True):  # capture records the counters' advance without running it
            c.copy_(s)


def _pointers(tensors) -> tuple:
    """The addresses, shapes and dtypes of a tensor, a dict of them (masks per layer type) or a list."""
    if isinstance(tensors, torch.Tensor):
        return ((tensors.data_ptr(), tuple(tensors.shape), tensors.dtype),)
    if isinstance(tensors, dict):
        return tuple((name, *_pointers(t)) for name, t in sorted(tensors.items()))
    return tuple(p for t in tensors for p in _pointers(t))
