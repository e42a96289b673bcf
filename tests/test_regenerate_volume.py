"""Regeneration at volume (train/regenerate.py): engines answering side by side, a kill and a resume with nothing
lost or written twice, an engine failing mid-run, settings changed on resume, repeated ids, reasoning targets.

Stand-in engines answer from the prompt's token ids (deterministic, like greedy decoding) after a delay, so
the concurrency and resume logic runs without a model; a vllm-marked test drives the real worker. Run as a
script, this file is the run that the kill test stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from train_fixtures import CHATML, char_tokenizer, read_jsonl

from train.data import load_rows
from train.regenerate import regenerate
from train.vllm_engine import default_vllm_python

ROOT = Path(__file__).resolve().parent.parent


class StandIn:
    """Answers each prompt with a reply made from its ids, after `delay` seconds; fails on call `fail_at`."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None, reply: str | None = None):
        self.delay, self.fail_at, self.reply, self.calls, self.prompts = delay, fail_at, reply, 0, []
        self.most_active = [0]  # the most engines answering at one moment, shared by `side_by_side`

    def complete(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("the engine died")
        self.prompts += prompts
        time.sleep(self.delay)
        return [(self.reply or f"ok {len(p)} {sum(p) % 97}.", True) for p in prompts]


def side_by_side(count: int, delay: float) -> list[StandIn]:
    """Engines that record how many of them were answering at the same moment."""
    lock, most = threading.Lock(), [0]
    running = [0]

    class Counted(StandIn):
        def complete(self, *args, **kwargs):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                return super().complete(*args, **kwargs)
            finally:
                with lock:
                    running[0] -= 1

    engines = [Counted(delay) for _ in range(count)]
    for e in engines:
        e.most_active = most
    return engines


def write_data(path: Path, n: int, repeat_ids: int = 0) -> str:
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": "old"},
                                         {"role": "user", "content": "and then?"}]} for i in range(n)]
    rows += [{"id": f"c{i}", "messages": [{"role": "user", "content": "a different question"}]}
             for i in range(repeat_ids)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def by_id(path) -> dict:
    records = read_jsonl(path)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id written twice"
    return {r["id"]: r for r in records}


def test_engines_answer_side_by_side_and_write_what_one_engine_writes(tmp_path):
    data = load_rows(write_data(tmp_path / "d.jsonl", 24))
    one = regenerate(StandIn(), char_tokenizer(), data, tmp_path / "one.jsonl", batch_size=2, progress=False)
    engines = side_by_side(3, delay=0.05)
    three = regenerate(engines, char_tokenizer(), data, tmp_path / "three.jsonl", batch_size=2, progress=False)
    assert one["written"] == three["written"] == 24 and three["answers_per_s"] > 0
    assert by_id(tmp_path / "one.jsonl") == by_id(tmp_path / "three.jsonl")
    assert engines[0].most_active[0] == 3  # all three were answering at once
    assert all(e.calls > 0 for e in engines)


def test_a_killed_run_resumes_with_nothing_lost_or_written_twice(tmp_path):
    data = write_data(tmp_path / "d.jsonl", 60)
    whole = tmp_path / "whole.jsonl"
    regenerate(StandIn(), char_tokenizer(), load_rows(data), whole, batch_size=2, progress=False)
    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, __file__, data, str(out)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_bytes().splitlines()) >= 6:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(read_jsonl(out))
    assert 6 <= written < 60, f"the kill came after {written} of 60 answers (stderr: {proc.stderr.read()[-2000:]!r})"
    counts = regenerate(side_by_side(3, 0.0), char_tokenizer(), load_rows(data), out, batch_size=2, progress=False)
    assert counts["skipped_done"] == written and counts["written"] == 60 - written
    assert by_id(out) == by_id(whole)


def test_an_engine_failing_keeps_the_finished_batches(tmp_path):
    data = load_rows(write_data(tmp_path / "d.jsonl", 24))
    engines = [StandIn(0.02), StandIn(0.02), StandIn(0.05, fail_at=3)]
    out = tmp_path / "o.jsonl"
    with pytest.raises(RuntimeError, match="the engine died"):
        regenerate(engines, char_tokenizer(), data, out, batch_size=2, progress=False)
    kept = len(read_jsonl(out))
    assert kept >= 4  # at least the failing engine's first batches and the others' are on disk
    counts = regenerate(StandIn(), char_tokenizer(), data, out, batch_size=2, progress=False)
    assert counts["skipped_done"] == kept and len(by_id(out)) == 24


def test_a_resume_with_changed_settings_is_refused_and_the_file_kept(tmp_path):
    data = load_rows(write_data(tmp_path / "d.jsonl", 6))
    out = tmp_path / "o.jsonl"
    regenerate(StandIn(), char_tokenizer(), data, out, max_samples=3, max_new_tokens=16, progress=False)
    before = out.read_bytes()
    for change, flag in (({"max_new_tokens": 32}, "--max_new_tokens 16 -> 32"),
                         ({"temperature": 0.7}, "--temperature 0.0 -> 0.7"),
                         ({"reasoning": "drop"}, "--reasoning 'keep' -> 'drop'"),
                         ({"out_format": "sharegpt"}, "--format 'messages' -> 'sharegpt'")):
        with pytest.raises(ValueError, match=flag):
            regenerate(StandIn(), char_tokenizer(), data, out, **{"max_new_tokens": 16, **change}, progress=False)
        assert out.read_bytes() == before
    # What does not change the answers may: more rows, another batch size, more engines.
    counts = regenerate([StandIn(), StandIn()], char_tokenizer(), data, out, max_new_tokens=16, batch_size=3,
                        progress=False)
    assert counts["written"] == 3 and len(by_id(out)) == 6


def test_the_command_refuses_changed_settings_before_loading_anything(tmp_path):
    from train.regenerate import main

    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "c0", "messages": [], "finished": true}\n')
    (tmp_path / "o.jsonl.settings.json").write_text(json.dumps({"target": "some/other-model", "max_new_tokens": 256}))
    with pytest.raises(ValueError, match="--target 'some/other-model' -> 'smollm2-135m-instruct'"):
        # the data file does not exist: the settings are checked before the data is read
        main(["--target", "smollm2-135m-instruct", "--data", str(tmp_path / "none.jsonl"), "--out", str(out)])


def test_repeated_ids_are_answered_once(tmp_path):
    data = load_rows(write_data(tmp_path / "d.jsonl", 4, repeat_ids=2))
    with pytest.warns(UserWarning, match="2 rows repeat an earlier row's id"):
        counts = regenerate(StandIn(), char_tokenizer(), data, tmp_path / "o.jsonl", progress=False)
    assert counts["skipped_duplicate_ids"] == 2 and counts["written"] == 4
    assert by_id(tmp_path / "o.jsonl")["c0"]["messages"][0]["content"] == "question 0"  # the first row's


def test_a_resume_onto_a_file_without_its_last_newline_appends_after_one(tmp_path):
    data = load_rows(write_data(tmp_path / "d.jsonl", 6))
    out = tmp_path / "o.jsonl"
    regenerate(StandIn(), char_tokenizer(), data, out, max_samples=2, progress=False)
    out.write_bytes(out.read_bytes().rstrip(b"\n"))  # saved by an editor that drops the final newline
    counts = regenerate(StandIn(), char_tokenizer(), data, out, max_samples=4, progress=False)
    assert counts["skipped_done"] == 2 and counts["written"] == 2
    # before, the first new record was glued onto the last line, and this resume refused the file as damaged
    counts = regenerate(StandIn(), char_tokenizer(), data, out, progress=False)
    assert counts["skipped_done"] == 4 and sorted(by_id(out)) == [f"c{i}" for i in range(6)]


def test_a_resume_on_edited_data_is_refused_naming_the_data(tmp_path):
    """An Alpaca row's id is its row number: with a row inserted at the top, a resume would skip the new prompt
    under an id already answered (for the old row 0) and answer nothing new for it."""
    rows = [{"instruction": f"question {i}", "input": "", "output": "old"} for i in range(4)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))
    out = tmp_path / "o.jsonl"
    regenerate(StandIn(), char_tokenizer(), load_rows(str(path)), out, max_samples=2, run={"data": str(path)},
               progress=False)
    before = out.read_bytes()
    path.write_text(json.dumps([{"instruction": "a new first question", "input": "", "output": "old"}, *rows]))
    with pytest.raises(ValueError, match=f"holds answers to other rows than {path} has now .*Restore the data"):
        regenerate(StandIn(), char_tokenizer(), load_rows(str(path)), out, run={"data": str(path)}, progress=False)
    assert out.read_bytes() == before
    path.write_text(json.dumps(rows))  # restored: the resume goes on
    counts = regenerate(StandIn(), char_tokenizer(), load_rows(str(path)), out, run={"data": str(path)},
                        progress=False)
    assert counts["skipped_done"] == 2 and counts["written"] == 2


SYSTEM = {"role": "system", "content": "be brief"}
PARTS = [{"type": "text", "text": "question"}]


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": None}], r"row 1 \(id 'b'\): message 0 \(user\) has content None, not text"),
    ([{**SYSTEM, "content": None}, {"role": "user", "content": "q"}], r"message 0 \(system\) has content None"),
    ([{"role": "user", "content": PARTS}], r"message 0 \(user\) has content as a list of 1 parts, not text"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": PARTS}], r"message 1 \(assistant\) has "
     r"content as a list of 1 parts"),
])
def test_rows_training_refuses_are_refused_by_regeneration_alike(tmp_path, messages, fragment):
    """Regeneration keeps the prompts as they are, so a prompt training refuses would be answered and then refused
    when the answers are trained on (a list of content parts was rendered as its Python text)."""
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "yo"}]},
            {"id": "b", "messages": [*messages, {"role": "assistant", "content": "yo"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from train.data import build_samples

    with pytest.raises(ValueError, match=fragment):
        build_samples(load_rows(str(path)), char_tokenizer(), 512)
    out = tmp_path / "o.jsonl"
    with pytest.raises(ValueError, match=fragment):
        regenerate(StandIn(), char_tokenizer(), load_rows(str(path)), out, progress=False)
    assert not out.exists() or out.read_text() == ""


def test_a_null_reply_is_answered_by_regeneration_and_refused_by_training(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    from train.data import build_samples

    with pytest.raises(ValueError, match="regenerate the replies with train.regenerate"):
        build_samples(load_rows(str(path)), char_tokenizer(), 512)
    regenerate(StandIn(reply="an answer"), char_tokenizer(), load_rows(str(path)), tmp_path / "o.jsonl",
               progress=False)
    assert by_id(tmp_path / "o.jsonl")["a"]["messages"][1]["content"] == "an answer"
    samples, _ = build_samples(load_rows(str(tmp_path / "o.jsonl")), char_tokenizer(), 512)
    assert len(samples) == 1


@pytest.mark.parametrize("first_has_id", [True, False])
def test_rows_with_and_without_ids_are_refused_not_merged(tmp_path, first_has_id):
    """A row without an id is answered under its row number, which another row's id can be: the row numbered 1
    and the row with id "1" were taken for one, and the second dropped as a duplicate."""
    lacks, has = (1, 0) if first_has_id else (0, 1)
    rows = [None, None]
    rows[has] = {"id": str(lacks), "messages": [{"role": "user", "content": "question"}]}
    rows[lacks] = {"messages": [{"role": "user", "content": "another question"}]}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=f"row {lacks} has no id \\(id\\) but row {has} has id '{lacks}'.*give every "
                                         "row an id"):
        regenerate(StandIn(), char_tokenizer(), load_rows(str(path)), tmp_path / "o.jsonl", progress=False)


THINKING = CHATML + "{% if add_generation_prompt and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"


@pytest.mark.parametrize("reasoning, expected", [("keep", "<think>let me see.</think>\n\nfour."), ("drop", "four.")])
def test_reasoning_kept_or_dropped(tmp_path, reasoning, expected):
    engine = StandIn(reply="<think>let me see.</think>\n\nfour.")
    data = load_rows(write_data(tmp_path / "d.jsonl", 2))
    out = tmp_path / "o.jsonl"
    regenerate(engine, char_tokenizer(THINKING), data, out, reasoning=reasoning, progress=False)
    messages = by_id(out)["c0"]["messages"]
    assert messages[1]["content"] == expected and messages[3]["content"] == expected


def test_reasoning_cut_by_the_token_limit_is_an_unfinished_empty_answer_when_dropped(tmp_path):
    engine = StandIn(reply="<think>still thinking")
    out = tmp_path / "o.jsonl"
    regenerate(engine, char_tokenizer(), load_rows(write_data(tmp_path / "d.jsonl", 1)), out, reasoning="drop",
               progress=False)
    record = by_id(out)["c0"]
    assert record["finished"] is False and record["messages"][1]["content"] == ""


@pytest.mark.parametrize("thinking, switched_off", [(None, False), (True, False), (False, True)])
def test_enable_thinking_reaches_the_template(tmp_path, thinking, switched_off):
    engine, tok = StandIn(), char_tokenizer(THINKING)
    regenerate(engine, tok, load_rows(write_data(tmp_path / "d.jsonl", 1)), tmp_path / "o.jsonl",
               enable_thinking=thinking, progress=False)
    closed = tok.decode(tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])  # the char vocabulary's
    assert engine.prompts and all(tok.decode(p).endswith(closed) == switched_off for p in engine.prompts)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_vllm_engines_resume_a_killed_command(tmp_path):
    python = Path(os.environ.get("SELFSPEC_VLLM_PYTHON", default_vllm_python()))
    if not python.exists():
        pytest.skip(f"no vLLM environment at {python}: run `make vllm`")
    prompts = [json.loads(line)["turns"][0] for line in open(ROOT / "data" / "demo_prompts.jsonl")][:32]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "train.regenerate", "--engine", "vllm", "--engines", "2", "--target",
           "smollm2-135m-instruct", "--data", str(data), "--out", str(out), "--max_new_tokens", "32",
           "--batch_size", "4"]
    tag = f"SELFSPEC_KILL_TEST={tmp_path}"  # inherited by every process the command starts, vLLM's included
    env = {**os.environ, "SELFSPEC_KILL_TEST": str(tmp_path)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_bytes().splitlines()) >= 4:
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the command; its vLLM workers get SIGTERM when it dies (vllm_engine.py)
    proc.wait()
    # nothing it started outlives it: vLLM's engine and worker processes (GBs each) go with their worker
    deadline = time.monotonic() + 60
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _tagged_processes(tag) == []
    written = len(read_jsonl(out))
    assert 4 <= written < 32, proc.stderr.read()[-3000:]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["skipped_done"] == written and counts["written"] == 32 - written
    assert sorted(by_id(out)) == sorted(f"q{i}" for i in range(32))
    print(f"\nvLLM-CPU, 2 engines, batch 4, 32 tokens: {counts['answers_per_s']} answers/s, "
          f"{counts['tokens_per_s']} tokens/s")


def _tagged_processes(tag: str) -> list[str]:
    """The command lines of live processes whose environment holds `tag`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag.encode() in (proc / "environ").read_bytes().split(b"\0") \
                    and (proc / "stat").read_text().split(") ")[-1][0] != "Z":
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


if __name__ == "__main__":  # the run the kill test stops: three slow engines side by side
    regenerate([StandIn(0.15) for _ in range(3)], char_tokenizer(), load_rows(sys.argv[1]), sys.argv[2], batch_size=2,
               progress=False)
