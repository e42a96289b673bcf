"""Write a saved selfspec drafter in a serving format: the one vLLM serves for its kind by default, or --format.

    .venv/bin/python scripts/export.py runs/demo/drafter out/eagle3-sglang --format sglang

Formats (heads.export.FORMATS): speculators (EAGLE-3, vLLM), sglang (EAGLE-3, SGLang/SpecForge), vllm (Medusa),
dflash (DFlash, vLLM). docs/export.md says what each writes and what is refused.
"""

from __future__ import annotations

import argparse
import sys

import heads
from heads.export import FORMATS, export


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", help="a saved drafter folder, hub id or shipped drafter name")
    parser.add_argument("out_dir", help="an empty or new folder (an earlier export of ours is replaced)")
    parser.add_argument("--format", choices=sorted(FORMATS), default=None,
                        help="default: the format vLLM serves for the drafter's kind")
    args = parser.parse_args(argv)
    try:
        print(export(heads.load(args.drafter), args.out_dir, format=args.format))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
