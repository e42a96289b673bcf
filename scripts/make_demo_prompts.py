"""Write `data/demo_prompts.jsonl`, the demo's instruction prompts (train/apps/demo_prompts.py).

    python scripts/make_demo_prompts.py            # rewrites data/demo_prompts.jsonl
"""

from train.apps.demo_prompts import main

raise SystemExit(main())
