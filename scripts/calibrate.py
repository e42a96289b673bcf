"""Calibrate a trained drafter's tree to its acceptance on held-out prompts and to this machine's costs
(heads/calibrate_cli.py).

    python scripts/calibrate.py --drafter runs/demo/drafter --prompts held_out.jsonl --write
"""

from heads.calibrate_cli import main

raise SystemExit(main())
