"""Self-distillation: the target rewrites the assistant turns; resumable; output loads as training data."""

from __future__ import annotations

import gzip

import pytest
from train_fixtures import (
    char_tokenizer,
    conversations,
    read_jsonl,
    tiny_chat_target,
    write_alpaca,
    write_sharegpt,
)

from train.data import build_samples, load_rows
from train.regenerate import main as regenerate_main
from train.regenerate import merge_files, read_done_ids, regenerate


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target()


def test_greedy_replies_are_the_targets_own(tmp_path, target):
    model, tok = target
    rows = load_rows(write_alpaca(tmp_path / "a.json", conversations(5)))
    out = tmp_path / "out.jsonl"
    counts = regenerate(model, tok, rows, out, max_new_tokens=12, batch_size=2, progress=False)
    assert counts["written"] == 5
    records = read_jsonl(out)
    assert {r["id"] for r in records} == {"0", "1", "2", "3", "4"}
    for r in records:
        user = r["messages"][0]["content"]
        assert user == conversations(5)[int(r["id"])][0]["content"]
        # One prompt alone through generate gives the same reply as in the left-padded batch.
        prompt = tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        alone = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert r["messages"][1]["content"] == tok.decode(alone, skip_special_tokens=True).strip()
    # The output is training data in the messages format (an empty reply still teaches the end-of-turn token).
    samples, stats = build_samples(load_rows(str(out)), tok, 512)
    assert stats.extra["format"] == "messages" and len(samples) == 5


def test_multi_turn_and_sharegpt_output(tmp_path, target):
    model, tok = target
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "old too"}]
    rows = load_rows(write_sharegpt(tmp_path / "s.json", [conv, conv[:1]]))
    out = tmp_path / "out.jsonl"
    regenerate(model, tok, rows, out, max_new_tokens=6, batch_size=4, out_format="sharegpt", progress=False)
    records = {r["id"]: r for r in read_jsonl(out)}
    turns = records["c0"]["conversations"]
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    assert turns[0]["value"] == "hi" and turns[2]["value"] == "more"
    assert "old" not in (turns[1]["value"], turns[3]["value"])
    # A conversation that ends with a prompt gets a reply appended.
    assert [t["from"] for t in records["c1"]["conversations"]] == ["human", "gpt"]


def test_resume_skips_done_ids_and_drops_a_cut_line(tmp_path, target):
    model, tok = target
    rows = load_rows(write_alpaca(tmp_path / "a.json", conversations(6)))
    out = tmp_path / "out.jsonl"
    regenerate(model, tok, rows, out, max_samples=3, max_new_tokens=4, batch_size=2, progress=False)
    first = read_jsonl(out)
    with open(out, "a") as f:
        f.write('{"id": "5", "messa')  # killed mid-write
    assert read_done_ids(out) == {r["id"] for r in first}
    counts = regenerate(model, tok, rows, out, max_new_tokens=4, batch_size=2, progress=False)
    assert counts["skipped_done"] == 3 and counts["written"] == 3
    records = read_jsonl(out)
    assert records[:3] == first and sorted(r["id"] for r in records) == [str(i) for i in range(6)]


def test_sampling_and_cli(tmp_path, target):
    from train_fixtures import save_tiny_target

    folder = save_tiny_target(tmp_path / "target")
    data = write_alpaca(tmp_path / "a.json", conversations(3))
    out = tmp_path / "out.jsonl"
    regenerate_main(["--target", folder, "--data", data, "--out", str(out), "--max_new_tokens", "5",
                     "--temperature", "0.8", "--top_p", "0.9", "--batch_size", "3"])
    assert len(read_jsonl(out)) == 3


def test_several_sampled_answers_per_prompt_resume_by_sample(tmp_path, target):
    model, tok = target
    rows = load_rows(write_alpaca(tmp_path / "a.json", conversations(3)))
    out = tmp_path / "out.jsonl"
    settings = dict(max_new_tokens=10, batch_size=4, temperature=1.0, samples=3, progress=False)
    regenerate(model, tok, rows, out, max_samples=2, **settings)
    assert sorted(r["id"] for r in read_jsonl(out)) == ["0#0", "0#1", "0#2", "1#0", "1#1", "1#2"]
    counts = regenerate(model, tok, rows, out, **settings)  # resumes: only row 2's samples are new
    assert counts["skipped_done"] == 6 and counts["written"] == 3
    records = read_jsonl(out)
    assert len({r["id"] for r in records}) == 9
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r["id"].split("#")[0], set()).add(r["messages"][1]["content"])
    # Sampled, not copied: a random tiny model's answers to one prompt differ (where it writes any).
    assert sum(len(answers) > 1 for answers in by_prompt.values()) >= 2


def test_merge_files_joins_whole_lines_in_order(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"id": "1", "messages": []}\n\n{"id": "2", "messages": []}\n')
    b.write_text('{"id": "3", "messages": []}\n{"id": "4", "mess')  # the second file was cut by a kill mid-line
    rows = merge_files([a, tmp_path / "missing.jsonl", b], tmp_path / "all.jsonl")
    assert rows == 3 and [r["id"] for r in read_jsonl(tmp_path / "all.jsonl")] == ["1", "2", "3"]


def test_merge_files_reads_gzipped_answers(tmp_path):
    # distill_gpu's --greedy may name the shipped data/alpaca_smollm2_distill_29k.jsonl.gz; before, its bytes
    # were read as a damaged JSONL file and refused.
    shipped, sampled = tmp_path / "shipped.jsonl.gz", tmp_path / "s.jsonl"
    shipped.write_bytes(gzip.compress(b'{"id": "1"}\n{"id": "2"}\n'))
    sampled.write_text('{"id": "3", "messages": []}\n')
    assert merge_files([shipped, sampled], tmp_path / "all.jsonl") == 3
    assert [r["id"] for r in read_jsonl(tmp_path / "all.jsonl")] == ["1", "2", "3"]
    assert gzip.decompress(shipped.read_bytes()) == b'{"id": "1"}\n{"id": "2"}\n'  # left as it was


def test_bad_input(tmp_path, target):
    model, tok = target
    rows = load_rows(write_alpaca(tmp_path / "a.json", conversations(2)))
    with pytest.raises(ValueError, match="chat template"):
        regenerate(model, char_tokenizer(chat_template=None), rows, tmp_path / "o.jsonl", progress=False)
    with pytest.raises(ValueError, match="out_format"):
        regenerate(model, tok, rows, tmp_path / "o.jsonl", out_format="csv", progress=False)
    with pytest.raises(ValueError, match="temperature > 0"):
        regenerate(model, tok, rows, tmp_path / "o.jsonl", samples=2, progress=False)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        regenerate(model, tok, rows, tmp_path / "o.jsonl", samples=0, temperature=1.0, progress=False)


def test_sharegpt_output_refuses_tool_turns_before_answering(tmp_path, target):
    """ShareGPT has no tool role: a messages row holding one is refused before any answer is written."""
    import json

    model, tok = target
    rows = [{"id": "t0", "messages": [{"role": "user", "content": "weather?"},
                                      {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                                      {"role": "assistant", "content": "old"}]}]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=r"conversation 't0': message 1 has role 'tool'.*--format messages"):
        regenerate(model, tok, load_rows(str(data)), out, max_new_tokens=4, out_format="sharegpt", progress=False)
    assert not out.exists() or out.read_text() == ""
