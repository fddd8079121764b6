# Two commands do all set-up on a fresh machine:
#   make reproduce   the pipeline on the embedded default target (smollm2-135m, offline, CPU)
#   make test        the test suite
# Each creates or updates the virtualenv it needs.

PYTHON ?= python3
VENV ?= .venv
# torch is installed first with an exact pin: on a CPU machine this takes the CPU build (a looser
# spec can pull a multi-GB CUDA build); GPU users may set TORCH_SPEC to their own build.
TORCH_SPEC ?= torch==2.13.0
PIPELINE ?= smollm2-135m
BIN = $(VENV)/bin
STAMP = $(VENV)/.dlite-installed

.PHONY: reproduce test install gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Every stage resumes: run it again after an interruption and it continues where it stopped.
reproduce: $(STAMP)
	$(BIN)/dlite run $(PIPELINE)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# On a GPU machine whose python3 already has torch, transformers, accelerate, typer, rich, pyyaml and
# pytest (no venv, no network): the tests on the GPU (less the server's, which need fastapi), the micro
# pipeline end to end, and the decode profile at Qwen3-4B's shapes.  Not part of `make test`.
gpu-check:
	PYTHONPATH=$(CURDIR)/src $(PYTHON) -m pytest -q -x --ignore tests/test_serve.py
	PYTHONPATH=$(CURDIR)/src $(PYTHON) -m dlite_cli run micro --run-dir runs/gpu-check-micro
	PYTHONPATH=$(CURDIR)/src $(PYTHON) -m dlite_cli profile --target qwen3-4b
