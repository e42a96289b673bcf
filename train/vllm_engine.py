"""vLLM's offline engine, run in its own environment, as a generator for self-distillation.

vLLM's CPU build needs its own torch and transformers, so it lives in .venv-vllm (`make vllm`), not in the
project's environment. `VLLMEngine` starts train/vllm_worker.py there and talks JSON lines to it:

    with VLLMEngine("smollm2-135m-instruct") as engine:
        engine.replies([[{"role": "user", "content": "Hi"}]], max_new_tokens=64)   # [(text, finished)]

The worker runs in its own process group, killed with everything vLLM started when the engine closes (or
when this process dies: Linux parent-death signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
# vLLM's speculative methods that need no drafter, with the settings selfspec starts them with.
DRAFTERLESS = {
    "ngram": {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {},  # vLLM's defaults (arctic-inference's suffix trees, up to 24 tokens a step)
}


def default_vllm_python() -> Path:
    """$SELFSPEC_VLLM_PYTHON, else the environment `make vllm` builds."""
    return Path(os.environ.get("SELFSPEC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def vllm_model_path(target: str) -> str:
    """A target vLLM can load: the embedded short name becomes its converted transformers folder."""
    from infer.embedded import EMBEDDED_NAME, embedded_folder

    return str(embedded_folder()) if str(target).lower() == EMBEDDED_NAME else str(target)


class Speculation(NamedTuple):
    """What vLLM is started with to draft: see `speculative_config`."""

    config: dict  # vLLM's speculative_config
    drafter: object | None  # the selfspec drafter exported for it; None for a drafter-less method
    what: str  # what drafts, in words, for messages


def speculative_config(spec: str, *, target: str | None = None, export_dir: str | os.PathLike | None = None,
                       num_speculative_tokens: int | None = None) -> Speculation:
    """vLLM's speculative_config for a drafter-less method of vLLM's (`DRAFTERLESS`: ngram, suffix) or a saved
    selfspec drafter folder, which is first exported to the first format of its kind that vLLM loads, into
    `export_dir` (default `<drafter>-<format>` beside it; never over a user's files). `target`: the model an
    export that needs one (Medusa heads sharing the target's lm_head) loads, default the drafter's own.
    `num_speculative_tokens` defaults to the method's setting or the drafter's tree depth. Used by
    scripts/bench.py's vLLM rows and scripts/serve.py; a problem the user can fix is a ValueError saying so."""
    import heads
    from heads.export import check_out_dir

    if spec in DRAFTERLESS:
        config = {"method": spec, **DRAFTERLESS[spec]}
        if num_speculative_tokens is not None:
            config["num_speculative_tokens"] = num_speculative_tokens
        return Speculation(config, None, f"vLLM's {spec} drafting")
    if not Path(spec).is_dir():
        raise ValueError(f"{spec} is not a folder: pass a saved drafter (a folder with config.json and "
                         f"model.safetensors, e.g. runs/<run>/drafter) or one of {sorted(DRAFTERLESS)}")
    try:
        drafter = heads.load(spec)
    except (ValueError, OSError) as err:
        raise ValueError(f"{spec} is not a selfspec drafter: {err}") from None
    kind = heads.get_kind(drafter.kind)
    formats = [f for f in kind.exports if f.vllm_method]
    if not formats:
        servable = sorted(k.title for k in heads.REGISTRY.values() if any(f.vllm_method for f in k.exports))
        raise ValueError(f"vLLM cannot serve {kind.title}s: the kind has no export format vLLM loads. Serve one "
                         f"of {servable}, vLLM's drafter-less {sorted(DRAFTERLESS)}, or use this drafter with "
                         "selfspec's own engine (infer.SelfSpecModel, scripts/bench.py)")
    fmt = formats[0]
    out = Path(export_dir) if export_dir else Path(f"{Path(spec).resolve()}-{fmt.name}")
    check_out_dir(out)
    if fmt.needs_target(drafter):  # e.g. Medusa heads sharing the target's lm_head write a copy of it
        from infer.loading import resolve_target

        model, tokenizer = resolve_target(target or drafter.config.base_model_name_or_path, dtype="auto")
        drafter.attach(model, tokenizer)
    exported = fmt.export(drafter, out)
    if num_speculative_tokens is None:  # tokens drafted per step along one branch: the tree's depth
        tree = drafter.config.resolve_tree(drafter.config.tree)
        num_speculative_tokens = max(map(len, tree["paths"])) if tree.get("paths") else int(tree["depth"])
    config = {"method": fmt.vllm_method, "model": str(Path(exported).resolve()),
              "num_speculative_tokens": num_speculative_tokens}
    return Speculation(config, drafter, f"{fmt.description} export {exported}")


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM when this process dies, so no vLLM server outlives its caller."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of `proc`'s process group (vLLM's workers included) is still running."""
    proc.poll()  # reap the leader, or the zombie would count as alive
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_group(proc: subprocess.Popen, grace: float = 30.0, wait_first: bool = False) -> None:
    """SIGTERM to `proc`'s whole group, SIGKILL to what is left after `grace` seconds; with `wait_first`, first
    `grace` seconds for it to leave on its own (a worker whose stdin was closed)."""
    steps = ((None, grace),) if wait_first else ()
    for sig, wait in (*steps, (signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not group_alive(proc):
            break
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
        deadline = time.monotonic() + wait
        while group_alive(proc) and time.monotonic() < deadline:
            time.sleep(0.2)
    proc.wait()


class VLLMEngine:
    """Chat replies from vLLM's offline engine, batched by vLLM's scheduler."""

    def __init__(self, target: str, *, dtype: str = "float32", vllm_python: str | os.PathLike | None = None,
                 log: str | os.PathLike | None = None, enforce_eager: bool = True, max_model_len: int | None = None,
                 startup_timeout: float = 900.0, speculative_config: dict | None = None, log_stats: bool = False,
                 env: dict[str, str] | None = None):
        python = Path(vllm_python) if vllm_python else default_vllm_python()
        if not python.exists():
            raise FileNotFoundError(f"no vLLM environment at {python}: run `make vllm`, or pass the python of an "
                                    "environment with vLLM (--vllm_python / $SELFSPEC_VLLM_PYTHON)")
        self.log = Path(log) if log else ROOT / "runs" / "vllm-regenerate.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(python), str(WORKER), "--model", vllm_model_path(target), "--dtype", dtype]
        cmd += ["--enforce-eager"] if enforce_eager else []
        cmd += ["--max-model-len", str(max_model_len)] if max_model_len else []
        cmd += ["--speculative-config", json.dumps(speculative_config)] if speculative_config else []
        cmd += ["--log-stats"] if log_stats else []
        # A fixed KV cache: without it vLLM's CPU backend wants 92% of the memory node (GPU builds ignore it).
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, **(env or {})}
        with open(self.log, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                         env=env, text=True, start_new_session=True, preexec_fn=die_with_parent)
        try:
            self._read("ready", startup_timeout)
        except BaseException:
            self.close()
            raise

    def _read(self, key: str, timeout: float | None = None):
        """The next protocol line's `key`; vLLM's own failure (the end of its log) if the worker died."""
        return self._read_line(timeout)[key]

    def _read_line(self, timeout: float | None = None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"vLLM did not start within {timeout:.0f} s; it was stopped. Its log: {self.log}")
        line = self.proc.stdout.readline()  # the worker writes one line per request
        if not line:
            self.proc.wait(timeout=30)
            tail = "\n".join(f"  | {t}" for t in deque(self.log.read_text(errors="replace").splitlines(), 25))
            raise RuntimeError(f"the vLLM worker exited with code {self.proc.returncode}; the end of its log "
                               f"({self.log}):\n{tail}")
        return json.loads(line)

    def replies(self, histories: list[list[dict]], max_new_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0) -> list[tuple[str, bool]]:
        """(reply, finished) for each history; `finished` is False when max_new_tokens cut the reply."""
        request = {"histories": histories, "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "top_p": top_p, "seed": seed}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return [(text, finished) for text, finished in self._read("replies")]

    def complete(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[tuple[str, bool]]:
        """(reply, finished) for each rendered, tokenized chat prompt, all handed to vLLM's scheduler at once;
        request i samples with seed + i. train/regenerate.py's engine interface."""
        request = {"prompt_ids_batch": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "top_p": top_p, "seed": seed}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return [(text, finished) for text, finished in self._read("replies")]

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int,
                     sampling: dict | None = None) -> tuple[list[int], dict | None]:
        """One generation from token ids, greedy, or sampled with `sampling`'s temperature, top_p, top_k and seed:
        (new ids, eos included where it stopped; the spec-decode counters it added, or None without speculation
        or log_stats)."""
        request = {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, **(sampling or {})}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self._read_line()
        return line["ids"], line["spec"]

    def close(self, grace: float = 30.0) -> None:
        """End the worker: stdin closed (it leaves its loop), then SIGTERM and SIGKILL to its whole group."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        stop_group(self.proc, grace, wait_first=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
