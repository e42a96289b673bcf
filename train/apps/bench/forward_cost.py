"""How much more one target forward costs when it scores n new tokens instead of 1.

This is the number speculative decoding lives on: verifying a tree of n drafted tokens costs one forward
over n tokens, so the speedup is bounded by tau / (cost(n) / cost(1)). The forward runs on top of a KV
cache of `--context` tokens, as a verification step does mid-generation, once with plain `nn.Linear`, once
with oneDNN's prepacked weights, and once as SelfSpecModel ran it on CPU before the lean forward: blocks of
up to `stream_rows` rows on the streamed kernel, larger ones prepacked (infer/cpu/linear.py). The last two
columns time a verify block as the engine runs it now, in its own KV cache under its tree mask (what tree
calibration times): through the model's modules (`lean_verify=False`), and through the lean forward
(infer/cpu/lean_forward.py) where the target takes it. On a CPU every timed forward starts with the weights out of
the caches (128 MB written before it), as in generation, where the drafter's pass comes between two verifies.

    python scripts/forward_cost.py --target smollm2-135m-instruct --context 256
"""

from __future__ import annotations

import argparse
import json
import os

import torch

# timed as calibration times
from infer.tuning.plan import stream_rows
from infer.tuning.timing import block_costs, forward_cost, median_seconds


def static_forward_cost(model, context: int, sizes: list[int], repeats: int, compiled: bool = False) -> dict[int, float]:
    """Median seconds of one verify-shaped forward over n tree nodes on the engine's static KV cache
    (`SelfSpecModel(static_cache=True)`: masks over the whole capacity, blocks written in place, then
    forgotten), eagerly or through `torch.compile` (one graph per n, compiled in the warm-up run)."""
    from infer.attention import prompt_tree
    from infer.kv import VERIFY_ROOM, KVState

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=g)
    kv = KVState(1, prefix.device, model.config, capacity=context + max(sizes) + VERIFY_ROOM)
    run = torch.compile(model, dynamic=False) if compiled else model
    out = {}
    with torch.inference_mode():
        depth, ancestors, valid = prompt_tree(torch.ones_like(prefix))
        kv.forward_tree(model, depth, ancestors, valid, input_ids=prefix, use_cache=True, logits_to_keep=1)
        kv.mark_valid(valid)
        for n in sizes:
            ids = torch.randint(0, vocab, (1, n), generator=g)
            depth, ancestors, valid = prompt_tree(torch.ones_like(ids))  # a chain: the widest attention a tree has
            # the first run is a warm-up (and the compile)
            out[n] = median_seconds(lambda: kv.forward_tree(run, depth, ancestors, valid, input_ids=ids,  # noqa: B023
                                                             use_cache=True),
                                     repeats, prefix.device, after=lambda: kv.rollback(context))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all logical CPUs)")
    parser.add_argument("--static", action="store_true",
                        help="also on the engine's static KV cache, eager and compiled (torch.compile)")
    return parser


def main(argv=None) -> int:
    from infer.loading import resolve_target

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, _ = resolve_target(args.target)
    columns = cpu_columns(model, args.context, args.sizes, args.repeats)
    if args.static:
        columns["static"] = static_forward_cost(model, args.context, args.sizes, args.repeats)
        columns["static compiled"] = static_forward_cost(model, args.context, args.sizes, args.repeats, compiled=True)
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; cost relative to a plain 1-token forward")
    print("| new tokens | " + " | ".join(f"{name} ms | {name} cost" for name in columns) + " |")
    print("| ---: |" + " ---: | ---: |" * len(columns))
    one = columns["plain"][args.sizes[0]]
    for n in args.sizes:
        print(f"| {n} | " + " | ".join(f"{c[n] * 1e3:.1f} | {c[n] / one:.2f}x" for c in columns.values()) + " |")
    print(json.dumps({kind: {str(n): s for n, s in costs.items()} for kind, costs in columns.items()}))
    return 0


def cpu_columns(model, context: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds per block size: plain `nn.Linear`, oneDNN prepacked, and where this CPU streams small blocks,
    the streamed kernel and the engine's verify block through the modules and through the lean forward."""
    from infer.cpu import linear

    columns = {"plain": forward_cost(model, context, sizes, repeats)}
    with linear.prepacked_linears(model, enabled=linear.available()):  # oneDNN for every block
        columns["prepacked"] = forward_cost(model, context, sizes, repeats)
    rows = stream_rows(model)  # what SelfSpecModel does on CPU: the streamed kernel where it measured faster
    if rows:
        with linear.prepacked_linears(model, enabled=True, stream_rows=rows):
            columns[f"streamed<={rows}"] = forward_cost(model, context, sizes, repeats)
        from infer.cpu.lean_forward import LeanForward, why_not
        from infer.target import generation_mode

        # as generate runs it: its attention switch (infer/cpu/gqa_attention.py), the kernel choice, its cache
        with generation_mode(model), linear.prepacked_linears(model, enabled=True, stream_rows=rows):
            columns["engine, modules"] = block_costs(model, model, context, sizes, repeats)
            if why_not(model) is None:
                lean = LeanForward(model, rows, linear.PackCache())
                columns["engine, lean"] = block_costs(model, lean, context, sizes, repeats)
    return columns
