"""Data loading: formats, the assistant-only loss mask, truncation, splits, batching and bad input."""

from __future__ import annotations

import json

import datasets
import pytest
from train_fixtures import CHATML, char_tokenizer, conversations, write_alpaca, write_messages, write_sharegpt

from heads.eagle3.objective import token_counts
from train.data import (
    Sample,
    build_samples,
    collate,
    detect_format,
    epoch_batches,
    load_rows,
    split_samples,
    tokenize_conversation,
)

KNOWN = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b c"},
]


def test_mask_exact_positions_on_known_conversation():
    tok = char_tokenizer()
    ids, mask = tokenize_conversation(tok, KNOWN)
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                    "<|im_start|>assistant\nb c<|im_end|>\n")
    # One token per character; "<|im_start|>" and "<|im_end|>" are one token each.
    # "<|im_start|>system\nbe nice<|im_end|>\n" = 1 + 6 + 1 + 7 + 1 + 1 = 17 tokens,
    # "<|im_start|>user\nhi<|im_end|>\n" = 1 + 4 + 1 + 2 + 1 + 1 = 10 tokens,
    # "<|im_start|>assistant\n" = 1 + 9 + 1 = 11 tokens -> "yo<|im_end|>" at 38, 39, 40.
    # "\n" (41), "<|im_start|>user\na<|im_end|>\n" = 9 tokens (42..50), "<|im_start|>assistant\n" 51..61,
    # "b c<|im_end|>" at 62..65, final "\n" at 66 (not the assistant's: generation stops at <|im_end|>).
    assert [i for i, m in enumerate(mask) if m] == [38, 39, 40, 62, 63, 64, 65]
    assert tok.convert_ids_to_tokens([ids[i] for i in (38, 39, 40)]) == ["y", "o", "<|im_end|>"]
    assert len(ids) == 67


@pytest.mark.parametrize("writer", [write_messages, write_sharegpt, write_alpaca])
def test_each_format_loads_with_the_same_mask(tmp_path, writer):
    convs = conversations(6)
    suffix = ".jsonl" if writer is write_messages else ".json"
    rows = load_rows(writer(tmp_path / f"data{suffix}", convs))
    samples, stats = build_samples(rows, char_tokenizer(), max_length=512)
    assert stats.extra["format"] == {write_messages: "messages", write_sharegpt: "sharegpt",
                                     write_alpaca: "alpaca"}[writer]
    assert len(samples) == 6
    for s, conv in zip(samples, convs, strict=True):
        ids, mask = tokenize_conversation(char_tokenizer(), conv)
        assert s.input_ids == ids and s.loss_mask == mask
        masked = char_tokenizer().decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        assert masked == conv[1]["content"] + "<|im_end|>"


def test_cut_reply_does_not_train_the_end_of_turn(tmp_path):
    rows = [{"id": "a", "messages": KNOWN[1:3], "finished": False}, {"id": "b", "messages": KNOWN[1:3], "finished": True}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cut, done = build_samples(load_rows(str(path)), char_tokenizer(), 512)[0]
    tok = char_tokenizer()
    assert tok.decode([i for i, m in zip(cut.input_ids, cut.loss_mask, strict=True) if m]) == "yo"
    assert tok.decode([i for i, m in zip(done.input_ids, done.loss_mask, strict=True) if m]) == "yo<|im_end|>"


def test_parquet_and_alpaca_input_field(tmp_path):
    ds = datasets.Dataset.from_list([{"instruction": "say", "input": "hi", "output": "hi"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    samples, _ = build_samples(load_rows(str(tmp_path / "d.parquet")), char_tokenizer(), 512)
    assert "say\n\nhi" in char_tokenizer().decode(samples[0].input_ids)


def test_gzipped_json_lines(tmp_path):
    import gzip

    rows = [{"instruction": "say", "input": "", "output": f"hi {i}"} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert load_rows(str(tmp_path / "d.jsonl.gz"))["output"] == ["hi 0", "hi 1", "hi 2"]
    # A bad line inside the archive is named like one in a plain file.
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress((text + "{oops\n").encode()))
    with pytest.raises(ValueError, match="line 4 is not valid JSON"):
        load_rows(str(tmp_path / "bad.jsonl.gz"))


@pytest.mark.slow
def test_smollm2_template_mask():
    """The real target's template (ChatML that adds a default system turn when none is given)."""
    from transformers import AutoTokenizer

    from infer.embedded import embedded_folder

    tok = AutoTokenizer.from_pretrained(embedded_folder())
    ids, mask = tokenize_conversation(tok, KNOWN[1:])
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ids)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "yo<|im_end|>b c<|im_end|>"


def test_truncation_counts_and_drops(tmp_path):
    convs = conversations(4) + [[{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "late"}]]
    rows = load_rows(write_messages(tmp_path / "d.jsonl", convs))
    samples, stats = build_samples(rows, char_tokenizer(), max_length=60)
    assert stats.dropped_after_truncation == 1 and stats.truncated >= 1
    assert len(samples) == 4 and all(len(s.input_ids) <= 60 for s in samples)


def test_split_and_batches_are_deterministic_and_sharded():
    samples = [type("S", (), {"input_ids": [0] * (5 + i % 7)})() for i in range(40)]
    train, held = split_samples(samples, 0.1, 100, seed=3)
    assert len(held) == 4 and len(train) == 36
    assert split_samples(samples, 0.1, 100, seed=3)[1] == held
    lengths = [len(s.input_ids) for s in train]
    a = epoch_batches(lengths, 4, seed=0, epoch=1, group_by_length=True)
    assert a == epoch_batches(lengths, 4, seed=0, epoch=1, group_by_length=True)
    assert a != epoch_batches(lengths, 4, seed=0, epoch=2, group_by_length=True)
    assert sorted(i for b in a for i in b) == list(range(36))
    r0 = epoch_batches(lengths, 4, 0, 1, True, rank=0, world_size=2)
    r1 = epoch_batches(lengths, 4, 0, 1, True, rank=1, world_size=2)
    assert len(r0) == len(r1) == 4 and not {i for b in r0 for i in b} & {i for b in r1 for i in b}


def test_collate_pads_right():
    from train.data import Sample

    batch = collate([Sample("a", [5, 6, 7], [0, 1, 1]), Sample("b", [5], [1])], [3, 9], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["index"].tolist() == [3, 9]


# ---- bad input: a clear ValueError before anything expensive ------------------------------------------------

@pytest.mark.parametrize("content", ["", "[]"])
def test_empty_dataset(tmp_path, content):
    (tmp_path / "d.json").write_text(content)
    with pytest.raises(ValueError, match="empty"):
        load_rows(str(tmp_path / "d.json"))
    with pytest.raises(ValueError, match="empty"):
        build_samples(datasets.Dataset.from_list([]), char_tokenizer(), 512)


def test_no_assistant_turns(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}] * 3
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="assistant"):
        build_samples(load_rows(str(path)), char_tokenizer(), 512)


def test_every_sample_over_max_length(tmp_path):
    rows = load_rows(write_messages(tmp_path / "d.jsonl", conversations(3)))
    with pytest.raises(ValueError, match="max_length"):
        build_samples(rows, char_tokenizer(), max_length=10)


def test_tokenizer_without_chat_template(tmp_path):
    rows = load_rows(write_messages(tmp_path / "d.jsonl", conversations(3)))
    with pytest.raises(ValueError, match="chat template"):
        build_samples(rows, char_tokenizer(chat_template=None), 512)


def test_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the data format"):
        detect_format(["prompt", "completion"])


def test_template_that_rewrites_history_is_rejected():
    # Renders only the last user turn when a generation prompt is asked for: not prefix-stable.
    odd = CHATML.replace("{% for m in messages %}", "{% for m in (messages[-1:] if add_generation_prompt "
                                                     "else messages) %}")
    with pytest.raises(ValueError, match="prefix"):
        tokenize_conversation(char_tokenizer(odd), KNOWN)


def test_missing_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_rows("/nonexistent/data.jsonl")


def test_token_counts_counts_trained_tokens_only():
    samples = [Sample("a", [5, 1, 1, 2], [0, 1, 1, 1]), Sample("b", [5, 5, 3], [1, 0, 0]), Sample("c", [4], [0])]
    counts = token_counts(samples, 6)
    assert counts.tolist() == [0, 2, 1, 0, 0, 1]  # 5 is trained once (b) and masked twice; 4 never trained
    assert token_counts([], 6).tolist() == [0] * 6
    assert token_counts([Sample("d", [7, 2], [1, 1])], 6).tolist() == [0, 0, 1, 0, 0, 0]  # past the vocab: dropped
