"""What the engine is asked to do (`EngineOptions`) and what it runs (`Plan`).

`SelfSpecModel(target, drafter, **options)` checks its options once, here, before any work; a policy
(`infer.policy.settle`) then times the machine where it must and settles every "where it pays" choice into a
`Plan`; the engine (`infer.engine.Engine`) only runs the plan it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .drafting import Drafter

_FLAGS = ("typical_acceptance", "compile", "int8_argmax", "int8_drafter", "freeze_gc")  # True or False
_AUTO_FLAGS = ("cpu_prepack", "lookup_first", "lean_verify", "draft_batches", "captured_step")  # True, False or None (where it pays)


@dataclass(frozen=True)
class EngineOptions:
    """Every option of `SelfSpecModel`, checked when made: a flag must be a bool (the string "false" is refused),
    and each error names the option.

    `typical_acceptance`: when sampling, accept drafts by Medusa's typical acceptance
    (`infer.verify.accept_typical`: faster, not lossless); greedy decoding stays greedy.

    `tokenizer`: the target's tokenizer; a trained drafter checks it against the one it was trained with (None:
    looked for beside the target).

    `cpu_prepack`: run multi-row matmuls of target and drafter on prepacked oneDNN weights (`infer.cpu`), or on
    selfspec's streamed kernel for the block sizes where it measured faster on this machine
    (`infer.tuning.plan.stream_rows`, timed once per machine and cached), and one fp32 row there too where it beat
    torch's GEMV by a margin (`stream_one_row`: fp32 sums in another order than transformers', so only where it pays);
    None = on for an fp32 CPU target whose linear weights take at most a quarter of RAM (off for the target when its
    verify is compiled).

    `lookup_first`: wrap the drafter in `LookupFirstDrafter` (prompt lookup where the context repeats itself, the
    drafter elsewhere); None = as a trained drafter's config says (`lookup_first`, set by
    `scripts/calibrate.py --write` where lookup first measured faster on held-out prompts), else off.

    `compile`: run the drafter's own one-token forwards through `torch.compile` where it has any (the draft-model
    and self-drafters: `bf16`, `int8`, `int4`, `early_exit`, ...), and with `static_cache` the target's verify
    forward too (one graph per bucket; on the captured step, the forward its graphs capture). The first generate
    pays the compiles. A compiler failure falls back to eager with one warning. On a CPU the compiled verify has not
    paid (docs/benchmarks.md).

    `static_cache`: the target's KV cache is preallocated for the whole generation and committed in place (True:
    room for prompt + max_new_tokens, rounded up to 256 slots but never past the target's context, and kept for
    later calls of the same batch size while they fit; an int, at most the context: that many tokens of prompt
    plus output, and a longer request is refused before any work), with `infer.kv.VERIFY_ROOM` more slots for
    the block being verified; verify blocks are padded to `infer.kv.VERIFY_BUCKETS` node counts, so the
    verify forward has a few fixed shapes. The cache stays allocated between calls (`free_cache()` drops it). None
    (the default): on for a target on one CUDA device, where the captured step needs it; off elsewhere.

    `tree` (trained drafters only): a dict of tree settings overriding the drafter's saved ones, or "calibrated":
    the tree that maximizes predicted tokens/s on this machine, from the acceptance statistics
    `scripts/calibrate.py --write` stored with the drafter and this machine's verify and draft costs, measured on
    first use and cached per device (`infer.tree_choice.calibrated_tree`).

    `step_observer`: called as `step_observer(tree, acceptance, budget)` after every verify step with the verified
    `DraftTree`, the `infer.verify.Acceptance` and the [B] depth budget the tree was cut to (live rows only), e.g.
    to count which nodes are accepted (`infer.tuning.acceptance.AcceptanceRecorder`); None costs nothing.

    `lean_verify`: run the target's prefill and verify forwards as `infer.cpu.lean_forward.LeanForward` computes
    them (the same function in fewer, larger ops, on the user's weights as they are) instead of through the model's
    modules. None = wherever it can: with `cpu_prepack` on a Llama-layout target (`infer.cpu.lean_forward.why_not`,
    checked again at every call), not compiled, and no forward hook of the user's on the target at the call (hooks then see every
    forward). True where it cannot is an error; False = never. `last_stats["verify_forward"]` says which ran.
    Unless False, an EAGLE-3 drafter's forwards run the same way where they can (`heads.eagle3.lean.LeanEagle3`:
    widened q/k/v over a Llama-layout layer, fp32 on CPU, no hook of the user's on the drafter).

    `int8_argmax`: where the lean forward verifies and only each node's greedy token is read (greedy, no typical
    acceptance, no token bans from suppress_tokens, begin_suppress_tokens or min_new_tokens), take it through
    `infer.cpu.argmax_head.ArgmaxHead`: an int8 copy of the LM head finds the tokens that could be the argmax (a
    proven bound), its own rows score them. The same tokens, for a quarter of an fp32 head's bytes (half of a bf16
    head's); the copy is kept while the weight is unchanged. False = the full head always.

    `int8_drafter`: where an EAGLE-3 drafter's forward runs lean, draft from int8 copies of its weights
    (`heads.eagle3.lean.LeanEagle3`): its LM head's scores the draft vocabulary, and those of its `fc` and layers
    run every draft step (not the prompt) on the streamed kernel. Drafting reads a quarter of the bytes and may
    rank near-ties otherwise; the output is the same. False = its fp32 weights.

    `draft_batches`: whether a call of several rows drafts. A trained drafter's tree is chosen for one row, and
    each further row costs the verify forward nearly as much again on a CPU, so a tree that pays on one row can
    lose on several (docs/benchmarks.md, "Batches"). None = where a drafter with acceptance statistics
    (`scripts/calibrate.py --write`) is predicted to be faster than no drafts at the call's batch size by more than
    `infer.policy.BATCH_MARGIN` (`infer.tree_choice.predict_batch`: timed on the first call of each batch size,
    then cached), else with no drafts; the same output either way, and `last_stats["batch_drafting"]` says which
    ran and why. True = always draft; False = a call of several rows never drafts. One-row calls always draft.

    `captured_step` (needs `static_cache`): the target's verify forward runs over static input buffers, one set per
    `infer.engine.VERIFY_BUCKETS` node count, captured as a CUDA graph per bucket on a GPU and replayed every step
    (`infer.cuda.StepGraphs`), and the drafter drafts without host reads (`infer.drafting.Drafter.sync_free`); an
    EAGLE or EAGLE-3 drafter's forwards after the prompt's run the same way over a static cache of its own. On a
    CPU the same buffers run uncaptured, which only tests the path. With `compile`, the forward each graph captures
    is the target's compiled one (inductor's fused kernels, without inductor's own CUDA graphs): the fused captured
    step. None = on for a CUDA target with `static_cache`.

    `freeze_gc`: once per process, when the first engine is made, collect garbage and move every object then alive
    (the imported modules of torch and transformers, the loaded models: some 420k objects) into the garbage
    collector's permanent generation (`gc.freeze`), as vLLM does after its warm-up. A full collection then scans
    only what came after, instead of costing ~0.2 s mid-generation (measured on this project's CPU: one every few
    generations of the drafted path, 1.7-5% of their time). Objects frozen are still freed when their last reference
    goes; only reference cycles among them are never collected. False = the collector as it is.
    """

    typical_acceptance: bool = False
    tokenizer: object = None
    cpu_prepack: bool | None = None
    lookup_first: bool | None = None
    compile: bool = False
    static_cache: bool | int | None = None
    tree: dict | str | None = None
    step_observer: Callable | None = None
    lean_verify: bool | None = None
    int8_argmax: bool = True
    int8_drafter: bool = True
    draft_batches: bool | None = None
    captured_step: bool | None = None
    freeze_gc: bool = True

    def __post_init__(self):
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in _AUTO_FLAGS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        static = self.static_cache
        if static is not None and (not isinstance(static, (bool, int)) or (type(static) is int and static < 1)):
            raise ValueError(f"static_cache must be True, False, None or a number of tokens >= 1, got {static!r}")
        if self.captured_step and self.static_cache is False:
            raise ValueError("captured_step=True needs static_cache (True or a number of tokens): graphs are captured "
                             "over the preallocated cache")
        if self.tree is not None and not isinstance(self.tree, dict) and self.tree != "calibrated":
            raise ValueError(f"tree must be a dict of tree settings, 'calibrated' or None, got {self.tree!r}")
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "get_vocab", None)):
            raise ValueError(f"tokenizer must be the target's tokenizer (a transformers tokenizer) or None, got "
                             f"{type(self.tokenizer).__name__}")
        if self.step_observer is not None and not callable(self.step_observer):
            raise ValueError(f"step_observer must be a function called after every verify step, or None, got "
                             f"{self.step_observer!r}")

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def of(cls, **options) -> EngineOptions:
        """The options from keywords, an unknown one refused by name."""
        unknown = sorted(set(options) - cls.names())
        if unknown:
            raise TypeError(f"SelfSpecModel got {', '.join(unknown)}: not an option; the options are "
                            f"{', '.join(f.name for f in fields(cls))} (infer.options.EngineOptions)")
        return cls(**options)


@dataclass(frozen=True)
class Plan:
    """What the engine runs, settled from `EngineOptions` for one target and drafter on this machine; the engine
    reads it and chooses nothing."""

    options: EngineOptions  # as asked (a calibrated tree is the chosen dict by now)
    drafter: Drafter  # what drafts, prompt lookup first wrapped around it where asked
    cpu_prepack: bool  # multi-row matmuls of target and drafter on prepacked weights or the streamed kernel
    stream_rows: int  # blocks of 2..this many rows run on the streamed kernel (0: none)
    lean_verify: bool  # prefill and verify through the lean forward, where it can run at the call
    drafter_stream_rows: int | None  # a drafter with lean forwards of its own runs them so (None: its modules)
    # per batch size of more than one row: whether the call drafts, and why (None: it does, nothing predicted)
    batch_drafting: Callable[[int], dict | None] | None = None
    # the verify forward over static buffers per node bucket (CUDA graphs on a GPU), and drafting without host reads
    captured_step: bool = False
    # greedy acceptance walks the tree on the host, from one read of the target's choices: where the target runs on
    # a CPU, a read costs nothing and a Python walk fewer calls than the device's tensor ops (`verify.accept_greedy_host`)
    host_acceptance: bool = False
    # an fp32 target's one-row blocks (a step without drafts) on the streamed kernel, where it beat torch's GEMV by a
    # margin on this machine (`infer.tuning.plan.stream_one_row`)
    stream_one_row: bool = False
