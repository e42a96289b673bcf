"""EAGLE-3 layer styles at equal budget: a Llama layer at the target's sizes against the target's own layer
(train/apps/experiments/compare_layer_styles.py; the table in docs/export.md is its output).

    .venv/bin/python scripts/compare_layer_styles.py --archs qwen3 gemma3_text --seeds 0 1 2 --steps 150
"""

from train.apps.experiments.compare_layer_styles import main

raise SystemExit(main())
