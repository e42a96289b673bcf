"""selfspec, SpecForge and speculators trained side by side on the same rows, every drafter measured by selfspec's
engine (train/apps/bench/trainers.py; its docstring is the manual).

    make peers
    python scripts/bench_trainers.py --work runs/bench_trainers --budget 100000
"""

from train.apps.bench.trainers import main

raise SystemExit(main())
