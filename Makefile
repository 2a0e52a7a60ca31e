# Two commands from a fresh clone:  make demo  and  make test.
# A virtual environment is created in .venv if there is none. torch is pinned to the CPU wheel this
# machine has on disk; an unpinned torch would pull several GB of CUDA packages. On a GPU machine
# whose Python already has torch, use `pip install --no-deps -e .` instead.
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
# make demo installs what the demo uses (the core and matplotlib for its curves.png), not the
# test suite's extras (lightning, accelerate, mlflow, wandb, ...), which make test adds
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo lint test test-all test-gpu install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[plot]"
	@touch $(DEMO_STAMP)

# The main job on its embedded data: every GPU there is, or 2 CPU processes without one.
demo: $(DEMO_STAMP)
	@DEVICES=$$($(PY) -c "import torch; print('auto' if torch.cuda.is_available() else 'cpu:2')"); \
	$(VENV)/bin/multigpu train --model cnn --data digits --epochs 8 --batch-size 32 \
	    --lr 0.003 --scheduler cosine --devices $$DEVICES --out runs/demo-$$(date +%Y%m%d-%H%M%S)

# ruff, then the layer contract (pyproject.toml): a few seconds, so every test run starts with them
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	PYTHONPATH=src $(VENV)/bin/lint-imports

# The quick loop: the unit tests and, of the multi-process ones (marker slow), those marked smoke:
# a few per feature. `pytest` alone (pyproject's addopts) runs every test but the gpu and extended
# ones, every multi-process test among them: the default tier, what running one file gives.
SMOKE := not gpu and not extended and (smoke or not slow)

test: lint
	$(PY) -m pytest -m '$(SMOKE)'

# Every CPU test: the default tier, the extended ones and the localhost SLURM tier too: what CI
# runs (.ci/run).
test-all: lint
	$(PY) -m pytest -m 'not gpu'

# On a machine with 2+ GPUs (see tests/gpu).
test-gpu:
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	    python3 -m pytest -m gpu tests/gpu -v

clean:
	rm -rf $(VENV) runs .pytest_cache
