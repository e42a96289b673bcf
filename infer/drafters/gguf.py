"""The target's own weights, quantized in a GGUF file, drafting through llama.cpp.

A 4-bit copy of the target agrees with it on most next tokens, and llama.cpp runs it several times faster
than a transformers forward of the full-precision target on a CPU, so it is both close and cheap: the two
things a drafter needs. The drafter keeps one llama.cpp context per batch row; each step it cuts that
context back to the tokens the target committed (llama.cpp's sequence removal), feeds what it has not
seen, and drafts a chain whose length `AdaptiveLength` chooses from measured costs and acceptance.

The draft's tokenizer must be the target's: that is checked up front, token by token, when the target's
tokenizer is known. Exactness never depends on the draft: the target verifies every token.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from ..drafting import Drafter, TargetStep
from ..loading import target_tokenizer
from ..sampling import logits_to_probs, sample
from ..tree import DraftTree
from .adaptive import AdaptiveLength, modelled_cost
from .chain import chain_tree

LLAMA_CPP = "llama-cpp-python==0.3.36"  # the version measured; `pip install 'selfspec[gguf]'` pins it
MAX_CONTEXT = 32768  # llama.cpp allocates its KV cache up front; longer targets need n_ctx= explicitly


def _llama_class():
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise ImportError(f"the 'gguf' drafter runs the GGUF file with llama.cpp, which is not installed; "
                          f"install it with: pip install '{LLAMA_CPP}' (pip compiles it, about 8 minutes on "
                          "2 cores) or pip install 'selfspec[gguf]'") from err
    return Llama


def default_gguf() -> Path:
    """The GGUF file the embedded target (`smollm2-135m-instruct`) is read from."""
    from ..embedded import GGUF_FILE, gguf_dir

    return gguf_dir() / GGUF_FILE


class _Sequence:
    """One llama.cpp context and the tokens in its KV cache."""

    def __init__(self, llm):
        self.llm, self.fed = llm, []

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Make the context hold `tokens` (reusing their longest cached prefix); the logits after the last."""
        common = 0
        for a, b in zip(self.fed, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is fed again: only the newest logits are kept
        self.llm.n_tokens = common  # llama.cpp drops every cached position from here on before decoding
        self.fed = self.fed[:common]
        return self.extend(tokens[common:])

    def extend(self, tokens: list[int]) -> np.ndarray:
        """Feed tokens after everything cached; the logits after the last."""
        if len(self.fed) + len(tokens) > self.llm.n_ctx():
            raise ValueError(f"the GGUF draft context holds {self.llm.n_ctx()} tokens but this row needs "
                             f"{len(self.fed) + len(tokens)}; pass a larger n_ctx to GGUFDrafter")
        self.llm.eval(tokens)
        self.fed.extend(tokens)
        return self.logits()

    def logits(self) -> np.ndarray:
        from llama_cpp import llama_get_logits_ith

        ptr = llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))


class GGUFDrafter(Drafter):
    """Drafts chains with llama.cpp running a GGUF quantization of the target (default: the embedded
    target's own file). `max_tokens` caps a chain; `adaptive=False` always drafts `max_tokens`."""

    def __init__(self, path: str | os.PathLike | None = None, max_tokens: int = 12, adaptive: bool = True,
                 n_threads: int | None = None, n_ctx: int | None = None, tokenizer=None):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.path = Path(path).expanduser() if path is not None else default_gguf()
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}; pass the path of a .gguf quantization of "
                                    "the target, e.g. 'gguf:/models/target.Q4_K_M.gguf'")
        self._llama = _llama_class()
        self.max_tokens, self.n_threads, self.n_ctx = max_tokens, n_threads, n_ctx
        # greedy calls share one timed calibration; a sampled call gets a fresh modelled one (see AdaptiveLength)
        self.adaptive = adaptive
        self.timed_length = AdaptiveLength(max_tokens) if adaptive else None
        self.length = self.timed_length
        self.tokenizer = tokenizer
        self._free: list[_Sequence] = []  # contexts not bound to a row, reused by the next generate
        self.rows: list[_Sequence] = []
        self._opened: list = []  # every llama.cpp context, closed with the drafter or at interpreter exit
        weakref.finalize(self, _close_all, self._opened)

    # ---------------------------------------------------------------- set-up
    def _new_sequence(self) -> _Sequence:
        threads = self.n_threads or torch.get_num_threads()
        llm = self._llama(model_path=str(self.path), n_ctx=self._context_size, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
        self._opened.append(llm)
        return _Sequence(llm)

    def check_target(self, target) -> None:
        text = target.config.get_text_config()
        positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        self._context_size = self.n_ctx or min(int(positions or 4096) + 1, MAX_CONTEXT)
        self._free.append(self._new_sequence())
        llm = self._free[0].llm
        self.vocab = llm.n_vocab()
        if self.vocab > text.vocab_size:
            raise ValueError(f"{self.path.name} has {self.vocab} tokens but the target only {text.vocab_size}: "
                             "the draft must be a quantization of the target, with its tokenizer")
        self.target_vocab = text.vocab_size
        tokenizer = self.tokenizer or target_tokenizer(target)
        if tokenizer is None:
            warnings.warn(f"cannot check that {self.path.name} uses the target's tokenizer (pass tokenizer= to "
                          "SelfSpecModel); if it does not, drafts are rejected and generation is slow",
                          stacklevel=4)
            return
        ours = tokenizer.convert_ids_to_tokens(list(range(self.vocab)))
        for i, token in enumerate(ours):
            theirs = llm._model.token_get_text(i)
            if token is not None and theirs != token:
                raise ValueError(f"{self.path.name} does not use the target's tokenizer: token {i} is "
                                 f"{theirs!r} there and {token!r} in the target's; use a GGUF converted from "
                                 "the target itself")

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self._free.extend(self.rows)
        while len(self._free) < batch_size:
            self._free.append(self._new_sequence())
        self.rows, self._free = self._free[:batch_size], self._free[batch_size:]
        self.context: list[list[int]] = [[] for _ in range(batch_size)]
        self.length = self.timed_length
        if self.adaptive and getattr(sampling, "do_sample", False):  # modelled: the file's bytes over the target's
            self.length = AdaptiveLength(self.max_tokens, cost=modelled_cost(self.path.stat().st_size, target))
        if self.length is not None:
            self.length.new_generation()

    # ---------------------------------------------------------------- the loop
    def observe(self, step: TargetStep) -> None:
        tokens, valid = step.tokens.tolist(), step.valid.tolist()
        for row, (toks, ok) in enumerate(zip(tokens, valid, strict=True)):
            self.context[row].extend(t for t, v in zip(toks, ok, strict=True) if v)
        if self.length is not None:
            self.length.judged(step.valid.sum(1) - 1)  # a no-op after the prefill
        self.roots = step.next_tokens

    def propose(self, budget: torch.Tensor) -> DraftTree:
        k = max(0, min(self.max_tokens, int(budget.max())))
        rows = len(self.rows)
        if k and self.length is not None and not self.length.worth_drafting():
            # drafting has not paid lately: this step verifies the roots alone (llama.cpp catches up later)
            return chain_tree(self.roots, self.roots.new_zeros(rows, 0), self.roots.new_zeros(rows))
        drafts = torch.zeros(rows, k, dtype=torch.long)
        lengths = torch.zeros(rows, dtype=torch.long)
        q = torch.zeros(rows, k, self.target_vocab) if self.sampling.do_sample and k else None
        if self.length is not None:
            self.length.start(rows)
        roots = self.roots.tolist()
        for row, seq in enumerate(self.rows):
            limit = min(k, int(budget[row]))
            if limit == 0:
                continue
            logits = seq.feed(self.context[row] + [roots[row]])
            for i in range(limit):
                token, confidence, probs = self._pick(logits)
                drafts[row, i] = token
                if q is not None:
                    q[row, i, :self.vocab] = probs
                lengths[row] = i + 1
                more = self.length.keep_going(row, confidence) if self.length is not None else True
                if i + 1 == limit or not more:
                    break
                logits = seq.extend([token])  # the draft so far is cached: no prefix to compare
        if self.length is not None:
            self.length.drafted()
        device = self.roots.device
        return chain_tree(self.roots, drafts.to(device), lengths.to(device), None if q is None else q.to(device))

    def _pick(self, logits: np.ndarray) -> tuple[int, float, torch.Tensor | None]:
        """The draft token, the drafter's probability for it, and the distribution it was drawn from."""
        if self.sampling.do_sample:
            probs = logits_to_probs(torch.from_numpy(logits.copy()), self.sampling)
            token = int(sample(probs[None], self.generator)[0])
            return token, float(probs[token]), probs
        token = int(logits.argmax())
        top = logits[token]
        confidence = 1.0 / float(np.exp(logits - top).sum())
        return token, confidence if math.isfinite(confidence) else 0.0, None

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = [int(r) for r in rows]
        self._free.extend(seq for i, seq in enumerate(self.rows) if i not in keep)
        self.rows = [self.rows[r] for r in keep]
        self.context = [self.context[r] for r in keep]
        self.roots = self.roots[rows]
        if self.length is not None:
            self.length.select_rows(rows)


def _close_all(contexts: list) -> None:
    # llama-cpp-python frees contexts in __del__, which fails once the interpreter tears down its modules
    for llm in contexts:
        llm.close()
    contexts.clear()


def from_spec(arg: str | None, target, tokenizer=None) -> GGUFDrafter:
    """`gguf` (the embedded target's GGUF) or `gguf:<path to .gguf>`."""
    return GGUFDrafter(arg or None, tokenizer=tokenizer)
