"""Runs inside the vLLM environment (`make vllm`), started by train/vllm_engine.py: vLLM's offline engine
answering chat requests, one JSON line in on stdin, one JSON line out, so that vLLM never has to be
importable in the project's own environment. It imports nothing from the project.

Requests, one of:
- {"histories": [[{"role", "content"}, ...], ...], "max_new_tokens", "temperature", "top_p", "seed"}: chat
  replies, answered {"replies": [[text, finished], ...]} in the same order, `finished` False when
  max_new_tokens cut it;
- {"prompt_ids_batch": [[...], ...], "max_new_tokens", "temperature", "top_p", "seed"}: the same replies to
  prompts already rendered and tokenized by the caller (train/regenerate.py renders tools and reasoning
  switches with the target's own template), answered like "histories";
- {"prompt_ids": [...], "max_new_tokens"} and, to sample, "temperature", "top_p", "top_k", "seed": one generation
  from token ids (greedy without a temperature), answered {"ids": [...],
  "spec": {"drafts", "draft_tokens", "accepted", "per_position": [...]}}, the spec-decode counters this
  request added (zeros without speculation; counted only with --log-stats).
The first line written is {"ready": true}. Everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from itertools import zip_longest

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far, summed over engines."""
    got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            got[SPEC_COUNTERS[metric.name]] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            got["per_position"] = [a + b for a, b in zip_longest(got["per_position"], metric.values, fillvalue=0)]
    return got


def difference(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip_longest(v, before[k], fillvalue=0)] if isinstance(v, list) else v - before[k])
            for k, v in after.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a transformers folder or hub id")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start-up)")
    parser.add_argument("--speculative-config", default=None, help="JSON, as vLLM's --speculative-config")
    parser.add_argument("--log-stats", action="store_true", help="keep vLLM's metrics (spec-decode counters)")
    args = parser.parse_args()

    # SIGTERM comes when the caller dies (PR_SET_PDEATHSIG) or stops this worker: vLLM's engine and worker processes
    # (this process group: the worker runs in a session of its own) do not follow their parent, and each holds GBs,
    # so the whole group goes.
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM and its engine process print to stdout; keep that off the protocol

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              seed=0, speculative_config=spec, disable_log_stats=not args.log_stats)
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "prompt_ids" in request:
            before = spec_counters(llm) if args.log_stats and spec else None
            params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=request.get("temperature", 0.0),
                                    top_p=request.get("top_p", 1.0), top_k=request.get("top_k", 0),
                                    seed=request.get("seed"))
            out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt_ids"])], params, use_tqdm=False)
            counts = difference(spec_counters(llm), before) if before is not None else None
            protocol.write(json.dumps({"ids": list(out[0].outputs[0].token_ids), "spec": counts}) + "\n")
            continue
        if "prompt_ids_batch" in request:  # chat prompts the caller rendered (its template, tools, thinking switch)
            params = [SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                     top_p=request["top_p"], seed=request["seed"] + i)
                      for i in range(len(request["prompt_ids_batch"]))]
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompt_ids_batch"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)  # all at once: vLLM schedules them together
            replies = [[o.outputs[0].text.strip(), o.outputs[0].finish_reason == "stop"] for o in outputs]
            protocol.write(json.dumps({"replies": replies}) + "\n")
            continue
        # One call for the whole batch: vLLM's scheduler batches the requests itself (continuous batching).
        params = [SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                 top_p=request["top_p"], seed=request["seed"] + i)
                  for i in range(len(request["histories"]))]
        outputs = llm.chat(request["histories"], params, use_tqdm=False)
        replies = [[o.outputs[0].text.strip(), o.outputs[0].finish_reason == "stop"] for o in outputs]
        protocol.write(json.dumps({"replies": replies}) + "\n")


if __name__ == "__main__":  # vLLM's engine runs in a spawned process, which imports this file again
    main()
