"""Batched greedy generation, transformers against selfspec: `python scripts/bench_batches.py --help`.

The library module train/apps/bench/batches.py does the work; this file only calls it.
"""

from train.apps.bench.batches import main

raise SystemExit(main())
