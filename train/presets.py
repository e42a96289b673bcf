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

from .data import RowIds, check_contents, detect_format, read_tools, row_name, to_messages


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role", "content"} and, in the openai preset, tool_calls / tool_call_id / name
    tools: list | None = None  # function schemas for the chat template (openai preset)


@dataclass(frozen=True)
class Preset:
    name: str
    layouts: tuple[tuple[str, ...], ...]  # column sets, any one of which the rows must have
    read: Callable[[dict, str], tuple[list[dict], list | None]]  # (row, where) -> (messages, tools)
    id_keys: tuple[str, ...] = ("id",)  # the columns that hold a row's id, the first not null taken


def _sharegpt(row: dict, where: str) -> tuple[list[dict], None]:
    messages = to_messages(row, "sharegpt", where)
    while messages and messages[0]["role"] == "assistant":  # a fragment's tail, with no prompt before it
        messages.pop(0)
    return messages, None


def _ultrachat(row: dict, where: str) -> tuple[list[dict], None]:
    if "messages" in row and row.get("messages") is not None:
        return to_messages(row, "messages", where), None
    turns = row["data"]
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: UltraChat 'data' must be a list of strings (user, assistant, user, ...), "
                         f"got {turns!r:.80}")
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)], None


def _openai(row: dict, where: str) -> tuple[list[dict], list | None]:
    # train.data reads the tool fields as training does (calls checked, Arrow's merged-schema nulls dropped)
    return to_messages(row, "messages", where), read_tools(row, where)


PRESETS = {p.name: p for p in (
    Preset("sharegpt", (("conversations",),), _sharegpt),
    Preset("ultrachat", (("prompt_id", "messages"), ("id", "data")), _ultrachat, ("prompt_id", "id")),
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
    """Each row of `rows` (a datasets.Dataset or a list of dicts) as a Conversation, read by `preset`, its
    messages checked as training checks them (train.data.check_contents), the replies aside: they are written anew."""
    columns = rows.column_names if hasattr(rows, "column_names") else set().union(*(r.keys() for r in rows))
    check_preset(preset, columns)
    fmt = detect_format(columns, rows) if preset == "auto" else None
    ids = RowIds(("id",) if preset == "auto" else PRESETS[preset].id_keys)
    for index, row in enumerate(rows):
        where = row_name(index, row)
        if preset == "auto":
            tools = read_tools(row, where) if fmt == "messages" else None  # as training reads them
            messages = to_messages(row, fmt, where)
        else:
            messages, tools = PRESETS[preset].read(row, where)
        check_contents(messages, where, replies=False)
        yield Conversation(ids(row, index), messages, tools)
