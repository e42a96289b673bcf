"""How much more one target forward costs when it scores n new tokens instead of 1.

This is the number speculative decoding lives on: verifying a tree of n drafted tokens costs one forward
over n tokens, so the speedup is bounded by tau / (cost(n) / cost(1)). The forward runs on top of a KV
cache of `--context` tokens, as a verification step does mid-generation, once with plain `nn.Linear` and
once with the prepacked weights SelfSpecModel uses on CPU (infer/cpu_linear.py).

    python scripts/forward_cost.py --target smollm2-135m-instruct --context 256
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch


def forward_cost(model, context: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one forward over n new tokens after a `context`-token prefix, per n."""
    from infer.kv import cache_argument

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=g)
    with torch.inference_mode():
        cache = model(prefix, use_cache=True)[cache_argument(model)]
        out = {}
        for n in sizes:
            ids = torch.randint(0, vocab, (1, n), generator=g)
            pos = torch.arange(context, context + n)[None]
            times = []
            for _ in range(repeats + 1):  # the first run is a warm-up
                kv = copy.deepcopy(cache)
                tic = time.perf_counter()
                model(ids, position_ids=pos, use_cache=True, **{cache_argument(model): kv})
                times.append(time.perf_counter() - tic)
            out[n] = statistics.median(times[1:])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all logical CPUs)")
    args = parser.parse_args(argv)

    from infer import cpu_linear
    from infer.embedded import resolve_target

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, _ = resolve_target(args.target)
    plain = forward_cost(model, args.context, args.sizes, args.repeats)
    with cpu_linear.prepacked_linears(model, enabled=cpu_linear.available()):  # what SelfSpecModel does on CPU
        packed = forward_cost(model, args.context, args.sizes, args.repeats)
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; cost relative to a plain 1-token forward")
    print("| new tokens | plain ms | plain cost | prepacked ms | prepacked cost |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    one = plain[args.sizes[0]]
    for n in args.sizes:
        print(f"| {n} | {plain[n] * 1e3:.1f} | {plain[n] / one:.2f}x | {packed[n] * 1e3:.1f} | "
              f"{packed[n] / one:.2f}x |")
    print(json.dumps({kind: {str(n): s for n, s in costs.items()}
                      for kind, costs in (("plain", plain), ("prepacked", packed))}))


if __name__ == "__main__":
    main()
