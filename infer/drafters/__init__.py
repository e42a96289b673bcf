"""Drafters a user reaches by name, one per file, and the one table of their names.

`SelfSpecModel(target, "<name>")`, `scripts/bench.py --drafter <name>` and the error for an unknown name
all read `DRAFTERS`; a drafter that takes an argument is written `<name>:<argument>`. Trained drafters
(Medusa, EAGLE, EAGLE-3) are not here: they live in `heads/` and are passed as models.
"""

from __future__ import annotations

from . import gguf, layer_skip, lookahead, ngram, none, self_draft, staged
from .draft_model import DraftModelDrafter
from .lookup_first import LookupFirstDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .registry import DRAFTERS, build_drafter, known, register
from .suffix import from_spec as suffix_from_spec

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


__all__ = ["DRAFTERS", "DraftModelDrafter", "LookupFirstDrafter", "NgramDrafter", "NoDrafter", "build_drafter",
           "known", "register"]
