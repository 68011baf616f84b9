# gcbs-kit: `make reproduce` runs every notebook headlessly; `make test` runs the whole test suite.
# Both bootstrap .venv on a fresh machine that has only Python 3.11.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
RUN_DIR := runs/$(shell date +%Y%m%d-%H%M%S)
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider

.PHONY: help install test unit nbval sync-check reproduce notebooks clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0  # first and pinned: a CPU build; see README for CUDA
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

install: $(STAMP)  ## create .venv and install everything (torch first)

test: unit nbval sync-check  ## pytest (unit, multi-process, papermill smoke), nbval, jupytext drift check

unit: $(STAMP)  ## pytest only
	$(BIN)/pytest tests

nbval: $(STAMP)  ## re-run the notebooks and compare their NBVAL_CHECK_OUTPUT cells
	$(BIN)/pytest $(NBVAL) $(NOTEBOOKS)

sync-check: $(STAMP)  ## fail when a notebook's .py and .ipynb differ
	@status=0; for nb in $(NOTEBOOKS); do \
	  $(BIN)/jupytext --quiet --to py:percent --output - "$$nb" | diff -u "$${nb%.ipynb}.py" - \
	    || { echo "$$nb and $${nb%.ipynb}.py differ: run make notebooks"; status=1; }; \
	done; exit $$status

reproduce: $(STAMP)  ## run every notebook with papermill (CPU CI profile) into runs/<timestamp>/
	mkdir -p $(RUN_DIR)
	for nb in $(NOTEBOOKS); do \
	  $(BIN)/papermill --cwd notebooks "$$nb" "$(RUN_DIR)/$$(basename $$nb)" || exit 1; \
	done
	@echo "Executed notebooks and their results are in $(RUN_DIR)/"

notebooks: $(STAMP)  ## sync each edited .py into its .ipynb and re-execute it in place (committed outputs)
	for py in $(sort $(wildcard notebooks/[0-9]*.py)); do \
	  $(BIN)/jupytext --quiet --sync "$$py" && \
	  (cd notebooks && ../$(BIN)/jupyter execute --inplace "$$(basename $${py%.py}.ipynb)") || exit 1; \
	done

clean:  ## remove the virtual environment and run outputs
	rm -rf $(VENV) runs
