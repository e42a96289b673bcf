"""An interleaved A/B of the engine's options on one random target, in one process (train/apps/bench/options_ab.py;
its docstring is the manual).

    python scripts/bench_options.py --random-target llama3-1b --dtype bfloat16 \
        --variant lean_verify=False --variant int8_argmax=False --variant "" --rounds 4
"""

from train.apps.bench.options_ab import main

raise SystemExit(main())
