"""Self-distillation data: the target answers the prompts itself.

A drafter is trained to predict the target, so the best training text is what the target would write.
This replaces every assistant turn of a dataset with the target's own reply (turn by turn, so later turns
see the regenerated earlier ones), batched with left padding, greedy or sampled.

    python -m train.regenerate --target smollm2-135m-instruct --data data/alpaca_smollm2_regenerated.jsonl \\
        --out runs/data/alpaca_smollm2.jsonl --max_samples 500 --max_new_tokens 256

Resumable: records are appended to `--out` one line each, and a restart skips the ids already there (a
line cut short by a kill is dropped); an id is answered once, for the first row that has it. The settings
that decide the answers (target, data, dtype, token limit, sampling, format, preset, reasoning) and a fingerprint
of the data's rows are kept in `<out>.settings.json`, and resuming with any of them changed (a row inserted into
an Alpaca file, whose ids are its row numbers) is refused by name before the target loads. With
sampling, a resumed run draws different random numbers than an uninterrupted one would have (batches are
formed anew), so only greedy output is reproducible.

`--preset sharegpt|ultrachat|openai` reads a known layout (train/presets.py; `openai` keeps tool calls and
passes `tools` to the chat template). Reasoning targets: `--enable_thinking true|false` is passed to the chat
template, and `--reasoning drop` removes a reply's leading <think>...</think> block (`keep`, the default,
trains the drafter on the reasoning too, which the target does write).

`--samples N` writes N sampled answers per prompt (ids `<id>#0` .. `<id>#N-1`; needs `--temperature` > 0):
several of the target's own answers to one prompt are more training text where prompts are few.

`--engine vllm` generates with vLLM's offline engine instead (train/vllm_engine.py: vLLM runs in its own
environment, `make vllm`), each batch handed to vLLM's scheduler whole, so a larger `--batch_size` (64+)
pays there; the file written is the same, and so is resuming. `--engines N` starts N vLLM workers (one per
GPU) that answer batches side by side while one thread writes whatever finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import threading
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from itertools import islice
from pathlib import Path

import torch

from .data import load_rows, read_text, rows_fingerprint
from .presets import CHOICES, check_preset, read_conversations

REASONING = ("keep", "drop")  # what --reasoning does with a reply's leading reasoning block
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the tags reasoning models (Qwen3, DeepSeek-R1) write


def read_done_ids(out: Path, repair: bool = True) -> set[str]:
    """Ids already written; a line that is not a record with an id is refused. With `repair` the file is left
    ready to append to: a last line cut short by a kill is removed, and a whole last line without its newline
    (the file edited by hand) gets one, or the next record would be glued onto it."""
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
        except ValueError:  # not JSON, or not UTF-8
            if i == len(lines) - 1:  # a partial final line: the kill happened mid-write
                break
            raise ValueError(f"{out}: line {i + 1} is not JSON; refusing to append to a damaged file") from None
        what = not_an_answer(record)
        if what:
            raise ValueError(f"{out}: line {i + 1} {what}, so it is not an answer this command wrote (one object "
                             "with an id and its messages per line); give --out a file of its own, or a file it "
                             "wrote. Nothing was changed.")
        done.add(str(record["id"]))
        keep += len(line) + 1
    if not repair:
        return done
    if keep < len(raw):
        with out.open("r+b") as f:
            f.truncate(keep)
    elif raw and not raw.endswith(b"\n"):
        with out.open("ab") as f:
            f.write(b"\n")
    return done


def not_an_answer(record) -> str | None:
    """What makes an output line no record of ours, or None: a file of other records with ids (the user's own)
    would otherwise be resumed, and answers appended to it."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}"
    if record.get("id") is None:
        return "has no 'id'"
    if not isinstance(record.get("messages", record.get("conversations")), list):
        return "has neither 'messages' nor 'conversations'"
    return None


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


def conversation_plan(messages: list[dict], where: str = "a conversation") -> list[dict]:
    """The prompt turns of a conversation with each assistant reply (and a final one) left empty. An assistant
    turn that calls tools keeps the data's call: the tool results after it answer that call. `where` names the
    row in errors."""
    if not messages:
        raise ValueError(f"{where} has no messages, so no prompt to answer; drop the row")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: the conversation starts with an assistant turn; it needs a prompt before it")
    plan = [dict(m) for m in messages]
    for m in plan:
        if m["role"] == "assistant" and not m.get("tool_calls"):
            m["content"] = None
    if plan[-1]["role"] != "assistant":
        plan.append({"role": "assistant", "content": None})
    return plan


class TransformersEngine:
    """The target's own batched `generate` behind the engine interface regenerate() drives (`complete`), which
    train.vllm_engine.VLLMEngine implements too."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}

    @torch.no_grad()
    def complete(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[tuple[str, bool]]:
        """(reply, finished) for each tokenized prompt; `finished` is False when max_new_tokens cut the reply."""
        # ids: [B, T] left-padded, so that every row's reply starts at column T
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=None) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = self.model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                  pad_token_id=pad, **sampling)
        new = out[:, width:].cpu()  # one copy, not a device sync per token below
        return [(self.tokenizer.decode(row, skip_special_tokens=True).strip(), any(int(t) in self.eos for t in row))
                for row in new]


def as_engines(model, tokenizer) -> list:
    """The engines to answer with: a model (its `generate`), an engine with `complete`, or a list of engines
    answering batches side by side (data-parallel vLLM workers)."""
    if isinstance(model, (list, tuple)):
        if not model or not all(hasattr(e, "complete") for e in model):
            raise ValueError("engines must be a non-empty list of objects with complete() (e.g. VLLMEngine)")
        return list(model)
    return [model if hasattr(model, "complete") else TransformersEngine(model, tokenizer)]


def split_reasoning(reply: str, reasoning: str) -> tuple[str, bool]:
    """The reply as written (`keep`), or (`drop`) what follows its reasoning: after </think>, whether the reply
    opened the block or the template's generation prompt did (DeepSeek-R1 style). The flag is False when `drop`
    found a block the token limit cut before it closed, leaving no answer."""
    if reasoning == "keep":
        return reply, True
    close = reply.find(THINK_CLOSE)
    if close >= 0:
        return reply[close + len(THINK_CLOSE):].strip(), True
    if reply.lstrip().startswith(THINK_OPEN):
        return "", False
    return reply, True


class Renderer:
    """Chat prompts as token ids, with the target's own template (tools and a thinking switch passed to it);
    a lock, since engines answer in threads and a tokenizer call changes the tokenizer's padding state."""

    def __init__(self, tokenizer, enable_thinking: bool | None):
        self.tokenizer, self.lock = tokenizer, threading.Lock()
        self.options = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def prompt(self, history: list[dict], tools: list | None) -> list[int]:
        with self.lock:
            text = self.tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True,
                                                      **self.options)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        with self.lock:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_batch(engine, renderer: Renderer, batch: list[tuple[str, list[dict], list | None]], *,
                 max_new_tokens: int, temperature: float, top_p: float, seed: int,
                 reasoning: str) -> tuple[list[tuple[str, list[dict], list | None, bool]], int]:
    """Fill in the empty assistant turns of each conversation in `batch`, turn by turn (a later turn sees the
    replies before it); returns (id, messages, tools, finished) for each and the reply tokens written."""
    finished, tokens = [True] * len(batch), 0
    for turn in range(max(len(plan) for _, plan, _ in batch)):
        live = [i for i, (_, plan, _) in enumerate(batch) if turn < len(plan) and plan[turn]["role"] == "assistant"
                and plan[turn]["content"] is None and not plan[turn].get("tool_calls")]
        if not live:
            continue
        prompts = [renderer.prompt(batch[i][1][:turn], batch[i][2]) for i in live]
        replies = engine.complete(prompts, max_new_tokens, temperature, top_p, seed)
        for i, (reply, fin) in zip(live, replies, strict=True):
            reply, whole = split_reasoning(reply, reasoning)
            batch[i][1][turn]["content"] = reply
            finished[i] = finished[i] and fin and whole
            tokens += renderer.count(reply)
    return [(id_, plan, tools, fin) for (id_, plan, tools), fin in zip(batch, finished, strict=True)], tokens


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


SHAREGPT_NAMES = {"user": "human", "assistant": "gpt", "system": "system"}


def check_sharegpt_fits(todo: list) -> None:
    """ShareGPT records have no tool roles, tool calls or developer turns: a conversation holding one is refused
    before any answer is generated, not when its answer is written."""
    for id_, plan, _tools in todo:
        for i, m in enumerate(plan):
            if m["role"] not in SHAREGPT_NAMES or m.get("tool_calls"):
                what = "tool calls" if m.get("tool_calls") else f"role {m['role']!r}"
                raise ValueError(f"conversation {id_!r}: message {i} has {what}, which --format sharegpt cannot "
                                 "write; use --format messages (the OpenAI layout keeps them)")


def to_record(id_: str, messages: list[dict], fmt: str, finished: bool, tools: list | None = None) -> dict:
    if fmt == "sharegpt":
        turns = [{"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in messages]
        return {"id": id_, "conversations": turns, "finished": finished}
    record = {"id": id_, "messages": messages}
    if tools:
        record["tools"] = tools
    return {**record, "finished": finished}


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def check_out(out: Path) -> None:
    """`--out` names a file that is there or can be made: not a folder, not under a file."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the .jsonl file to write (e.g. {out / 'answers.jsonl'})")
    if settings_path(out).is_dir():
        raise ValueError(f"{settings_path(out)} is a folder where --out's settings are kept; move it away")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--out {out} cannot be created: {parent} is a file, not a folder; choose another --out")


def read_settings(path: Path) -> dict:
    """The settings recorded beside an output; a damaged file is refused, since it is what a resume checks."""
    try:
        saved = json.loads(path.read_text())
        damage = None if isinstance(saved, dict) else f"a JSON {type(saved).__name__}, not an object"
    except ValueError as err:  # not JSON, or not UTF-8
        saved, damage = None, f"not JSON: {err}"
    if damage:
        raise ValueError(f"{path} is damaged ({damage}), so whether the answers beside it were written with these "
                         "settings cannot be checked; restore it, or delete it to record these settings (only if "
                         "they are the ones the answers were written with). Nothing was changed.")
    return saved


def check_settings(out: str | Path, settings: dict, *, write: bool = True) -> None:
    """A file being resumed must be continued with the settings that wrote it: its answers and the new ones are
    one data set. `settings` (flag name -> value) are recorded beside `out` (<out>.settings.json) and compared
    on every later run; a difference is refused, naming each flag, before anything loads or is written. The
    data's fingerprint (`data_fingerprint`, train.data.rows_fingerprint) is one of them where the rows are read."""
    out = Path(out)
    check_out(out)
    path = settings_path(out)
    holds_answers = out.exists() and out.stat().st_size > 0
    saved = read_settings(path) if holds_answers and path.is_file() else {}
    if holds_answers and path.is_file():
        changed = [f"--{k} {saved[k]!r} -> {v!r}" for k, v in settings.items()
                   if k in saved and saved[k] != v and k != "data_fingerprint"]
        if changed:
            raise ValueError(f"{out} holds answers written with other settings ({', '.join(changed)}): resume it with "
                             "the settings it was written with, or write to another --out. Nothing was changed.")
        check_same_data(out, saved, settings)
    elif holds_answers:
        warnings.warn(f"{out} holds answers but no {path.name} (written before settings were recorded): whether "
                      "they were written with these settings cannot be checked; recording these", stacklevel=2)
    if write:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**saved, **settings}, indent=1) + "\n")
        os.replace(tmp, path)


def check_same_data(out: Path, saved: dict, settings: dict) -> None:
    """Answers are kept by id, and an id can be a row number (Alpaca): a resume on rows edited since would skip
    the new prompts under ids already answered. Refused, naming the data and the fix."""
    if "data_fingerprint" not in settings:
        return
    if "data_fingerprint" not in saved:
        warnings.warn(f"{out} was written before the data's fingerprint was recorded: whether its rows changed "
                      "since cannot be checked; recording them as they are now", stacklevel=3)
    elif saved["data_fingerprint"] != settings["data_fingerprint"]:
        data = settings.get("data", saved.get("data", "the data"))
        raise ValueError(f"{out} holds answers to other rows than {data} has now ({saved['data_fingerprint']} then, "
                         f"{settings['data_fingerprint']} now): the data changed since, and a resume would skip new "
                         "or edited rows under ids already answered. Restore the data it was written from, or write "
                         "to another --out. Nothing was changed.")


def answer_settings(*, max_new_tokens: int, temperature: float, top_p: float, out_format: str, seed: int,
                    samples: int, preset: str, enable_thinking: bool | None, reasoning: str) -> dict:
    """What decides the answers a run writes (not batch size, engines or max_samples, which a resumed run may
    change); the seed only where sampling draws with it."""
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "format": out_format,
            "seed": seed if temperature > 0 else None, "samples": samples, "preset": preset,
            "enable_thinking": enable_thinking, "reasoning": reasoning}


def plan_work(out: Path, rows, *, preset: str, samples: int, max_samples: int, out_format: str,
              repair: bool = True) -> tuple[list, dict]:
    """(id, plan, tools) for every answer still to write, and counts of what was skipped: ids already in `out`
    (read_done_ids, which `repair`s the file), and rows whose id an earlier row has (the first is kept, warned:
    an id names one conversation). Everything refused here is refused before any answer, and main() calls it
    with repair=False before the target loads."""
    done = read_done_ids(out, repair)
    todo, seen, duplicates = [], set(), []
    for index, conv in enumerate(read_conversations(rows, preset)):
        if max_samples and index >= max_samples:
            break
        plan = conversation_plan(conv.messages, f"row {index} (id {conv.id!r})")
        if conv.id in seen:
            duplicates.append(conv.id)
            continue
        seen.add(conv.id)
        ids = [conv.id] if samples == 1 else [f"{conv.id}#{k}" for k in range(samples)]
        for sample_id in ids:
            if sample_id not in done:
                todo.append((sample_id, [dict(m) for m in plan], conv.tools))
    if out_format == "sharegpt":
        check_sharegpt_fits(todo)
    if duplicates and repair:
        warnings.warn(f"{len(duplicates)} rows repeat an earlier row's id (first: {duplicates[:3]}); each id is "
                      "answered once, for its first row", stacklevel=3)
    return todo, {"skipped_duplicate_ids": len(duplicates), "skipped_done": len(done)}


def regenerate(model, tokenizer, rows, out: str | Path, *, max_samples: int = 0, max_new_tokens: int = 256,
               batch_size: int = 8, temperature: float = 0.0, top_p: float = 1.0, out_format: str = "messages",
               seed: int = 0, samples: int = 1, preset: str = "auto", enable_thinking: bool | None = None,
               reasoning: str = "keep", run: dict | None = None, progress: bool = True) -> dict:
    """Append regenerated conversations for `rows` (a datasets.Dataset) to `out`; return counts.

    `model` is the target (transformers' batched `generate`), an engine with `complete` (a
    `train.vllm_engine.VLLMEngine`), or a list of engines, which answer batches side by side while this thread
    writes each finished batch. With `samples` > 1 each row is answered that many times (sampled), as records
    `<id>#0`, `<id>#1`, ... `run`: further settings that decide the answers (target, data, dtype), recorded and
    checked with these (`check_settings`)."""
    from tqdm.auto import tqdm

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
    check_reasoning(preset, out_format, enable_thinking, reasoning)
    if len(rows) == 0:
        raise ValueError("the dataset is empty")
    check_preset(preset, rows.column_names if hasattr(rows, "column_names") else rows[0].keys())
    engines = as_engines(model, tokenizer)
    out = Path(out)
    run = dict(run or {})
    if "data_fingerprint" not in run:  # main() takes it before the target loads
        run["data_fingerprint"] = rows_fingerprint(rows)
    check_settings(out, {**run, **answer_settings(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, out_format=out_format, seed=seed,
        samples=samples, preset=preset, enable_thinking=enable_thinking, reasoning=reasoning)})
    todo, counts = plan_work(out, rows, preset=preset, samples=samples, max_samples=max_samples,
                             out_format=out_format)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Similar prompt lengths in a batch waste less padding.
    todo.sort(key=lambda item: sum(len(m["content"] or "") for m in item[1]))
    counts.update(written=0, unfinished=0, tokens=0)
    renderer = Renderer(tokenizer, enable_thinking)
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, reasoning=reasoning)
    batches = [(b, todo[b:b + batch_size]) for b in range(0, len(todo), batch_size)]
    start = time.perf_counter()
    with out.open("a") as f, tqdm(total=len(todo), disable=not progress, desc="regenerate") as bar:
        def write(answers, tokens):
            for id_, plan, tools, fin in answers:
                f.write(json.dumps(to_record(id_, plan, out_format, fin, tools), ensure_ascii=False) + "\n")
                counts["written"] += 1
                counts["unfinished"] += not fin
            f.flush()  # a kill loses at most the batches in flight, and a resume answers them again
            counts["tokens"] += tokens
            bar.update(len(answers))

        # Each batch samples with seed + its offset, whichever engine answers it, so the answers do not depend
        # on how many engines there are.
        if len(engines) == 1:
            for b, batch in batches:
                write(*answer_batch(engines[0], renderer, batch, seed=seed + b, **settings))
        else:
            answer_side_by_side(engines, renderer, batches, seed, settings, write)
    counts["seconds"] = round(time.perf_counter() - start, 1)
    counts["tokens_per_s"] = round(counts["tokens"] / max(counts["seconds"], 1e-9), 1)
    counts["answers_per_s"] = round(counts["written"] / max(counts["seconds"], 1e-9), 2)
    return counts


def answer_side_by_side(engines: list, renderer: Renderer, batches: list, seed: int, settings: dict, write) -> None:
    """One thread per engine, each taking the next batch; this thread writes each batch as it finishes. If an
    engine fails, the batches other engines finished are still written before the error is raised."""
    free = queue.Queue()
    for engine in engines:
        free.put(engine)

    def answer(b, batch):
        engine = free.get()
        try:
            return answer_batch(engine, renderer, batch, seed=seed + b, **settings)
        finally:
            free.put(engine)

    pending = iter(batches)
    failure = None
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        # At most one batch waiting per engine: batches are not all queued at once, so an error stops the run
        # after the batches in flight.
        running = {pool.submit(answer, *item) for item in islice(pending, 2 * len(engines))}
        while running:
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    write(*future.result())
                except Exception as err:  # noqa: BLE001 - kept to re-raise once the finished batches are written
                    failure = failure or err
            if failure is None:
                running |= {pool.submit(answer, *item) for item in islice(pending, len(finished))}
    if failure is not None:
        raise failure


def check_reasoning(preset: str, out_format: str, enable_thinking: bool | None, reasoning: str) -> None:
    from .presets import CHOICES

    if preset not in CHOICES:
        raise ValueError(f"--preset must be one of {list(CHOICES)}, got {preset!r}")
    if reasoning not in REASONING:
        raise ValueError(f"--reasoning must be one of {REASONING}, got {reasoning!r}")
    if enable_thinking not in (None, True, False):
        raise ValueError(f"--enable_thinking must be true or false (or left out), got {enable_thinking!r}")
    if preset == "openai" and out_format == "sharegpt":
        raise ValueError("--format sharegpt has no tool roles or tool calls; with --preset openai use --format "
                         "messages")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="folder, hub id or smollm2-135m-instruct")
    parser.add_argument("--data", required=True, help="hub id or .json/.jsonl/.parquet (ShareGPT, messages, Alpaca)")
    parser.add_argument("--out", required=True, help="jsonl to append to (resumes if it exists)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--preset", default="auto", choices=CHOICES,
                        help="the data's layout (train/presets.py); auto: detected from the columns")
    parser.add_argument("--max_samples", type=int, default=0, help="first N rows only (0 = all)")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8, help="conversations per request to an engine")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=1, help="answers per prompt (sampled; ids <id>#k)")
    parser.add_argument("--format", default="messages", choices=["messages", "sharegpt"])
    parser.add_argument("--enable_thinking", default=None, choices=["true", "false"],
                        help="passed to the chat template (Qwen3-style reasoning switch); left out: not passed")
    parser.add_argument("--reasoning", default="keep", choices=REASONING,
                        help="a reply's leading <think>...</think> block: keep it in the answer, or drop it")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                        help="vllm: vLLM's offline engine from its own environment (make vllm)")
    parser.add_argument("--engines", type=int, default=1,
                        help="vLLM engines answering batches side by side (one per GPU where there are as many)")
    parser.add_argument("--vllm_python", default=None,
                        help="python of the environment with vLLM ($SELFSPEC_VLLM_PYTHON; default .venv-vllm)")
    args = parser.parse_args(argv)

    from infer.loading import TARGET_FIX, check_local_folder

    from .target import load_target
    from .vllm_engine import vllm_model_path

    check_local_folder(args.target, "--target", TARGET_FIX)
    out = Path(args.out)
    if out.is_file() and Path(args.data).is_file() and out.samefile(args.data):
        raise ValueError(f"--out {args.out} is the --data file: the answers would be appended to the prompts they "
                         f"answer; give --out a file of its own (e.g. {out.with_name(out.stem + '_regenerated.jsonl')})")
    check_generation(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                     top_p=args.top_p, max_samples=args.max_samples)
    if args.engines < 1 or (args.engines > 1 and args.engine != "vllm"):
        raise ValueError(f"--engines {args.engines}: give 1, or several with --engine vllm (each a vLLM worker)")
    thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
    check_reasoning(args.preset, args.format, thinking, args.reasoning)
    settings = dict(max_samples=args.max_samples, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                    temperature=args.temperature, top_p=args.top_p, out_format=args.format, seed=args.seed,
                    samples=args.samples, preset=args.preset, enable_thinking=thinking, reasoning=args.reasoning)
    data = str(Path(args.data).resolve()) if Path(args.data).exists() else args.data
    run = {"target": args.target, "data": data, "split": args.split, "dtype": args.dtype}
    # Before the data or the target load: a resumed file's settings, then the data's layout.
    answering = answer_settings(**{k: v for k, v in settings.items() if k not in ("max_samples", "batch_size")})
    check_settings(args.out, {**run, **answering}, write=False)
    if args.engine == "transformers":
        check_device(args.device)
    rows = load_rows(args.data, args.split)
    check_preset(args.preset, rows.column_names)
    run["data_fingerprint"] = rows_fingerprint(rows)
    check_settings(args.out, {**run, **answering}, write=False)
    plan_work(Path(args.out), rows, preset=args.preset, samples=args.samples, max_samples=args.max_samples,
              out_format=args.format, repair=False)
    if args.engine == "vllm":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_model_path(args.target))
        with start_vllm_engines(args.target, args.engines, args.dtype, args.vllm_python, Path(args.out)) as engines:
            counts = regenerate(engines if len(engines) > 1 else engines[0], tokenizer, rows, args.out, run=run,
                                **settings)
    else:
        model, tokenizer = load_target(args.target, args.dtype)
        counts = regenerate(model.to(args.device), tokenizer, rows, args.out, run=run, **settings)
    print(json.dumps(counts))


def check_device(device: str) -> None:
    """--device names a device this machine has, said before the data or the target load."""
    try:
        where = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device ({err}); give cpu, cuda or cuda:N") from None
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) that torch can "
                         "use; give --device cpu, or run where there is one")
    if where.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: Apple's MPS is not available here; give --device cpu")
    if where.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: train.regenerate runs on cpu, cuda or mps")


@contextlib.contextmanager
def start_vllm_engines(target: str, count: int, dtype: str, vllm_python, out: Path):
    """`count` vLLM workers started side by side (each on its own GPU where there are as many; on a CPU they share
    the cores), closed on the way out."""
    from .vllm_engine import VLLMEngine

    gpus = torch.cuda.device_count()
    if count > 1 and 0 < gpus < count:
        raise ValueError(f"--engines {count} with {gpus} GPUs: give at most one engine per GPU")

    def start(i):
        env = {"CUDA_VISIBLE_DEVICES": str(i)} if gpus >= count > 1 else None
        log = out.with_suffix(".vllm.log" if count == 1 else f".vllm{i}.log")
        return VLLMEngine(target, dtype=dtype, vllm_python=vllm_python, log=log, env=env)

    with contextlib.ExitStack() as stack, ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(start, i) for i in range(count)]
        engines, errors = [], []
        for future in futures:  # every start is waited for, so none is left running when another fails
            try:
                engines.append(stack.enter_context(future.result()))
            except Exception as err:  # noqa: BLE001 - the first is raised once the started engines are closed
                errors.append(err)
        if errors:
            raise errors[0]
        yield engines

if __name__ == "__main__":
    main()
