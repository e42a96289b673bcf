"""Timing this machine: the harness (`median_seconds`: caches evicted before each run on a CPU), a forward over n
new tokens (`forward_cost`, `block_costs`), and the three costs a tree's speed is predicted from, each cached per
machine (`infer.tuning.cache`): one verify forward over the root and 0..N drafted nodes (`verify_costs`), one
drafting step per tree (`draft_costs`), and the engine's own work a step around them (`no_drafts_step`).
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from .. import engine as engine_module
from .. import kv as kv_module
from .. import target as target_module
from .. import verify as verify_module
from ..attention import prompt_tree
from ..cpu import argmax_head, lean_forward, linear
from ..drafters.none import NoDrafter
from ..drafting import TargetStep
from ..kv import KVState, cache_argument, forward_block
from ..sampling import SamplingParams
from ..target import generation_mode, max_positions
from .cache import config_hash, device_name, digest, fingerprint, read_cache, write_cache
from .plan import engine, prepack_default, stream_one_row, stream_rows

MAX_NODES = 64  # the largest tree calibration considers (drafted nodes, the root not counted)
EVICT_BYTES = 128 << 20  # written before each timed CPU run: more than a last-level cache holds


# ---------------------------------------------------------------------------------------------- the harness
@functools.cache
def _eviction_buffer() -> torch.Tensor:
    """Made once per measurement of many timed runs; verify_costs and draft_costs free it when done."""
    return torch.zeros(EVICT_BYTES // 4)


def median_seconds(fn, repeats: int, device: torch.device, after=None) -> float:
    """Median seconds of `fn()` over `repeats` runs after a warm-up; `after()`, untimed, follows each run.

    On a CPU each run starts with its weights out of the caches, as in generation, where the target's forward and
    the drafter's pass evict each other's: timed back to back, a drafter small enough to stay in the last-level
    cache looks cheaper than generation finds it (docs/benchmarks.md, "The engine's cost on a CPU")."""
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        if device.type == "cpu":
            _eviction_buffer().add_(1.0)  # untimed
        times.append(seconds(fn, device))
        if after is not None:
            after()
    return statistics.median(times[1:])


def seconds(fn, device: torch.device) -> float:
    """Seconds of one `fn()`, the device synchronized before and after."""
    _sync(device)
    tic = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - tic


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fitting_context(target, context: int, extra: int) -> int:
    """`context`, shortened where the target's positions cannot hold it plus `extra` tokens."""
    most = max_positions(target.config)
    return max(1, min(context, most - extra)) if most else context


# ---------------------------------------------------------------------------------------------- forwards
def forward_cost(model, context: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one forward over n new tokens after a `context`-token prefix, per n (each timed
    `repeats` times after a warm-up, from evicted caches on a CPU as `median_seconds` times)."""
    vocab = model.config.get_text_config().vocab_size
    device = model.device
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=g).to(device)
    with torch.inference_mode():
        cache = model(prefix, use_cache=True)[cache_argument(model)]
        out = {}
        for n in sizes:
            ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
            pos = torch.arange(context, context + n, device=device)[None]
            kv = [copy.deepcopy(cache)]  # each run extends a fresh copy of the prefix's cache

            def run():
                model(ids, position_ids=pos, use_cache=True, **{cache_argument(model): kv[0]})  # noqa: B023

            out[n] = median_seconds(run, repeats, device, after=lambda: kv.__setitem__(0, copy.deepcopy(cache)))  # noqa: B023
    return out


def block_costs(target, model, context: int, sizes: list[int], repeats: int, batch: int = 1) -> dict[int, float]:
    """Median seconds of `model` (the target or its lean forward) on a chain of n new nodes after a
    `context`-token prompt in the engine's KV cache, per n: mask, forward and cache writes, as a verify step
    runs them (each timed `repeats` times after a warm-up, the block rolled back after each); `batch` rows of
    prompt and chain at once."""
    vocab = target.config.get_text_config().vocab_size
    device = target.device
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (batch, context), generator=g).to(device)
    with torch.inference_mode():
        kv = KVState(batch, device, target.config)
        depth, ancestors, valid = prompt_tree(torch.ones_like(prefix))
        forward_block(target, kv, depth, ancestors, valid, input_ids=prefix, logits_to_keep=1)
        kv.commit_block(0, valid)
        start, out = kv.size, {}
        for n in sizes:
            ids = torch.randint(0, vocab, (batch, n), generator=g).to(device)
            depth, ancestors, valid = prompt_tree(torch.ones_like(ids))
            out[n] = median_seconds(lambda: forward_block(model, kv, depth, ancestors, valid, input_ids=ids),  # noqa: B023 -- run in this iteration
                                     repeats, device, after=lambda: kv.rollback(start))
    return out


def _lean_source_hash() -> str:
    return digest(Path(lean_forward.__file__).read_text() + linear.KERNEL_SOURCE.read_text()
                  + Path(argmax_head.__file__).read_text())


def _engine_source_hash() -> str:
    """The engine's source and its forward's: a step of generation timed with other code is timed anew."""
    sources = "".join(Path(m.__file__).read_text() for m in (engine_module, verify_module, kv_module, target_module))
    return digest(sources + _lean_source_hash())


def verify_costs(target, max_nodes: int = MAX_NODES, *, context: int = 256, repeats: int = 5,
                 prepack: bool | None = None) -> list[float]:
    """Seconds of one verify forward over the root and n = 0..max_nodes drafted nodes on this machine, run as
    the engine runs it by default (its KV cache and tree mask; the lean forward where it applies, else the
    model's own with the prepacked weights where it uses them), cached per target shape, device, threads,
    context and forward (the lean forward's and its kernel's source included: new code is measured anew)."""
    prepack = prepack_default(target, prepack)
    context = fitting_context(target, context, max_nodes + 1)
    streamed, lean, one_row = _verify_setup(target, prepack)
    with generation_mode(target), linear.prepacked_linears(target, enabled=prepack, stream_rows=streamed,
                                                           one_row=one_row):
        fields = {"target": fingerprint(target), "device": device_name(target.device),
                  "threads": torch.get_num_threads(), "context": context, "prepack": prepack,
                  "stream_rows": streamed, "one_row": one_row, "attention": target.config._attn_implementation,  # as generate runs it
                  "forward": f"lean {_lean_source_hash()}" if lean else "transformers", "caches": "evicted"}
        cached = read_cache("verify", fields)
        if cached is not None and len(cached["seconds"]) > max_nodes:
            return cached["seconds"][: max_nodes + 1]
        costs = block_costs(target, _verify_model(target, streamed, lean, one_row), context,
                            list(range(1, max_nodes + 2)), repeats)
    _eviction_buffer.cache_clear()  # its 128 MB are not kept past the measurement
    curve = [costs[n + 1] for n in range(max_nodes + 1)]
    write_cache("verify", fields, {"target_name": getattr(target, "name_or_path", None), "seconds": curve})
    return curve


def _verify_setup(target, prepack: bool) -> tuple[int, bool, bool]:
    """How the engine verifies on this machine: the streamed kernel's largest block (0: none), whether the lean
    forward runs, and whether one fp32 row goes to the streamed kernel (`stream_one_row`)."""
    streamed = stream_rows(target) if prepack else 0
    return streamed, prepack and lean_forward.why_not(target) is None, prepack and stream_one_row(target)


def _verify_model(target, streamed: int, lean: bool, one_row: bool):
    """The forward a verify step runs: greedy, as calibration measures acceptance, so the lean forward reads each
    node's argmax only."""
    return lean_forward.LeanForward(target, streamed, linear.shared_pack_cache(target), argmax_only=True,
                                    one_row=one_row) if lean else target


def batch_costs(target, drafter, tree: dict, nodes: int, batch: int, *, context: int, repeats: int,
                prepack: bool) -> dict[str, float]:
    """Seconds of a step of `batch` rows on this machine: "draft_seconds" of `drafter` (a heads model) drafting
    `tree` (`nodes` drafted nodes a row), "verify_seconds" of the verify forward over the root and those nodes, and
    "no_drafts_verify_seconds" over the root alone, each row after a `context`-token prompt. Cached per target
    shape, drafter, tree, device, threads, context, batch and the engine's source."""
    streamed, lean, one_row = _verify_setup(target, prepack)
    fields = {"target": fingerprint(target), "drafter": config_hash(drafter.config),
              "tree": json.dumps(tree, sort_keys=True), "device": device_name(target.device),
              "threads": torch.get_num_threads(), "context": context, "prepack": prepack, "batch": batch,
              "engine": _engine_source_hash(), "caches": "evicted"}
    cached = read_cache("batch", fields)
    if cached is None:
        with generation_mode(target), linear.prepacked_linears(target, enabled=prepack, stream_rows=streamed,
                                                               one_row=one_row):
            verify = block_costs(target, _verify_model(target, streamed, lean, one_row), context, [1, nodes + 1],
                                 repeats, batch=batch)
        draft = draft_costs(target, drafter, [tree], context=context, repeats=repeats, prepack=prepack,
                            batch=batch)[0]
        _eviction_buffer.cache_clear()
        cached = {"draft_seconds": draft, "verify_seconds": verify[nodes + 1], "no_drafts_verify_seconds": verify[1]}
        write_cache("batch", fields, cached)
    return cached


NO_DRAFTS_TOKENS = (8, 40)  # the two generation lengths `no_drafts_step` takes the difference of


def no_drafts_step(target, *, context: int = 256, repeats: int = 5, prepack: bool | None = None) -> dict[str, float]:
    """A decoding step of generation with no drafts on this machine, split: "forward_seconds" in the target's
    forward over the root, "draft_seconds" in the drafter (`infer.drafters.NoDrafter`: an empty tree), and
    "engine_seconds" in the engine around them (accepting, committing the kept path in the KV cache, emitting,
    bookkeeping), which a step with drafts pays too. The engine with no drafts generates NO_DRAFTS_TOKENS
    new tokens after a `context`-token prompt, timed whole and split by its own statistics; the shorter
    generation is subtracted from the longer, so what each call pays once (the prompt's forward, making the lean
    forward) drops out. The median of `repeats` pairs after a warm-up. Unlike `verify_costs`, the forward is timed
    as this loop runs it, with nothing between the steps to evict the caches. Cached per target shape, device,
    threads, context and the engine's source."""
    prepack = prepack_default(target, prepack)
    context = fitting_context(target, context, max(NO_DRAFTS_TOKENS) + 1)
    fields = {"target": fingerprint(target), "device": device_name(target.device), "threads": torch.get_num_threads(),
              "context": context, "prepack": prepack, "engine": _engine_source_hash()}
    cached = read_cache("no_drafts", fields)
    if cached is not None:
        return {name: cached[name] for name in ("engine_seconds", "forward_seconds", "draft_seconds")}
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(target.device)
    model = engine(target, NoDrafter(), cpu_prepack=prepack, lookup_first=False)
    short, long = NO_DRAFTS_TOKENS

    def split(new_tokens: int) -> tuple[float, float, float, int]:
        wall = seconds(lambda: model.generate(ids, max_new_tokens=new_tokens), target.device)
        stats = model.last_stats
        forward, draft = stats["target_seconds"], stats["draft_seconds"]
        return wall - forward - draft, forward, draft, stats["target_forwards"]

    per_step: dict[str, list[float]] = {"engine_seconds": [], "forward_seconds": [], "draft_seconds": []}
    for i in range(repeats + 1):  # the first pair is a warm-up
        *shorter, n_short = split(short)
        *longer, n_long = split(long)
        if i and n_long > n_short:  # an end-of-sequence token could stop both at once: then the pair tells nothing
            for name, a, b in zip(per_step, shorter, longer, strict=True):
                per_step[name].append((b - a) / (n_long - n_short))
    if not per_step["engine_seconds"]:
        raise RuntimeError(f"every generation from the random {context}-token prompt ended within {short} tokens; "
                           "a step with no drafts could not be timed")
    result = {name: max(statistics.median(values), 0.0) for name, values in per_step.items()}
    write_cache("no_drafts", fields, result)
    return result


def draft_costs(target, drafter, trees: list[dict], *, context: int = 256, repeats: int = 5,
                prepack: bool | None = None, batch: int = 1) -> list[float]:
    """Seconds of one drafting step per tree settings in `trees` on this machine: the drafter (a heads model)
    proposing the tree after a `context`-token prompt, plus observing a step that committed two tokens, run
    as `SelfSpecModel` runs it by default (its lean forward where it has one), for `batch` rows at once.
    Trees drafted alike (dynamic ones differing only in `total_tokens` and drafting the same rows per pass,
    `pass_rows`) are timed once."""
    prepack = prepack_default(target, prepack)
    device = target.device
    context = fitting_context(target, context, 2 * (repeats + 1) + max(tree_depth(t) for t in trees) + 1)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    budget = torch.full((batch,), context, device=device)  # never the limit
    timed, observe = {}, None
    streamed = stream_rows(target) if prepack else 0
    with generation_mode(target), torch.inference_mode(), linear.prepacked_linears(
            target, drafter, enabled=prepack, stream_rows=streamed, one_row=prepack and stream_one_row(target)):
        out = target(ids, output_hidden_states=bool(drafter.feature_layers))
        features = tuple(out.hidden_states[i] for i in drafter.feature_layers)
        ones = torch.ones_like(ids, dtype=torch.bool)
        prompt = TargetStep(ids, ones, features, out.logits[:, -1].argmax(-1))
        accepted = TargetStep(ids[:, -2:], ones[:, -2:], tuple(h[:, -2:] for h in features), prompt.next_tokens)
        keys = []
        for tree in trees:
            step = drafter.as_drafter(**tree)
            key = (_draft_key(tree), step.pass_rows() if hasattr(step, "pass_rows") else ())
            keys.append(key)
            if key in timed:
                continue
            step.lean_forwards(streamed if prepack else None)  # as SelfSpecModel runs it by default
            step.bind(target, SamplingParams(), batch)
            step.observe(prompt)
            if observe is None:
                observe = median_seconds(lambda s=step: s.observe(accepted), repeats, device)
            timed[key] = median_seconds(lambda s=step: s.propose(budget), repeats, device)
    _eviction_buffer.cache_clear()
    return [observe + timed[key] for key in keys]


def tree_depth(tree: dict) -> int:
    """How deep tree settings draft: the longest path of a static tree, the depth of a dynamic one."""
    return max(len(p) for p in tree["paths"]) if tree.get("mode", "static") == "static" else tree["depth"]


def _draft_key(tree: dict) -> str:
    return json.dumps({k: v for k, v in tree.items() if k != "total_tokens"}, sort_keys=True)
