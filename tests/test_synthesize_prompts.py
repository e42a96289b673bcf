"""Magpie-style prompts: the target writes user messages from its chat template's prefix; resumable; bad input."""

from __future__ import annotations

import pytest
from train_fixtures import CHATML, char_tokenizer, read_jsonl, save_tiny_target, tiny_chat_target

from train.data import detect_format, load_rows
from train.synthesize_prompts import main as synthesize_main
from train.synthesize_prompts import query_prefix, synthesize


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target()


def test_prompts_are_finished_new_messages_that_regenerate_reads(tmp_path, target):
    model, tok = target
    out = tmp_path / "magpie.jsonl"
    counts = synthesize(model, tok, out, count=5, batch_size=16, max_new_tokens=24, min_chars=1, progress=False)
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [f"magpie-{i}" for i in range(5)] and counts["written"] == 5
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == 5 and all(t and "<|im_end|>" not in t for t in texts)
    assert counts["drawn"] == 5 + counts["unfinished"] + counts["short_or_repeated"]
    assert counts["unfinished"] > 0  # the tiny model often runs past 24 tokens: those are dropped, not cut
    assert detect_format(load_rows(str(out)).column_names) == "messages"


def test_command_line_then_regenerate_answers_them(tmp_path):
    from train.regenerate import main as regenerate_main

    folder = save_tiny_target(tmp_path / "target")
    prompts, answers = tmp_path / "magpie.jsonl", tmp_path / "answers.jsonl"
    synthesize_main(["--target", folder, "--out", str(prompts), "--count", "3", "--batch_size", "16",
                     "--max_new_tokens", "24", "--min_chars", "1"])
    regenerate_main(["--target", folder, "--data", str(prompts), "--out", str(answers), "--max_new_tokens", "5"])
    asked = {r["id"]: r["messages"][0]["content"] for r in read_jsonl(prompts)}
    answered = read_jsonl(answers)
    assert len(asked) == 3 and {r["id"]: r["messages"][0]["content"] for r in answered} == asked
    assert all(r["messages"][1]["role"] == "assistant" for r in answered)


def test_the_prefix_is_the_template_before_a_user_message():
    before, after = query_prefix(char_tokenizer())
    assert (before, after) == ("<|im_start|>user\n", "<|im_end|>\n")


def test_a_killed_run_resumes_without_losing_or_repeating_prompts(tmp_path, target):
    model, tok = target
    out = tmp_path / "magpie.jsonl"
    synthesize(model, tok, out, count=3, batch_size=16, max_new_tokens=24, min_chars=1, progress=False)
    first = read_jsonl(out)
    with out.open("a") as f:
        f.write('{"id": "magpie-3", "messages": [{"role": "us')  # the kill, mid-write
    counts = synthesize(model, tok, out, count=6, batch_size=16, max_new_tokens=24, min_chars=1, seed=1,
                        progress=False)
    rows = read_jsonl(out)
    assert rows[:3] == first and [r["id"] for r in rows] == [f"magpie-{i}" for i in range(6)]
    assert len({r["messages"][0]["content"] for r in rows}) == 6
    assert counts["already_there"] == 3 and counts["written"] == 3


@pytest.mark.parametrize("template, message", [
    (None, "has no chat template"),
    (CHATML.replace("{{ m['content'] }}", "{{ m['content'] | lower }}"), "does not render a user's message"),
])
def test_templates_it_cannot_cut_are_refused(tmp_path, target, template, message):
    model, _ = target
    with pytest.raises(ValueError, match=message):
        synthesize(model, char_tokenizer(template), tmp_path / "m.jsonl", count=1, progress=False)


def test_an_out_file_of_other_rows_is_refused(tmp_path, target):
    model, tok = target
    out = tmp_path / "answers.jsonl"
    out.write_text('{"id": "0", "conversations": [{"from": "human", "value": "hi"}]}\n')
    with pytest.raises(ValueError, match="answers.jsonl: line 1 is not a prompt row"):
        synthesize(model, tok, out, count=2, progress=False)


def test_greedy_and_hopeless_settings_fail_with_the_fix(tmp_path, target):
    model, tok = target
    with pytest.raises(ValueError, match="temperature must be > 0"):
        synthesize(model, tok, tmp_path / "m.jsonl", count=1, temperature=0, progress=False)
    with pytest.raises(RuntimeError, match="raise max_new_tokens"):
        synthesize(model, tok, tmp_path / "m.jsonl", count=1, batch_size=2, max_new_tokens=1, min_chars=50,
                   progress=False)
