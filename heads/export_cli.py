"""scripts/export.py: a saved selfspec drafter (folder, hub id or shipped name) written in a serving format, the one
vLLM serves for its kind by default, or --format (heads.export.export_formats()). docs/export.md says what each writes and
what is refused.

    .venv/bin/python scripts/export.py runs/demo/drafter out/eagle3-sglang --format sglang
"""

from __future__ import annotations

import argparse
import sys

from . import load
from .export import check_out_dir, export, export_formats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="a saved drafter folder, hub id or shipped drafter name")
    parser.add_argument("out_dir", help="an empty or new folder (an earlier export of ours is replaced)")
    parser.add_argument("--format", choices=sorted(export_formats()), default=None,
                        help="default: the format vLLM serves for the drafter's kind")
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out_dir)  # before the drafter loads: a folder that cannot take the export is said first
        print(export(load(args.drafter), args.out_dir, format=args.format))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
