"""Which EAGLE-3 training settings pay on a CPU budget: one drafter trained per setting, each measured
(train/sweep.py).

    python scripts/sweep.py --out runs/sweep --only base lr3e-3
"""

from train.sweep import main

raise SystemExit(main())
