"""train/apps/serve.py (scripts/serve.py): a drafter served by vLLM in one command.

Without vLLM (seconds): the command vLLM gets for each kind, and every bad input (not a drafter, a kind vLLM
cannot serve, no vLLM environment, a port in use, vLLM dying during start-up) gets a message saying what to
do and leaves no process behind; SIGTERM stops the server and all it started. A stand-in for vLLM's python
(a script that answers /health, or dies) makes the process handling testable here.

With vLLM (marked `vllm`, a few minutes; CI builds the environment with `make vllm` first): the round trip on
the embedded SmolLM2 target, for EAGLE-3 and DFlash. Each drafter is trained in the test (60 steps on the
target's own answers to 16 shipped prompts, so it has learned those answers), exported and served by vLLM's CPU
build through scripts/serve.py, and asked over HTTP. The greedy text must equal SelfSpecModel's and vLLM's
acceptance at each of the 3 draft positions (its /metrics counters) must be within 10% of ours (or one draft,
where counts are small), both drafting a chain of 3 tokens. This proves that the exported drafter computes the same drafts in vLLM as in our engine,
not that the drafter is good on text it has not seen.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from train_fixtures import save_tiny_target

import heads
from train.apps import serve
from train.vllm_engine import default_vllm_python

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "scripts" / "serve.py"  # run as the command it is, in its own process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """A tiny saved target and a saved drafter of each kind built on it (they record the target's folder)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve")
    target = AutoModelForCausalLM.from_pretrained(save_tiny_target(root / "target"))
    out = {"root": root, "target": str(root / "target")}
    # EAGLE-3 reads three distinct layers, as vLLM serves them (a 4-layer target's default repeats one)
    for kind, options in (("eagle3", {"feature_layers": [1, 2, 3]}), ("eagle", {}),
                          ("medusa", {"num_heads": 2, "share_lm_head": True})):
        heads.build(kind, target, **options).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    return out


def fake_vllm(folder: Path, mode: str) -> Path:
    """A stand-in for the python of a vLLM environment: answers the vllm-package probe, then either dies
    during start-up ("die"), loses its engine but stays up unhealthy ("engine-dies") or serves /health until
    SIGTERM ("serve"); each first starts a child process,
    as vLLM starts its engine, whose pid they write to child.pid."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import http.server, signal, subprocess, sys
        if sys.argv[1] == "-c":
            sys.exit(0)
        child = subprocess.Popen(["sleep", "300"])
        open({str(folder / "child.pid")!r}, "w").write(str(child.pid))
        if {mode!r} == "die":
            print("(Worker pid=1) ERROR ValueError: simulated start-up failure", flush=True)
            print("RuntimeError: Engine core initialization failed.", flush=True)
            sys.exit(1)
        if {mode!r} == "engine-dies":  # the API process stays up, never healthy, as vLLM's does
            print("(EngineCore pid=2) ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly "
                  "(exit code: -9), shutting down executor.", flush=True)
            print("(EngineCore pid=2) ERROR [core.py:1512] EngineCore encountered a fatal error.", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            signal.pause()

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        port = int(sys.argv[sys.argv.index("--port") + 1])
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """))
    python.chmod(0o755)
    return python


def run_main(capsys, *argv) -> tuple[int, str]:
    code = serve.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ---- without vLLM -------------------------------------------------------------------------------------------


def test_dry_run_eagle3_gives_the_speculators_export_and_its_method(drafters, capsys):
    code, out = run_main(capsys, drafters["eagle3"], "--dry-run", "--num-speculative-tokens", "3",
                         "--spec", "draft_tensor_parallel_size=1", "--", "--enforce-eager")
    assert code == 0, out
    command = next(line for line in out.splitlines() if "vllm.entrypoints.openai.api_server" in line)
    spec = json.loads(re.search(r"--speculative-config '(.+?)'", command).group(1))
    export = drafters["eagle3"] + "-speculators"
    assert spec == {"method": "eagle3", "model": export, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
    assert f"--model {drafters['target']}" in command and command.endswith("--enforce-eager")
    assert json.loads(Path(export, "config.json").read_text())["speculators_model_type"] == "eagle3"


def test_dry_run_medusa_exports_with_the_targets_lm_head(drafters, capsys):
    code, out = run_main(capsys, drafters["medusa"], "--dry-run")
    assert code == 0, out
    spec = json.loads(re.search(r"--speculative-config '(.+?)'", out).group(1))
    assert spec["method"] == "medusa" and spec["num_speculative_tokens"] == 2  # the default tree's depth
    assert json.loads(Path(spec["model"], "config.json").read_text())["original_lm_head"] is True


def test_dry_run_drafterless_methods(drafters, capsys):
    code, out = run_main(capsys, "ngram", "--target", drafters["target"], "--dry-run")
    assert code == 0, out
    assert json.loads(re.search(r"--speculative-config '(.+?)'", out).group(1))["method"] == "ngram"
    code, out = run_main(capsys, "suffix", "--dry-run")
    assert code == 2 and "needs --target" in out


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a folder"),
    ("target", "is not a selfspec drafter"),
    ("empty", "is not a selfspec drafter"),
    ("eagle", "vLLM cannot serve EAGLE-1/2 drafters"),
])
def test_what_is_not_a_servable_drafter_is_named(drafters, tmp_path, capsys, case, message):
    source = {"missing": tmp_path / "nothing", "target": drafters["target"], "empty": tmp_path,
              "eagle": drafters["eagle"]}[case]
    code, out = run_main(capsys, source, "--dry-run")
    assert code == 2 and message in out, out


def test_missing_vllm_environment(drafters, tmp_path, capsys):
    code, out = run_main(capsys, drafters["eagle3"], "--vllm-python", tmp_path / "none" / "bin" / "python")
    assert code == 2 and "no vLLM environment" in out and "make vllm" in out
    not_vllm = tmp_path / "python"
    not_vllm.symlink_to(sys.executable)  # a python without vllm: this project's own environment
    code, out = run_main(capsys, drafters["eagle3"], "--vllm-python", not_vllm)
    assert code == 2 and "has no vllm package" in out


def test_port_in_use(drafters, tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = run_main(capsys, drafters["eagle3"], "--port", port,
                             "--vllm-python", fake_vllm(tmp_path / "venv", "serve"))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out and "--port" in out


def test_vllm_dying_during_start_up_is_reported_and_leaves_nothing(drafters, tmp_path, capsys):
    fake = fake_vllm(tmp_path / "venv", "die")
    code, out = run_main(capsys, drafters["eagle3"], "--port", free_port(), "--vllm-python", fake,
                         "--log", tmp_path / "vllm.log")
    assert code == 2, out
    assert "exited with code 1 during start-up: ValueError: simulated start-up failure" in out
    assert str(tmp_path / "vllm.log") in out
    assert not pid_alive(int((tmp_path / "venv" / "child.pid").read_text()))


def test_an_engine_dead_at_start_up_is_reported_at_once(drafters, tmp_path, capsys):
    """vLLM's API process outlives a dead engine (a worker killed for memory) and never answers /health: serve
    says so when the log shows it, rather than waiting out --startup-timeout."""
    fake = fake_vllm(tmp_path / "venv", "engine-dies")
    start = time.monotonic()
    code, out = run_main(capsys, drafters["eagle3"], "--port", free_port(), "--vllm-python", fake,
                         "--log", tmp_path / "vllm.log", "--startup-timeout", "120")
    assert code == 2, out
    assert time.monotonic() - start < 60
    assert "vLLM's engine died during start-up" in out and "exit code: -9" in out and "memory" in out
    assert not pid_alive(int((tmp_path / "venv" / "child.pid").read_text()))


def test_sigterm_stops_the_server_and_everything_it_started(drafters, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVE), drafters["eagle3"], "--port", str(port),
                             "--vllm-python", str(fake_vllm(tmp_path / "venv", "serve")),
                             "--log", str(tmp_path / "vllm.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "vLLM is serving" in line:
                break
        assert f"http://127.0.0.1:{port}/v1" in "".join(lines), "".join(lines)
        started = descendants(proc.pid)
        assert len(started) >= 2  # the stand-in server and its child
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
        assert [pid for pid in started if pid_alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- with vLLM: the round trip ------------------------------------------------------------------------------

VLLM_PYTHON = default_vllm_python()
CHAIN = [[0], [0, 0], [0, 0, 0]]  # draft 3 tokens in a chain, as vLLM does
NEW_TOKENS = 48


def chat_ids(tokenizer, prompt: str):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm` (CI's .ci/run does)")
    return VLLM_PYTHON


# Each kind's drafter trained (60 steps; DFlash 200) on the target's own greedy answers to 16 shipped prompts, drafting a
# chain of 3 tokens as vLLM does: EAGLE-3 with a static chain, DFlash with blocks of 4 (the root and 3 drafts).
TRAINED = {
    "eagle3": ({"drafter_options": {"draft_vocab_size": 2048}, "ttt_steps": 2}, {"mode": "static", "paths": CHAIN}),
    # DFlash learns to use its anchor slowly (docs/training.md): more steps, for acceptance past position 0
    "dflash": ({"drafter_options": {"block_size": 4, "num_layers": 1, "anchors_per_sample": 32}, "max_steps": 200,
                "lr": 5e-3}, {}),
}


@pytest.fixture(scope="module", params=sorted(TRAINED))
def trained(request, vllm_python, smollm2, tmp_path_factory):
    import datasets

    from train.config import load_config
    from train.regenerate import regenerate
    from train.train_heads import train

    kind = request.param
    settings, tree = TRAINED[kind]
    model, tokenizer = smollm2
    root = tmp_path_factory.mktemp(f"vllm_round_trip_{kind}")
    prompts = [json.loads(line)["turns"][0] for line in open(ROOT / "data" / "demo_prompts.jsonl")][:16]
    rows = datasets.Dataset.from_list([{"id": str(i), "messages": [{"role": "user", "content": p}]}
                                       for i, p in enumerate(prompts)])
    regenerate(model, tokenizer, rows, root / "data.jsonl", max_new_tokens=64, batch_size=8, progress=False)
    result = train(load_config(None, {
        "target": "smollm2-135m-instruct", "drafter": kind, "data": str(root / "data.jsonl"),
        "output_dir": str(root / "run"), "feature_cache_dir": str(root / "features"), "features": "offline",
        "max_steps": 60, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "eval_fraction": 0.1,
        "progress_bar": False, "log_every": 0} | settings))
    drafter = heads.load(result["drafter_dir"])
    drafter.config.tree = drafter.config.resolve_tree(tree)
    drafter.save_pretrained(result["drafter_dir"])
    return kind, result["drafter_dir"], prompts[:6]


def spec_counters(url: str) -> tuple[float, list[float]]:
    """(drafts, [drafts whose tokens up to position k were accepted, for k = 0, 1, ...]) from vLLM's
    Prometheus metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    drafts = sum(map(float, re.findall(r"^vllm:spec_decode_num_drafts_total\{.*\} (\S+)$", text, re.M)))
    by_position = []
    for k in range(len(CHAIN)):
        pattern = rf'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{{.*position="{k}".*\}} (\S+)$'
        by_position.append(sum(map(float, re.findall(pattern, text, re.M))))
    return drafts, by_position


def chat(url: str, prompt: str) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_our_drafter_with_the_same_text_and_acceptance(vllm_python, smollm2, trained, tmp_path):
    from infer import SelfSpecModel

    model, tokenizer = smollm2
    kind, drafter_dir, prompts = trained
    # the drafter's fp32 weights, as vLLM runs them: the int8 copies our engine drafts from by default rank near ties
    # otherwise (its int8 head alone moved the rare third-position acceptances by 2 in 121 on a Zen 5 EPYC)
    ours = SelfSpecModel(model, heads.load(drafter_dir), tokenizer=tokenizer, int8_drafter=False)
    our_texts, our_steps = [], []
    for prompt in prompts:  # before vLLM starts: the two would share the machine's cores
        ids = chat_ids(tokenizer, prompt)
        out = ours.generate(ids, max_new_tokens=NEW_TOKENS)
        our_texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        our_steps += ours.last_stats["accepted_lengths"]
    # a step that emitted n tokens accepted the drafts at positions 0..n-2
    ours_by_position = [sum(n - 1 > k for n in our_steps) / len(our_steps) for k in range(len(CHAIN))]

    port, tic = free_port(), time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SERVE), drafter_dir, "--vllm-python", str(vllm_python),
                             "--port", str(port), "--dtype", "float32",
                             "--log", str(tmp_path / "vllm.log"), "--", "--enforce-eager", "--max-model-len", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            found = re.search(r"vLLM is serving \S+ at (http://\S+)/v1", line)
            if found:
                url = found.group(1)
                break
        assert url, f"serve.py ended without serving (exit {proc.wait()}); vLLM log: {tmp_path / 'vllm.log'}"
        started = time.monotonic() - tic
        before = spec_counters(url)
        replies = [chat(url, prompt) for prompt in prompts]
        after = spec_counters(url)
        workers = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert [pid for pid in workers if pid_alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()

    for prompt, reply in zip(prompts, replies, strict=True):
        assert reply["prompt_token_ids"] == chat_ids(tokenizer, prompt)[0].tolist()
    vllm_texts = [reply["choices"][0]["message"]["content"] for reply in replies]
    drafts = after[0] - before[0]
    vllm_by_position = [(a - b) / drafts for a, b in zip(after[1], before[1], strict=True)] if drafts else []
    print(f"\n{kind}: vLLM ready after {started:.0f} s; acceptance by position over {drafts:.0f} vLLM drafts and "
          f"{len(our_steps)} of our steps: vLLM {[round(x, 3) for x in vllm_by_position]}, "
          f"ours {[round(x, 3) for x in ours_by_position]}")
    assert vllm_texts == our_texts
    assert drafts > 0 and vllm_by_position[0] > 0, "vLLM's metrics show no accepted draft tokens"
    # within 10%, or two drafts where the counts are too small for 10% to be two: the kernels of the two engines
    # round differently, so a near tie can fall the other way (on a Zen 5 EPYC, with both heads fp32, the eagle3
    # drafter's third position was accepted 3 times in 121 here and 4 in vLLM); a drafter served wrong (its
    # features from other layers, say) misses by far more
    for k, (theirs, mine) in enumerate(zip(vllm_by_position, ours_by_position, strict=True)):
        assert abs(theirs - mine) <= max(0.1 * mine, 2 / drafts) + 1e-9, \
            f"position {k}: vLLM {theirs:.3f}, ours {mine:.3f}"
