"""Calibrate a trained drafter's tree to its acceptance on held-out prompts and to this machine's costs
(heads/calibration.py).

    python scripts/calibrate.py --drafter runs/demo/drafter --prompts held_out.jsonl --write
"""

from heads.calibration import main

raise SystemExit(main())
