"""Drafters in the formats other projects publish, loaded as selfspec drafters by `heads.load` (and so by
`SelfSpecModel.from_pretrained`).

One module per format, each with `detect(config, files) -> bool` (its config.json as a dict, and which of
`common.CANDIDATE_FILES` the checkpoint holds), `target_name(config)` (the target the checkpoint names, if any) and
`load(path_or_id, config, target=None, **hub_kwargs)`, which maps the checkpoint's weights onto our drafter of the
same design, key by key and shape by shape, after checking it fits the target; each module's docstring says what
its format computes and how our drafter is set to compute the same. They are registered in `FORMATS`, which
`heads.load` consults when a config is not one of our own kinds': exactly one must recognise it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import dflash_zlab, eagle1_authors, eagle_authors, medusa_fd, specforge, speculators
from .common import CANDIDATE_FILES, files_of


@dataclass(frozen=True)
class Format:
    name: str  # short name, e.g. "specforge"
    description: str  # what error messages call it
    detect: Callable[[dict, frozenset[str]], bool]
    target_name: Callable[[dict], str | None]
    load: Callable  # (path_or_id, config, target=None, **hub_kwargs) -> DrafterModel


# format name -> Format, in the order error messages list them
FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    if fmt.name in FORMATS:
        raise ValueError(f"checkpoint format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt


for _module in (eagle_authors, eagle1_authors, specforge, speculators, medusa_fd, dflash_zlab):
    register(Format(_module.NAME, _module.DESCRIPTION, _module.detect, _module.target_name, _module.load))


def detect(config: dict, files: frozenset[str]) -> list[Format]:
    """The formats that recognise a checkpoint (its config and which weight files it holds)."""
    return [fmt for fmt in FORMATS.values() if fmt.detect(config, files)]


def known() -> str:
    """The known formats, one per line, for error messages."""
    return "\n".join(f"  - {fmt.name}: {fmt.description}" for fmt in FORMATS.values())


__all__ = ["FORMATS", "Format", "register", "detect", "known", "files_of", "CANDIDATE_FILES"]
