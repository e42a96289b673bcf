"""Training on tool-use conversations (train/data.py): the calls a template renders in an assistant turn are
trained, tool results are not, the rows' `tools` reach the template, and bad tool data or a template that
drops the calls is refused by name."""

from __future__ import annotations

import string
import warnings
from pathlib import Path

import datasets
import pytest
from train_fixtures import CHATML, character_tokenizer, read_jsonl
from transformers import PreTrainedTokenizerFast

from train.data import (
    Conversation,
    build_samples,
    conversations_fingerprint,
    load_rows,
    read_conversations,
    tokenize_conversation,
)
from train.regenerate import regenerate

SAMPLE = Path(__file__).resolve().parent / "data" / "presets" / "openai_tools.jsonl"

# ChatML with the tool schemas in a system preamble and each call as JSON inside the assistant turn, the way
# tool-use templates (Qwen2.5's <tool_call>, Llama 3.1's JSON) place them.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c['function'] | tojson }}</call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same without the tools preamble: the calls are rendered, the schemas are not
NO_TOOLS_TEMPLATE = TOOL_TEMPLATE[TOOL_TEMPLATE.index("{% for m"):]

CALL_1 = '<call>{"name": "get_weather", "arguments": "{\\"city\\": \\"paris\\"}"}</call><|im_end|>'
CALL_2 = '<call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</call><|im_end|>'


def json_tokenizer(chat_template: str = TOOL_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable character (JSON needs braces and quotes, which the fixtures' tokenizer lacks)."""
    return character_tokenizer(["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"], string.printable, chat_template)


def trained_spans(tok, ids, mask) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    spans, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans + ([tok.decode(run)] if run else [])


def test_sample_tool_calls_are_trained_and_tool_results_are_not():
    tok = json_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # this template renders the tools: no warning
        samples, stats = build_samples(load_rows(str(SAMPLE)), tok, max_length=4096)
    assert stats.extra["format"] == "messages" and [s.id for s in samples] == ["t1", "t2", "t3"]
    t1, t2, t3 = samples
    assert trained_spans(tok, t1.input_ids, t1.loss_mask) == [CALL_1, "yes, it is raining in paris.<|im_end|>"]
    assert trained_spans(tok, t2.input_ids, t2.loss_mask) == [CALL_2]  # "" content: the call alone
    assert trained_spans(tok, t3.input_ids, t3.loss_mask) == ["hello.<|im_end|>"]
    text = tok.decode(t1.input_ids)
    # the schema reached the template, as prompt; the tool result is in the text but not trained
    assert text.startswith('<|im_start|>system\ntools: [{"type": "function", "function": {"name": "get_weather", '
                           '"description": "the weather in a city"')
    assert '<|im_start|>tool\n{"rain": true}<|im_end|>' in text
    assert "None" not in text  # the call-only turn's null content is not printed
    assert not tok.decode(t3.input_ids).startswith("<|im_start|>system\ntools")  # t3 has no tools


def test_regenerated_tool_records_train(tmp_path):
    """What train.regenerate writes for the openai preset (calls kept, content null, a `tools` column) trains."""

    class Fixed:
        def complete(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
            return [("done.", True) for _ in prompts]

    tok = json_tokenizer()
    out = tmp_path / "tools.jsonl"
    regenerate(Fixed(), tok, load_rows(str(SAMPLE)), out, preset="openai", progress=False)
    assert {r["id"]: r for r in read_jsonl(out)}["t1"]["messages"][2]["content"] is None
    samples, _ = build_samples(load_rows(str(out)), tok, max_length=4096)
    spans = {s.id: trained_spans(tok, s.input_ids, s.loss_mask) for s in samples}
    assert spans["t1"] == [CALL_1, "done.<|im_end|>"]
    assert spans["t2"] == [CALL_2, "done.<|im_end|>"]  # regeneration answered the tool result


def test_a_cut_last_reply_after_a_call_keeps_the_call_trained():
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "it is"}]
    tok = json_tokenizer()
    ids, mask = tokenize_conversation(tok, messages, last_reply_cut=True)
    assert trained_spans(tok, ids, mask) == ['<call>{"name": "add", "arguments": {"a": 2, "b": 3}}</call><|im_end|>',
                                             "it is"]


def test_tools_change_the_data_fingerprint():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    plain = conversations_fingerprint([Conversation("a", messages, False)])
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert conversations_fingerprint([Conversation("a", messages, False, tools)]) != plain


# ---- bad input: refused by row and message, before the target loads ----------------------------------------

def rows_with(tool_calls, role="assistant", **row):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None, "tool_calls": tool_calls}]
    if role != "assistant":
        messages.append({"role": "assistant", "content": "yo"})
    return datasets.Dataset.from_list([{"id": "bad", "messages": messages, **row}])


@pytest.mark.parametrize("tool_calls, match", [
    ("get_weather(paris)", r"message 1 \(assistant\) has tool_calls 'get_weather\(paris\)', not a list"),
    ([{"name": "f", "arguments": "{}"}], r"message 1 \(assistant\): tool call 0 is .*; tool_calls must be a list"),
    ([{"type": "function", "function": {"name": "f"}}], r"message 1 \(assistant\): tool call 0 is"),
    ([{"type": "code", "function": {"name": "f", "arguments": "{}"}}], r"message 1 \(assistant\): tool call 0 is"),
    ([{"type": "function", "function": {"name": "", "arguments": "{}"}}], r"message 1 \(assistant\): tool call 0"),
])
def test_malformed_tool_calls_are_refused_naming_row_and_message(tool_calls, match):
    with pytest.raises(ValueError, match=r"row 0 \(id 'bad'\): " + match):
        read_conversations(rows_with(tool_calls))


def test_tool_calls_on_another_role_and_null_content_without_calls_are_refused():
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ValueError, match=r"row 0 \(id 'bad'\): message 1 \(user\) has tool_calls, but only assistant"):
        read_conversations(rows_with(call, role="user"))
    # an empty list is no call, so the turn is a reply without text
    with pytest.raises(ValueError, match=r"message 1 \(assistant\) has content None, not text; fill in the reply"):
        read_conversations(rows_with([]))


def test_tools_that_are_not_a_list_of_schemas_are_refused():
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ValueError, match=r"row 0 \(id 'bad'\): 'tools' must be a list of function schemas"):
        read_conversations(rows_with(call, tools='[{"type": "function"}]'))


@pytest.mark.filterwarnings("ignore:the chat template ignores the rows' `tools`")  # plain ChatML ignores both
def test_a_template_that_ignores_tool_calls_is_refused():
    with pytest.raises(ValueError, match=r"conversation 't1': the chat template ignores tool_calls \(message 2 .*"
                                         r"get_weather.*template that renders tool calls"):
        build_samples(load_rows(str(SAMPLE)), json_tokenizer(CHATML), max_length=4096)


def test_a_template_that_ignores_tools_warns_once():
    with pytest.warns(UserWarning, match=r"ignores the rows' `tools` \(conversation 't1'") as caught:
        samples, _ = build_samples(load_rows(str(SAMPLE)), json_tokenizer(NO_TOOLS_TEMPLATE), max_length=4096)
    assert sum("`tools`" in str(w.message) for w in caught) == 1
    assert len(samples) == 3
