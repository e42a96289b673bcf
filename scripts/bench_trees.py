"""Drafters measured by selfspec's engine at the anchors' trees and the calibrated one (train/apps/bench/trainer_eval.py).

    python scripts/bench_trees.py --drafter smollm2-135m-instruct-eagle3 --prompts 16 --out runs/trees
"""

from train.apps.bench.trainer_eval import main

raise SystemExit(main())
