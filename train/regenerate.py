"""Self-distillation data: the target answers the prompts itself.

A drafter is trained to predict the target, so the best training text is what the target would write.
This replaces every assistant turn of a dataset with the target's own reply (turn by turn, so later turns
see the regenerated earlier ones), batched with left padding, greedy or sampled.

    python -m train.regenerate --target smollm2-135m-instruct --data ../shared/data/alpaca_5000.json \\
        --out runs/data/alpaca_smollm2.jsonl --max_samples 500 --max_new_tokens 256

Resumable: records are appended to `--out` one line each, and a restart skips the ids already there (a
line cut short by a kill is dropped). With sampling, a resumed run draws different random numbers than an
uninterrupted one would have (batches are formed anew), so only greedy output is reproducible.

`--samples N` writes N sampled answers per prompt (ids `<id>#0` .. `<id>#N-1`; needs `--temperature` > 0):
several of the target's own answers to one prompt are more training text where prompts are few.

`--engine vllm` generates with vLLM's offline engine instead (train/vllm_engine.py: vLLM runs in its own
environment, `make vllm`), each batch handed to vLLM's scheduler whole, so a larger `--batch_size` (64+)
pays there; the file written is the same, and so is resuming.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path

import torch

from .data import detect_format, load_rows, read_text, row_name, to_messages


def read_done_ids(out: Path) -> set[str]:
    """Ids already written; a last line cut short by a kill is removed from the file."""
    if not out.exists():
        return set()
    raw = out.read_bytes()
    lines = raw.split(b"\n")
    done, keep = set(), 0
    for i, line in enumerate(lines):
        if not line.strip():
            keep += len(line) + 1
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a partial final line: the kill happened mid-write
                break
            raise ValueError(f"{out}: line {i + 1} is not JSON; refusing to append to a damaged file") from None
        done.add(str(record["id"]))
        keep += len(line) + 1
    if keep < len(raw):
        with out.open("r+b") as f:
            f.truncate(min(keep, len(raw)))
    return done


def merge_files(sources: list[str | Path], dest: str | Path) -> int:
    """Concatenate regenerated JSONL files into one training file (a last line cut short by a kill is
    dropped from its file first; a missing source is skipped; a gzipped one, `.jsonl.gz` like the shipped
    answers, is a finished file and is copied as it is); returns the rows written."""
    rows = 0
    with Path(dest).open("w") as f:
        for source in map(Path, sources):
            if not source.exists():
                continue
            if source.suffix != ".gz":
                read_done_ids(source)  # drops a last line cut short by a kill; a gzipped file is finished
            for line in read_text(source).splitlines():
                if line.strip():
                    f.write(line + "\n")
                    rows += 1
    return rows


def conversation_plan(messages: list[dict]) -> list[dict]:
    """The prompt turns of a conversation with each assistant turn (and a final reply) left empty."""
    plan = [dict(m) for m in messages]
    for m in plan:
        if m["role"] == "assistant":
            m["content"] = None
    if not plan or plan[-1]["role"] != "assistant":
        plan.append({"role": "assistant", "content": None})
    if plan[0]["role"] == "assistant":
        raise ValueError("a conversation starts with an assistant turn; it needs a prompt before it")
    return plan


@torch.no_grad()
def generate_replies(model, tokenizer, histories: list[list[dict]], max_new_tokens: int,
                     temperature: float, top_p: float) -> list[tuple[str, bool]]:
    """(reply, finished) for each history; `finished` is False when max_new_tokens cut the reply."""
    prompts = [tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=None) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[:, enc["input_ids"].shape[1]:].cpu()  # one copy, not a device sync per token below
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    replies = []
    for row in new:
        finished = any(int(t) in eos for t in row)
        replies.append((tokenizer.decode(row, skip_special_tokens=True).strip(), finished))
    return replies


def check_generation(*, max_new_tokens: int, batch_size: int, temperature: float, top_p: float,
                     max_samples: int = 0) -> None:
    """Generation settings (of this module and train.synthesize_prompts), checked before the target loads."""
    for name, value, least in (("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1),
                               ("max_samples", max_samples, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def to_record(id_: str, messages: list[dict], fmt: str, finished: bool) -> dict:
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        turns = [{"from": names[m["role"]], "value": m["content"]} for m in messages]
        return {"id": id_, "conversations": turns, "finished": finished}
    return {"id": id_, "messages": messages, "finished": finished}


def regenerate(model, tokenizer, rows, out: str | Path, *, max_samples: int = 0, max_new_tokens: int = 256,
               batch_size: int = 8, temperature: float = 0.0, top_p: float = 1.0, out_format: str = "messages",
               seed: int = 0, samples: int = 1, progress: bool = True) -> dict:
    """Append regenerated conversations for `rows` (a datasets.Dataset) to `out`; return counts.

    `model` is the target (transformers' batched `generate`) or a `train.vllm_engine.VLLMEngine`. With
    `samples` > 1 each row is answered that many times (sampled), as records `<id>#0`, `<id>#1`, ..."""
    from tqdm.auto import tqdm

    from .vllm_engine import VLLMEngine

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; set tokenizer.chat_template first")
    check_generation(max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature, top_p=top_p,
                     max_samples=max_samples)
    if out_format not in ("messages", "sharegpt"):
        raise ValueError(f"out_format must be 'messages' or 'sharegpt', got {out_format!r}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"samples={samples} with greedy decoding (temperature 0) writes the same answer "
                         f"{samples} times; set a temperature > 0 (e.g. 0.7) or samples=1")
    if len(rows) == 0:
        raise ValueError("the dataset is empty")
    fmt = detect_format(rows.column_names)
    if max_samples:
        rows = rows.select(range(min(max_samples, len(rows))))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done_ids(out)
    todo = []
    for index, row in enumerate(rows):
        id_ = str(row.get("id", index))
        for sample_id in [id_] if samples == 1 else [f"{id_}#{k}" for k in range(samples)]:
            if sample_id not in done:
                todo.append((sample_id, conversation_plan(to_messages(row, fmt, row_name(index, row)))))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    # Similar prompt lengths in a batch waste less padding.
    todo.sort(key=lambda item: sum(len(m["content"] or "") for m in item[1]))
    counts = {"skipped_done": len(done), "written": 0, "unfinished": 0, "tokens": 0}
    start = time.perf_counter()
    with out.open("a") as f, tqdm(total=len(todo), disable=not progress, desc="regenerate") as bar:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            torch.manual_seed(seed + b)
            if isinstance(model, VLLMEngine):
                replies = partial(model.replies, seed=seed + b)
            else:
                replies = partial(generate_replies, model, tokenizer)
            finished = [True] * len(batch)
            for turn in range(max(len(plan) for _, plan in batch)):
                live = [i for i, (_, plan) in enumerate(batch)
                        if turn < len(plan) and plan[turn]["content"] is None]
                if not live:
                    continue
                histories = [batch[i][1][:turn] for i in live]
                for i, (reply, fin) in zip(live, replies(histories, max_new_tokens, temperature, top_p),
                                           strict=True):
                    batch[i][1][turn]["content"] = reply
                    finished[i] = finished[i] and fin
                    counts["tokens"] += len(tokenizer(reply, add_special_tokens=False)["input_ids"])
            for (id_, plan), fin in zip(batch, finished, strict=True):
                f.write(json.dumps(to_record(id_, plan, out_format, fin), ensure_ascii=False) + "\n")
                counts["written"] += 1
                counts["unfinished"] += not fin
            f.flush()
            bar.update(len(batch))
    counts["seconds"] = round(time.perf_counter() - start, 1)
    counts["tokens_per_s"] = round(counts["tokens"] / max(counts["seconds"], 1e-9), 1)
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="folder, hub id or smollm2-135m-instruct")
    parser.add_argument("--data", required=True, help="hub id or .json/.jsonl/.parquet (ShareGPT, messages, Alpaca)")
    parser.add_argument("--out", required=True, help="jsonl to append to (resumes if it exists)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--max_samples", type=int, default=0, help="first N rows only (0 = all)")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=1, help="answers per prompt (sampled; ids <id>#k)")
    parser.add_argument("--format", default="messages", choices=["messages", "sharegpt"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                        help="vllm: vLLM's offline engine from its own environment (make vllm)")
    parser.add_argument("--vllm_python", default=None,
                        help="python of the environment with vLLM ($SELFSPEC_VLLM_PYTHON; default .venv-vllm)")
    args = parser.parse_args(argv)

    from infer.embedded import TARGET_FIX, check_local_folder

    from .target import load_target
    from .vllm_engine import VLLMEngine, vllm_model_path

    check_local_folder(args.target, "--target", TARGET_FIX)
    check_generation(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                     top_p=args.top_p, max_samples=args.max_samples)
    rows = load_rows(args.data, args.split)
    settings = dict(max_samples=args.max_samples, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                    temperature=args.temperature, top_p=args.top_p, out_format=args.format, seed=args.seed, samples=args.samples)
    if args.engine == "vllm":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_model_path(args.target))
        log = Path(args.out).with_suffix(".vllm.log")
        with VLLMEngine(args.target, dtype=args.dtype, vllm_python=args.vllm_python, log=log) as engine:
            counts = regenerate(engine, tokenizer, rows, args.out, **settings)
    else:
        model, tokenizer = load_target(args.target, args.dtype)
        counts = regenerate(model.to(args.device), tokenizer, rows, args.out, **settings)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
