"""Drafters a user reaches by name, one per file, and the one table of their names.

`SelfSpecModel(target, "<name>")`, `scripts/bench.py --drafter <name>` and the error for an unknown name
all read `DRAFTERS`; a drafter that takes an argument is written `<name>:<argument>`. Trained drafters
(Medusa, EAGLE, EAGLE-3) are not here: they live in `heads/` and are passed as models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..drafting import Drafter
from . import gguf, layer_skip, lookahead, ngram, none, self_draft, staged
from .draft_model import DraftModelDrafter
from .lookup_first import LookupFirstDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .suffix import from_spec as suffix_from_spec


@dataclass(frozen=True)
class Entry:
    build: Callable  # (argument or None, target, tokenizer) -> Drafter
    usage: str  # how the name is written, with its argument
    when: str  # one line: when to use it


DRAFTERS: dict[str, Entry] = {}


def register(name: str, build: Callable, usage: str, when: str) -> None:
    if name in DRAFTERS:
        raise ValueError(f"a drafter named {name!r} is registered already")
    DRAFTERS[name] = Entry(build, usage, when)


register("ngram", ngram.from_spec, "ngram[:<longest n-gram>]",
         "no model at all: prompt lookup, for answers that copy from the prompt")
register("gguf", gguf.from_spec, "gguf[:<file.gguf>]",
         "a GGUF quantization of the target run by llama.cpp (default: the embedded target's own file)")
register("int8", self_draft.int8, "int8",
         "a copy of the target with int8 weight-only linears, drafting in torch")
register("int4", self_draft.int4, "int4",
         "the target's layers in 4-bit groups (GGUF's Q4_1), its LM head in int8 groups (Q8_0), run on selfspec's CPU "
         "kernel: for a target that was never 4-bit (one dequantized from such a GGUF, the embedded one, is verified on "
         "those weights already, and `none` runs faster)")
register("bf16", self_draft.bf16, "bf16", "a bfloat16 copy of the target, drafting in torch")
register("early_exit", self_draft.early_exit, "early_exit:<layers>",
         "the target's own first <layers> layers, final norm and LM head; no extra weights")
register("layerskip", layer_skip.from_spec, "layerskip[:<fraction>]",
         "the target minus the layers it can spare, chosen per request from agreement; no extra weights")
register("staged", staged.from_spec, "staged:<drafter>+ngram",
         "prompt lookup guesses for a self-drafter, which confirms and extends the guess in one forward")
register("lookahead", lookahead.from_spec, "lookahead[:<window>,<ngram>,<guesses>]",
         "no model: Jacobi iteration in the verify forward fills an n-gram pool (Fu et al. 2024)")
register("none", none.from_spec, "none",
         "no drafts: one token a target forward through selfspec's own forward, the baseline that tells its gain from "
         "drafting's")
register("suffix", suffix_from_spec, "suffix[:<drafter>]",
         "no model: suffix matches in the request and earlier responses (repeated requests); <drafter> elsewhere")


def known() -> str:
    return ", ".join(entry.usage for entry in DRAFTERS.values())


def build_drafter(spec: str, target, tokenizer=None) -> Drafter:
    """The drafter a name stands for, e.g. "ngram", "gguf", "early_exit:8", "staged:int8+ngram"."""
    name, sep, arg = spec.partition(":")
    entry = DRAFTERS.get(name.strip())
    if entry is None:
        raise ValueError(f"unknown drafter {spec!r}; the named drafters are: {known()}; or pass a trained "
                         "drafter (heads.load(...)), a causal LM sharing the target's tokenizer, or an "
                         "infer.Drafter")
    if sep and not arg.strip():
        raise ValueError(f"drafter {spec!r} has nothing after ':'; write {entry.usage}")
    return entry.build(arg.strip() if sep else None, target, tokenizer)


__all__ = ["DRAFTERS", "DraftModelDrafter", "LookupFirstDrafter", "NgramDrafter", "NoDrafter", "build_drafter",
           "known", "register"]
