"""Which EAGLE-3 training settings pay on a CPU budget: one drafter trained per setting, each measured
(train/apps/experiments/sweep.py).

    python scripts/sweep.py --out runs/sweep --only base lr3e-3
"""

from train.apps.experiments.sweep import main

raise SystemExit(main())
