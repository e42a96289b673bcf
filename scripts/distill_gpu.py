"""Self-distillation at scale on one GPU, inside a time budget (train/distill_gpu.py).

    python scripts/distill_gpu.py --prompts tatsu-lab/alpaca --out runs/gpu_distill \\
        --regen-minutes 3 --train-minutes 3.5
"""

from train.distill_gpu import main

raise SystemExit(main())
