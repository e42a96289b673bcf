"""The applications built on training and the engine: the benchmark (bench/), serving with vLLM (serve.py), the
demo (demo.py, demo_prompts.py) and experiments (experiments/). They import training proper (train/*.py), never
the reverse: training proper never imports train.apps (tests/test_layers.py checks it)."""
