"""The engine: speculative generation over any transformers causal LM, verified with a tree mask.

The loop (Stern et al. 2018; Leviathan et al. 2023; Cai et al. 2024 for trees):

    1. prefill the prompt; the target picks the first new token (the first root)
    2. the drafter proposes a tree below the root
    3. ONE target forward scores every tree node (4D tree attention mask, explicit positions), plus any
       scored nodes the drafter adds for itself (never accepted, never seen by the tree)
    4. acceptance keeps the longest valid path plus one token from the target (the bonus)
    5. the kept path's KV entries are gathered into place; everything else is dropped
    6. the drafter observes what was committed; repeat from 2 until every row is done

Greedy output is token-identical to `target.generate(do_sample=False)`; sampling is exact rejection
sampling over the tree, so outputs follow the target's distribution.

Between 4 and 5 the host reads the device once (`_read_step`: the kept paths, their lengths and the new tokens,
in one small tensor); greedy acceptance stays on the device, and what the host keeps (rows alive, tokens
emitted, budgets) it keeps as Python values. On a GPU any other read would drain the queue of launched kernels. On a
CPU (`Plan.host_acceptance`) greedy acceptance walks the tree on the host instead, from one read of the target's
choices: there a read costs nothing and the walk fewer calls than the tensor ops.
The captured step (`Plan.captured_step`, `infer.cuda`) replays the verify forward as a CUDA graph per node bucket,
drafts without reads and accepts sampled deterministic drafts on the device too (`infer.verify.accept_drawn`);
without it, sampled acceptance walks the tree on the host, where a CPU's reads cost next to nothing.

`Engine` runs a settled `infer.options.Plan` and chooses nothing: which drafter, kernels and forwards run, and
whether a call of several rows drafts, are settled before it (`infer.policy.settle`); `infer.SelfSpecModel` is
the engine with its options settled so.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel

from . import cpu, cuda
from .attention import prompt_tree
from .drafters import LookupFirstDrafter, NoDrafter
from .drafting import Drafter, TargetStep
from .kv import VERIFY_ROOM, KVState, forward_block, verify_bucket
from .options import Plan
from .request import NOT_GIVEN, Settings, check_generator, check_inputs, resolve_settings, with_keywords
from .sampling import NOT_A_DISTRIBUTION, logits_to_probs, next_token
from .target import generation_mode, max_positions
from .tree import MALFORMED, DraftTree
from .verify import (
    Acceptance,
    accept_drawn,
    accept_greedy,
    accept_greedy_host,
    accept_sampled,
    accept_typical,
)

_gc_lock = threading.Lock()
# generate calls under way, whether the collector was on before them, and whether `freeze_heap` has run
_gc_state = {"calls": 0, "enabled": False, "frozen": False}


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cyclic garbage collector off while any generate call runs, and as it was after the last one.

    A step allocates hundreds of tensors and small objects, which trigger collections; every so often one is a
    full collection over the whole heap (hundreds of thousands of tracked objects with a model and transformers
    loaded), a cost generation pays for nothing (docs/benchmarks.md, "The engine's cost on a CPU"). Nothing is
    lost: a generate call leaves no cyclic garbage, and reference counting frees everything else as before."""
    with _gc_lock:
        if _gc_state["calls"] == 0:
            _gc_state["enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["calls"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["calls"] -= 1
            if _gc_state["calls"] == 0 and _gc_state["enabled"]:
                gc.enable()


def freeze_heap() -> bool:
    """Once per process: collect garbage, then move every object alive into the collector's permanent generation
    (`gc.freeze`). Pausing the collector during a call (`_cyclic_gc_paused`) only moves its full collections to just
    after the call, each a scan of every tracked object (~0.2 s with torch, transformers and a model loaded); frozen,
    those objects are never scanned again. Returns whether this call froze the heap (False: it was already)."""
    with _gc_lock:
        if _gc_state["frozen"]:
            return False
        gc.collect()
        gc.freeze()
        _gc_state["frozen"] = True
        return True


@dataclass
class _Rows:
    """Per-row output of one generate call, on the host; `alive` maps cache rows to output rows."""

    alive: list[int]  # output row of each live cache row
    limit: list[int]  # max new tokens per output row (max_new_tokens, capped by the context length)
    out: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens per verify step, all rows
    # per live row, on the device: its limit and its new tokens so far, kept there step by step, since a list
    # copied to a GPU waits for the queue as a read does
    limit_on_device: torch.Tensor | None = None
    count_on_device: torch.Tensor | None = None

    def start_on(self, device: torch.device) -> None:
        """The device's copies of the limits and counts (once a call, after the first token)."""
        self.limit_on_device = torch.tensor([self.limit[r] for r in self.alive], device=device)
        self.count_on_device = torch.tensor([len(self.out[r]) for r in self.alive], device=device)

    def emit(self, row: int, tokens: list[int], eos: set[int]) -> bool:
        """Append tokens for an output row; True if the row is finished."""
        out = self.out[row]
        for tok in tokens:
            out.append(tok)
            if tok in eos or len(out) >= self.limit[row]:
                return True
        return False


@dataclass
class _Read:
    """What the host learns of a verify step, in its one read of the device: per live row, the nodes kept
    (the root and accepted drafts: `length`), their indices in the tree, and the new tokens (accepted drafts,
    then the bonus)."""

    lengths: list[int]
    paths: list[list[int]]
    tokens: list[list[int]]
    # with scored nodes beside the tree: the target's argmax at each, and which were scored as proposed
    scored_choice: list[list[int]] | None = None
    scored_valid: list[list[bool]] | None = None

    @property
    def in_place(self) -> bool:
        """Every kept node is the block's slot of the same index (nothing to move in the KV cache)."""
        return all(path[:n] == list(range(n)) for path, n in zip(self.paths, self.lengths, strict=True))


class Engine:
    """A frozen target plus a drafter, generating with tree-verified speculation as its `Plan` says.

    >>> engine = Engine(target, plan)   # the plan from infer.policy.settle, or infer.tuning.plan
    >>> out = engine.generate(input_ids, max_new_tokens=64)   # == target.generate(input_ids, ...)
    """

    def __init__(self, target: PreTrainedModel, plan: Plan):
        options = plan.options
        self.target = target  # its train/eval flags are the user's: generate sets eval only for the call
        self.plan = plan
        self.drafter = plan.drafter
        self.cpu_prepack = plan.cpu_prepack
        self._active: Drafter = self.drafter  # the drafter of the call in progress (NoDrafter where it stands down)
        self.step_observer = options.step_observer
        self.typical_acceptance = options.typical_acceptance
        self.static_cache = options.static_cache
        self.int8_argmax = options.int8_argmax
        self._verify_forward = None  # the target's compiled forward for verify blocks (static cache only)
        self._verify_fallback: str | None = None  # why a compiled or captured verify forward was dropped, if it was
        self._cache: KVState | None = None  # the static KV cache, kept for the next call of the same shape
        # the drafter that runs forwards of its own (lookup-first wraps one)
        own = self.drafter.primary if isinstance(self.drafter, LookupFirstDrafter) else self.drafter
        self._own = own
        self.captured_step = plan.captured_step
        if options.compile:
            self._compile(own)
        if plan.captured_step:  # the verify forward over static buffers per bucket; drafting reads nothing
            self._verify_forward = cuda.StepGraphs(target, compiled=options.compile)
            self.drafter.sync_free = True  # lookup first passes it to both of its drafters
        self._packed = cpu.shared_pack_cache(target)  # packed copies of the weights, not on the modules
        self._stream_rows = plan.stream_rows  # verify blocks of 2..this many rows run on the streamed kernel
        self._one_row = plan.stream_one_row  # and one fp32 row too, where it beat torch's GEMV here
        self._lean_verify = plan.lean_verify  # the verify forward without transformers' module machinery
        self._lean: cpu.lean_forward.LeanForward | None = None  # this call's, made when it began
        own.lean_forwards(plan.drafter_stream_rows, int8=options.int8_drafter)  # its forwards lean too, or not
        own.capture_forwards(cuda.StepGraphs if plan.captured_step else None)  # captured with the verify, or not
        self._busy = threading.Lock()  # the drafter and the stats are per model: one generate at a time
        self.last_stats: dict = {}
        if options.freeze_gc:
            freeze_heap()

    def _compile(self, own: Drafter) -> None:
        """The drafter's own forwards compiled where it has any, and with a static cache the verify forward (on the
        captured step, by the graphs' seam: `cuda.StepGraphs(compiled=True)`)."""
        if not own.compile_forwards() and not self.static_cache:
            warnings.warn(f"compile=True: a {type(self.drafter).__name__} runs no forward of its own to compile "
                          "and without static_cache the verify is not compiled; nothing is compiled", stacklevel=4)
        if self.static_cache and not self.captured_step:
            self._verify_forward = _CompiledForward(self.target)

    @contextlib.contextmanager
    def verify_path(self):
        """(forward, name): what a greedy verify step of this engine runs the target with, set up as generate sets
        it up (prepacked linears, the lean forward), to time a step's parts (`train.apps.bench`). A compiled or captured
        verify runs on the static cache it was made for: there the eager forward is given, and its name says so."""
        with torch.inference_mode(), generation_mode(self.target), cpu.prepacked_linears(
                self.target, cache=self._packed, enabled=self.cpu_prepack, stream_rows=self._stream_rows,
                one_row=self._one_row):
            lean = (cpu.lean_verify_forward(self.target, self._stream_rows, self._packed, argmax_only=self.int8_argmax,
                                            one_row=self._one_row) if self._lean_verify else None)
            name = "lean" if lean is not None else "transformers"
            if self._verify_forward is not None:
                name += f" (eager: the {self._verify_forward_name()} forward needs its static cache)"
            yield (lean if lean is not None else self.target), name

    def free_cache(self) -> None:
        """Drop the static KV cache kept between calls (the next call allocates a new one), and with it what holds its
        memory: the captured graphs over it (their kept inputs and outputs) and the drafter's captured forwards and
        static cache."""
        self._cache = None
        if isinstance(self._verify_forward, cuda.StepGraphs):
            self._verify_forward.release()
        if self.captured_step:
            self._own.capture_forwards(cuda.StepGraphs)  # a fresh seam: the drafter's graphs and cache go

    # ---------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = NOT_GIVEN, pad_token_id: int | None = NOT_GIVEN,
                 streamer=None,
                 generation_config: GenerationConfig | None = None,
                 generator: torch.Generator | None = None, **settings) -> torch.Tensor:
        """Like `target.generate`: returns [B, prompt + new] with rows that stop early padded.

        A setting not given as an argument comes, as in transformers' `generate`, from the keywords (any
        `GenerationConfig` field, e.g. `min_new_tokens=4`), then `generation_config`, then the target's own
        generation config, then transformers' defaults (`TRANSFORMERS_DEFAULTS`: greedy; when sampling,
        temperature 1, top_k 50, top_p 1). So a target whose generation config samples is sampled with its
        settings. As in transformers, `eos_token_id=None` given means no eos (left out: the configs'), and
        `pad_token_id=None` given pads with the first eos. Settings whose output could differ from
        `target.generate`'s, and requests for more than the token ids (`output_scores`, `return_dict_in_generate`,
        ...) or for `max_time`, are refused by name.
        """
        check_generator(generator, self.target.device)
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise TypeError("streamer must have put() and end() methods, like transformers' TextStreamer")
        call = resolve_settings(self.target, self.typical_acceptance, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
                              with_keywords(generation_config, settings))
        input_ids, attention_mask = check_inputs(self.target, input_ids, attention_mask, streamer)
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this SelfSpecModel is already generating in another thread; its drafter keeps "
                               "per-call state, so give each thread its own SelfSpecModel (they can share the "
                               "target)")
        try:
            # before the call's own set-up: the first call of a batch size times its steps, as calibration does
            self._active, batch_drafting = self._drafter_for(input_ids.shape[0])
            # a compiled verify traces the target's own linears (patched ones would fail its guards every call)
            packed_target = None if self._verify_forward is not None else self.target
            with generation_mode(self.target), _cyclic_gc_paused(), cpu.prepacked_linears(
                    packed_target, getattr(self.drafter, "model", None), cache=self._packed,
                    enabled=self.cpu_prepack, stream_rows=self._stream_rows, one_row=self._one_row):
                out = self._generate(input_ids, attention_mask, call, streamer, generator)
            self.last_stats["batch_drafting"] = batch_drafting
            return out
        finally:
            self._lean = None  # it holds the target's tensors: nothing of the call outlives it
            self._active = self.drafter
            self._busy.release()

    def _drafter_for(self, rows: int) -> tuple[Drafter, dict | None]:
        """The drafter of a call of `rows` rows: the model's own, or `NoDrafter` where the plan has a call of several
        rows stand down; and what decided it (None for one row, or where nothing was decided)."""
        if rows == 1 or isinstance(self.drafter, NoDrafter) or self.plan.batch_drafting is None:
            return self.drafter, None
        choice = self.plan.batch_drafting(rows)
        if choice is None:
            return self.drafter, None
        return (self.drafter if choice["drafts"] else NoDrafter()), dict(choice)

    def _generate(self, input_ids, attention_mask, settings: Settings, streamer, generator) -> torch.Tensor:
        """The loop, on checked inputs and settings."""
        rows = self._start_rows(attention_mask, settings.max_new_tokens)
        kv = self._new_cache(input_ids, max(rows.limit))  # what the context lets the rows emit, not what was asked
        self._lean = self._lean_forward(settings)
        stats = {"draft_seconds": 0.0, "verify_seconds": 0.0, "prefill_seconds": 0.0, "target_forwards": 0,
                 "row_forwards": 0, "target_seconds": 0.0, "verify_forward": self._verify_forward_name(),
                 "int8_argmax": self._lean is not None and self._lean.argmax_head is not None}
        if streamer is not None:
            streamer.put(input_ids.cpu())

        # 1. Prefill: the prompt, and the target's first token (the first root).
        tic = time.perf_counter()
        step = self._prefill(kv, input_ids, attention_mask, settings, generator, stats)
        stats["prefill_seconds"] = time.perf_counter() - tic  # also in verify_seconds: the prompt's forward
        stats["verify_seconds"] += stats["prefill_seconds"]
        stats["target_forwards"] += 1
        stats["row_forwards"] += input_ids.shape[0]
        _, roots = step.on_host()  # the prompt and first tokens on the host, for the drafters too
        done = self._emit(rows, [[t] for t in roots], settings, streamer)
        self._active.bind(self.target, settings.sampling, input_ids.shape[0], generator)
        self._active.observe(step)
        rows.start_on(kv.length.device)
        self._drop_finished(kv, rows, done)

        while rows.alive:
            # 2. Draft a tree below each row's root, no deeper than the row may still emit.
            tic = time.perf_counter()
            budget = (rows.limit_on_device - rows.count_on_device - 1).clamp(min=0)
            tree = self._active.propose(budget).prune_deeper_than(budget)
            stats["draft_seconds"] += time.perf_counter() - tic
            # 3-5. Verify every node in one forward, accept, keep only the accepted path's KV: the step's one
            # read of the device (`_Read`) comes between acceptance and the commit.
            tic = time.perf_counter()
            step, acc, seen = self._verify(kv, tree, settings, generator, rows.count_on_device, stats,
                                           max(self._budget(rows)))
            stats["verify_seconds"] += time.perf_counter() - tic
            if self.step_observer is not None:
                self.step_observer(tree, acc, budget)
            stats["target_forwards"] += 1
            stats["row_forwards"] += len(rows.alive)
            # the step on the host, from its one read: each row's root (its last token out) and kept drafts
            step.host_tokens = [[rows.out[r][-1], *new[:-1]] for r, new in zip(rows.alive, seen.tokens, strict=True)]
            step.host_next = [new[-1] for new in seen.tokens]
            done = self._emit(rows, seen.tokens, settings, streamer)
            rows.accepted.extend(seen.lengths)
            rows.count_on_device = rows.count_on_device + acc.length
            # 6. The drafter learns what was committed.
            tic = time.perf_counter()
            self._active.observe(step)
            stats["draft_seconds"] += time.perf_counter() - tic
            self._drop_finished(kv, rows, done)

        if streamer is not None:
            streamer.end()
        # what ran, read again at the end: a compiled or captured forward that failed mid-call fell back to eager
        stats["verify_forward"] = self._verify_forward_name()
        if self._verify_fallback is not None:
            stats["verify_fallback"] = self._verify_fallback
        new_tokens = sum(len(o) for o in rows.out)
        # tau: new tokens per (row, target forward), the bonus token counted and the prefill included
        stats.update(new_tokens=new_tokens, accepted_lengths=rows.accepted,
                     mean_accepted_length=new_tokens / max(stats["row_forwards"], 1))
        self.last_stats = stats
        return self._assemble(input_ids, rows, settings.pad)

    # ---------------------------------------------------------------- steps
    def _prefill(self, kv, input_ids, attention_mask, settings, generator, stats: dict) -> TargetStep:
        depth, ancestors, valid = prompt_tree(attention_mask)
        tic = time.perf_counter()
        model = self._lean if self._lean is not None else self.target  # the lean forward: about 10 ms less here
        out = forward_block(model, kv, depth, ancestors, valid, input_ids=input_ids,
                            output_hidden_states=bool(self._active.feature_layers), logits_to_keep=1)
        stats["target_seconds"] += time.perf_counter() - tic  # inside the target's forward
        kv.mark_valid(valid)
        logits = self._constrain(out.logits[:, -1:], torch.zeros_like(input_ids[:, :1]), settings)
        root = next_token(logits[:, -1], settings.sampling, generator)
        return TargetStep(tokens=input_ids, valid=valid, next_tokens=root,
                          hidden=self._features(out), prompt_cache=kv.cache)

    def _verify(self, kv: KVState, tree: DraftTree, settings: Settings, generator, emitted: torch.Tensor,
                stats: dict, deepest: int) -> tuple[TargetStep, Acceptance, _Read]:
        """emitted: [B] new tokens each row has emitted so far, the root included; deepest: no valid node is
        deeper (the budget); the target forward's time goes into stats["target_seconds"]."""
        depth, ancestors = tree.structure()  # a malformed tree is caught by the read below
        start = kv.size
        # Scored nodes (if any) ride after the tree nodes; the tree never attends to them.
        tokens, offsets, attend, valid = tree.verify_block(depth, ancestors)
        n, m = tree.num_nodes, tokens.shape[1]
        if kv.static:  # padded to a fixed node count: padding nodes see only themselves and are never kept
            if m > kv.room():
                warnings.warn(f"a verify block of {m} nodes does not fit the static KV cache ({kv.room()} slots "
                              "left): it grows, and compiled verify graphs recompile", stacklevel=3)
                kv.grow(kv.size + verify_bucket(m))
            size = verify_bucket(m)
            tokens, offsets, attend, valid = _pad_block(tokens, offsets, attend, valid,
                                                        size if size <= kv.room() else m)
        tic = time.perf_counter()
        out = self._verify_forward_block(kv, tokens, offsets, attend, valid)
        stats["target_seconds"] += time.perf_counter() - tic  # inside the target's forward
        logits = self._constrain(out.logits[:, :n], emitted[:, None] + depth, settings)
        walked = None  # greedy on a CPU: (acceptance, paths, tokens) from the walk on the host
        if settings.typical:
            acc = accept_typical(tree, logits, ancestors, depth, settings.sampling, generator=generator)
        elif settings.sampling.do_sample and self.captured_step and tree.q is None:  # the walk without reads
            probs = logits_to_probs(logits, settings.sampling, sync_free=True)
            acc = accept_drawn(tree, probs, ancestors, depth, min(deepest, n - 1), generator)
        elif settings.sampling.do_sample:
            acc = accept_sampled(tree, logits, ancestors, settings.sampling, generator)
        else:
            walked = accept_greedy_host(tree, logits) if self.plan.host_acceptance else None
            acc = accept_greedy(tree, logits, ancestors, depth) if walked is None else walked[0]
        scored_choice = out.logits[:, n:m].argmax(-1) if tree.scored is not None else None  # [B, E]
        if walked is None:
            seen = _read_step(tree, acc, scored_choice)
        else:  # the target on a CPU: reads cost nothing
            seen = _Read([len(path) for path in walked[1]], walked[1], walked[2])
            if scored_choice is not None:
                seen.scored_choice, seen.scored_valid = scored_choice.tolist(), tree.scored.valid.tolist()
        if acc.rewind is not None:
            acc.rewind(seen.lengths)
        acc = acc.trimmed(max(seen.lengths))
        keep = acc.keep
        # scored nodes' slots lie past the path: dropped with the rejected
        kv.commit(start, acc.path, keep, in_place=seen.in_place)
        hidden = tuple(h.gather(1, acc.path[..., None].expand(-1, -1, h.shape[-1])) for h in self._features(out))
        step = TargetStep(tokens=tree.tokens.gather(1, acc.path), valid=keep,
                          hidden=hidden, next_tokens=acc.bonus)
        if tree.scored is not None:  # a copy: a captured forward's logits are overwritten by the next step's
            step.scored_logits, step.scored_valid = out.logits[:, n:m].clone(), tree.scored.valid
            step.host_scored_choice, step.host_scored_valid = seen.scored_choice, seen.scored_valid
        return step, acc, seen

    def _verify_forward_block(self, kv: KVState, tokens, offsets, attend, valid):
        """The target on a verify block: its compiled forward where there is one, else eager; a compiled
        forward that fails (no compiler, an op it cannot take) is dropped with one warning, and what it wrote
        into the cache is forgotten before the eager forward."""
        hidden = bool(self._active.feature_layers)
        if self._verify_forward is not None:
            size = kv.size
            try:
                return forward_block(self._verify_forward, kv, offsets, attend, valid, input_ids=tokens,
                                     output_hidden_states=hidden)
            except Exception as err:  # noqa: BLE001 -- any compiler failure: go on eagerly, as promised
                what = "capturing" if self.captured_step else "compiling"
                warnings.warn(f"{what} the target's verify forward failed ({type(err).__name__}: "
                              f"{str(err)[:200]}); verifying goes on without {what}", stacklevel=4)
                self._verify_forward = None
                self._verify_fallback = f"{what} failed: {type(err).__name__}: {str(err)[:200]}"
                kv.rollback(size)
        model = self._lean if self._lean is not None else self.target
        return forward_block(model, kv, offsets, attend, valid, input_ids=tokens, output_hidden_states=hidden)

    def _verify_forward_name(self) -> str:
        """What runs the verify forward now: "cuda graphs", "static buffers" (the captured step uncaptured, on a
        CPU), either "... of the compiled forward" (the fused captured step), "compiled", "lean" (the CPU's own
        forward) or "transformers" (the model's modules)."""
        if isinstance(self._verify_forward, cuda.StepGraphs):
            ran = "cuda graphs" if self._verify_forward.capture else "static buffers"
            return f"{ran} of the compiled forward" if self._verify_forward.compiled else ran
        if isinstance(self._verify_forward, _CompiledForward):
            return "compiled"
        return "lean" if self._lean is not None else "transformers"

    def _lean_forward(self, settings: Settings) -> cpu.lean_forward.LeanForward | None:
        """This call's lean forward of the target, or None where the model's own runs (`cpu.lean_verify_forward`)."""
        if not self._lean_verify:
            return None
        # where only each node's argmax is read, it comes from the int8 copy of the LM head
        reads_more = (settings.sampling.do_sample or settings.typical or settings.suppress or settings.begin_suppress
                      or (settings.min_new_tokens and settings.eos))
        return cpu.lean_verify_forward(self.target, self._stream_rows, self._packed,
                                       argmax_only=self.int8_argmax and not reads_more, one_row=self._one_row)

    def _new_cache(self, input_ids: torch.Tensor, max_new_tokens: int) -> KVState:
        """The target's KV cache for one generate call: growing, or static with room for the whole request."""
        batch, width = input_ids.shape
        if not self.static_cache:
            return KVState(batch, input_ids.device, self.target.config)
        tokens = width + max_new_tokens
        if self.static_cache is not True and tokens > self.static_cache:
            raise ValueError(f"a prompt of {width} tokens (padding included) plus max_new_tokens={max_new_tokens} "
                             f"needs {tokens} slots; the static cache holds {self.static_cache}: raise "
                             "static_cache, shorten the request, or pass static_cache=True (sized per call)")
        if self.static_cache is True:  # sized per call, in steps of 256 slots, never shrinking: few shapes
            capacity = -(-(tokens + VERIFY_ROOM) // 256) * 256
            max_len = max_positions(self.target.config)
            if max_len:  # a step of 256 never past the context: nothing could use the slots
                capacity = min(capacity, max(tokens, max_len) + VERIFY_ROOM)
            capacity = max(capacity, self._cache.capacity if self._cache else 0)
        else:
            capacity = self.static_cache + VERIFY_ROOM
        kv = self._cache
        if kv is not None and (kv.capacity, kv.batch_size, kv.length.device) == (capacity, batch, input_ids.device):
            kv.reset()  # the same buffers as the last call: compiled (and captured) graphs stay valid
        else:
            kv = self._cache = KVState(batch, input_ids.device, self.target.config, capacity=capacity)
        return kv

    def _features(self, out) -> tuple[torch.Tensor, ...]:
        layers = self._active.feature_layers
        return tuple(out.hidden_states[i] for i in layers) if layers else ()

    # ---------------------------------------------------------------- bookkeeping
    def _start_rows(self, attention_mask, max_new_tokens) -> _Rows:
        max_len = max_positions(self.target.config)
        prompt_lens = attention_mask.sum(1).tolist()
        limit = [min(max_new_tokens, max_len - n) if max_len else max_new_tokens for n in prompt_lens]
        if min(limit) < max_new_tokens:
            warnings.warn(f"max_new_tokens={max_new_tokens} does not fit the target's context of {max_len} "
                          f"positions: a prompt of {max(prompt_lens)} tokens can get at most {min(limit)} new "
                          "tokens", stacklevel=4)
        b = attention_mask.shape[0]
        return _Rows(alive=list(range(b)), limit=limit, out=[[] for _ in range(b)])

    def _budget(self, rows: _Rows) -> list[int]:
        """Deepest draft depth per live row: drafts plus the bonus must fit the row's remaining tokens."""
        return [max(rows.limit[r] - len(rows.out[r]) - 1, 0) for r in rows.alive]

    def _emit(self, rows: _Rows, tokens: list[list[int]], settings, streamer) -> list[bool]:
        """Append each live row's new tokens; returns its finished flags."""
        done = []
        for b, row in enumerate(rows.alive):
            before = len(rows.out[row])
            done.append(rows.emit(row, tokens[b], settings.eos))
            if streamer is not None:
                streamer.put(torch.tensor(rows.out[row][before:]))
        return done

    def _drop_finished(self, kv, rows: _Rows, done: list[bool]) -> None:
        if not any(done):
            return
        keep = [b for b, finished in enumerate(done) if not finished]
        rows.alive = [rows.alive[b] for b in keep]
        if keep:
            index = torch.tensor(keep, device=kv.length.device)
            kv.select_rows(index)
            self._active.select_rows(index)
            rows.limit_on_device, rows.count_on_device = rows.limit_on_device[index], rows.count_on_device[index]

    def _assemble(self, input_ids, rows: _Rows, pad: int) -> torch.Tensor:
        width = max(len(o) for o in rows.out)
        new = torch.full((len(rows.out), width), pad, dtype=input_ids.dtype, device=input_ids.device)
        for b, toks in enumerate(rows.out):
            new[b, :len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)

    # ---------------------------------------------------------------- input checks
    def _constrain(self, logits: torch.Tensor, new_so_far: torch.Tensor, settings: Settings) -> torch.Tensor:
        """Apply the generation config's token bans in place, as transformers' logits processors would.

        logits: [B, N, V] for nodes whose predicted token is new token number `new_so_far[b, n]` (0 = first).
        """
        if settings.suppress:
            logits.index_fill_(-1, settings.ids("suppress", logits.device), -float("inf"))
        if settings.begin_suppress:
            ids = settings.ids("begin_suppress", logits.device)
            first = (new_so_far == 0)[..., None]
            logits.index_copy_(-1, ids, logits.index_select(-1, ids).masked_fill(first, -float("inf")))
        if settings.min_new_tokens and settings.eos:
            ids = settings.ids("eos", logits.device)
            early = (new_so_far < settings.min_new_tokens)[..., None]
            logits.index_copy_(-1, ids, logits.index_select(-1, ids).masked_fill(early, -float("inf")))
        return logits

class _CompiledForward:
    """The target's forward through `torch.compile` (fixed shapes; CUDA graphs on a GPU). A function calling
    the target is compiled, not the module: `torch.compile(module)` leaves a flag on the user's model."""

    def __init__(self, target: PreTrainedModel):
        self._orig_mod = target  # the name `cache_argument` looks under for the wrapped class
        mode = "reduce-overhead" if target.device.type == "cuda" else None
        self._compiled = torch.compile(lambda *args, **kwargs: target(*args, **kwargs), dynamic=False, mode=mode)

    @property
    def dtype(self) -> torch.dtype:
        return self._orig_mod.dtype

    def __call__(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)


def _read_step(tree: DraftTree, acc: Acceptance, scored_choice: torch.Tensor | None = None) -> _Read:
    """The host's one read of a verify step: the kept paths, their lengths and the new tokens, with the tree's
    well-formedness, in one `tolist` of one small tensor (each separate read would drain a GPU's queue); with
    `scored_choice` ([B, E], the target's argmax at scored nodes beside the tree), those and the nodes' validity
    too, for a drafter that works on the host (lookahead's window)."""
    # path: [B, P] padded past each row's length; the new tokens are the kept drafts (not the root), then the bonus
    b, p = acc.path.shape
    flags = tree.malformed().long() + 2 * (acc.invalid.long() if acc.invalid is not None else 0)
    parts = [acc.length[:, None], flags[:, None], acc.bonus[:, None], acc.path, tree.tokens.gather(1, acc.path)]
    if scored_choice is not None:
        parts += [scored_choice, tree.scored.valid.long()]
    packed = torch.cat(parts, dim=1).tolist()
    if any(row[1] & 1 for row in packed):
        raise ValueError(MALFORMED)
    if any(row[1] & 2 for row in packed):
        raise ValueError(NOT_A_DISTRIBUTION)
    lengths = [row[0] for row in packed]
    paths = [row[3:3 + p] for row in packed]
    tokens = [row[3 + p + 1:3 + p + n] + [row[2]] for row, n in zip(packed, lengths, strict=True)]
    seen = _Read(lengths, paths, tokens)
    if scored_choice is not None:
        e, at = scored_choice.shape[1], 3 + 2 * p
        seen.scored_choice = [row[at:at + e] for row in packed]
        seen.scored_valid = [[bool(v) for v in row[at + e:at + 2 * e]] for row in packed]
    return seen


def _pad_block(tokens, offsets, attend, valid, size: int):
    """A verify block of M nodes padded to `size`: padding nodes hold token 0 at the root's position, are
    invalid, and attend to nothing but themselves (the mask adds that)."""
    b, m = tokens.shape
    if size == m:
        return tokens, offsets, attend, valid
    padded = [tokens.new_zeros(b, size), offsets.new_zeros(b, size), valid.new_zeros(b, size)]
    for full, part in zip(padded, (tokens, offsets, valid), strict=True):
        full[:, :m] = part
    block = attend.new_zeros(b, size, size)
    block[:, :m, :m] = attend
    return padded[0], padded[1], block, padded[2]
