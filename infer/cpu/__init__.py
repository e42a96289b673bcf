"""CPU-only acceleration, in one place: what runs only where the target is an fp32 model on a CPU.

- `linear`: prepacked oneDNN weights, and selfspec's streamed kernel (`kernels/few_rows_linear.cpp`, compiled on
  first use) for the few-row matmuls of a verify step; the int8 and int4 linears the self-drafters run on it;
- `lean_forward`: the target's prefill and verify forward as plain tensor code on that kernel (Llama layout);
- `argmax_head`: an int8 copy of the LM head for greedy verification, exact for every token that could win;
- `gqa_attention`: sdpa over grouped K/V heads without a copy of the cache per query head.

The engine reaches them through this module only (`shared_pack_cache`, `prepacked_linears`, `lean_verify_forward`,
`attention`); on any other device each is a no-op or stands aside. Where they pay is decided before the engine
runs (`infer.tuning.plan`, which reads the submodules).
"""

from __future__ import annotations

import contextlib

from . import argmax_head, gqa_attention, lean_forward, linear
from .linear import PackCache, prepacked_linears, shared_pack_cache


def attention(target, impl: str) -> str:
    """The attention `target` runs with during a generate call where it would run `impl` (a maskable one): on a
    CPU, sdpa over grouped K/V heads as `gqa_attention` runs it."""
    return gqa_attention.NAME if impl == "sdpa" and target.device.type == "cpu" else impl


def lean_verify_forward(target, stream_rows: int, packed: PackCache, argmax_only: bool,
                        one_row: bool = False) -> lean_forward.LeanForward | None:
    """This call's lean forward of `target`, or None where the model's own must run: a forward hook of the user's on
    it (hooks see every forward), or a layer adapted since the plan was made. Made per call: the user may have
    added a hook, adapted a layer (LoRA, quantization) or swapped a weight since the last one."""
    if lean_forward.user_hooks(target):
        return None
    with contextlib.suppress(lean_forward.Unsupported):
        return lean_forward.LeanForward(target, stream_rows, packed, argmax_only=argmax_only, one_row=one_row)
    return None


__all__ = ["PackCache", "argmax_head", "attention", "gqa_attention", "lean_forward", "lean_verify_forward", "linear",
           "prepacked_linears", "shared_pack_cache"]
