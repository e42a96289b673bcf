"""The timing harness: questions in, every method timed on every prompt (interleaved), outputs checked.

`run_bench` renders each question's turns with the chat template, runs the methods one after another on the
same prompt (so a slow phase of the machine hits all of them alike), checks every greedy output against the
baseline's, and hands the records to `train.apps.bench.report.aggregate`.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from train.apps.bench.methods import BASELINE, GREEDY, ForwardCounter, Method
from train.apps.bench.report import aggregate


def load_questions(path: str | Path, limit: int = 0, categories: list[str] | None = None,
                   per_category: int = 0) -> list[dict]:
    """Questions from a jsonl file, optionally filtered by category, cut to the first `per_category` of
    each category, then to the first `limit`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no question file at {path}; pass --questions with an MT-bench/Spec-Bench jsonl "
                                "file, e.g. data/mt_bench.jsonl")
    questions = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                questions.append(_question(path, n, line))
    if categories:
        unknown = set(categories) - {q["category"] for q in questions}
        if unknown:
            raise ValueError(f"--categories {sorted(unknown)} not in {path}")
        questions = [q for q in questions if q["category"] in categories]
    if per_category:
        kept, seen = [], {}
        for q in questions:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            if seen[q["category"]] <= per_category:
                kept.append(q)
        questions = kept
    return questions[:limit] if limit else questions


def _question(path, n: int, line: str) -> dict:
    """Line `n` of a question file, checked."""
    try:
        q = json.loads(line)
    except json.JSONDecodeError as err:
        hint = " (a JSON array? write one question object per line)" if line.lstrip()[:1] == "[" else ""
        raise ValueError(f"{path}:{n}: not valid JSON: {err.msg} at column {err.colno}{hint}") from None
    if not isinstance(q, dict):
        raise ValueError(f"{path}:{n}: each line must be one question object, got a JSON "
                         f"{type(q).__name__}; write one object per line (jsonl)")
    missing = {"question_id", "category", "turns"} - q.keys()
    if missing:
        raise ValueError(f"{path}:{n}: question lacks {sorted(missing)}; expected MT-bench/Spec-Bench "
                         "jsonl with question_id, category, turns")
    if not isinstance(q["turns"], list) or not q["turns"]:
        raise ValueError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
    return q


def render(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[1, T] prompt ids: the conversation so far through the chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; bench renders prompts as chat conversations")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return enc["input_ids"]


def new_tokens(out: torch.Tensor, prompt_len: int, eos: set[int]) -> list[int]:
    """Generated ids up to and including the first eos (padding after it dropped)."""
    new = out[0, prompt_len:].tolist()
    for i, tok in enumerate(new):
        if tok in eos:
            return new[:i + 1]
    return new


def eos_ids(target, tokenizer) -> set[int]:
    eos = target.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def run_bench(target, tokenizer, questions: list[dict], methods: list[Method], *, max_new_tokens: int = 128,
              repeats: int = 1, turns: int = 1, warmup: bool = True, progress: bool = True,
              on_record: Callable[[dict], None] | None = None, timed_from_turn: int = 1,
              passes: int = 1, done: list[dict] | None = None, sampling: dict | None = None,
              seed: int = 0) -> dict:
    """Time every method on every question (interleaved), check greedy equality, aggregate per category.

    `methods[0]` is the reference every other method's output is compared with (the baseline). Later turns
    are rendered with the reference's reply to the earlier ones, as MT-bench does with a model's own answers.
    Turns before `timed_from_turn` are only answered by the reference, untimed, for that history (questions
    with fewer turns are left out). With `passes` > 1 the whole question list is run again after itself.

    `done`: records an interrupted run already measured (its records.jsonl); those questions are not timed
    again, and a later turn of one gets its history from an untimed reference run, as skipped turns do.

    `sampling`: the methods sample (as they were made to; these are the settings recorded): outputs are not
    compared, and every method's run of the i-th timed generation starts from torch's seed `seed + i`.
    """
    done = list(done or [])
    _check_run(methods, max_new_tokens, repeats, turns, passes, timed_from_turn, done)
    eos = eos_ids(target, tokenizer)
    engines = {m.name: m.engine for m in methods}
    greedy = not (sampling or GREEDY)["do_sample"]
    with torch.inference_mode():
        if warmup:
            warm_up(methods, render(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}]),
                    target.device, min(max_new_tokens, 32), eos, progress)
        work = [(p, q, t) for p in range(passes) for q in questions if len(q["turns"]) >= timed_from_turn
                for t in range(min(turns, len(q["turns"])))]
        records, mismatches = _measure(methods, tokenizer, target, work, done, eos, max_new_tokens, repeats,
                                       turns, timed_from_turn, None if greedy else seed, on_record, progress)
    mismatches = [{"question_id": rec["question_id"], "turn": rec["turn"], "method": name,
                   "engine": engines[name], "first_differing_token": None}
                  for rec in done for name, r in rec["results"].items() if r["matches_baseline"] is False] + mismatches
    names = [m.name for m in methods]
    ideals = {m.name: m.ideal_tokens_per_step for m in methods if m.ideal_tokens_per_step is not None}
    return {"methods": names, "engines": engines, "questions": done + records, "mismatches": mismatches,
            "per_category": aggregate(done + records, names, ideals),
            "settings": {"max_new_tokens": max_new_tokens, "repeats": repeats, "turns": turns, "batch_size": 1,
                         "greedy": greedy, "sampling": None if greedy else {**sampling, "seed": seed},
                         "warmup": warmup, "timed_from_turn": timed_from_turn, "passes": passes}}


def _check_run(methods: list[Method], max_new_tokens: int, repeats: int, turns: int, passes: int,
               timed_from_turn: int, done: list[dict]) -> None:
    """Refuse settings run_bench cannot keep, before anything runs; warn where repeats mean something else."""
    if not methods or methods[0].name != BASELINE:
        raise ValueError(f"methods[0] must be the '{BASELINE}' reference")
    if repeats < 1 or turns < 1 or max_new_tokens < 1 or passes < 1:
        raise ValueError("repeats, turns, passes and max_new_tokens must all be >= 1")
    if not 1 <= timed_from_turn <= turns:
        raise ValueError(f"timed_from_turn must be in 1..turns ({turns}), got {timed_from_turn}")
    stateful = [m.name for m in methods if m.reset is not None]
    if done and stateful:
        raise ValueError(f"cannot resume with {', '.join(stateful)}: they learn from every earlier answer, so "
                         "skipping the measured questions changes what they are measured on; start the run again")
    for rec in done:
        if set(rec["results"]) != {m.name for m in methods}:
            raise ValueError(f"cannot resume: the earlier run measured {', '.join(rec['results'])}, this one "
                             f"{', '.join(m.name for m in methods)}; pass the same methods or start again")
    if repeats > 1 and stateful:
        warnings.warn(f"{', '.join(stateful)} keep earlier responses: repeats 2..{repeats} of a question see "
                      "its first answer, so their times are a repeated-request workload's", stacklevel=3)


def warm_up(methods: list[Method], ids: torch.Tensor, device, max_new_tokens: int, eos: set[int],
            progress: bool = True) -> None:
    """Every method once on `ids`, untimed: first calls pay for allocator growth, kernel selection and lazy
    imports. A method that learns from its answers forgets this one, so it cannot help the first question."""
    from tqdm.auto import tqdm

    ids, reference = ids.to(device), None
    for m in tqdm(methods, desc="warm-up", disable=not progress):
        if m.before is not None:
            m.before(reference)
        out, _ = m.run(ids, max_new_tokens)
        if reference is None:  # methods[0], the baseline
            reference = new_tokens(out, ids.shape[1], eos)
        if m.reset is not None:
            m.reset()


def _measure(methods, tokenizer, target, work, done, eos, max_new_tokens, repeats, turns, timed_from_turn,
             seed, on_record, progress) -> tuple[list[dict], list[dict]]:
    """The timed loop over (pass, question, turn): (new records, their mismatches). `seed` None: greedy."""
    from tqdm.auto import tqdm

    measured = {(rec.get("pass", 1), rec["question_id"], rec["turn"]) for rec in done}
    counter, history, records, mismatches = ForwardCounter(target), {}, [], []
    engines = {m.name: m.engine for m in methods}
    for i, (p, q, turn) in enumerate(tqdm(work, desc="bench", disable=not progress)):
        key, was_measured = (p, q["question_id"]), (p + 1, q["question_id"], turn + 1) in measured
        if was_measured and turn + 1 == min(turns, len(q["turns"])):  # no later turn needs its reply
            continue
        messages = history.get(key, []) + [{"role": "user", "content": q["turns"][turn]}]
        ids = render(tokenizer, messages).to(target.device)
        if turn + 1 < timed_from_turn or was_measured:  # history only: the reference's reply, untimed
            out, _ = methods[0].run(ids, max_new_tokens)
            reply = new_tokens(out, ids.shape[1], eos)
        else:
            results, outputs = time_methods(methods, ids, max_new_tokens, repeats, counter, eos,
                                            seed=None if seed is None else seed + i)
            for name, r in results.items():
                r["matches_baseline"] = outputs[name] == outputs[BASELINE] if seed is None else None
                if r["matches_baseline"] is False:
                    mismatches.append({"question_id": q["question_id"], "turn": turn + 1, "method": name,
                                       "engine": engines[name],
                                       "first_differing_token": first_difference(outputs[name], outputs[BASELINE])})
            records.append({"question_id": q["question_id"], "category": q["category"], "turn": turn + 1,
                            "pass": p + 1, "prompt_tokens": ids.shape[1], "results": results})
            if on_record is not None:
                on_record(records[-1])
            reply = outputs[BASELINE]
        history[key] = messages + [{"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)}]
    return records, mismatches


def time_methods(methods, ids, max_new_tokens, repeats, counter, eos, seed: int | None = None) -> tuple[dict, dict]:
    """One prompt, every method, `repeats` rounds (methods interleaved within a round). `seed`: the methods
    sample, each run starting from this torch seed (None: greedy, and a repeated run must give the same output).

    Returns per-method measurements (median seconds over the rounds) and each method's new token ids.
    """
    results = {m.name: {"seconds_all": []} for m in methods}
    outputs = {}
    for _ in range(repeats):
        for m in methods:
            if m.before is not None:
                m.before(outputs[BASELINE])  # the baseline runs first in every round
            counter.reset()
            if seed is not None:
                torch.manual_seed(seed)
            with contextlib.nullcontext() if m.counts_forwards else counter.counting():
                tic = time.perf_counter()
                out, stats = m.run(ids, max_new_tokens)
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                seconds = time.perf_counter() - tic
            r = results[m.name]
            r["seconds_all"].append(seconds)
            tokens = new_tokens(out, ids.shape[1], eos)
            if seed is None and m.name in outputs and outputs[m.name] != tokens:
                raise RuntimeError(f"{m.name} gave different greedy outputs on repeated runs of one prompt")
            outputs[m.name] = tokens
            # a method whose target runs elsewhere (vLLM) counts its own forwards
            r.update(new_tokens=len(tokens), target_forwards=stats.get("target_forwards", counter.calls))
            if "accepted_by_position" in stats:
                r.update(drafts=stats["drafts"], accepted_by_position=stats["accepted_by_position"])
            if "accepted_lengths" in stats:
                r.update(accepted_lengths=list(stats["accepted_lengths"]), draft_seconds=stats.get("draft_seconds"),
                         verify_seconds=stats.get("verify_seconds"),
                         target_seconds=stats.get("target_seconds", counter.seconds))
    for r in results.values():
        r["seconds"] = statistics.median(r["seconds_all"])
    return results, outputs


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
