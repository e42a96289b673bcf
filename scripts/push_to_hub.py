"""Push a trained drafter to the Hugging Face Hub with its model card (heads/publish.py).

    python scripts/push_to_hub.py runs/demo --repo-id you/smollm2-135m-eagle3
"""

from heads.publish import main

raise SystemExit(main())
