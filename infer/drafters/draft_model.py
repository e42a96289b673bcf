"""A separate, smaller causal LM with the target's tokenizer drafts a chain autoregressively."""

from __future__ import annotations

import contextlib
import warnings

import torch

from ..attention import prompt_tree
from ..cpu.lean_forward import LeanForward, Unsupported
from ..drafting import Drafter, TargetStep
from ..kv import KVState, forward_block
from ..sampling import logits_to_probs, sample
from ..tree import DraftTree
from .adaptive import AdaptiveLength, forward_bytes, modelled_cost
from .chain import chain_tree


class DraftModelDrafter(Drafter):
    """A smaller causal LM with the target's tokenizer drafts up to `num_tokens` tokens autoregressively
    (Leviathan et al. 2023; Chen et al. 2023). When sampling, drafts are drawn from the draft model's
    processed distribution q, which verification uses for rejection sampling. With `adaptive=True` a row
    stops drafting where one more token no longer pays (`AdaptiveLength`); otherwise every row drafts
    `num_tokens`. Under `sync_free` (the engine's captured step) propose and observe read nothing on the host: every
    row drafts `num_tokens` (no adaptive stop, no stop at the budget: the engine prunes each row's chain to it), and
    what the host needs of a step (how many tokens each row kept) comes from the engine's one read
    (`TargetStep.on_host`).

    `lean_quantized`: the model's linears are all `infer.cpu.linear.Int8Linear` or `Int4Linear` (the `int8` and
    `int4` self-drafters' copies of the target), and its forwards run as `infer.cpu.lean_forward.LeanForward` computes
    them, one kernel call a layer, where that can run the model (a Llama-layout model, the kernel built);
    elsewhere its own forward runs. Transformers' modules around the quantized matmuls cost more than the matmuls
    do on a 2-core CPU (docs/benchmarks.md).

    `prompt_kv_from_target`: the model's decoder layers are the target's first layers or copies of them (the
    self-drafters: a lower-precision copy, or its first k layers), so their K/V for the prompt are the target's,
    exactly or to the copy's rounding; the prefill copies them from the target's cache instead of running the
    model over the prompt. Only the drafts can change, never the output."""

    def __init__(self, model, num_tokens: int = 4, adaptive: bool = False, lean_quantized: bool = False,
                 prompt_kv_from_target: bool = False):
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.model, self.num_tokens, self.lean_quantized = model.eval(), num_tokens, lean_quantized
        self.prompt_kv_from_target = prompt_kv_from_target
        self.decode = None  # the compiled one-token forward, once compile_forwards() is called
        self.compiled_rows: set[int] = set()  # batch sizes it has compiled a graph for
        self.adaptive = adaptive
        # greedy calls share one timed calibration (their output never depends on it); a sampled call gets its
        # own, modelled and fresh (`AdaptiveLength`'s docstring says why)
        self.timed_length = AdaptiveLength(num_tokens) if adaptive else None
        self.length = self.timed_length
        text = model.config.get_text_config()
        self.max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)

    def check_target(self, target) -> None:
        mine, theirs = self.model.config.get_text_config(), target.config.get_text_config()
        if mine.vocab_size != theirs.vocab_size:
            raise ValueError(f"draft model vocab_size {mine.vocab_size} != target vocab_size "
                             f"{theirs.vocab_size}: a draft model must share the target's tokenizer")
        if self.model.device != target.device:
            raise ValueError(f"draft model is on {self.model.device} but the target is on {target.device}; "
                             "move both to one device")

    def compile_forwards(self) -> bool:
        """Run the one-token draft forwards through `torch.compile` (shapes dynamic over the cache length,
        so one graph serves a whole generation); the catch-up block stays eager. The first call compiles
        (about 40 s for SmolLM2-135M on 2 CPU cores); if compiling fails, drafting goes on eagerly after
        one warning naming why."""
        self.decode = torch.compile(self.model, dynamic=True)
        return True

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.kv = KVState(batch_size, target.device, self.model.config, roomy=self.decode is None)
        self.lean = self._lean_forward()
        self.pending: list[torch.Tensor] = []  # committed tokens the draft model has not seen, per row
        self.committed: list[int] = []  # per row, tokens committed so far: the draft cache's plus the pending ones
        self.pend_aligned = True  # every row's pending tokens filled the last catch-up block (nothing to move)
        self.start = self.fed = 0
        self.off = False  # set once a row outgrows the draft model's context
        sampled = getattr(sampling, "do_sample", False)
        self.length = None if self.sync_free else (
            self._sampled_length() if self.adaptive and sampled else self.timed_length)
        if self.length is not None:
            self.length.new_generation()

    def _sampled_length(self) -> AdaptiveLength:
        """A sampled call's draft lengths: from acceptance and the model's bytes, so one seed, one sample."""
        return AdaptiveLength(self.num_tokens, cost=modelled_cost(forward_bytes(self.model), self.target))

    def observe(self, step: TargetStep) -> None:
        if self.off:  # past the draft model's context: the target goes on alone
            self.roots = step.next_tokens
            return
        kept = [len(tokens) for tokens in step.on_host()[0]]  # per row: the prompt, or the root and kept drafts
        if self.kv.size == 0:  # prefill: the whole prompt
            self.committed = kept
            if self.max_positions and max(kept) >= self.max_positions:
                self.off, self.roots = True, step.next_tokens
                return
            depth, ancestors, valid = prompt_tree(step.valid)
            copy = PromptKV.of(step.prompt_cache, self.model, step.tokens.shape[1]) if (
                self.prompt_kv_from_target) else None
            forward_block(copy or self._runner(), self.kv, depth, ancestors, valid, input_ids=step.tokens,
                          logits_to_keep=1)
            self.kv.mark_valid(valid)
            self.pending = [step.tokens.new_empty(0)] * step.tokens.shape[0]
        else:
            # Slots since the last propose: [pending (left-padded), root, d1, ..., d_{fed-1}]. Keep the
            # pending ones and the chain nodes the target accepted; queue accepted tokens never fed.
            accepted = step.valid.sum(1)
            keep = torch.cat([self.pend_valid, self._chain_slots_kept(accepted)], dim=1)
            order = (~keep).long().argsort(dim=1, stable=True)  # kept slots first, in order
            self.kv.commit(self.start, order, keep.gather(1, order), in_place=self._kept_in_place())
            fed = self._nodes_fed(len(kept))
            self.pending = [step.tokens[b, fed[b]:kept[b]] for b in range(len(kept))]
            self.committed = [n + k for n, k in zip(self.committed, kept, strict=True)]
            if self.length is not None:
                self.length.judged(accepted - 1)
        self.roots = step.next_tokens

    def _chain_slots_kept(self, accepted: torch.Tensor) -> torch.Tensor:
        """[B, fed] bool: which chain slots of the last propose hold a node the target kept. Here chain slot
        i holds node i (the root, then each draft but the last)."""
        return torch.arange(self.fed, device=accepted.device)[None, :] < accepted[:, None]

    def _kept_in_place(self) -> bool | None:
        """Whether the slots observe keeps are where they go already (no move; known without a read): the chain's
        kept nodes are a prefix of it, right after the pending tokens, so they are in place where no row's pending
        tokens were left-padded; where one was, its kept slots move (its root is always kept)."""
        return self.pend_aligned

    def _nodes_fed(self, rows: int) -> list[int]:
        """Per row, how many tree nodes (root first) the last propose fed to the draft cache."""
        return [self.fed] * rows

    def _skip_drafting(self) -> DraftTree:
        """Nothing to draft; the root reaches the draft cache with the next block."""
        b = self.roots.shape[0]
        self.start, self.fed, self.pend_aligned = self.kv.size, 0, True
        self.pend_valid = torch.zeros(b, 0, dtype=torch.bool, device=self.roots.device)
        self.pending = [torch.cat([p, self.roots[r:r + 1]]) for r, p in enumerate(self.pending)]
        return chain_tree(self.roots, self.roots.new_zeros(b, 0), self.roots.new_zeros(b))

    def _catch_up_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed tokens the draft model has not seen and the root, as one left-padded block
        ([B, W] ids and validity); starts the bookkeeping of this propose."""
        b = self.roots.shape[0]
        width = max(len(p) for p in self.pending) + 1
        block = self.roots.new_zeros(b, width)
        valid = torch.zeros(b, width, dtype=torch.bool, device=block.device)
        for row, pend in enumerate(self.pending):
            seq = torch.cat([pend, self.roots[row:row + 1]])
            block[row, width - len(seq):] = seq
            valid[row, width - len(seq):] = True
        self.start, self.fed = self.kv.size, 0
        self.pend_valid = valid[:, :-1]
        self.pend_aligned = all(len(pend) == width - 1 for pend in self.pending)
        return block, valid

    def _room(self, budget: torch.Tensor) -> int:
        """How many tokens to draft this step: at most num_tokens, the budget, and what still fits in the
        draft model's context (a short-context draft model stops drafting; the target goes on alone);
        none on a step where `AdaptiveLength` finds that drafting does not pay."""
        k = self.num_tokens if self.sync_free else max(0, min(self.num_tokens, int(budget.max())))
        if self.off or (k and self.length is not None and not self.length.worth_drafting()):
            return 0
        if self.max_positions and self._used() + k > self.max_positions:
            k = max(0, self.max_positions - self._used())
            self.off = k == 0
        return k

    def _used(self) -> int:
        """The longest row's next position once its pending tokens and the root are fed: what it has committed, and
        the root."""
        return max(self.committed) + 1

    def propose(self, budget: torch.Tensor) -> DraftTree:
        k = self._room(budget)
        b = self.roots.shape[0]
        if k == 0:
            return self._skip_drafting()
        block, valid = self._catch_up_block()
        depth, ancestors, node_valid = prompt_tree(valid)
        inputs, drafts, qs = block, [], []
        one = torch.ones(b, 1, dtype=torch.bool, device=block.device)
        lengths = torch.zeros(b, dtype=torch.long)
        going = None if self.sync_free else (budget > 0).cpu()  # rows still drafting (host-side)
        if self.length is not None:
            self.length.start(b)
        for i in range(k):
            logits = self._forward(i > 0, depth, ancestors, node_valid, inputs).logits[:, -1]
            self.kv.mark_valid(node_valid)
            self.fed += 1
            if self.sampling.do_sample:
                q = logits_to_probs(logits, self.sampling)
                token = sample(q, self.generator)
                qs.append(q)
            else:
                q, token = None, logits.argmax(-1)
            drafts.append(token)
            if going is not None:  # where a read costs nothing: rows stop at their budget or where drafting no
                lengths[going] = i + 1  # longer pays
                if self.length is not None:
                    going &= self._keep_going(logits if q is None else q, token, going)
                going &= budget.cpu() > i + 1
                if not going.any():
                    break
            # The next query is one new node right after everything fed so far.
            inputs, depth, ancestors, node_valid = token[:, None], torch.zeros_like(inputs[:, :1]), one[..., None], one
        if self.length is not None:
            self.length.drafted()
        q = torch.stack(qs, 1) if qs else None
        # sync_free: every row's whole chain, which the engine prunes to its budget
        lengths = self.roots.new_full((b,), len(drafts)) if going is None else lengths.to(self.roots.device)
        return chain_tree(self.roots, torch.stack(drafts, 1), lengths, q)

    def _lean_forward(self) -> LeanForward | None:
        """This generation's lean forward of the quantized model, or None where its own forward runs every block."""
        if not self.lean_quantized or self.decode is not None:
            return None
        with contextlib.suppress(Unsupported):
            return LeanForward(self.model, 0, None, quantized=True)  # quantized linears: the kernel at any size
        return None

    def _runner(self):
        """What runs the draft model's eager forwards: its lean forward where there is one, else itself."""
        return self.lean if self.lean is not None else self.model

    def _forward(self, one_token: bool, depth, ancestors, node_valid, inputs):
        """The draft model on a block after its cache: compiled for one-token blocks where it was asked for."""
        if not (one_token and self.decode is not None):
            return forward_block(self._runner(), self.kv, depth, ancestors, node_valid, input_ids=inputs,
                                 logits_to_keep=1)
        sizes = [layer.get_seq_length() for layer in self.kv.cache.layers]
        if self.length is not None and inputs.shape[0] not in self.compiled_rows:
            self.length.untimed()  # this call compiles (once per batch size): not a draft cost
        self.compiled_rows.add(inputs.shape[0])
        try:
            return forward_block(self.decode, self.kv, depth, ancestors, node_valid, input_ids=inputs,
                                 logits_to_keep=1)
        except Exception as err:  # noqa: BLE001 -- any compiler failure: go on eagerly, as promised
            warnings.warn(f"compiling the draft forward failed ({type(err).__name__}: {str(err)[:200]}); "
                          "drafting goes on without compiling", stacklevel=3)
            self.decode = None
            for layer, size in zip(self.kv.cache.layers, sizes, strict=False):  # undo what part of it wrote
                layer.crop(size - layer.get_seq_length())
            return forward_block(self.model, self.kv, depth, ancestors, node_valid, input_ids=inputs,
                                 logits_to_keep=1)

    def _keep_going(self, scores: torch.Tensor, token: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """[B] bool: rows still drafting for which `AdaptiveLength` says one more draft pays. `scores` are
        the sampled-from probabilities when sampling, else logits."""
        probs = scores if self.sampling.do_sample else torch.softmax(scores.float(), dim=-1)
        confidence = probs.gather(1, token[:, None])[:, 0].tolist()
        return torch.tensor([bool(on) and self.length.keep_going(r, c)
                             for r, (on, c) in enumerate(zip(drafting.tolist(), confidence, strict=True))])

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.length is not None:
            self.length.select_rows(rows)
        self.kv.select_rows(rows)
        self.pending = [self.pending[int(r)] for r in rows]
        self.committed = [self.committed[int(r)] for r in rows]
        self.roots = self.roots[rows]


class PromptKV:
    """Run in the draft model's place on the prompt (`KVState.forward` calls it as it would the model): writes the
    target's K/V of the prompt, from its cache, into the draft's cache, one layer per draft layer, in the draft's
    dtype. Returns nothing: the prefill reads no logits."""

    def __init__(self, target_cache, model):
        self.source, self.dtype = target_cache, model.dtype
        self.layers = model.config.get_text_config().num_hidden_layers

    @classmethod
    def of(cls, target_cache, model, n: int) -> PromptKV | None:
        """One for a prompt of `n` slots, or None where the target's cache does not hold every draft layer's
        first `n` slots as [B, H, S, D] tensors (none given, fewer layers, a window that dropped slots)."""
        if target_cache is None:
            return None
        made = cls(target_cache, model)
        layers = getattr(target_cache, "layers", [])
        if len(layers) < made.layers:
            return None
        for layer in layers[:made.layers]:
            keys = getattr(layer, "keys", None)
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[2] < n:
                return None
        return made

    def __call__(self, input_ids, *, cache, **model_inputs):
        # model_inputs (mask, positions, ...): what the model would read to compute the K/V it copies
        n = input_ids.shape[1]
        for i in range(self.layers):
            layer = self.source.layers[i]
            cache.update(layer.keys[:, :, :n].to(self.dtype), layer.values[:, :, :n].to(self.dtype), i)
