"""Benchmark speculative decoding against transformers' own greedy and prompt-lookup decoding.

For every question (MT-bench / Spec-Bench jsonl: `question_id`, `category`, `turns`) the prompt is rendered
with the target's chat template and generated at batch 1, greedy, by each method in turn, interleaved per
question so that every method sees the same machine state:

    baseline   target.generate(do_sample=False)                       -- transformers greedy
    pld        target.generate(prompt_lookup_num_tokens=N)             -- transformers prompt lookup
    <drafter>  SelfSpecModel(target, drafter, lookup_first=False).generate(...) -- one per --drafter: the
                       drafter alone, even where its config makes prompt lookup first its default
    <drafter>+lookup   the same with lookup_first=True: prompt lookup on rows whose context repeats
    <drafter>+fp32argmax  the same with the target's whole fp32 LM head in a greedy verify (int8_argmax off)
    <drafter>+fp32draft   the same drafting from the drafter's fp32 weights (int8_drafter off); the suffixes
                       +compile, +static and +modules set the other SelfSpecModel options of their names
    oracle:<alpha>     SelfSpecModel drafting the baseline's own answer, each token wrong with probability
                       1 - alpha (`--oracle`): acceptance is set, drafting is free, so tokens/s against the
                       ideal (1 - alpha^(K+1)) / (1 - alpha) tokens per plain step is the engine's overhead
    vllm[-<method>]    vLLM's offline engine from its own environment (`make vllm`), one per --vllm: plain
                       decoding, its n-gram or suffix drafting, or a trained drafter exported as
                       scripts/serve.py exports it; tau and acceptance by draft position from vLLM's own
                       spec-decode counters

Workloads: first turns (default), all turns (`--turns 2`), MT-bench second turns only (`--second-turns`: the
first turn's reply, part of the prompt, is the target's own greedy one, generated untimed), and repeated
requests (`--passes 2`: every question asked again after all of them, so a drafter that keeps earlier
responses, such as `suffix`, can reuse the first pass; each pass gets its own rows in the table).

Per category it reports the mean accepted length tau (new tokens per target forward, the prefill forward
included; greedy is 1.0 by definition), tokens/s, and speedups over both transformers methods, from the
median time over `--repeats`. Every greedy output must equal the baseline's token for token; mismatches are
printed loudly, and `--strict` turns them into a nonzero exit.

`--sample` times sampled generation instead (`--temperature`, `--top-p`, `--top-k`; the baseline is
transformers' `generate(do_sample=True)` with the same settings). Sampled outputs are not compared: they
follow the target's distribution, which tests/test_sampling.py checks; every method's run of a question starts
from the same seed (`--seed` plus the question's place in the run), vLLM rows' too.

    python scripts/bench.py --target smollm2-135m-instruct --questions ../shared/data/mt_bench.jsonl \\
        --drafter ngram --drafter runs/demo/drafter --out runs/bench/mt_bench

Writes `results.json`, `results.md`, `speedup.png` and `accepted_lengths.png` into `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

BASELINE, PLD = "baseline", "pld"
GREEDY = {"do_sample": False}


# ---------------------------------------------------------------------------------------------- inputs
def load_questions(path: str | Path, limit: int = 0, categories: list[str] | None = None,
                   per_category: int = 0) -> list[dict]:
    """Questions from a jsonl file, optionally filtered by category, cut to the first `per_category` of
    each category, then to the first `limit`."""
    questions = []
    if not Path(path).is_file():
        raise FileNotFoundError(f"no question file at {path}; pass --questions with an MT-bench/Spec-Bench jsonl "
                                "file, e.g. ../shared/data/mt_bench.jsonl")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
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
            questions.append(q)
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


def render(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[1, T] prompt ids: the conversation so far through the chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; bench renders prompts as chat conversations")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return enc["input_ids"]


# ---------------------------------------------------------------------------------------------- methods
@dataclass
class Method:
    """A named way to generate: `run(input_ids, max_new_tokens) -> (output_ids [1, T + new], stats)`."""

    name: str
    run: Callable[[torch.Tensor, int], tuple[torch.Tensor, dict]]
    reset: Callable[[], None] | None = None  # forgets what earlier calls left (a suffix drafter's responses)
    close: Callable[[], None] | None = None  # frees what it holds (a vLLM engine's processes)
    engine: str = "selfspec"  # or "transformers", "vllm": whose output a mismatch would be
    # called with the baseline's new tokens for the prompt before each run (an oracle drafter's answer)
    before: Callable[[list[int]], None] | None = None
    ideal_tokens_per_step: float | None = None  # an oracle's expected tokens per step at its alpha
    # its stats report target_forwards (and target_seconds) itself; otherwise ForwardCounter's hooks count them
    counts_forwards: bool = False


class ForwardCounter:
    """Counts the target's forward calls while a method that reports none of its own runs (transformers'
    rows), and the time spent inside them. Its hooks sit on the target only during such a run:
    SelfSpecModel reports its own forwards and their time, and runs its lean verify forward only on a
    target without user hooks."""

    def __init__(self, model):
        self.model, self.calls, self.seconds, self._tic, self._handles = model, 0, 0.0, None, []

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    @contextlib.contextmanager
    def counting(self):
        self._handles = [self.model.register_forward_pre_hook(self._enter),
                         self.model.register_forward_hook(self._leave)]
        try:
            yield
        finally:
            self.remove()

    @torch.compiler.disable  # a compiled forward would trace the hooks and recompile on every new count
    def _enter(self, module, args):
        self.calls += 1
        self._tic = time.perf_counter()

    @torch.compiler.disable
    def _leave(self, module, args, output):
        if self._tic is not None:
            self.seconds += time.perf_counter() - self._tic
            self._tic = None

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def hf_method(target, name: str, sampling: dict | None = None, **generate_kwargs) -> Method:
    """transformers' `generate`: greedy, or with `sampling`'s settings (do_sample, temperature, top_p, top_k)."""
    pad = target.generation_config.pad_token_id
    if pad is None:
        eos = target.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos

    def run(input_ids, max_new_tokens):
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                              pad_token_id=pad, **(sampling or GREEDY), **generate_kwargs)
        return out, {}

    return Method(name, run, engine="transformers")


def engine_method(target, drafter, name: str, lookup_first: bool = False, compile: bool = False,
                  static_cache: bool = False, lean_verify: bool | None = None, int8_argmax: bool = True,
                  int8_drafter: bool = True, sampling: dict | None = None) -> Method:
    """`int8_argmax`, `int8_drafter`: SelfSpecModel's options of those names; `sampling`: generate's sampling
    settings (None: greedy)."""
    from infer import SelfSpecModel

    model = SelfSpecModel(target, drafter, lookup_first=lookup_first, compile=compile, static_cache=static_cache,
                          lean_verify=lean_verify, int8_argmax=int8_argmax, int8_drafter=int8_drafter)

    def run(input_ids, max_new_tokens):
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, **(sampling or GREEDY))
        return out, dict(model.last_stats)

    return Method(name, run, reset=getattr(model.drafter, "clear", None), counts_forwards=True)


def oracle_method(target, alpha: float, depth: int = 8, static_cache: bool = False, compile: bool = False) -> Method:
    """SelfSpecModel with `OracleDrafter`: the baseline's own answer drafted, each token wrong with
    probability 1 - alpha, so acceptance is set and drafting is free (see infer/drafters/oracle.py).
    `static_cache`/`compile`: the engine's static-cache path (and its compiled verify)."""
    from infer import SelfSpecModel
    from infer.drafters.oracle import OracleDrafter, expected_tokens_per_step

    drafter = OracleDrafter(alpha, depth)
    model = SelfSpecModel(target, drafter, static_cache=static_cache, compile=compile)
    suffix = (STATIC_SUFFIX if static_cache else "") + (COMPILE_SUFFIX if compile else "")

    def run(input_ids, max_new_tokens):
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out, dict(model.last_stats)

    return Method(f"oracle:{alpha:g}{suffix}", run, before=lambda answer: drafter.expect([answer]),
                  ideal_tokens_per_step=expected_tokens_per_step(alpha, depth), counts_forwards=True)


def parse_tree(text: str | None) -> dict:
    """`depth=4,top_k=4,total_tokens=16` -> {"depth": 4, ...} (values parsed as JSON where they can be)."""
    if not text:
        return {}
    tree = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--tree item {item!r} must look like key=value")
        try:
            tree[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            tree[key.strip()] = value
    return tree


def load_drafter(spec: str, target, tree: dict | None = None):
    """(name, drafter) for a named drafter (`infer.drafters.DRAFTERS`: ngram, gguf, ...),
    `draft-model:<path or hub id>`, or a saved drafter folder / hub id.

    `tree` overrides a trained drafter's saved drafting settings (e.g. depth, top_k, total_tokens)."""
    if spec.endswith(SUFFIXES):
        raise ValueError(f"strip the suffixes {', '.join(SUFFIXES)} before load_drafter (see drafter_method)")
    from infer.drafters import DRAFTERS

    if spec.partition(":")[0] in DRAFTERS:  # a drafter by name: ngram, gguf, int8, bf16, early_exit:<k>, ...
        return spec, spec
    if spec.startswith("draft-model:"):
        from infer.embedded import resolve_target

        path = spec.split(":", 1)[1]
        model, _ = resolve_target(path, dtype=target.dtype)
        return f"draft-model:{Path(path).name}", model
    import heads

    drafter = heads.load(spec)
    if tree:
        drafter.config.tree = drafter.config.resolve_tree({**(drafter.config.tree or {}), **tree})
    return drafter_label(spec, drafter), drafter


def drafter_label(folder: str, drafter) -> str:
    """`<kind>:<name>` for a saved drafter; a run's drafter lives in runs/<run>/drafter: named by the run."""
    folder = Path(folder)
    label = folder.parent.name if folder.name == "drafter" and folder.parent.name else folder.name
    return f"{drafter.kind}:{label}"


LOOKUP_SUFFIX = "+lookup"  # `--drafter <spec>+lookup`: SelfSpecModel(..., lookup_first=True)
COMPILE_SUFFIX = "+compile"  # `--drafter <spec>+compile`: SelfSpecModel(..., compile=True)
STATIC_SUFFIX = "+static"  # `--drafter <spec>+static`: SelfSpecModel(..., static_cache=True)
MODULES_SUFFIX = "+modules"  # `--drafter <spec>+modules`: SelfSpecModel(..., lean_verify=False)
FP32_ARGMAX_SUFFIX = "+fp32argmax"  # `--drafter <spec>+fp32argmax`: SelfSpecModel(..., int8_argmax=False)
FP32_DRAFT_SUFFIX = "+fp32draft"  # `--drafter <spec>+fp32draft`: SelfSpecModel(..., int8_drafter=False)
SUFFIXES = (LOOKUP_SUFFIX, COMPILE_SUFFIX, STATIC_SUFFIX, MODULES_SUFFIX, FP32_ARGMAX_SUFFIX, FP32_DRAFT_SUFFIX)


def _serve_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("selfspec_serve", Path(__file__).resolve().parent / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_speculation(spec: str) -> tuple[str, dict | None]:
    """(row name, vLLM speculative_config) for `--vllm plain|ngram|suffix|<drafter folder>`; a drafter is
    exported to the format vLLM loads for its kind, beside it, as scripts/serve.py does."""
    serve = _serve_module()
    if spec == "plain":
        return "vllm", None
    if spec in serve.DRAFTERLESS:
        return f"vllm-{spec}", {"method": spec, **serve.DRAFTERLESS[spec]}
    try:
        drafter = serve.load_drafter(spec)
        fmt = serve.servable_format(drafter)
    except serve.ServeError as err:
        raise ValueError(f"--vllm {spec}: {err}") from None
    out = Path(f"{Path(spec).resolve()}-{fmt.name}")
    exported = serve.export_drafter(drafter, fmt, drafter.config.base_model_name_or_path, out)
    config = {"method": fmt.vllm_method, "model": str(Path(exported).resolve()),
              "num_speculative_tokens": serve.tree_depth(drafter.config)}
    return f"vllm-{drafter_label(spec, drafter)}", config


def vllm_method(spec: str, target_name: str, dtype: str, threads: int, log_dir: Path,
                sampling: dict | None = None) -> Method:
    """vLLM's offline engine on the same prompts (see the module docstring), started once here: greedy, or
    sampled with `sampling`'s settings from the torch seed the run set (`torch.initial_seed()`)."""
    from train.vllm_engine import VLLMEngine

    name, config = vllm_speculation(spec)
    # vLLM's CPU build binds its OpenMP threads itself: the same cores and count as the torch rows
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    engine = VLLMEngine(target_name, dtype=dtype, speculative_config=config, log_stats=config is not None, env=env,
                        log=log_dir / f"{name.replace(':', '_')}.log")

    def run(input_ids, max_new_tokens):
        settings = None
        if sampling is not None and sampling["do_sample"]:
            settings = {"temperature": sampling["temperature"], "top_p": sampling["top_p"],
                        "top_k": sampling["top_k"], "seed": torch.initial_seed()}
        ids, counts = engine.generate_ids(input_ids[0].tolist(), max_new_tokens, settings)
        out = torch.cat([input_ids.cpu(), torch.tensor([ids], dtype=input_ids.dtype)], dim=1)
        if not counts:
            return out, {"target_forwards": len(ids)}
        # every target forward emits its accepted drafts and one token of its own, the prefill one
        return out, {"target_forwards": max(len(ids) - counts["accepted"], 1), "drafts": counts["drafts"],
                     "accepted_by_position": counts["per_position"]}

    return Method(name, run, close=engine.close, engine="vllm", counts_forwards=True)


def drafter_method(spec: str, target, tree: dict | None = None, sampling: dict | None = None) -> Method:
    base, options = spec, []
    while base.endswith(SUFFIXES):  # in any order
        suffix = next(s for s in SUFFIXES if base.endswith(s))
        base, options = base[: -len(suffix)], [suffix, *options]
    name, drafter = load_drafter(base, target, tree)
    if isinstance(drafter, torch.nn.Module):
        drafter.to(target.device)  # a drafter keeps its own dtype; it must sit on the target's device
    return engine_method(target, drafter, name + "".join(options), LOOKUP_SUFFIX in options,
                         COMPILE_SUFFIX in options, STATIC_SUFFIX in options,
                         lean_verify=False if MODULES_SUFFIX in options else None,
                         int8_argmax=FP32_ARGMAX_SUFFIX not in options,
                         int8_drafter=FP32_DRAFT_SUFFIX not in options, sampling=sampling)


# ---------------------------------------------------------------------------------------------- running
def _new_tokens(out: torch.Tensor, prompt_len: int, eos: set[int]) -> list[int]:
    """Generated ids up to and including the first eos (padding after it dropped)."""
    new = out[0, prompt_len:].tolist()
    for i, tok in enumerate(new):
        if tok in eos:
            return new[:i + 1]
    return new


def _eos_ids(target, tokenizer) -> set[int]:
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
    from tqdm.auto import tqdm

    if not methods or methods[0].name != BASELINE:
        raise ValueError(f"methods[0] must be the '{BASELINE}' reference")
    if repeats < 1 or turns < 1 or max_new_tokens < 1 or passes < 1:
        raise ValueError("repeats, turns, passes and max_new_tokens must all be >= 1")
    if not 1 <= timed_from_turn <= turns:
        raise ValueError(f"timed_from_turn must be in 1..turns ({turns}), got {timed_from_turn}")
    stateful = [m.name for m in methods if m.reset is not None]
    done = list(done or [])
    if done and stateful:
        raise ValueError(f"cannot resume with {', '.join(stateful)}: they learn from every earlier answer, so "
                         "skipping the measured questions changes what they are measured on; start the run again")
    for rec in done:
        if set(rec["results"]) != {m.name for m in methods}:
            raise ValueError(f"cannot resume: the earlier run measured {', '.join(rec['results'])}, this one "
                             f"{', '.join(m.name for m in methods)}; pass the same methods or start again")
    measured = {(rec.get("pass", 1), rec["question_id"], rec["turn"]) for rec in done}
    if repeats > 1 and stateful:
        warnings.warn(f"{', '.join(stateful)} keep earlier responses: repeats 2..{repeats} of a question see "
                      "its first answer, so their times are a repeated-request workload's", stacklevel=2)
    eos = _eos_ids(target, tokenizer)
    engines = {m.name: m.engine for m in methods}
    counter = ForwardCounter(target)
    records, history = list(done), {}
    mismatches = [{"question_id": rec["question_id"], "turn": rec["turn"], "method": name,
                   "engine": engines[name], "first_differing_token": None}
                  for rec in done for name, r in rec["results"].items() if r["matches_baseline"] is False]
    with torch.inference_mode():
        if warmup:  # first calls pay for allocator growth, kernel selection and lazy imports
            ids = render(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}]).to(target.device)
            reference = None
            for m in tqdm(methods, desc="warm-up", disable=not progress):
                if m.before is not None:
                    m.before(reference)
                out, _ = m.run(ids, min(max_new_tokens, 32))
                if reference is None:  # methods[0], the baseline
                    reference = _new_tokens(out, ids.shape[1], eos)
                if m.reset is not None:  # the warm-up answer must not help the first question
                    m.reset()
        work = [(p, q, t) for p in range(passes) for q in questions if len(q["turns"]) >= timed_from_turn
                for t in range(min(turns, len(q["turns"])))]
        greedy = not (sampling or GREEDY)["do_sample"]
        for i, (p, q, turn) in enumerate(tqdm(work, desc="bench", disable=not progress)):
            key, was_measured = (p, q["question_id"]), (p + 1, q["question_id"], turn + 1) in measured
            if was_measured and turn + 1 == min(turns, len(q["turns"])):  # no later turn needs its reply
                continue
            messages = history.get(key, []) + [{"role": "user", "content": q["turns"][turn]}]
            ids = render(tokenizer, messages).to(target.device)
            if turn + 1 < timed_from_turn or was_measured:
                # history only: the reference's reply, untimed
                out, _ = methods[0].run(ids, max_new_tokens)
                reply = tokenizer.decode(_new_tokens(out, ids.shape[1], eos), skip_special_tokens=True)
                history[key] = messages + [{"role": "assistant", "content": reply}]
                continue
            results, outputs = _time_methods(methods, ids, max_new_tokens, repeats, counter, eos,
                                             seed=None if greedy else seed + i)
            for name in results:
                results[name]["matches_baseline"] = outputs[name] == outputs[BASELINE] if greedy else None
                if results[name]["matches_baseline"] is False:
                    mismatches.append({"question_id": q["question_id"], "turn": turn + 1, "method": name,
                                       "engine": engines[name],
                                       "first_differing_token": _first_difference(outputs[name],
                                                                                  outputs[BASELINE])})
            records.append({"question_id": q["question_id"], "category": q["category"], "turn": turn + 1,
                            "pass": p + 1, "prompt_tokens": ids.shape[1], "results": results})
            if on_record is not None:
                on_record(records[-1])
            reply = tokenizer.decode(outputs[BASELINE], skip_special_tokens=True)
            history[key] = messages + [{"role": "assistant", "content": reply}]
    names = [m.name for m in methods]
    ideals = {m.name: m.ideal_tokens_per_step for m in methods if m.ideal_tokens_per_step is not None}
    return {"methods": names, "engines": engines, "questions": records, "mismatches": mismatches,
            "per_category": _aggregate(records, names, ideals),
            "settings": {"max_new_tokens": max_new_tokens, "repeats": repeats, "turns": turns, "batch_size": 1,
                         "greedy": greedy, "sampling": None if greedy else {**sampling, "seed": seed},
                         "warmup": warmup, "timed_from_turn": timed_from_turn, "passes": passes}}


def _time_methods(methods, ids, max_new_tokens, repeats, counter, eos, seed: int | None = None) -> tuple[dict, dict]:
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
            tokens = _new_tokens(out, ids.shape[1], eos)
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


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _aggregate(records: list[dict], names: list[str], ideals: dict[str, float] | None = None) -> dict:
    """Per category (and 'overall'): tokens/s = total new tokens / total median seconds; speedups are ratios
    of tokens/s; tau = total new tokens / total target forwards. For selfspec rows, per step: drafting,
    verifying, the target's forwards and the engine's own time (the rest). For an oracle row (`ideals`:
    its expected tokens per step), the ideal tokens/s, that many tokens per plain greedy step."""
    ideals = ideals or {}
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec["category"], []).append(rec)
    several_passes = any(rec.get("pass", 1) > 1 for rec in records)
    if several_passes:  # the repeated workload: each pass on its own
        for rec in records:
            groups.setdefault(f"pass {rec['pass']}", []).append(rec)
    if len({rec["turn"] for rec in records}) > 1:  # each turn on its own (per pass when there are several)
        for rec in records:
            label = f"turn {rec['turn']}" + (f", pass {rec['pass']}" if several_passes else "")
            groups.setdefault(label, []).append(rec)
    groups["overall"] = records
    table = {}
    for cat, recs in groups.items():
        row = {}
        for name in names:
            tokens = sum(r["results"][name]["new_tokens"] for r in recs)
            seconds = sum(r["results"][name]["seconds"] for r in recs)
            forwards = sum(r["results"][name]["target_forwards"] for r in recs)
            row[name] = {"questions": len(recs), "new_tokens": tokens, "seconds": round(seconds, 4),
                         "tokens_per_s": tokens / seconds if seconds else 0.0,
                         "tau": tokens / forwards if forwards else 0.0,
                         "mismatches": sum(r["results"][name]["matches_baseline"] is False for r in recs)}
            by_position = acceptance_by_position([r["results"][name] for r in recs])
            if by_position:
                row[name]["acceptance_by_position"] = by_position
            if all(r["results"][name].get("draft_seconds") is not None for r in recs) and forwards:
                # per target forward, the prefill included (as in tau)
                row[name]["draft_ms_per_step"] = 1000 * sum(r["results"][name]["draft_seconds"] for r in recs) / forwards
                row[name]["verify_ms_per_step"] = 1000 * sum(r["results"][name]["verify_seconds"] for r in recs) / forwards
                if all(r["results"][name].get("target_seconds") is not None for r in recs):
                    target_s = sum(r["results"][name]["target_seconds"] for r in recs)
                    draft_s = sum(r["results"][name]["draft_seconds"] for r in recs)
                    row[name]["target_ms_per_step"] = 1000 * target_s / forwards
                    # what neither the target's forwards nor the drafter took: masks, acceptance, cache commits
                    row[name]["engine_ms_per_step"] = 1000 * (seconds - target_s - draft_s) / forwards
        for name in names:
            for ref, key in ((BASELINE, "speedup_vs_greedy"), (PLD, "speedup_vs_pld")):
                if ref in row and row[ref]["tokens_per_s"]:
                    row[name][key] = row[name]["tokens_per_s"] / row[ref]["tokens_per_s"]
            if name in ideals and row[BASELINE]["tokens_per_s"]:
                # a plain step's cost is the baseline's seconds per token (tau 1)
                ideal = ideals[name] * row[BASELINE]["tokens_per_s"]
                row[name].update(ideal_tokens_per_step=ideals[name], ideal_tokens_per_s=ideal,
                                 fraction_of_ideal=row[name]["tokens_per_s"] / ideal)
        table[cat] = row
    return table


def acceptance_by_position(results: list[dict]) -> list[float]:
    """Per draft position i, the fraction of drafting steps whose draft at position i was accepted (and all
    before it): from selfspec's accepted lengths (every step after the prefill; a step emitting L tokens
    accepted positions 0..L-2) or from vLLM's per-position counters over its drafts. Empty if neither."""
    if results and all("accepted_by_position" in r for r in results):
        drafts = sum(r["drafts"] for r in results)
        width = max(len(r["accepted_by_position"]) for r in results)
        totals = [sum(r["accepted_by_position"][i] for r in results if i < len(r["accepted_by_position"]))
                  for i in range(width)]
        return [t / drafts for t in totals] if drafts else []
    lengths = [a for r in results for a in r.get("accepted_lengths", [])]
    if not lengths:
        return []
    return [sum(a - 1 > i for a in lengths) / len(lengths) for i in range(max(lengths) - 1)]


# ---------------------------------------------------------------------------------------------- outputs
def to_markdown(result: dict) -> str:
    methods, cats = result["methods"], list(result["per_category"])
    s = result["settings"]
    sampling = s.get("sampling")
    versus = "speedup vs transformers sampling" if sampling else "speedup vs greedy"
    lines = [f"| category | method | tau | tokens/s | {versus} | speedup vs PLD | draft ms/step | "
             "verify ms/step | mismatches |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cat in cats:
        for name in methods:
            r = result["per_category"][cat][name]
            vs_pld = f"{r['speedup_vs_pld']:.2f}x" if "speedup_vs_pld" in r else "-"
            label = f"**{cat}**" if cat == "overall" else cat
            draft = f"{r['draft_ms_per_step']:.0f}" if "draft_ms_per_step" in r else "-"
            verify = f"{r['verify_ms_per_step']:.0f}" if "verify_ms_per_step" in r else "-"
            lines.append(f"| {label} | {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup_vs_greedy']:.2f}x | {vs_pld} | {draft} | {verify} | {r['mismatches']} |")
    env = result.get("environment", {})
    how = "greedy"
    if sampling:
        how = (f"sampled (temperature {sampling['temperature']}, top-p {sampling['top_p']}, top-k {sampling['top_k']}, "
               f"seed {sampling['seed']}; outputs not compared)")
    foot = (f"\n{len(result['questions'])} generations, batch 1, {how}, max {s['max_new_tokens']} new tokens, "
            f"median of {s['repeats']} repeat(s)")
    if s.get("timed_from_turn", 1) > 1:
        foot += f", turn {s['timed_from_turn']} onwards timed (earlier turns answered by the baseline, untimed)"
    if s.get("passes", 1) > 1:
        foot += f", {s['passes']} passes over the questions (each question asked again after all of them)"
    if env:
        foot += f"; {env.get('cpu')}, {env.get('torch_threads')} torch threads, {env.get('dtype')}"
        if env.get("memory_floor_ms"):
            foot += (f"; memory floor of one target forward {env['memory_floor_ms']:.1f} ms "
                     f"({env['weight_mb']:.0f} MB of weights at {env['read_gb_per_s']:.1f} GB/s measured read "
                     "bandwidth)")
        if env.get("load_average"):
            foot += f", load average {env['load_average'][0]:.2f} at the end"
    foot += ". tau = new tokens per target forward (prefill included).\n"
    if result["mismatches"]:
        foot += f"\n**{len(result['mismatches'])} greedy output(s) differ from the baseline.**\n"
    overall = result["per_category"]["overall"]
    timed = [m for m in methods if "engine_ms_per_step" in overall[m]]
    if timed:
        foot += ("\nWhere a step's time goes (overall, ms per target forward): the target's forwards, the "
                 "drafter, and the engine's own rest (masks, acceptance, cache commits).\n\n| method | step | "
                 "target forward | drafter | engine | engine share | ideal tokens/s | of ideal |\n"
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for m in timed:
            r = overall[m]
            step = r["target_ms_per_step"] + r["draft_ms_per_step"] + r["engine_ms_per_step"]
            ideal = f"{r['ideal_tokens_per_s']:.1f} | {r['fraction_of_ideal']:.0%}" if "ideal_tokens_per_s" in r else "- | -"
            foot += (f"| {m} | {step:.1f} | {r['target_ms_per_step']:.1f} | {r['draft_ms_per_step']:.1f} | "
                     f"{r['engine_ms_per_step']:.1f} | {r['engine_ms_per_step'] / step:.1%} | {ideal} |\n")
    accepting = [m for m in methods if overall[m].get("acceptance_by_position")]
    if accepting:
        width = min(8, max(len(overall[m]["acceptance_by_position"]) for m in accepting))
        foot += ("\nAcceptance by draft position (overall): the fraction of drafting steps whose draft at that "
                 "position was accepted, with every draft before it.\n\n| method | "
                 + " | ".join(str(i) for i in range(width)) + " |\n| --- |" + " ---: |" * width + "\n")
        for m in accepting:
            acc = overall[m]["acceptance_by_position"]
            foot += f"| {m} | " + " | ".join(f"{acc[i]:.2f}" if i < len(acc) else "-" for i in range(width)) + " |\n"
    return "\n".join(lines) + "\n" + foot


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = [m for m in result["methods"] if m != BASELINE]
    cats = list(result["per_category"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, name in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [result["per_category"][c][name]["speedup_vs_greedy"] for c in cats], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs transformers " + ("sampling" if result["settings"].get("sampling") else "greedy"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    hist = {name: [a for rec in result["questions"] for a in rec["results"][name].get("accepted_lengths", [])]
            for name in methods}
    hist = {k: v for k, v in hist.items() if v}
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        top = max(max(v) for v in hist.values())
        bins = [x - 0.5 for x in range(1, top + 2)]
        for name, values in hist.items():
            ax.hist(values, bins=bins, alpha=0.5, density=True, label=f"{name} (mean {statistics.mean(values):.2f})")
        ax.set_xlabel("tokens emitted per verification step (accepted drafts + bonus)")
        ax.set_ylabel("fraction of steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "accepted_lengths.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write_outputs(result: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["markdown"].write_text(to_markdown(result))
    if plots:
        for p in plot(result, out_dir):
            paths[p.stem] = p
    return paths


def environment(target, threads: int) -> dict:
    import transformers

    from infer.tuning.cache import device_name

    cpu = device_name(torch.device("cpu"))  # model name, family and model: one bare name can cover two CPUs
    try:
        import subprocess

        git = dict(capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip() or None
        if commit and subprocess.run(["git", "status", "--porcelain", "infer", "heads"], **git).stdout.strip():
            commit += "-dirty"  # the engine or drafters measured differ from the commit
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "git_commit": commit, "torch_threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            # Other processes on the machine distort every timing; the 1/5/15-minute load says how much.
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}


def memory_floor(target) -> dict:
    """The least time one forward can take: every weight read once at the measured read bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    if target.device.type != "cpu":
        return {"weight_mb": weight_bytes / 1e6}
    big = torch.ones(2**27)  # 512 MB: far past the caches
    big.sum()
    times = []
    for _ in range(5):
        tic = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - tic)
    gbs = big.numel() * 4 / min(times) / 1e9
    return {"weight_mb": weight_bytes / 1e6, "read_gb_per_s": gbs, "memory_floor_ms": weight_bytes / gbs / 1e6}


def report_mismatches(result: dict) -> None:
    if result["settings"].get("sampling"):
        print("sampled: outputs are not compared (they follow the target's distribution: tests/test_sampling.py)")
        return
    if not result["mismatches"]:
        print("greedy check: every output equals transformers' greedy output")
        return
    print(f"\n!!! GREEDY MISMATCH: {len(result['mismatches'])} output(s) differ from transformers' greedy output "
          "!!!", file=sys.stderr)
    for m in result["mismatches"]:
        whose = " (vLLM's own output: not selfspec's exactness)" if m.get("engine") == "vllm" else ""
        print(f"!!!   question {m['question_id']} turn {m['turn']}: {m['method']} differs from token "
              f"{m['first_differing_token']}{whose}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- CLI
def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {value}")
        return value
    return parse


def number_in(low: float, high: float | None = None, open_low: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, ...] with `open_low`; no upper bound: None)."""
    span = (f"in {'(' if open_low else '['}{low:g}, {high:g}]" if high is not None
            else f"{'>' if open_low else '>='} {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {span}, got {text!r}") from None
        above = low < value if open_low else low <= value
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text}")
        return value
    return parse


def device(text: str) -> str:
    """An argparse type: a device torch knows the name of (cpu, cuda, cuda:1, mps, ...)."""
    try:
        where = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; write cpu, cuda or cuda:<index>") from None
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                                         "write cpu, or an index below that")
    return text


def check_drafter_spec(spec: str) -> None:
    """Refuse, before any model loads, a --drafter that is no named drafter, draft model, folder or hub id."""
    from infer.drafters import DRAFTERS, known

    base = spec
    while base.endswith(SUFFIXES):
        base = base[: -len(next(s for s in SUFFIXES if base.endswith(s)))]
    if base.partition(":")[0] in DRAFTERS or base.startswith("draft-model:") or "/" in base or Path(base).exists():
        return
    import heads

    if base in heads.shipped_drafters():
        return
    raise ValueError(f"--drafter {spec!r}: unknown drafter {base!r}; the named drafters are: {known()}; or a saved "
                     f"drafter folder, a shipped drafter ({', '.join(heads.shipped_drafters()) or 'none'}), "
                     "draft-model:<path or hub id>, or a hub id (owner/name)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    parser.add_argument("--questions", required=True, help="jsonl with question_id, category, turns")
    parser.add_argument("--drafter", action="append", default=[],
                        help="a drafter name (ngram, gguf[:<file>], int8, bf16, early_exit:<k>, ...) | "
                             "path/to/drafter_folder | draft-model:<path>, each optionally suffixed "
                             f"{LOOKUP_SUFFIX!r} (prompt lookup first), {COMPILE_SUFFIX!r} (the drafter's "
                             f"forwards compiled; with {STATIC_SUFFIX!r} the verify too), {STATIC_SUFFIX!r} "
                             f"(the target's static KV cache), {MODULES_SUFFIX!r} (verify through the "
                             f"model's own modules, not the lean forward), {FP32_ARGMAX_SUFFIX!r} (the target's "
                             f"whole fp32 LM head in a greedy verify) and/or {FP32_DRAFT_SUFFIX!r} (drafting "
                             "from the drafter's fp32 weights, not int8 copies); repeat for several")
    parser.add_argument("--out", default="runs/bench/latest", help="folder for results.json/.md and plots")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)
    parser.add_argument("--repeats", type=at_least(1), default=1, help="timed runs per question and method (median)")
    parser.add_argument("--turns", type=at_least(1), default=1, help="how many turns of each question to run")
    parser.add_argument("--second-turns", action="store_true",
                        help="MT-bench second turns only: the first turn is answered by the baseline (untimed) "
                             "and is part of the timed second turn's prompt")
    parser.add_argument("--passes", type=at_least(1), default=1,
                        help="run the question list this many times in a row; 2 = the repeated-request workload")
    parser.add_argument("--limit", type=at_least(0), default=0, help="first N questions only (0 = all)")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--per-category", type=at_least(0), default=0, help="first N questions of each category (0 = all)")
    parser.add_argument("--tree", default=None,
                        help="override trained drafters' tree settings, e.g. depth=4,top_k=4,total_tokens=16")
    parser.add_argument("--pld-tokens", type=at_least(1), default=10, help="prompt_lookup_num_tokens for the PLD baseline")
    parser.add_argument("--no-pld", action="store_true", help="skip the transformers prompt-lookup baseline")
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0 = all logical CPUs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", type=device, default="cpu", help="where the target and drafters run, e.g. cuda")
    parser.add_argument("--oracle", action="append", type=number_in(0, 1), default=[], metavar="ALPHA",
                        help="a row drafting the baseline's own answer, each token wrong with probability "
                             "1 - ALPHA (chains of --oracle-depth): engine cost against the ideal; repeatable")
    parser.add_argument("--oracle-depth", type=at_least(1), default=8, help="chain length of --oracle rows")
    parser.add_argument("--oracle-static", action="store_true",
                        help="each --oracle row also with the static KV cache (oracle:ALPHA+static)")
    parser.add_argument("--vllm", action="append", default=[], metavar="plain|ngram|suffix|DRAFTER",
                        help="a vLLM row (vLLM's CPU build from `make vllm`, or --vllm-python): plain decoding, "
                             "its ngram or suffix drafting, or a drafter folder exported for vLLM; repeatable")
    parser.add_argument("--sample", action="store_true",
                        help="time sampled generation (transformers' sampling as the baseline), not greedy")
    parser.add_argument("--temperature", type=number_in(0, open_low=True), default=0.7, help="with --sample")
    parser.add_argument("--top-p", type=number_in(0, 1, open_low=True), default=0.9, help="with --sample (1 = no nucleus filter)")
    parser.add_argument("--top-k", type=at_least(0), default=0, help="with --sample (0 = no top-k filter)")
    parser.add_argument("--seed", type=int, default=0, help="with --sample: the first generation's torch seed")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if any selfspec or transformers greedy output differs")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="keep the questions an interrupted run with the same methods wrote to --out's "
                             "records.jsonl and measure only the rest")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    from infer.embedded import resolve_target

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    questions = load_questions(args.questions, args.limit, args.categories, args.per_category)
    if not questions:
        parser.error("no questions selected")
    tree = parse_tree(args.tree)
    for spec in args.drafter:
        check_drafter_spec(spec)
    sampling = None
    if args.sample:
        if args.oracle:
            parser.error("--sample: an --oracle row drafts the greedy answer; leave it out")
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    target, tokenizer = resolve_target(args.target, dtype=getattr(torch, args.dtype))
    target.to(args.device)
    methods = [hf_method(target, BASELINE, sampling)]
    if not args.no_pld:
        methods.append(hf_method(target, PLD, sampling, prompt_lookup_num_tokens=args.pld_tokens))
    for spec in args.drafter:
        methods.append(drafter_method(spec, target, tree, sampling))
    methods += [oracle_method(target, alpha, args.oracle_depth) for alpha in args.oracle]
    if args.oracle_static:
        methods += [oracle_method(target, alpha, args.oracle_depth, static_cache=True) for alpha in args.oracle]
    try:
        for spec in args.vllm:
            methods.append(vllm_method(spec, args.target, args.dtype, threads, Path(args.out), sampling))
        return _run(args, argv, target, tokenizer, questions, methods, sampling)
    finally:
        for m in methods:
            if m.close is not None:
                m.close()


def _run(args, argv, target, tokenizer, questions, methods, sampling: dict | None) -> int:
    print(f"{len(questions)} questions, methods: {', '.join(m.name for m in methods)}, "
          f"torch threads: {torch.get_num_threads()}")

    load_before = environment(target, torch.get_num_threads())["load_average"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    partial = Path(args.out) / "records.jsonl"  # one line per question as it finishes
    done = []
    if args.resume and partial.exists():
        done = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        print(f"resuming: {len(done)} records measured earlier in {partial}")
    else:
        partial.write_text("")

    def keep(record: dict) -> None:
        with open(partial, "a") as f:
            f.write(json.dumps(record) + "\n")

    turns, timed_from = (max(args.turns, 2), 2) if args.second_turns else (args.turns, 1)
    result = run_bench(target, tokenizer, questions, methods, max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, turns=turns, on_record=keep, timed_from_turn=timed_from,
                       passes=args.passes, done=done, sampling=sampling, seed=args.seed)
    result["environment"] = environment(target, torch.get_num_threads())
    result["environment"]["load_average_before"] = load_before
    if done:  # the earlier part ran on another day or under another load: say so beside the numbers
        result["environment"]["resumed"] = {"records_measured_before": len(done),
                                            "resumed_at": result["environment"]["date"]}
    result["environment"].update(memory_floor(target))
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv)
    result["settings"].update(target=args.target, questions=args.questions, pld_tokens=None if args.no_pld else
                              args.pld_tokens, drafters=args.drafter, vllm=args.vllm or None,
                              oracle=args.oracle or None, oracle_depth=args.oracle_depth if args.oracle else None,
                              tree=parse_tree(args.tree) or None)
    paths = write_outputs(result, args.out, plots=not args.no_plots)
    print(to_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    report_mismatches(result)
    ours = [m for m in result["mismatches"] if m.get("engine") != "vllm"]
    return 1 if args.strict and ours else 0


if __name__ == "__main__":
    sys.exit(main())
