"""Dataset presets (train/presets.py): each loads its shipped sample (tests/data/presets/), a file in another
layout is refused naming the preset that fits, and regeneration through the openai preset keeps tool calls
and hands the tools to the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_fixtures import CHATML, char_tokenizer, read_jsonl

from train.data import load_rows
from train.presets import check_preset, read_conversations
from train.regenerate import Renderer, regenerate

SAMPLES = Path(__file__).resolve().parent / "data" / "presets"


def roles(conv) -> list[str]:
    return [m["role"] for m in conv.messages]


def test_sharegpt_sample():
    convs = list(read_conversations(load_rows(str(SAMPLES / "sharegpt.json")), "sharegpt"))
    assert [c.id for c in convs] == ["sg1", "sg2", "sg3"]
    assert roles(convs[1]) == ["user", "assistant", "user", "assistant"]  # the leading 'gpt' fragment dropped
    assert convs[1].messages[0]["content"] == "now sort it"
    assert roles(convs[2]) == ["system", "user", "assistant"]  # 'chatgpt' is an assistant


@pytest.mark.parametrize("name, ids, first", [("ultrachat.jsonl", ["u1", "u2", "u3"], "how do tides work?"),
                                              ("ultrachat_original.jsonl", ["0", "1"], "what is a verb?")])
def test_ultrachat_samples(name, ids, first):
    convs = list(read_conversations(load_rows(str(SAMPLES / name)), "ultrachat"))
    assert [c.id for c in convs] == ids
    assert roles(convs[0]) == ["user", "assistant", "user", "assistant"]
    assert convs[0].messages[0]["content"] == first


def test_openai_tools_sample():
    convs = list(read_conversations(load_rows(str(SAMPLES / "openai_tools.jsonl")), "openai"))
    assert [c.id for c in convs] == ["t1", "t2", "t3"]
    assert roles(convs[0]) == ["system", "user", "assistant", "tool", "assistant"]
    call = convs[0].messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "paris"}'}
    assert convs[0].messages[3]["tool_call_id"] == "call_1"
    # datasets merges the rows' schemas; the other tool's parameters must not appear as nulls in this one's
    assert convs[0].tools[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    assert convs[1].tools[0]["function"]["name"] == "add" and convs[2].tools is None
    assert roles(convs[2])[0] == "developer"


@pytest.mark.parametrize("preset, sample, fits", [
    ("ultrachat", "sharegpt.json", "sharegpt"),
    ("sharegpt", "ultrachat_original.jsonl", "ultrachat"),
    ("openai", "sharegpt.json", "sharegpt"),
    ("sharegpt", "openai_tools.jsonl", "openai"),
])
def test_a_preset_given_another_layout_is_refused_naming_the_one_that_fits(preset, sample, fits):
    with pytest.raises(ValueError, match=rf"--preset {preset} expects .* fit --preset .*{fits}"):
        check_preset(preset, load_rows(str(SAMPLES / sample)).column_names)
    with pytest.raises(ValueError, match="--preset must be one of"):
        check_preset("vicuna", ["conversations"])


class Recorder:
    """An engine that answers every prompt with a fixed reply and keeps the prompts it was given."""

    def __init__(self, reply="done."):
        self.reply, self.prompts = reply, []

    def complete(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.prompts += prompts
        return [(self.reply, True) for _ in prompts]


TOOLS_TEMPLATE = "{% if tools %}tools {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}" + CHATML


def test_regenerating_tool_conversations_keeps_the_calls(tmp_path):
    tok = char_tokenizer(TOOLS_TEMPLATE)
    engine = Recorder()
    out = tmp_path / "tools.jsonl"
    regenerate(engine, tok, load_rows(str(SAMPLES / "openai_tools.jsonl")), out, preset="openai", progress=False)
    records = {r["id"]: r for r in read_jsonl(out)}
    t1 = records["t1"]["messages"]
    assert t1[2]["tool_calls"][0]["id"] == "call_1" and t1[2]["content"] is None  # the data's call, kept
    assert t1[4]["content"] == "done."  # the reply after the tool result, regenerated
    t2 = records["t2"]["messages"]
    assert [m["role"] for m in t2] == ["user", "assistant", "tool", "assistant"]  # a reply to the tool result
    assert records["t2"]["tools"][0]["function"]["name"] == "add" and "tools" not in records["t3"]
    prompts = [tok.decode(p) for p in engine.prompts]
    assert sum(p.startswith("tools get") for p in prompts) == 1 and sum(p.startswith("tools add") for p in prompts) == 1
    with pytest.raises(ValueError, match="--format sharegpt has no tool roles"):
        regenerate(engine, tok, load_rows(str(SAMPLES / "openai_tools.jsonl")), tmp_path / "x.jsonl",
                   preset="openai", out_format="sharegpt", progress=False)


def test_renderer_passes_tools_to_the_template():
    tok = char_tokenizer(TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = tok.decode(Renderer(tok, None).prompt([{"role": "user", "content": "hi"}], tools))
    assert text.startswith("tools add")  # the schema reached the template
