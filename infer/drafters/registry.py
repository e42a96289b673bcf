"""The one table of drafter names: `register` adds a name, `build_drafter` makes the drafter a name stands for.

The table's lines are in `infer.drafters` (its `__init__`); a drafter that builds another by name (`staged`,
`suffix`) imports `build_drafter` from here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from ..drafting import Drafter


@dataclass(frozen=True)
class Entry:
    build: Callable  # (argument or None, target, tokenizer) -> Drafter
    usage: str  # how the name is written, with its argument
    when: str  # one line: when to use it


DRAFTERS: dict[str, Entry] = {}


def register(name: str, build: Callable, usage: str, when: str) -> None:
    if name in DRAFTERS:
        raise ValueError(f"a drafter named {name!r} is registered already")
    DRAFTERS[name] = Entry(build, usage, when)


def known() -> str:
    return ", ".join(entry.usage for entry in DRAFTERS.values())


def closest(name: str, others: tuple[str, ...] = ()) -> str:
    """' (did you mean ...?)' naming the drafter name (or one of `others`) nearest a mistyped `name`, or ''."""
    near = difflib.get_close_matches(name, [*DRAFTERS, *others], n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def build_drafter(spec: str, target, tokenizer=None) -> Drafter:
    """The drafter a name stands for, e.g. "ngram", "gguf", "early_exit:8", "staged:int8+ngram"."""
    name, sep, arg = spec.partition(":")
    entry = DRAFTERS.get(name.strip())
    if entry is None:
        raise ValueError(f"unknown drafter {spec!r}{closest(name.strip())}; the named drafters are: {known()}; "
                         "or pass a trained drafter (heads.load(...)), a causal LM sharing the target's tokenizer, "
                         "or an infer.Drafter")
    if sep and not arg.strip():
        raise ValueError(f"drafter {spec!r} has nothing after ':'; write {entry.usage}")
    return entry.build(arg.strip() if sep else None, target, tokenizer)
