"""Dataset presets for regeneration: the layouts users bring, each read into one conversation form.

    python -m train.regenerate --preset ultrachat --data HuggingFaceH4/ultrachat_200k --split train_sft ...

A preset names the layout, so a file in another one is refused before the target loads (naming the preset
that fits, where one does), and it cleans what that layout is known to hold:

- `sharegpt`: `conversations` of `from`/`value` (human, gpt, system, and the other speaker names of
  train.data.SHAREGPT_ROLES); assistant turns before the first user turn (fragments of a split conversation
  in the ShareGPT dumps) are dropped.
- `ultrachat`: HuggingFaceH4/ultrachat_200k (`prompt_id` and OpenAI `messages`) or the original
  stingning/ultrachat (`id` and `data`, a list of strings alternating user and assistant).
- `openai`: OpenAI chat messages with tools: roles system, developer, user, assistant and tool; assistant
  `tool_calls`, tool `tool_call_id`/`name`, and an optional `tools` column (function schemas) that the chat
  template is given. An assistant turn that calls tools is kept as the data has it, since the tool results
  after it answer that call; the replies that are not tool calls are regenerated.
- `auto` (the default): the format detected from the columns (train.data.detect_format), as training reads it.

Samples of each, written here: tests/data/presets/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .data import ROLES, detect_format, row_name, to_messages


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role", "content"} and, in the openai preset, tool_calls / tool_call_id / name
    tools: list | None = None  # function schemas for the chat template (openai preset)


@dataclass(frozen=True)
class Preset:
    name: str
    layouts: tuple[tuple[str, ...], ...]  # column sets, any one of which the rows must have
    read: Callable[[dict, int, str], Conversation]


def _id(row: dict, index: int, *keys: str) -> str:
    for key in keys:
        if row.get(key) is not None:
            return str(row[key])
    return str(index)


def _sharegpt(row: dict, index: int, where: str) -> Conversation:
    messages = to_messages(row, "sharegpt", where)
    while messages and messages[0]["role"] == "assistant":  # a fragment's tail, with no prompt before it
        messages.pop(0)
    return Conversation(_id(row, index, "id"), messages)


def _ultrachat(row: dict, index: int, where: str) -> Conversation:
    if "messages" in row and row.get("messages") is not None:
        return Conversation(_id(row, index, "prompt_id", "id"), to_messages(row, "messages", where))
    turns = row["data"]
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: UltraChat 'data' must be a list of strings (user, assistant, user, ...), "
                         f"got {turns!r:.80}")
    roles = ("user", "assistant")
    return Conversation(_id(row, index, "id"), [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])


TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def _drop_nulls(value):
    """`datasets` reads JSON rows into one Arrow schema, so a key one row has and another lacks comes back as
    None in the other (a tool parameter of another tool's schema); drop them, or templates would render them."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _openai(row: dict, index: int, where: str) -> Conversation:
    turns = row["messages"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError(f"{where}: 'messages' must be a list of objects, got {turns!r:.80}")
    messages = []
    for i, m in enumerate(turns):
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m.get('role')!r}; roles must be one of {list(ROLES)}")
        message = {"role": m["role"], "content": m.get("content")}
        message.update({k: _drop_nulls(m[k]) for k in TOOL_FIELDS if m.get(k) is not None})
        if m["role"] == "tool" and not isinstance(message["content"], str):
            raise ValueError(f"{where}: message {i} (tool) has content {message['content']!r:.60}, not text; a tool "
                             "result is the prompt of the reply after it")
        messages.append(message)
    tools = _drop_nulls(row.get("tools")) or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of function schemas (objects), got {tools!r:.80}")
    return Conversation(_id(row, index, "id"), messages, tools)


PRESETS = {p.name: p for p in (
    Preset("sharegpt", (("conversations",),), _sharegpt),
    Preset("ultrachat", (("prompt_id", "messages"), ("id", "data")), _ultrachat),
    Preset("openai", (("messages",),), _openai),
)}
CHOICES = ("auto", *PRESETS)


def check_preset(name: str, columns) -> None:
    """The rows' columns fit the preset; otherwise a ValueError naming --preset and the preset that fits."""
    if name not in CHOICES:
        raise ValueError(f"--preset must be one of {list(CHOICES)}, got {name!r}")
    columns = set(columns)
    if name == "auto":
        detect_format(columns)  # raises naming the columns found
        return
    preset = PRESETS[name]
    if any(set(layout) <= columns for layout in preset.layouts):
        return
    fits = [p.name for p in PRESETS.values() if any(set(layout) <= columns for layout in p.layouts)]
    hint = f"; these rows fit --preset {' or '.join(fits)}" if fits else ""
    expected = " or ".join("+".join(layout) for layout in preset.layouts)
    raise ValueError(f"--preset {name} expects the columns {expected}, but the data has {sorted(columns)}{hint}")


def read_conversations(rows, preset: str = "auto") -> Iterator[Conversation]:
    """Each row of `rows` (a datasets.Dataset or a list of dicts) as a Conversation, read by `preset`."""
    columns = rows.column_names if hasattr(rows, "column_names") else set().union(*(r.keys() for r in rows))
    check_preset(preset, columns)
    fmt = detect_format(columns) if preset == "auto" else None
    for index, row in enumerate(rows):
        where = row_name(index, row)
        if preset == "auto":
            yield Conversation(_id(row, index, "id"), to_messages(row, fmt, where))
        else:
            yield PRESETS[preset].read(row, index, where)

