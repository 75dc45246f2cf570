# The two commands of README.md. Both create .venv on first use and install what they need.
# torch==2.13.0 resolves to the CPU wheel on the development machines; on a GPU image use the
# Dockerfile instead (NGC PyTorch brings CUDA torch, NCCL, Transformer Engine and apex).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOKE_ARGS ?=
# The smoke run's layout: NPROC processes (gloo on CPU), tensor + sequence parallel TP, experts split
# over EP ranks (folded onto the tensor/data-parallel ranks). 2 processes, tp 2 x ep 2, fit 2 cores in
# about 3 minutes.
NPROC ?= 2
TP ?= 2
EP ?= 2

.PHONY: smoke test test-fast lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Each smoke run gets its own run directory: earlier runs' metrics are never overwritten.
smoke: $(STAMP)
	OMP_NUM_THREADS=$$(( $$(nproc) / $(NPROC) > 0 ? $$(nproc) / $(NPROC) : 1 )) \
	$(VENV)/bin/python -m launch.torchrun --standalone --nproc-per-node $(NPROC) -m launch.train \
		--config configs/smoke.yaml --require-loss-drop 2.0 parallel.tp=$(TP) parallel.ep=$(EP) \
		train.run_dir=runs/smoke-$$(date +%Y%m%d-%H%M%S) $(SMOKE_ARGS)

# One pytest worker per core of the 2-core CI machine (pytest-xdist); TEST_WORKERS=1 runs them in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The suite without the tests marked slow (pytest -m "not slow"): a quicker check while editing; CI runs make test.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
