"""The benchmark: speculative decoding timed against transformers' own decoding, and vLLM's.

The top library layer: it measures the engine (infer/), trained drafters (heads/) and vLLM's engine
(train/vllm_engine.py), so it sits above heads/, among the applications on top of training (train/apps/).
scripts/bench.py and scripts/bench_batches.py only call `main`. One module per job:

    methods   the rows: transformers' generate, SelfSpecModel with a drafter, the oracle, vLLM
    harness   questions, the interleaved timing loop, the greedy-equality check
    report    per-category aggregates, markdown, plots, the machine's description
    cli       `python scripts/bench.py`'s parser and main (its docstring is the command's manual)
    batches   batched generation at several batch sizes (scripts/bench_batches.py)
    gpu       the engine on a random-weight target of a real model's shape (`scripts/bench.py --random-target`)
    forward_cost  one forward's cost over n new tokens (scripts/forward_cost.py)
"""

from train.apps.bench.cli import at_least, build_parser, device, main, number_in
from train.apps.bench.harness import (
    eos_ids,
    first_difference,
    load_questions,
    new_tokens,
    render,
    run_bench,
    time_methods,
    warm_up,
)
from train.apps.bench.methods import (
    BASELINE,
    COMPILE_SUFFIX,
                                 FP32_ARGMAX_SUFFIX,
                                 FP32_DRAFT_SUFFIX,
    GREEDY,
    LOOKUP_SUFFIX,
    MODULES_SUFFIX,
    PLD,
    STATIC_SUFFIX,
    SUFFIXES,
    ForwardCounter,
    Method,
    check_drafter_spec,
    drafter_label,
    drafter_method,
    engine_method,
    hf_method,
    load_drafter,
    oracle_method,
    parse_tree,
    split_suffixes,
    vllm_method,
    vllm_speculation,
)
from train.apps.bench.report import (
    acceptance_by_position,
    aggregate,
    environment,
    memory_floor,
    plot,
    report_mismatches,
    to_markdown,
    write_outputs,
)

__all__ = ["BASELINE", "COMPILE_SUFFIX", "FP32_ARGMAX_SUFFIX", "FP32_DRAFT_SUFFIX", "GREEDY", "LOOKUP_SUFFIX",
           "MODULES_SUFFIX", "PLD", "STATIC_SUFFIX", "SUFFIXES", "ForwardCounter", "Method", "acceptance_by_position",
           "aggregate", "at_least", "build_parser", "check_drafter_spec", "device", "drafter_label", "drafter_method",
           "engine_method", "environment", "eos_ids", "first_difference", "hf_method", "load_drafter",
           "load_questions", "main", "memory_floor", "new_tokens", "number_in", "oracle_method", "parse_tree", "plot",
           "render", "report_mismatches", "run_bench", "split_suffixes", "time_methods", "to_markdown", "vllm_method",
           "vllm_speculation", "warm_up", "write_outputs"]
