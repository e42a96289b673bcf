"""Runs inside the vLLM environment (`make vllm`), started by train/vllm_engine.py: vLLM's offline engine
answering chat requests, one JSON line in on stdin, one JSON line out, so that vLLM never has to be
importable in the project's own environment. It imports nothing from the project.

Request: {"histories": [[{"role", "content"}, ...], ...], "max_new_tokens", "temperature", "top_p", "seed"}.
Reply: {"replies": [[text, finished], ...]} in the same order, `finished` False when max_new_tokens cut it.
The first line written is {"ready": true}. Everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a transformers folder or hub id")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start-up)")
    args = parser.parse_args()

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM and its engine process print to stdout; keep that off the protocol

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              seed=0)
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        # One call for the whole batch: vLLM's scheduler batches the requests itself (continuous batching).
        params = [SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                 top_p=request["top_p"], seed=request["seed"] + i)
                  for i in range(len(request["histories"]))]
        outputs = llm.chat(request["histories"], params, use_tqdm=False)
        replies = [[o.outputs[0].text.strip(), o.outputs[0].finish_reason == "stop"] for o in outputs]
        protocol.write(json.dumps({"replies": replies}) + "\n")


if __name__ == "__main__":  # vLLM's engine runs in a spawned process, which imports this file again
    main()
