"""Serve a trained drafter with vLLM's OpenAI-compatible server, in one command (train/apps/serve.py).

    python scripts/serve.py runs/demo/drafter                            # export, start vLLM, print the URL
    python scripts/serve.py ngram --target smollm2-135m-instruct         # vLLM's drafter-less n-gram method
"""

from train.apps.serve import main

raise SystemExit(main())
