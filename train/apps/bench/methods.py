"""The rows a benchmark times: each a `Method`, a named way to generate one prompt's answer.

transformers' `generate` (greedy, sampled or prompt lookup), SelfSpecModel with a drafter by name, folder or
draft model (with the option suffixes of `--drafter`), the oracle drafter, and vLLM's offline engine.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

BASELINE, PLD = "baseline", "pld"
GREEDY = {"do_sample": False}

LOOKUP_SUFFIX = "+lookup"  # `--drafter <spec>+lookup`: SelfSpecModel(..., lookup_first=True)
COMPILE_SUFFIX = "+compile"  # `--drafter <spec>+compile`: SelfSpecModel(..., compile=True)
STATIC_SUFFIX = "+static"  # `--drafter <spec>+static`: SelfSpecModel(..., static_cache=True)
MODULES_SUFFIX = "+modules"  # `--drafter <spec>+modules`: SelfSpecModel(..., lean_verify=False)
FP32_ARGMAX_SUFFIX = "+fp32argmax"  # `--drafter <spec>+fp32argmax`: SelfSpecModel(..., int8_argmax=False)
FP32_DRAFT_SUFFIX = "+fp32draft"  # `--drafter <spec>+fp32draft`: SelfSpecModel(..., int8_drafter=False)
SUFFIXES = (LOOKUP_SUFFIX, COMPILE_SUFFIX, STATIC_SUFFIX, MODULES_SUFFIX, FP32_ARGMAX_SUFFIX, FP32_DRAFT_SUFFIX)


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
        from infer.loading import resolve_target

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


def split_suffixes(spec: str) -> tuple[str, list[str]]:
    """`<base><suffix>...` -> (base, the suffixes in the order written); suffixes may come in any order."""
    base, options = spec, []
    while base.endswith(SUFFIXES):
        suffix = next(s for s in SUFFIXES if base.endswith(s))
        base, options = base[: -len(suffix)], [suffix, *options]
    return base, options


def check_drafter_spec(spec: str) -> None:
    """Refuse, before any model loads, a --drafter that is no named drafter, draft model, folder or hub id."""
    from infer.drafters import DRAFTERS, known
    from infer.drafters.registry import closest

    base, _ = split_suffixes(spec)
    if base.partition(":")[0] in DRAFTERS or base.startswith("draft-model:") or "/" in base or Path(base).exists():
        return
    import heads

    shipped = tuple(heads.shipped_drafters())
    if base in shipped:
        return
    raise ValueError(f"--drafter {spec!r}: no such local folder ({Path(base).absolute()}) and no drafter named "
                     f"{base!r}{closest(base, shipped)}; the named drafters are: {known()}; or a saved drafter "
                     f"folder, a shipped drafter ({', '.join(shipped) or 'none'}), draft-model:<path or hub id>, or "
                     "a hub id (owner/name)")


def is_trained(spec: str) -> bool:
    """Whether --drafter `spec` loads a trained drafter (a folder, shipped drafter or hub id), whose tree --tree
    sets, rather than a drafter by name or a draft model (`load_drafter`)."""
    from infer.drafters import DRAFTERS

    base, _ = split_suffixes(spec)
    return not (base.partition(":")[0] in DRAFTERS or base.startswith("draft-model:"))


def drafter_method(spec: str, target, tree: dict | None = None, sampling: dict | None = None) -> Method:
    """SelfSpecModel with the drafter `spec` names, its suffixes (LOOKUP_SUFFIX, ...) setting the options."""
    base, options = split_suffixes(spec)
    name, drafter = load_drafter(base, target, tree)
    if isinstance(drafter, torch.nn.Module):
        drafter.to(target.device)  # a drafter keeps its own dtype; it must sit on the target's device
    return engine_method(target, drafter, name + "".join(options), LOOKUP_SUFFIX in options,
                         COMPILE_SUFFIX in options, STATIC_SUFFIX in options,
                         lean_verify=False if MODULES_SUFFIX in options else None,
                         int8_argmax=FP32_ARGMAX_SUFFIX not in options,
                         int8_drafter=FP32_DRAFT_SUFFIX not in options, sampling=sampling)


def vllm_speculation(spec: str) -> tuple[str, dict | None]:
    """(row name, vLLM speculative_config) for `--vllm plain|ngram|suffix|<drafter folder>`; a drafter is
    exported to the format vLLM loads for its kind, beside it, as scripts/serve.py exports it."""
    from train.vllm_engine import speculative_config

    if spec == "plain":
        return "vllm", None
    try:
        speculation = speculative_config(spec)
    except ValueError as err:
        raise ValueError(f"--vllm {spec}: {err}") from None
    if speculation.drafter is None:
        return f"vllm-{spec}", speculation.config
    return f"vllm-{drafter_label(spec, speculation.drafter)}", speculation.config


def vllm_method(spec: str, target_name: str, dtype: str, threads: int, log_dir: Path,
                sampling: dict | None = None) -> Method:
    """vLLM's offline engine on the same prompts, started once here: greedy, or sampled with `sampling`'s
    settings from the torch seed the run set (`torch.initial_seed()`)."""
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
