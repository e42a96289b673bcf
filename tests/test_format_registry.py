"""One registry of formats per kind (heads.kinds.Kind: `exports`, `imports`): export, import, the CLI and the docs
all read it, so a kind cannot export to a format the exporter does not list or the docs leave out."""

from __future__ import annotations

from pathlib import Path

import foreign_checkpoints

import heads
from heads import export, formats
from heads.kinds import ExportFormat

ROOT = Path(__file__).resolve().parents[1]


def test_every_export_format_is_a_kinds_and_export_reads_the_kinds():
    defined = {v.name: v for v in vars(export).values() if isinstance(v, ExportFormat)}
    by_kind = [fmt for kind in heads.REGISTRY.values() for fmt in kind.exports]
    assert sorted(f.name for f in by_kind) == sorted(defined)  # each defined format belongs to exactly one kind
    assert export.export_formats() == defined
    for kind in heads.REGISTRY.values():
        assert export.kind_formats(kind.name) == tuple(f.name for f in kind.exports)
    assert export.kind_formats("eagle3") == ("speculators", "sglang")  # vLLM's first; SGLang's too


def test_every_import_format_is_claimed_by_one_kind():
    claimed = [name for kind in heads.REGISTRY.values() for name in kind.imports]
    assert sorted(claimed) == sorted(formats.FORMATS)
    assert sorted(foreign_checkpoints.FORMATS) == sorted(formats.FORMATS)  # the fixtures cover every reader


def test_the_docs_name_every_format_of_every_kind():
    text = (ROOT / "docs" / "export.md").read_text()
    missing = [f"{kind.name}: {fmt}" for kind in heads.REGISTRY.values()
               for fmt in [f.name for f in kind.exports] + list(kind.imports) if f"`{fmt}`" not in text]
    assert not missing, f"docs/export.md does not name: {missing}"
