"""Write a saved selfspec drafter in a serving format: the one vLLM serves for its kind by default, or --format
(heads/export_cli.py).

    .venv/bin/python scripts/export.py runs/demo/drafter out/eagle3-sglang --format sglang

Formats (heads.export.export_formats()): speculators (EAGLE-3, vLLM), sglang (EAGLE-3, SGLang/SpecForge), vllm (Medusa),
dflash (DFlash, vLLM). docs/export.md says what each writes and what is refused.
"""

from heads.export_cli import main

raise SystemExit(main())
