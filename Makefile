# Two commands a new user needs: `make demo` and `make test`. Both build .venv from nothing when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# two workers, each taking whole test files: a module fixture (e.g. the 8 processes of the trainer's resume tests)
# is then built once, not once per worker; in the order tests/conftest.py puts them (the heavy files first), not
# xdist's default of the files with the most tests first (it left one worker alone with the longest files at the end)
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: test test-fast demo lint format bench clean constraints gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: the pinned CPU wheel, so nothing else pulls a multi-GB CUDA build; then everything at the versions
	# constraints.txt pins (pyproject.toml states the ranges users install from)
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# the inner loop: everything but the tests marked slow (CI runs them all through `make test`)
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

# The demo's threads: README's figures are at THREADS=1 (the default) and THREADS=2. Idle OpenMP threads sleep
# (OMP_WAIT_POLICY=PASSIVE) instead of spinning until the next parallel region: on a busy machine spinning threads
# burn CPU that the demo's tiny matrices cannot use (2 threads spinning: 4x the CPU time of 2 sleeping in the warm
# start, 10x in an evaluation).
THREADS ?= 1
demo: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) OMP_WAIT_POLICY=PASSIVE $(PY) -m longstraw_agents.app.demo --out runs/demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/lint_imports.py
	$(PY) scripts/typecheck.py

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) -m bench.engine
	$(PY) -m bench.trainer
	$(PY) -m bench.ablation
	$(PY) -m bench.ablation_learning --jobs 2
	$(PY) -m bench.rollout
	$(PY) -m bench.compaction

# the wheels a GPU machine without a network needs for bench/gpu.sh, into .whl/ (ignored by git; bench/gpu.sh installs
# them first): flash-linear-attention and its kernels, einops, and transformers at this project's pin (the machine's
# image has an older one). All pure Python; fetched for the machine's Python 3.12 on x86-64.
GPU_WHEELS ?= flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 $(shell grep '^transformers==' constraints.txt)
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	ls -l .whl

# re-pin constraints.txt to what the venv holds now (after a dependency changed in pyproject.toml)
constraints: $(STAMP)
	head -n 3 constraints.txt > constraints.new
	$(PY) -m pip freeze --exclude-editable | sed 's/+cpu$$//' >> constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) runs .pytest_cache
