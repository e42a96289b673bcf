"""How much more one target forward costs when it scores n new tokens instead of 1 (train/apps/bench/forward_cost.py).

    python scripts/forward_cost.py --target smollm2-135m-instruct --context 256
"""

from train.apps.bench.forward_cost import main

raise SystemExit(main())
