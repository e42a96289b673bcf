"""Benchmark speculative decoding against transformers' own decoding: `python scripts/bench.py --help`.

The benchmark is the library module train/apps/bench/ (its cli module's docstring is the manual); this file only
calls it.
"""

from train.apps.bench import main

raise SystemExit(main())
