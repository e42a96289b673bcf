"""Conversations in, token ids and an assistant-only loss mask out.

Rows are read with `datasets` (a hub id or a local .json/.jsonl/.parquet file, JSON optionally gzipped) in one of three formats,
detected from the columns: ShareGPT (`conversations` of `from`/`value`), OpenAI (`messages` of
`role`/`content`) or Alpaca (`instruction`/`input`/`output`). Each conversation is rendered with the
target tokenizer's own chat template. Nothing is dropped or guessed silently: a malformed JSON line, a file
that is not UTF-8, damaged gzip or parquet, a row in another format than the rest, a role outside ROLES
(ShareGPT speaker names are mapped by SHAREGPT_ROLES) and a message without text (null, or a list of content
parts) are errors that name the file and line or the row.

OpenAI rows may use tools: assistant `tool_calls` (a turn that only calls tools has no text), tool results
with `tool_call_id`/`name`, and a `tools` column of function schemas, which the chat template is given. The
calls the template renders inside an assistant turn are the assistant's tokens like its text (the target
writes them, so the drafter learns to draft them); the tool results are prompt. A template that renders
a turn the same with and without its tool_calls would train on replies with the calls missing, and is
refused.

Which tokens are the assistant's is found without knowing the template: for every assistant turn i the
template renders the conversation up to turn i with the generation prompt (everything before the
reply) and up to and including turn i (everything through the reply). Both renderings must be prefixes
of the full rendering; the characters between them are the reply (and the template's end-of-turn
marker, which the model must learn to emit), and a token is the assistant's when it starts inside that
character span. Templates that rewrite earlier turns (so that prefixes are not prefixes) are rejected.
"""

from __future__ import annotations

import array
import gzip
import hashlib
import io
import json
import random
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.jsonfile import json_items

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}
# roles of the OpenAI messages format; only assistant turns are trained, the rest is context for the template
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI tool-use fields kept with a message (besides role and content) and handed to the chat template
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents, gunzipped where its name ends in .gz; a file that is not whole gzip or not
    UTF-8 is refused naming it and the line where it breaks."""
    path = Path(path)
    raw = gunzip(path) if path.suffix == ".gz" else path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):  # JSON forbids it: line 1 would be blamed as malformed
        raise ValueError(f"{path} starts with a UTF-8 byte-order mark (which some Windows editors write) that JSON "
                         "does not allow; save the file as UTF-8 without it (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' "
                         "<file>`)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {raw[err.start]:#04x}); save the file as "
                         "UTF-8 (e.g. `iconv -f latin1 -t utf-8`, if it is Latin-1)") from None


def gunzip(path: Path) -> bytes:
    """The decompressed bytes of a .gz file. A file cut short or damaged is refused naming the line of the text
    after which it breaks, so that what was read can be told from what was lost."""
    out = io.BytesIO()
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                out.write(chunk)
    except gzip.BadGzipFile as err:
        if out.tell() == 0 and "Not a gzipped file" in str(err):
            raise ValueError(f"{path} is not gzip-compressed although its name ends in .gz; rename it without .gz "
                             "or compress it with gzip") from None
        lost = err
    except (EOFError, zlib.error) as err:
        lost = err
    else:
        return out.getvalue()
    whole = out.getvalue().count(b"\n")
    raise ValueError(f"{path} is damaged gzip ({lost}): it breaks after line {whole} of its text; compress it again "
                     "from the original, or download it again") from None


def load_rows(source: str, split: str = "train"):
    """A `datasets.Dataset` from a local file or a hub dataset id."""
    import datasets

    path = Path(source)
    gzipped = path.suffix == ".gz" and Path(path.stem).suffix in (".json", ".jsonl")
    suffix = Path(path.stem).suffix if gzipped else path.suffix
    if suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise ValueError(f"data file {source!r} does not exist")
        if split != "train":  # a local file is read whole: another split asked for would be ignored
            raise ValueError(f"split {split!r} names a split of a hub dataset, but {source!r} is a local file, read "
                             "whole (as the split 'train'); leave the split out (--split, data_split), or give the "
                             "file that holds that split")
        if suffix != ".parquet":
            text = read_text(path)
            if text.strip() in ("", "[]"):
                raise ValueError(f"the dataset {source!r} is empty")
            check_json(text, source)
            return datasets.load_dataset("json", data_files=str(path), split="train")
        return load_parquet(path)
    if path.exists():
        raise ValueError(f"data {source!r}: local data must be a .json, .jsonl (either may be gzipped: .gz) or "
                         ".parquet file")
    return load_hub_rows(source, split)


def load_hub_rows(name: str, split: str):
    """A Hugging Face dataset by name (`tatsu-lab/alpaca`), through `datasets` and its cache; where the Hub
    cannot be reached and nothing is cached, or no such dataset exists, the error names both readings of
    `name` (a local file, a hub dataset) and what to do."""
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError, FileNotFoundError) as err:
        raise ValueError(
            f"data {name!r} is no local .json/.jsonl/.parquet file and could not be loaded as a Hugging Face "
            f"dataset ({type(err).__name__}: {str(err)[:200]}). Check the path or the dataset's name; a hub "
            "dataset needs the network once (or HF_DATASETS_OFFLINE=1 with it already cached): where offline, "
            "download it elsewhere and pass the file") from err


def load_parquet(path: Path):
    """A local parquet file as a Dataset; a damaged one is refused naming it (`datasets` reports it as an Arrow
    error without the file's name)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)  # the footer: a cut, empty or non-parquet file fails here, before datasets' cache
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    except (pa.ArrowException, datasets.exceptions.DatasetGenerationError) as err:
        raise ValueError(f"data file {str(path)!r} is not a readable parquet file ({err}); write it again, or give "
                         "the rows as .json/.jsonl") from None


def check_json(text: str, source: str) -> None:
    """A JSON array of row objects, or JSON Lines of row objects; raise naming the line that is not.

    `datasets` reports a malformed line without its number, so the file is read here first.
    """
    for where, row in json_items(text, source, "one row object per line"):
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object with the row's fields")


# each format: the column that marks a row as written in it, and how errors call it
LAYOUTS = {"sharegpt": ("conversations", "ShareGPT"), "messages": ("messages", "OpenAI messages"),
           "alpaca": ("instruction", "Alpaca")}


def detect_format(columns, rows=None) -> str:
    """The format of rows with these columns. Where they hold the columns of several formats (a file mixing them:
    the rows of one hold null in the others' columns) and `rows` are given, the format most rows are in, so that
    `check_layout` names the rows that differ, not the first of the others."""
    columns = set(columns)
    found = [fmt for fmt in ("sharegpt", "messages") if LAYOUTS[fmt][0] in columns]
    found += ["alpaca"] if {"instruction", "output"} <= columns else []
    if not found:
        raise ValueError(
            f"cannot tell the data format from columns {sorted(columns)}: expected 'conversations' "
            "(ShareGPT, from/value), 'messages' (OpenAI, role/content) or 'instruction'+'output' (Alpaca)")
    if len(found) == 1 or rows is None:
        return found[0]
    counts = layout_counts(rows, found)
    return max(found, key=lambda fmt: counts[fmt])  # a tie keeps the order above


def layout_counts(rows, formats: list[str]) -> dict[str, int]:
    """How many rows hold each format's column (not null), read as Arrow where `rows` is a Dataset."""
    columns = [LAYOUTS[fmt][0] for fmt in formats]
    if not hasattr(rows, "with_format"):
        return {fmt: sum(r.get(c) is not None for r in rows) for fmt, c in zip(formats, columns, strict=True)}
    counts = dict.fromkeys(formats, 0)
    for batch in rows.select_columns(columns).with_format("arrow").iter(batch_size=10_000):
        for fmt, column in zip(formats, columns, strict=True):
            counts[fmt] += len(batch) - batch.column(column).null_count
    return counts


def check_layout(row: dict, fmt: str, where: str) -> None:
    """A row in another format than the file is read as: its own column is filled, the format's is null."""
    if row.get(LAYOUTS[fmt][0]) is not None:
        return
    for other, (column, label) in LAYOUTS.items():
        if other != fmt and row.get(column) is not None:
            raise ValueError(f"{where} is a {label} row ({column!r}), not {LAYOUTS[fmt][1]} ({LAYOUTS[fmt][0]!r}) "
                             "as the file is read (the format of most of its rows, or --preset); give every row "
                             "one format: convert this row, or move it to a file of its own")


class RowIds:
    """The id of each row read in order: its own (the first of `keys` it holds), or its row number in a file whose
    rows have none. A file where some rows have ids and others not is refused: a row number could equal another
    row's id, and the two distinct rows would then be taken for one."""

    def __init__(self, keys: tuple[str, ...] = ("id",)):
        self.keys, self.first = keys, None  # first: (index, own id or None) of the first row read

    def __call__(self, row: dict, index: int) -> str:
        own = own_id(row, self.keys)
        if self.first is None:
            self.first = (index, own)
        elif (own is None) != (self.first[1] is None):
            (lacks, _), (has, value) = ((index, own), self.first) if own is None else (self.first, (index, own))
            raise ValueError(f"row {lacks} has no id ({'/'.join(self.keys)}) but row {has} has id {value!r}: a row "
                             "number used as an id could equal another row's id; give every row an id, or none (the "
                             "row numbers are then the ids)")
        return str(index) if own is None else str(own)


def own_id(row: dict, keys: tuple[str, ...] = ("id",)):
    """The row's id: the first of `keys` it holds not null (`datasets` gives a key another row has as null)."""
    return next((row[k] for k in keys if row.get(k) is not None), None)


def row_name(index: int, row: dict) -> str:
    """How errors name a row: its position (from 0) and its id if it has one."""
    return f"row {index} (id {row['id']!r})" if row.get("id") is not None else f"row {index}"


def to_messages(row: dict, fmt: str, where: str = "a row") -> list[dict]:
    """One row as a list of {"role", "content"} messages; `where` names the row in errors."""
    if fmt in LAYOUTS:
        check_layout(row, fmt, where)
    if fmt == "alpaca":
        for name in ("instruction", "output"):
            if not isinstance(row[name], str):
                raise ValueError(f"{where}: Alpaca field {name!r} is {row[name]!r}, not text; fix or drop the row")
        prompt = row["instruction"]
        if row.get("input"):
            prompt = f"{prompt}\n\n{row['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    if fmt == "sharegpt":
        turns = _turns(row, "conversations", where)
        messages = []
        for i, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(str(turn.get("from")).lower())
            if role is None:
                raise ValueError(f"{where}: ShareGPT turn {i} has unknown 'from' value {turn.get('from')!r}; "
                                 f"known values: {sorted(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": turn.get("value")})
        return messages
    if fmt == "messages":
        messages = []
        for i, m in enumerate(_turns(row, "messages", where)):
            if m.get("role") not in ROLES:
                hint = ""
                if str(m.get("role")).lower() in SHAREGPT_ROLES:
                    hint = (f" ({m.get('role')!r} is a ShareGPT speaker name: rename it to "
                            f"{SHAREGPT_ROLES[str(m.get('role')).lower()]!r}, or give the rows as ShareGPT "
                            "'conversations' of from/value)")
                raise ValueError(f"{where}: message {i} has role {m.get('role')!r}; roles must be one of "
                                 f"{list(ROLES)}{hint}")
            message = {"role": m["role"], "content": m.get("content")}
            message.update({k: drop_nulls(m[k]) for k in TOOL_FIELDS if m.get(k) is not None})
            if "tool_calls" in message:
                check_tool_calls(message, f"{where}: message {i} ({m['role']})")
                if not message["tool_calls"]:  # some exports write [] on every assistant turn: no call made
                    del message["tool_calls"]
            messages.append(message)
        return messages
    raise ValueError(f"unknown data format {fmt!r}")


def drop_nulls(value):
    """`datasets` reads JSON rows into one Arrow schema, so a key one row has and another lacks comes back as
    None in the other (a tool parameter of another tool's schema); drop them, or templates would render them."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def check_tool_calls(message: dict, where: str) -> None:
    """OpenAI's shape, which chat templates read: a list of {"type": "function", "function": {"name",
    "arguments"}}, arguments a JSON string (OpenAI) or an object (transformers' examples). `type` may be left
    out, as many converted datasets do; templates read only `function`."""
    calls = message["tool_calls"]
    fix = ('tool_calls must be a list of {"type": "function", "function": {"name": ..., "arguments": ...}} '
           "objects (arguments a JSON string or an object); fix or drop the row")
    if message["role"] != "assistant":
        raise ValueError(f"{where} has tool_calls, but only assistant turns call tools; move them to the "
                         "assistant turn or drop the row")
    if not isinstance(calls, list):
        raise ValueError(f"{where} has tool_calls {calls!r:.80}, not a list; {fix}")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str) and function["name"]
                and isinstance(function.get("arguments"), (str, dict))):
            raise ValueError(f"{where}: tool call {k} is {call!r:.120}; {fix}")


def read_tools(row: dict, where: str) -> list | None:
    """The row's `tools` column (function schemas for the chat template), or None where it has none."""
    tools = drop_nulls(row.get("tools")) or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of function schemas (objects), got {tools!r:.80}; a "
                         "JSON string must be parsed into the list first")
    return tools


def _turns(row: dict, column: str, where: str) -> list[dict]:
    turns = row[column]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError(f"{where}: {column!r} must be a list of objects, got {turns!r:.80}")
    return turns


def check_contents(messages: list[dict], where: str, replies: bool = True) -> None:
    """Every message must hold its text as one string. Null would train (or prompt) as an empty message, and a list
    of content parts is refused rather than rendered, since chat templates differ in what they make of one (some
    print the list). An assistant turn that calls tools may have null content: its calls are the reply, and
    OpenAI data gives it no text. `replies=False` (train.regenerate, which writes every other reply anew) accepts
    null replies too; otherwise it is the same check, so that regeneration answers only rows training accepts."""
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, str):
            continue
        if content is None and m["role"] == "assistant" and (m.get("tool_calls") or not replies):
            continue
        if isinstance(content, list):
            raise ValueError(f"{where}: message {i} ({m['role']}) has content as a list of {len(content)} parts, not "
                             "text; give its text as one string (join the text parts) or drop the row")
        fix = ("fill in the reply, drop the row, or regenerate the replies with train.regenerate"
               if m["role"] == "assistant" else "fill it in or drop the row")
        raise ValueError(f"{where}: message {i} ({m['role']}) has content {content!r:.60}, not text; {fix}")


def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set "
            "tokenizer.chat_template (a Jinja string) before training on conversations")


def _render(tokenizer, messages, generation_prompt: bool, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _for_template(messages: list[dict]) -> list[dict]:
    """A turn that only calls tools with empty text, not None: a template that prints content unguarded would
    write the word "None" into it."""
    return [{**m, "content": ""} if m["content"] is None and m.get("tool_calls") else m for m in messages]


def assistant_char_spans(tokenizer, messages: list[dict],
                         tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant reply in it (its text and
    the tool calls the template renders in the turn)."""
    messages = _for_template(messages)
    full = _render(tokenizer, messages, False, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a conversation starts with an assistant turn; it needs a prompt before it")
        before = _render(tokenizer, messages[:i], True, tools)
        through = _render(tokenizer, messages[: i + 1], False, tools)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise ValueError(
                "the chat template does not render conversations prefix-stably (rendering the first turns "
                "is not a prefix of rendering all of them), so assistant tokens cannot be located")
        if message.get("tool_calls"):
            # One more rendering per tool-call turn: sound (equal text means the calls are not in it) and cheap
            # next to the two above.
            without = {k: v for k, v in message.items() if k != "tool_calls"}
            if _render(tokenizer, [*messages[:i], without], False, tools) == through:
                raise ValueError(
                    f"the chat template ignores tool_calls (message {i} renders the same with and without its "
                    f"calls to {[c['function']['name'] for c in message['tool_calls']]}), so the drafter would "
                    "train on replies with the calls missing; give the tokenizer a chat template that renders "
                    "tool calls (the target's own tool-use template), or drop the tool-call turns")
        # Whitespace the template puts after the end-of-turn marker is never generated by the model.
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], last_reply_cut: bool = False,
                          tools: list | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on assistant tokens.

    `last_reply_cut`: the last reply was cut by a token limit (`"finished": false` from train.regenerate),
    so the end-of-turn marker after it is the template's, not the model's, and is not trained. A tool call
    comes from the data, never from a cut generation, so a last turn with tool_calls is trained whole.
    `tools`: function schemas handed to the chat template.
    """
    full, spans = assistant_char_spans(tokenizer, messages, tools)
    if last_reply_cut and spans and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        start, end = spans[-1]
        content = messages[-1]["content"]
        if full[start:end].startswith(content):
            spans[-1] = (start, start + len(content))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = any(s <= start < e for s, e in spans) and end > start
        mask.append(int(inside))
    return list(enc["input_ids"]), mask


@dataclass
class DataStats:
    rows: int = 0
    no_assistant: int = 0  # conversations without any assistant turn
    truncated: int = 0  # samples cut at max_length
    dropped_after_truncation: int = 0  # samples with no assistant token left after truncation
    train: int = 0
    eval: int = 0
    assistant_tokens: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role", "content"} and, in OpenAI tool-use rows, tool_calls / tool_call_id / name
    last_reply_cut: bool  # "finished": false from train.regenerate
    tools: list | None = None  # function schemas from the row's `tools` column, given to the chat template


def read_conversations(rows, max_samples: int = 0) -> tuple[list[Conversation], DataStats]:
    """Every row as checked messages; needs no tokenizer, so bad data fails before the target loads."""
    if len(rows) == 0:
        raise ValueError("the dataset is empty")
    fmt = detect_format(rows.column_names, rows)
    if max_samples:
        rows = rows.select(range(min(max_samples, len(rows))))
    stats = DataStats(rows=len(rows), extra={"format": fmt})
    out = []
    for index, row in enumerate(rows):
        where = row_name(index, row)
        messages = to_messages(row, fmt, where)
        check_contents(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            stats.no_assistant += 1
            continue
        if messages[0]["role"] == "assistant":
            raise ValueError(f"{where}: the conversation starts with an assistant turn; it needs a prompt "
                             "before it")
        tools = read_tools(row, where) if fmt == "messages" else None
        # Ids only name rows here (nothing is keyed by them), so a file mixing rows with and without ids trains.
        own = own_id(row)
        out.append(Conversation(str(index) if own is None else str(own), messages, row.get("finished") is False,
                                tools))
    if stats.no_assistant == stats.rows:
        raise ValueError(f"none of the {stats.rows} conversations has an assistant turn; nothing to train on")
    return out, stats


def conversations_fingerprint(conversations: list[Conversation]) -> str:
    """What a run trains on, before tokenizing: the count and a sha256 over every conversation's id, messages
    and cut flag. A data file (or hub dataset) changed in place changes it; a resume compares it."""
    h = hashlib.sha256()
    for c in conversations:
        # tools only where a row has them, so that data without tools keeps the fingerprint it had before
        item = [c.id, c.messages, c.last_reply_cut] + ([c.tools] if c.tools else [])
        h.update(json.dumps(item, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\0")
    return f"{len(conversations)} conversations, sha256 {h.hexdigest()[:16]}"


def rows_fingerprint(rows) -> str:
    """The rows as read, before any format is applied: their count and a sha256 over every row's fields.
    train.regenerate records it beside its output, as training records `conversations_fingerprint` in its
    checkpoints: a resume skips the ids already answered, and an Alpaca row's id is its row number, so a row
    inserted or edited in place would leave answers to other prompts under those ids."""
    h, count = hashlib.sha256(), 0
    for row in rows:
        h.update(json.dumps(row, ensure_ascii=False, sort_keys=True, default=str).encode())
        h.update(b"\0")
        count += 1
    return f"{count} rows, sha256 {h.hexdigest()[:16]}"


def samples_fingerprint(samples: list[Sample]) -> str:
    """The tokenized samples' count and a sha256 over their ids and loss masks: the same conversations give
    another one only where the tokenizer or its chat template changed."""
    h = hashlib.sha256()
    for s in samples:
        h.update(array.array("q", [len(s.input_ids), *s.input_ids, *s.loss_mask]).tobytes())
    return f"{len(samples)} samples, sha256 {h.hexdigest()[:16]}"


def tokenize_conversations(conversations: list[Conversation], stats: DataStats, tokenizer,
                           max_length: int) -> tuple[list[Sample], DataStats]:
    """Tokenize; truncate to max_length; drop samples left without assistant tokens."""
    check_chat_template(tokenizer)
    check_template_reads_tools(tokenizer, conversations)
    samples = []
    for c in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, c.messages, last_reply_cut=c.last_reply_cut, tools=c.tools)
        except ValueError as err:
            raise ValueError(f"conversation {c.id!r}: {err}") from err
        if len(ids) > max_length:
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        # The first token is never predicted, so a mask on position 0 alone is not a training signal.
        if sum(mask[1:]) == 0:
            stats.dropped_after_truncation += 1
            continue
        samples.append(Sample(c.id, ids, mask))
        stats.assistant_tokens += sum(mask)
    if not samples:
        raise ValueError(
            f"every sample lost all assistant tokens when truncated to max_length={max_length} "
            f"({stats.dropped_after_truncation} dropped); raise max_length")
    return samples, stats


def check_template_reads_tools(tokenizer, conversations: list[Conversation]) -> None:
    """Warn once where the chat template renders the first conversation with tools the same without them: the
    drafter then trains without the schemas the target sees when serving. A warning, not an error: the
    schemas are prompt, not trained text, and the replies and calls are still trained as written."""
    c = next((c for c in conversations if c.tools), None)
    if c is None:
        return
    messages = _for_template(c.messages)
    if _render(tokenizer, messages, False, c.tools) == _render(tokenizer, messages, False, None):
        warnings.warn(f"the chat template ignores the rows' `tools` (conversation {c.id!r} renders the same "
                      "without them), so training prompts lack the function schemas; give the tokenizer a chat "
                      "template that renders tools (the target's own tool-use template)", stacklevel=3)


def build_samples(rows, tokenizer, max_length: int, max_samples: int = 0) -> tuple[list[Sample], DataStats]:
    """Rows to training samples: `read_conversations`, then `tokenize_conversations`."""
    check_chat_template(tokenizer)
    return tokenize_conversations(*read_conversations(rows, max_samples), tokenizer, max_length)


def split_samples(samples: list[Sample], eval_fraction: float, max_eval: int, seed: int):
    """Deterministic held-out split: (train, eval)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_eval = min(int(round(len(samples) * eval_fraction)), max_eval)
    if eval_fraction > 0 and len(samples) > 1:
        n_eval = max(n_eval, 1)
    eval_set = [samples[i] for i in sorted(order[:n_eval])]
    train_set = [samples[i] for i in sorted(order[n_eval:])]
    if not train_set:
        raise ValueError(f"no training samples left after holding out {n_eval} for evaluation")
    return train_set, eval_set


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, group_by_length: bool,
                  rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """This rank's batches (lists of sample indices) for one epoch; the same on every call.

    With length grouping, shuffled indices are cut into mega-batches of 64 batches, each sorted by length
    and cut into batches, and the batches shuffled again. Every rank gets the same number of batches.
    """
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if group_by_length:
        mega = batch_size * 64
        order = [i for k in range(0, len(order), mega)
                 for i in sorted(order[k:k + mega], key=lambda i: -lengths[i])]
    batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if group_by_length:
        rng.shuffle(batches)
    per_rank = len(batches) // world_size
    if per_rank == 0:
        raise ValueError(f"{len(lengths)} training samples make fewer batches than the {world_size} processes")
    return batches[rank * per_rank:(rank + 1) * per_rank]


def collate(samples: list[Sample], indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, loss_mask [B, T] and the samples' indices [B]."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    loss = torch.zeros((len(samples), width), dtype=torch.bool)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        loss[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss,
            "index": torch.tensor(indices, dtype=torch.long)}
