"""Trees calibrated to the machine and the drafter.

A trained drafter's tree is worth what it gains per second: (1 + E[accepted drafts]) / (draft cost + verify
cost) per step. The first factor belongs to the drafter and the data, the second to the machine, so they
are measured apart:

1. acceptance (`measure_acceptance`): the drafter drafts a wide tree on held-out prompts through
   `SelfSpecModel` (greedy), and an `AcceptanceRecorder` counts which nodes the target accepts: per path of
   sibling ranks for a static tree, per rank in the drafter's score order for EAGLE-2's dynamic tree.
   Greedy acceptance does not depend on the machine, so the statistics are stored with the drafter
   (`config.calibration`, written by `scripts/calibrate.py --write`).
2. cost (`verify_costs`, `draft_costs`, `no_drafts_step`): one verify forward over 1..64 drafted nodes plus
   the root, with the prepacked weights the engine uses, one drafting step per candidate tree, and a step of
   generation with no drafts, which gives the engine's own work a step around the forward and the drafter,
   timed on this machine. The verify curve and the step with no drafts are cached per target shape, device
   name, torch threads and context (`$SELFSPEC_CACHE/calibration`, default ~/.cache/selfspec/calibration).
3. choice (`heads.trees.candidate_trees`, `best_prediction`): for every tree of N = 1..64 nodes the
   statistics predict E[accepted], and the one with the highest predicted tokens/s wins. Beside it, generation
   with no drafts (`predict_no_drafts`), so the choice says whether drafting pays.
4. prompt lookup first (`measure_lookup_first`): the chosen tree generates the prompts alone and with prompt
   lookup first, timed, interleaved; `--write` records whether lookup first was faster in the drafter's
   `config.lookup_first`, the default `SelfSpecModel` follows.

5. several rows (`predict_batch`): the tree is chosen for one row, but every row of a batch adds its nodes to the
   verify forward, so at a call's batch size its verify and drafting step are timed again beside the root alone;
   `SelfSpecModel` drafts a call of several rows only where that predicts drafting to be faster (`draft_batches`).

`SelfSpecModel(target, drafter, tree="calibrated")` runs 2 and 3 on first use (`calibrated_tree`) and
caches the choice, so a drafter calibrated once picks its tree again on every machine it runs on. A
calibrated dynamic tree drafts without the early stop (`min_confidence` 0): the statistics are of the full
tree. Greedy output never depends on the tree; only the speed does.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from heads.trees import NO_DRAFTS, Candidate, Prediction, best_prediction, candidate_trees, prior_paths

from . import argmax_head, cpu_linear, lean_forward
from . import engine as engine_module
from . import kv as kv_module
from . import verify as verify_module
from .drafters.none import NoDrafter
from .drafting import TargetStep
from .embedded import cache_dir
from .engine import SelfSpecModel, _generation_mode, _max_positions
from .kv import KVState, cache_argument, forward_block, prompt_tree
from .sampling import SamplingParams

MAX_NODES = 64  # the largest tree calibration considers (drafted nodes, the root not counted)
WIDE = 128  # drafted nodes of the tree acceptance is measured on; candidate trees are its subsets
PROMPT_FIELDS = ("turns", "prompt", "instruction")  # where a prompt file's objects hold the prompt
PROMPT_HELP = ("one prompt per line: a JSON string, or an object with 'turns' (MT-bench/Spec-Bench: the "
               "first turn is used), 'prompt', or 'instruction' (Alpaca, with an optional 'input')")


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(path: str | Path) -> list[str]:
    """Held-out prompts from a .jsonl file (see PROMPT_HELP) or a .json array of the same items."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}; pass --prompts with held-out prompts: {PROMPT_HELP}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8 "
                         "JSON Lines") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}); fix line "
                             f"{err.lineno}") from None
        prompts = [_prompt(item, f"{path}: element {i} of the array") for i, item in enumerate(items)]
    else:
        prompts = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}, column {err.colno}); fix or remove "
                                 f"line {number} (JSON Lines: {PROMPT_HELP})") from None
            prompts.append(_prompt(item, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path} holds no prompts (the file is empty); write {PROMPT_HELP}")
    return prompts


def _prompt(item, where: str) -> str:
    if isinstance(item, dict):
        field = next((f for f in PROMPT_FIELDS if f in item), None)
        if field is None:
            raise ValueError(f"{where}: an object without any of {list(PROMPT_FIELDS)} (it has {sorted(item)}); "
                             f"write {PROMPT_HELP}")
        value = item[field]
        if field == "turns":
            value = value[0] if isinstance(value, list) and value else None
        elif field == "instruction" and item.get("input"):
            value = f"{value}\n\n{item['input']}" if isinstance(value, str) else value
        item = value
        if not isinstance(item, str):
            raise ValueError(f"{where}: {field!r} must hold text (turns: a non-empty list of strings), got "
                             f"{item!r:.60}")
    if not isinstance(item, str):
        raise ValueError(f"{where}: a JSON {type(item).__name__}, not a prompt; write {PROMPT_HELP}")
    if not item.strip():
        raise ValueError(f"{where}: the prompt is empty; fill it in or remove it")
    return item


def encode_prompts(tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """[1, T] ids per prompt: a one-turn chat through the tokenizer's template when it has one, else the text."""
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    return [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]


# ---------------------------------------------------------------------------------------------- acceptance
class AcceptanceRecorder:
    """A `SelfSpecModel` step observer counting which drafted nodes the target accepts.

    Static trees: per path (node i of the verified tree is path i - 1 in `tree_from_paths` order, the order
    every static drafter builds). Dynamic trees: per rank of the node in the drafter's score order among the
    nodes no deeper than d, for every depth limit d (a tree drafted d deep keeping its N best nodes keeps
    ranks 0..N-1). A row whose tree the token budget cut (a generation's last steps) is left out of the
    statistics, as its deep nodes were never drafted; `accepted` lists every row's accepted drafts."""

    def __init__(self, mode: str, *, paths: list | None = None, depth: int | None = None,
                 max_nodes: int = MAX_NODES):
        if mode not in ("static", "dynamic"):
            raise ValueError(f"mode must be 'static' or 'dynamic', got {mode!r}")
        self.mode, self.max_nodes = mode, max_nodes
        if mode == "static":
            self.paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
            self.hits = torch.zeros(len(self.paths), dtype=torch.float64)
            self.depth = max(len(p) for p in self.paths)
        else:
            self.hits = torch.zeros(depth, max_nodes, dtype=torch.float64)  # [depth limit, rank]
            self.depth = depth
        self.steps = 0  # (step, row) pairs counted
        self.counted_accepted = 0  # drafted tokens accepted in them
        self.accepted: list[int] = []  # drafted tokens accepted per (step, row), in the engine's order

    def __call__(self, tree, acc, budget) -> None:
        # budget: [B] the depth each row's tree was cut to
        lengths = acc.length.tolist()
        self.accepted.extend(n - 1 for n in lengths)
        whole = (budget >= self.depth) & tree.valid.all(1)  # [B]
        if not whole.any():
            return
        if self.mode == "static" and tree.num_nodes != len(self.paths) + 1:
            raise ValueError(f"the drafter verified {tree.num_nodes - 1} nodes, not the {len(self.paths)} paths "
                             "being calibrated: pass it the same static tree")
        if self.mode == "dynamic" and tree.scores is None:
            raise ValueError("dynamic calibration ranks nodes by the drafter's scores, and this drafter's trees "
                             "carry none: calibrate EAGLE's dynamic tree, or a static tree (mode='static')")
        depth = tree.depth_and_ancestors()[0] if self.mode == "dynamic" else None
        for row in whole.nonzero()[:, 0].tolist():
            nodes = acc.path[row, 1:lengths[row]].cpu()  # accepted drafted nodes, shallowest first
            self.steps += 1
            self.counted_accepted += len(nodes)
            if self.mode == "static":
                self.hits[nodes - 1] += 1
            else:
                self._count_ranks(tree.scores[row].cpu(), depth[row].cpu(), nodes)

    def _count_ranks(self, scores: torch.Tensor, depth: torch.Tensor, nodes: torch.Tensor) -> None:
        # scores, depth: [N] per node of the verified tree; nodes: the accepted drafted ones
        order = scores[1:].sort(descending=True, stable=True).indices + 1  # drafted nodes, best first (keep_best's)
        for limit in range(1, self.hits.shape[0] + 1):
            ranked = order[depth[order] <= limit]
            rank = torch.full_like(scores, -1, dtype=torch.long)
            rank[ranked] = torch.arange(len(ranked))
            r = rank[nodes]
            r = r[(r >= 0) & (r < self.max_nodes)]
            self.hits[limit - 1, r] += 1

    def statistics(self) -> dict:
        """{"mode", "steps", "mean_accepted" (drafts per counted step, the wide tree's) and "p_accept"
        (static, per path) or "p_rank" (dynamic, per depth limit and rank)}."""
        if self.steps == 0:
            raise ValueError("no verify step could be counted (every tree was cut by the token budget): give "
                             "more prompts or a larger max_new_tokens")
        p = [round(x, 6) for x in (self.hits / self.steps).flatten().tolist()]
        out = {"mode": self.mode, "steps": self.steps, "mean_accepted": round(self.counted_accepted / self.steps, 6)}
        if self.mode == "static":
            return {**out, "p_accept": p}
        width = self.hits.shape[1]
        return {**out, "p_rank": [p[i:i + width] for i in range(0, len(p), width)]}


def calibratable(config) -> bool:
    """Whether calibration can choose this drafter's tree: static paths or EAGLE's dynamic tree (a block
    drafter's chain has no paths to choose among)."""
    return "paths" in config.TREE_DEFAULTS


def wide_tree(config, mode: str | None = None, *, wide: int = WIDE, depth: int | None = None,
              top_k: int | None = None) -> dict:
    """The tree settings acceptance is measured on: the `wide` best paths of a generous prior for a static
    tree (Medusa, EAGLE-1), or for EAGLE-2's dynamic tree its `wide` best-scored nodes. `depth` and `top_k`
    default to the drafter's own; the early stop is off (its tree would depend on the confidence)."""
    tree, known = config.tree, config.TREE_DEFAULTS
    if not calibratable(config):
        raise ValueError(f"calibration chooses static paths or EAGLE's dynamic tree; a {config.model_type} "
                         f"drafter's tree has settings {sorted(known)}")
    dynamic_capable = "mode" in known
    mode = mode or (tree["mode"] if dynamic_capable else "static")
    if mode == "dynamic" and not dynamic_capable:
        raise ValueError(f"a {config.model_type} drafter drafts static trees only; calibrate with mode='static'")
    if mode == "dynamic":
        return {"mode": "dynamic", "top_k": top_k or tree["top_k"],
                "depth": depth or max(tree["depth"], _measured_depth(config)), "total_tokens": wide,
                "min_confidence": 0.0}
    if mode != "static":
        raise ValueError(f"calibration mode must be 'static' or 'dynamic', got {mode!r}")
    if depth is None:
        depth = max(len(p) for p in tree["paths"]) if tree.get("paths") else tree["depth"]
    paths = [list(p) for p in prior_paths(depth, wide, top1=0.8, decay=0.9, spread=0.3)]
    return {"mode": "static", "paths": paths, "min_confidence": 0.0} if dynamic_capable else {"paths": paths}


def _measured_depth(config) -> int:
    """The deepest tree an earlier calibration measured acceptance on (0: none). `--write` stores the tree it
    chose, which may be shallow on a machine where verifying is dear; measuring again only that deep would
    keep a later calibration, on a machine where deeper trees pay, from ever seeing them."""
    measured = (getattr(config, "calibration", None) or {}).get("measured") or []
    return max((_depth(m["tree"]) for m in measured if "tree" in m), default=0)


def measure_acceptance(target, drafter, prompts: list[torch.Tensor], tree: dict, *, max_new_tokens: int = 64,
                       max_nodes: int = MAX_NODES, tokenizer=None, prepack: bool | None = None) -> dict:
    """Greedy generation of every prompt ([1, T] ids) with `drafter` (a heads model) drafting `tree`; the
    acceptance statistics as one entry of `config.calibration["measured"]`."""
    mode = tree.get("mode", "static")
    if mode == "dynamic" and tree["total_tokens"] < max_nodes:
        raise ValueError(f"a dynamic tree keeping {tree['total_tokens']} nodes cannot rank {max_nodes}: measure "
                         f"with total_tokens >= max_nodes")
    recorder = AcceptanceRecorder(mode, paths=tree.get("paths"), depth=tree.get("depth"), max_nodes=max_nodes)
    model = SelfSpecModel(target, drafter, tokenizer=tokenizer, tree=tree, cpu_prepack=prepack,
                          lookup_first=False, step_observer=recorder, draft_batches=True)  # the recorder needs drafts
    for ids in prompts:
        model.generate(ids, max_new_tokens=max_new_tokens)
    return {**recorder.statistics(), "tree": tree}


def measure_lookup_first(target, drafter, prompts: list[torch.Tensor], tree: dict, *, max_new_tokens: int = 64,
                         tokenizer=None, prepack: bool | None = None) -> dict:
    """Whether prompt lookup first (`infer.drafters.LookupFirstDrafter`) makes `drafter` (a heads model)
    drafting `tree` faster on this machine, and whether drafting pays at all: greedy generation of every prompt
    three ways, the drafter alone, with lookup first, and with no drafts (`infer.drafters.NoDrafter`: one token a
    target forward through the same engine), interleaved prompt by prompt with the order turning, after a warm-up
    of each. Returns per way the new tokens, target forwards and seconds; `pays`: lookup first made more tokens a
    second than the drafter alone; `drafting_pays`: the faster of those two made more than no drafts. Unlike the
    tree, this is a timing of whole generations, so it holds for the machine it ran on."""
    if not prompts:
        raise ValueError("measuring prompt lookup first needs at least one held-out prompt")
    models = {way: SelfSpecModel(target, drafter, tokenizer=tokenizer, tree=tree, cpu_prepack=prepack,
                                 lookup_first=way == "lookup_first") for way in ("alone", "lookup_first")}
    models["no_drafts"] = SelfSpecModel(target, NoDrafter(), tokenizer=tokenizer, cpu_prepack=prepack)
    totals = {way: {"new_tokens": 0, "target_forwards": 0, "seconds": 0.0} for way in models}
    for model in models.values():
        model.generate(prompts[0], max_new_tokens=min(8, max_new_tokens))
    ways = list(models)
    for i, ids in enumerate(prompts):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            run = functools.partial(models[way].generate, ids, max_new_tokens=max_new_tokens)
            totals[way]["seconds"] += _seconds(run, target.device)
            stats = models[way].last_stats
            totals[way]["new_tokens"] += stats["new_tokens"]
            totals[way]["target_forwards"] += stats["target_forwards"]
    for entry in totals.values():
        entry["tokens_per_second"] = entry["new_tokens"] / entry["seconds"]
    speed = {way: entry["tokens_per_second"] for way, entry in totals.items()}
    return {**totals, "pays": speed["lookup_first"] > speed["alone"],
            "drafting_pays": max(speed["alone"], speed["lookup_first"]) > speed["no_drafts"], "tree": tree,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "device": device_name(target.device),
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------- costs
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


STREAM_SIZES = (2, 4, 8, 16, 32)  # block rows at which the two multi-row kernels are compared
# A near-tie goes to the streamed kernel: this comparison times each weight alone, but the verify forward also
# fuses q/k/v and gate/up into one streamed call and runs its norms and rotary in the same kernel, none of which
# oneDNN's path has. Measured here (2026-11-26): a 2-row tie lost by 1% (27.8 against 27.5 ms) set 0 rows,
# and the whole verify step went from about 32 to 42 ms over 80 MT-bench questions.
STREAM_TIE = 0.05


def stream_rows(model, *, repeats: int = 3) -> int:
    """Up to how many rows the streamed kernel (`cpu_linear.few_rows_linear`) multiplies `model`'s linear
    weights faster than oneDNN's packed GEMM on this machine (0: at none, or it could not be built).

    Every linear weight of the model is multiplied by a block of n random rows, in model order, so the
    weights stream from memory as in a forward; each kernel is timed at n in STREAM_SIZES, the median of
    `repeats` runs after a warm-up, the two kernels alternating. The answer is `choose_stream_rows`'s,
    cached per model shape, device, threads and kernel source."""
    weights = [m.weight.detach() for m in model.modules()
               if type(m) is torch.nn.Linear and cpu_linear._plain(m.weight)]
    if not weights or weights[0].device.type != "cpu" or not cpu_linear.available():
        return 0
    fields = {"model": _fingerprint(model), "device": device_name(weights[0].device),
              "threads": torch.get_num_threads(), "kernel": _hash(cpu_linear.KERNEL_SOURCE.read_text()),
              "tie": STREAM_TIE}  # a cache written under another rule is measured anew
    cached = _read_cache("stream_rows", fields)
    if cached is not None:
        return cached["rows"]
    kernel = cpu_linear.streamed_kernel()
    if kernel is None:
        return 0
    packed = cpu_linear.PackCache()
    seconds = {"streamed": {}, "onednn": {}}
    runs = {  # inputs: in_features -> [n, in_features]
        "streamed": lambda inputs: [kernel.few_rows_linear(inputs[w.shape[1]], w, None) for w in weights],
        "onednn": lambda inputs: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed.get(w), None,
                                                                     "none", [], "") for w in weights],
    }
    with torch.inference_mode():
        for n in STREAM_SIZES:
            inputs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
            times = {name: [] for name in runs}
            for _ in range(repeats + 1):  # the kernels alternate, so a slow spell of the machine hits both
                for name, run in runs.items():
                    tic = time.perf_counter()
                    run(inputs)
                    times[name].append(time.perf_counter() - tic)
            for name in runs:  # the first run is a warm-up (it packs oneDNN's weights)
                seconds[name][n] = statistics.median(times[name][1:])
    rows = choose_stream_rows(seconds)
    _write_cache("stream_rows", fields, {"rows": rows, "seconds": seconds})
    return rows


def choose_stream_rows(seconds: dict[str, dict[int, float]]) -> int:
    """The largest n up to which the streamed kernel was faster than oneDNN, or within STREAM_TIE of it, at
    every size measured (0 if it lost clearly at the smallest)."""
    rows = 0
    for n in sorted(seconds["streamed"]):
        if seconds["streamed"][n] > seconds["onednn"][n] * (1 + STREAM_TIE):
            break
        rows = n
    return rows


def _lean_source_hash() -> str:
    return _hash(Path(lean_forward.__file__).read_text() + cpu_linear.KERNEL_SOURCE.read_text()
                 + Path(argmax_head.__file__).read_text())


def _engine_source_hash() -> str:
    """The engine's source and its forward's: a step of generation timed with other code is timed anew."""
    sources = "".join(Path(m.__file__).read_text() for m in (engine_module, verify_module, kv_module))
    return _hash(sources + _lean_source_hash())


def verify_costs(target, max_nodes: int = MAX_NODES, *, context: int = 256, repeats: int = 5,
                 prepack: bool | None = None) -> list[float]:
    """Seconds of one verify forward over the root and n = 0..max_nodes drafted nodes on this machine, run as
    the engine runs it by default (its KV cache and tree mask; the lean forward where it applies, else the
    model's own with the prepacked weights where it uses them), cached per target shape, device, threads,
    context and forward (the lean forward's and its kernel's source included: new code is measured anew)."""
    prepack = _prepack(target, prepack)
    context = _fitting_context(target, context, max_nodes + 1)
    streamed, lean = _verify_setup(target, prepack)
    with _generation_mode(target), cpu_linear.prepacked_linears(target, enabled=prepack, stream_rows=streamed):
        fields = {"target": _fingerprint(target), "device": device_name(target.device),
                  "threads": torch.get_num_threads(), "context": context, "prepack": prepack,
                  "stream_rows": streamed, "attention": target.config._attn_implementation,  # as generate runs it
                  "forward": f"lean {_lean_source_hash()}" if lean else "transformers", "caches": "evicted"}
        cached = _read_cache("verify", fields)
        if cached is not None and len(cached["seconds"]) > max_nodes:
            return cached["seconds"][: max_nodes + 1]
        costs = block_costs(target, _verify_model(target, streamed, lean), context, list(range(1, max_nodes + 2)),
                            repeats)
    _eviction_buffer.cache_clear()  # its 128 MB are not kept past the measurement
    seconds = [costs[n + 1] for n in range(max_nodes + 1)]
    _write_cache("verify", fields, {"target_name": getattr(target, "name_or_path", None), "seconds": seconds})
    return seconds


def _verify_setup(target, prepack: bool) -> tuple[int, bool]:
    """How the engine verifies on this machine: the streamed kernel's largest block (0: none), and whether the
    lean forward runs."""
    streamed = stream_rows(target) if prepack else 0
    return streamed, prepack and lean_forward.why_not(target) is None


def _verify_model(target, streamed: int, lean: bool):
    """The forward a verify step runs: greedy, as calibration measures acceptance, so the lean forward reads each
    node's argmax only."""
    return lean_forward.LeanForward(target, streamed, cpu_linear.PackCache(), argmax_only=True) if lean else target


NO_DRAFTS_TOKENS = (8, 40)  # the two generation lengths `no_drafts_step` takes the difference of


def no_drafts_step(target, *, context: int = 256, repeats: int = 5, prepack: bool | None = None) -> dict[str, float]:
    """A decoding step of generation with no drafts on this machine, split: "forward_seconds" in the target's
    forward over the root, "draft_seconds" in the drafter (`infer.drafters.NoDrafter`: an empty tree), and
    "engine_seconds" in the engine around them (accepting, committing the kept path in the KV cache, emitting,
    bookkeeping), which a step with drafts pays too. `SelfSpecModel` with no drafts generates NO_DRAFTS_TOKENS
    new tokens after a `context`-token prompt, timed whole and split by its own statistics; the shorter
    generation is subtracted from the longer, so what each call pays once (the prompt's forward, making the lean
    forward) drops out. The median of `repeats` pairs after a warm-up. Unlike `verify_costs`, the forward is timed
    as this loop runs it, with nothing between the steps to evict the caches. Cached per target shape, device,
    threads, context and the engine's source."""
    prepack = _prepack(target, prepack)
    context = _fitting_context(target, context, max(NO_DRAFTS_TOKENS) + 1)
    fields = {"target": _fingerprint(target), "device": device_name(target.device), "threads": torch.get_num_threads(),
              "context": context, "prepack": prepack, "engine": _engine_source_hash()}
    cached = _read_cache("no_drafts", fields)
    if cached is not None:
        return {name: cached[name] for name in ("engine_seconds", "forward_seconds", "draft_seconds")}
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(target.device)
    model = SelfSpecModel(target, NoDrafter(), cpu_prepack=prepack, lookup_first=False)
    short, long = NO_DRAFTS_TOKENS

    def split(new_tokens: int) -> tuple[float, float, float, int]:
        wall = _seconds(lambda: model.generate(ids, max_new_tokens=new_tokens), target.device)
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
    _write_cache("no_drafts", fields, result)
    return result


def draft_costs(target, drafter, trees: list[dict], *, context: int = 256, repeats: int = 5,
                prepack: bool | None = None, batch: int = 1) -> list[float]:
    """Seconds of one drafting step per tree settings in `trees` on this machine: the drafter (a heads model)
    proposing the tree after a `context`-token prompt, plus observing a step that committed two tokens, run
    as `SelfSpecModel` runs it by default (its lean forward where it has one), for `batch` rows at once.
    Trees drafted alike (dynamic ones differing only in `total_tokens` and drafting the same rows per pass,
    `pass_rows`) are timed once."""
    prepack = _prepack(target, prepack)
    device = target.device
    context = _fitting_context(target, context, 2 * (repeats + 1) + max(_depth(t) for t in trees) + 1)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    budget = torch.full((batch,), context, device=device)  # never the limit
    timed, observe = {}, None
    streamed = stream_rows(target) if prepack else 0
    with _generation_mode(target), torch.inference_mode(), cpu_linear.prepacked_linears(
            target, drafter, enabled=prepack, stream_rows=streamed):
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
            if hasattr(step, "lean_forwards"):  # as SelfSpecModel runs it by default
                step.lean_forwards(streamed if prepack else None)
            step.bind(target, SamplingParams(), batch)
            step.observe(prompt)
            if observe is None:
                observe = median_seconds(lambda s=step: s.observe(accepted), repeats, device)
            timed[key] = median_seconds(lambda s=step: s.propose(budget), repeats, device)
    _eviction_buffer.cache_clear()
    return [observe + timed[key] for key in keys]


# ---------------------------------------------------------------------------------------------- choice
def predict(target, drafter, calibration: dict, *, max_nodes: int = MAX_NODES, context: int = 256,
            repeats: int = 5, prepack: bool | None = None) -> list[Prediction]:
    """Every candidate tree the stored statistics allow, with this machine's draft and verify cost."""
    candidates = [c for measured in calibration["measured"] for c in candidate_trees(measured, max_nodes)]
    if not candidates:
        raise ValueError("the calibration statistics allow no tree; recalibrate the drafter")
    verify = verify_costs(target, max(c.nodes for c in candidates), context=context, repeats=repeats,
                          prepack=prepack)
    draft = draft_costs(target, drafter, [c.tree for c in candidates], context=context, repeats=repeats,
                        prepack=prepack)
    engine = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)["engine_seconds"]
    return [Prediction(c, d, verify[c.nodes], engine) for c, d in zip(candidates, draft, strict=True)]


def predict_no_drafts(target, *, context: int = 256, repeats: int = 5, prepack: bool | None = None) -> Prediction:
    """Generation with no drafts on this machine (`heads.trees.NO_DRAFTS`: one token a target forward through the
    same engine), its step as `no_drafts_step` times it: what the best tree has to beat for drafting to pay."""
    step = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)
    return Prediction(NO_DRAFTS, step["draft_seconds"], step["forward_seconds"], step["engine_seconds"])


def tree_candidate(calibration: dict, tree: dict) -> Candidate | None:
    """The candidate of a drafter's stored statistics (`config.calibration`) that drafts `tree`, its resolved
    tree settings; None where the statistics predict no such tree (one set by hand, say)."""
    for measured in calibration.get("measured") or []:
        for candidate in candidate_trees(measured, calibration.get("max_nodes", MAX_NODES)):
            if all(tree.get(key) == value for key, value in candidate.tree.items()):
                return candidate
    return None


def predict_batch(target, drafter, tree: dict, batch: int, *, context: int = 256, repeats: int = 3,
                  prepack: bool | None = None) -> tuple[Prediction, Prediction] | None:
    """`drafter` (a heads model) drafting `tree` and generation with no drafts, each step of `batch` rows on this
    machine, predicted per row: (drafting, no drafts), or None where its statistics do not hold this tree.

    A tree calibrated on one row costs more at several: every row's nodes go through the verify forward, which
    on a CPU costs nearly as much again for each row (SmolLM2 on the grid kernel, Zen 5: a 4-row step 2.5 times
    a 1-row one), while each row still gains only its own accepted drafts. So the verify of the root alone and of
    the tree, and the drafting step, are timed here at `batch` rows; the acceptance is the stored one (a row's
    acceptance does not depend on its neighbours) and the engine's own work a step `no_drafts_step`'s at one row.
    Cached per target shape, drafter, tree, device, threads, context, batch and the engine's source."""
    candidate = tree_candidate(drafter.config.calibration or {}, tree)
    if candidate is None:
        return None
    prepack = _prepack(target, prepack)
    context = _fitting_context(target, context, candidate.nodes + 1)
    streamed, lean = _verify_setup(target, prepack)
    fields = {"target": _fingerprint(target), "drafter": _config_hash(drafter.config),
              "tree": json.dumps(candidate.tree, sort_keys=True), "device": device_name(target.device),
              "threads": torch.get_num_threads(), "context": context, "prepack": prepack, "batch": batch,
              "engine": _engine_source_hash(), "caches": "evicted"}
    cached = _read_cache("batch", fields)
    if cached is None:
        with _generation_mode(target), cpu_linear.prepacked_linears(target, enabled=prepack, stream_rows=streamed):
            verify = block_costs(target, _verify_model(target, streamed, lean), context, [1, candidate.nodes + 1],
                                 repeats, batch=batch)
        draft = draft_costs(target, drafter, [candidate.tree], context=context, repeats=repeats, prepack=prepack,
                            batch=batch)[0]
        _eviction_buffer.cache_clear()
        cached = {"draft_seconds": draft, "verify_seconds": verify[candidate.nodes + 1],
                  "no_drafts_verify_seconds": verify[1]}
        _write_cache("batch", fields, cached)
    step = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)
    drafting = Prediction(candidate, cached["draft_seconds"], cached["verify_seconds"], step["engine_seconds"])
    none = Prediction(NO_DRAFTS, step["draft_seconds"], cached["no_drafts_verify_seconds"], step["engine_seconds"])
    return drafting, none


def calibrate(target, drafter, prompts: list[torch.Tensor], *, mode: str | None = None,
              top_k: list[int] | None = None, depth: int | None = None, wide: int = WIDE,
              max_nodes: int = MAX_NODES, max_new_tokens: int = 64, context: int = 256, repeats: int = 5,
              tokenizer=None, prepack: bool | None = None) -> tuple[dict, list[Prediction]]:
    """Measure `drafter`'s acceptance on `prompts` ([1, T] ids each, held out from its training data) with a
    wide tree (once per `top_k` for a dynamic tree), then this machine's costs; returns the statistics for
    `config.calibration` and the prediction for every candidate tree (`heads.trees.best_prediction` picks)."""
    if not 1 <= max_nodes <= wide:
        raise ValueError(f"max_nodes must be in 1..wide={wide} (candidate trees are subsets of the measured "
                         f"one), got {max_nodes}")
    if not prompts:
        raise ValueError("calibration needs at least one held-out prompt")
    trees = [wide_tree(drafter.config, mode, wide=wide, depth=depth, top_k=k) for k in (top_k or [None])]
    trees = list({json.dumps(t, sort_keys=True): t for t in trees}.values())  # a static tree ignores top_k
    measured = [measure_acceptance(target, drafter, prompts, tree, max_new_tokens=max_new_tokens,
                                   max_nodes=max_nodes, tokenizer=tokenizer, prepack=prepack) for tree in trees]
    calibration = {"measured": measured, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                   "max_nodes": max_nodes}
    return calibration, predict(target, drafter, calibration, max_nodes=max_nodes, context=context,
                                repeats=repeats, prepack=prepack)


@dataclass
class Choice:
    """What calibrating a drafter found (`choose`): the statistics for `config.calibration`, every candidate
    tree's prediction, the fastest of them, generation with no drafts predicted from the same machine, and that
    tree timed alone and with prompt lookup first (`measure_lookup_first`'s result; None when not measured)."""

    calibration: dict
    predictions: list[Prediction]
    best: Prediction
    no_drafts: Prediction  # `predict_no_drafts`: what the best tree is predicted to beat
    lookup_first: dict | None

    @property
    def tree(self) -> dict:
        return self.best.candidate.tree

    def write(self, folder, drafter) -> None:
        """Store it in the saved drafter at `folder` (`write_calibration`)."""
        write_calibration(folder, drafter, self.calibration, self.tree, self.lookup_first)


def choose(target, drafter, prompts: list[torch.Tensor], *, lookup_first: bool = True, max_new_tokens: int = 64,
           tokenizer=None, prepack: bool | None = None, **options) -> Choice:
    """Steps 1-4 of this module for `drafter` on held-out `prompts`: `calibrate` (its keyword `options` too),
    the tree with the highest predicted tokens/s, and, with `lookup_first`, that tree timed alone and with
    prompt lookup first. `scripts/calibrate.py` and `make demo` calibrate through this."""
    calibration, predictions = calibrate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                         tokenizer=tokenizer, prepack=prepack, **options)
    best = best_prediction(predictions)
    none = predict_no_drafts(target, prepack=prepack, **{k: options[k] for k in ("context", "repeats") if k in options})
    lookup = measure_lookup_first(target, drafter, prompts, best.candidate.tree, max_new_tokens=max_new_tokens,
                                  tokenizer=tokenizer, prepack=prepack) if lookup_first else None
    return Choice(calibration, predictions, best, none, lookup)


def write_calibration(folder, drafter, calibration: dict, tree: dict, lookup_first: dict | None = None) -> None:
    """Store the chosen tree and the acceptance statistics in the saved drafter at `folder`: its config.json
    (the weights are unchanged) and its model card. Later loads draft with that tree, and `tree="calibrated"`
    chooses again from the statistics on another machine. `lookup_first`, a `measure_lookup_first` result,
    is stored beside the statistics and sets `config.lookup_first`, which `SelfSpecModel` follows unless told
    otherwise."""
    import heads
    from heads.card import write_model_card

    config = drafter.config
    config.tree = config.resolve_tree({**config.tree, **tree})
    if lookup_first is not None:
        calibration = {**calibration, "lookup_first": lookup_first}
        config.lookup_first = bool(lookup_first["pays"])
    config.calibration = calibration
    # the weights in the folder keep their dtype (a drafter stored in fp16 may have been loaded in fp32)
    saved = copy.deepcopy(config)
    existing = Path(folder) / "config.json"
    stored = json.loads(existing.read_text()).get("dtype") if existing.is_file() else None
    saved.dtype = stored or config.dtype
    saved.save_pretrained(folder)
    registered = heads.REGISTRY.get(drafter.kind)
    write_model_card(folder, saved, kind=drafter.kind, title=registered.title if registered else None)


def calibrated_tree(drafter, target, tokenizer=None, *, prepack: bool | None = None, max_nodes: int | None = None,
                    context: int = 256, repeats: int = 3) -> dict:
    """The tree settings that maximize predicted tokens/s for `drafter` (a heads model) on this machine, from
    the acceptance statistics stored with it (`scripts/calibrate.py --write`) and this machine's costs.
    `max_nodes`, the largest tree considered, defaults to the one the statistics were calibrated with.

    The first call for a target, device, torch thread count and drafter measures the costs, `repeats` times
    each after a warm-up: a verify forward over each of 1..`max_nodes` + 1 tokens after a `context`-token
    prefix (the curve is shared by every drafter of the target), and one drafting step per candidate tree
    (`max_nodes` static trees, or one per depth for a dynamic tree). That is 4 x 65 target forwards and up to
    4 x 64 drafting steps at the defaults: well under a second for the tiny test models, and by an estimate
    from SmolLM2-135M's ~65 ms forward on 2 CPU cores, half a minute or so there (not timed). The choice is
    then cached (`$SELFSPEC_CACHE/calibration`), and later calls read one small JSON file. Where generation with
    no drafts is predicted faster than the best tree (`predict_no_drafts`), every call warns: the tree is still
    returned, and the caller decides whether to draft."""
    calibration = drafter.config.calibration
    if not calibration or not calibration.get("measured"):
        raise ValueError("tree='calibrated' chooses the tree from the drafter's acceptance statistics on held-out "
                         "prompts, and this drafter has none: run scripts/calibrate.py --drafter <its folder> "
                         "--prompts <held-out prompts> --write once, or leave tree= unset for its saved tree")
    max_nodes = max_nodes or calibration.get("max_nodes", MAX_NODES)
    drafter.attach(target, tokenizer)
    prepack = _prepack(target, prepack)
    fields = {"target": _fingerprint(target), "drafter": _config_hash(drafter.config),
              "device": device_name(target.device), "threads": torch.get_num_threads(), "context": context,
              "prepack": prepack, "max_nodes": max_nodes, "caches": "evicted",
              "prediction": "draft + verify + engine"}
    cached = _read_cache("tree", fields)
    if cached is None:
        best = best_prediction(predict(target, drafter, calibration, max_nodes=max_nodes, context=context,
                                       repeats=repeats, prepack=prepack))
        none = predict_no_drafts(target, context=context, repeats=repeats, prepack=prepack)
        cached = {"tree": best.candidate.tree, "nodes": best.candidate.nodes, "tokens_per_second": best.tokens_per_second,
                  "no_drafts_tokens_per_second": none.tokens_per_second}
        _write_cache("tree", fields, cached)
    if cached["no_drafts_tokens_per_second"] > cached["tokens_per_second"]:
        warnings.warn(f"drafting with this drafter is predicted not to pay on this machine ({fields['device']}, {fields['threads']} "
                      f"threads): its best tree is predicted at {cached['tokens_per_second']:.1f} tokens/s and "
                      f"generation with no drafts, SelfSpecModel(target) alone, at "
                      f"{cached['no_drafts_tokens_per_second']:.1f} (infer.calibrate.predict_no_drafts: estimates good to "
                      "about 10%; scripts/calibrate.py times both on held-out prompts). A drafter whose drafts are "
                      "accepted more often would change that", stacklevel=3)
    return cached["tree"]


# ---------------------------------------------------------------------------------------------- helpers
def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's (`cpu_name`): what a cost curve is cached under."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        name = cpu_name(Path("/proc/cpuinfo").read_text())
    except OSError:
        name = None
    return name or platform.processor() or platform.machine() or device.type


def cpu_name(cpuinfo: str) -> str | None:
    """The first CPU's model name in /proc/cpuinfo's text, with its family and model numbers where given. A virtual
    machine's model name can be as bare as "AMD EPYC" on a Zen 3 with AVX2 and on a Zen 5 with AVX-512, whose
    kernels and costs differ; the numbers tell them apart."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "cpu family", "model"):
            fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return None
    if "cpu family" in fields and "model" in fields:
        return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
    return fields["model name"]


def _fingerprint(model) -> str:
    """What a model's forward cost depends on: its class, dtype and parameter shapes."""
    shapes = [(name, list(p.shape)) for name, p in model.named_parameters()]
    return _hash([type(model).__name__, str(model.dtype), shapes])


def _config_hash(config) -> str:
    return _hash(config.to_dict())


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_file(kind: str, fields: dict) -> Path:
    return cache_dir() / "calibration" / f"{kind}-{_hash(fields)}.json"


def _read_cache(kind: str, fields: dict) -> dict | None:
    path = _cache_file(kind, fields)
    try:
        entry = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not measured yet, or a damaged file: measure again (and overwrite it)
    return entry if entry.get("fields") == fields else None


def _write_cache(kind: str, fields: dict, content: dict) -> None:
    path = _cache_file(kind, fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"fields": fields, **content}, indent=1))
    partial.replace(path)


def _prepack(target, prepack: bool | None) -> bool:
    """The engine's default: prepacked weights for an fp32 CPU target that fits them."""
    return cpu_linear.worth_it(target) if prepack is None else bool(prepack) and cpu_linear.available()


def _fitting_context(target, context: int, extra: int) -> int:
    """`context`, shortened where the target's positions cannot hold it plus `extra` tokens."""
    most = _max_positions(target.config)
    return max(1, min(context, most - extra)) if most else context


def _depth(tree: dict) -> int:
    return max(len(p) for p in tree["paths"]) if tree.get("mode", "static") == "static" else tree["depth"]


def _draft_key(tree: dict) -> str:
    return json.dumps({k: v for k, v in tree.items() if k != "total_tokens"}, sort_keys=True)


EVICT_BYTES = 128 << 20  # written before each timed CPU run: more than a last-level cache holds


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    """Made once per measurement of many timed runs; verify_costs and draft_costs free it when done."""
    return torch.zeros(EVICT_BYTES // 4)


def median_seconds(fn, repeats: int, device: torch.device, after=None) -> float:
    """Median seconds of `fn()` over `repeats` runs after a warm-up; `after()`, untimed, follows each run.

    On a CPU each run starts with its weights out of the caches, as in generation, where the target's forward and
    the drafter's pass evict each other's. Back to back, the shipped drafter's pass kept its 20 MB in a 32 MB L3
    and timed 0.8 ms where generation spends 1.9 (Zen 5 EPYC, 2026-11-27; evicted first: 1.5 ms), and a 2-row verify
    6.0 ms where it spends about 6.5 (evicted: 6.3)."""
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        if device.type == "cpu":
            _eviction_buffer().add_(1.0)  # untimed
        times.append(_seconds(fn, device))
        if after is not None:
            after()
    return statistics.median(times[1:])


def _seconds(fn, device: torch.device) -> float:
    """Seconds of one `fn()`, the device synchronized before and after."""
    _sync(device)
    tic = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - tic


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
