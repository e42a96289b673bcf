"""Prompts the target writes itself, for self-distillation where a prompt set is narrow.

An instruction-tuned model given its chat template up to where a user's message begins writes a user's
message (Magpie: Xu et al., 2024, arXiv:2406.08464). Sampled at temperature 1, these are requests of the
kinds the model was tuned on (advice, stories, role play, code, explanations), a wider spread than a
single instruction set such as Alpaca's. `train.regenerate` then answers them with the target, and the
answers train a drafter like any other regenerated data.

    python -m train.synthesize_prompts --target smollm2-135m-instruct --out runs/data/magpie.jsonl --count 2000
    python -m train.regenerate --target smollm2-135m-instruct --data runs/data/magpie.jsonl \\
        --out runs/data/magpie_answers.jsonl

Each row is `{"id": "magpie-<n>", "messages": [{"role": "user", "content": ...}]}`. Kept: messages the
model finished (it wrote its end-of-turn token within `--max_new_tokens`), at least `--min_chars` long,
not already in the file. Resumable: rows are appended, and a restart keeps those already there and numbers
on from them (its random draws differ from an uninterrupted run's, as in `train.regenerate`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .regenerate import check_generation, read_done_ids

MARKER = "SELFSPEC_USER_MESSAGE"  # stands in for the user's message while the template is rendered
MAX_BARREN_BATCHES = 20  # batches in a row that keep nothing before giving up


def query_prefix(tokenizer) -> tuple[str, str]:
    """The chat template's text before a user's message (a system prompt included where the template adds
    one) and the text right after it (its end of turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; set tokenizer.chat_template first")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if text.count(MARKER) != 1:
        raise ValueError("the chat template does not render a user's message as it is, so the text before one "
                         "cannot be cut out of it; synthesize prompts with another instruction-tuned model")
    before, after = text.split(MARKER)
    return before, after


def end_of_turn_ids(model, tokenizer, after: str) -> set[int]:
    """Token ids that end a user's message: the template's end of turn and the model's eos."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids.add(tokenizer.eos_token_id)
    first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    return {int(i) for i in ids | set(first) if i is not None}


def read_prompts(out: Path) -> list[str]:
    """The messages already in `out` (a last line cut short by a kill is dropped from the file)."""
    read_done_ids(out)
    if not out.exists():
        return []
    prompts = []
    for number, line in enumerate(out.read_text().splitlines(), 1):
        if line.strip():
            try:
                prompts.append(json.loads(line)["messages"][0]["content"])
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"{out}: line {number} is not a prompt row ({{'id', 'messages': [{{'role': 'user', "
                                 "'content'}]}); --out must be a file this script wrote, or a new one") from None
    return prompts


def check_settings(count: int, **generation) -> None:
    """What `synthesize` is asked to do makes sense; raised before the target loads (main)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    check_generation(**generation)
    if generation["temperature"] == 0:
        raise ValueError("temperature must be > 0: greedy decoding writes one prompt, got 0")


@torch.no_grad()
def synthesize(model, tokenizer, out: str | Path, *, count: int, batch_size: int = 64, max_new_tokens: int = 64,
               temperature: float = 1.0, top_p: float = 1.0, min_chars: int = 12, seed: int = 0,
               progress: bool = True) -> dict:
    """Append prompts written by `model` to `out` until it holds `count`; return counts."""
    from tqdm.auto import tqdm

    check_settings(count, batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    before, after = query_prefix(tokenizer)
    stops = end_of_turn_ids(model, tokenizer, after)
    prefix = tokenizer(before, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seen = read_prompts(out)
    texts = set(seen)
    counts = {"already_there": len(seen), "written": 0, "drawn": 0, "unfinished": 0, "short_or_repeated": 0}
    start, barren = time.perf_counter(), 0
    with out.open("a") as f, tqdm(total=count, initial=min(len(seen), count), disable=not progress,
                                  desc="synthesize prompts") as bar:
        while len(seen) < count:
            torch.manual_seed(seed + len(seen) + counts["drawn"])
            batch = prefix.repeat(batch_size, 1)
            new = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                                 temperature=temperature, top_p=top_p, top_k=None, max_new_tokens=max_new_tokens,
                                 eos_token_id=sorted(stops), pad_token_id=pad)[:, prefix.shape[1]:].cpu()
            kept = 0
            for row in new.tolist():
                if len(seen) >= count:
                    break
                counts["drawn"] += 1
                end = next((i for i, t in enumerate(row) if t in stops), None)
                if end is None:
                    counts["unfinished"] += 1
                    continue
                text = tokenizer.decode(row[:end], skip_special_tokens=True).strip()
                if len(text) < min_chars or text in texts:
                    counts["short_or_repeated"] += 1
                    continue
                record = {"id": f"magpie-{len(seen)}", "messages": [{"role": "user", "content": text}]}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                seen.append(text)
                texts.add(text)
                counts["written"] += 1
                kept += 1
            f.flush()
            bar.update(kept)
            barren = 0 if kept else barren + 1
            if barren >= MAX_BARREN_BATCHES:
                raise RuntimeError(f"{MAX_BARREN_BATCHES} batches in a row gave no finished, new prompt of at least "
                                   f"{min_chars} characters ({counts}); raise max_new_tokens, or lower min_chars")
    counts["seconds"] = round(time.perf_counter() - start, 1)
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="folder, hub id or smollm2-135m-instruct")
    parser.add_argument("--out", required=True, help="jsonl to append to (resumes if it exists)")
    parser.add_argument("--count", type=int, required=True, help="prompts the file should hold")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=64, help="longer messages are dropped, not cut")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--min_chars", type=int, default=12)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from infer.loading import TARGET_FIX, check_local_folder

    from .target import load_target

    check_local_folder(args.target, "--target", TARGET_FIX)
    check_settings(args.count, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p)
    model, tokenizer = load_target(args.target, args.dtype)
    counts = synthesize(model.to(args.device), tokenizer, args.out, count=args.count, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        min_chars=args.min_chars, seed=args.seed)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
