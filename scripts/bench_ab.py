"""An interleaved A/B of the engine at two revisions, one fresh process a run (train/apps/bench/ab.py; its docstring
is the manual).

    python scripts/bench_ab.py --base 808992d --drafter none --drafter smollm2-135m-instruct-eagle3 --rounds 3
"""

from train.apps.bench.ab import main

raise SystemExit(main())
