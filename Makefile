# Two commands do all set-up on a fresh machine:
#   make reproduce   the pipeline on the embedded default target (smollm2-135m, offline, CPU)
#   make test        the test suite
# Each creates or updates the virtualenv it needs.  `make docs` builds the documentation site into site/.

PYTHON ?= python3
VENV ?= .venv
# torch is installed first with an exact pin: on a CPU machine this takes the CPU build (a looser
# spec can pull a multi-GB CUDA build); GPU users may set TORCH_SPEC to their own build.
TORCH_SPEC ?= torch==2.13.0
# vllm: the CPU build of vLLM 0.32 the tests run DLite in; on a CUDA machine EXTRAS=dev,vllm-cuda
EXTRAS ?= dev,vllm
PIPELINE ?= smollm2-135m
BIN = $(VENV)/bin
STAMP = $(VENV)/.dlite-installed

.PHONY: reproduce ablations test install gpu-check docs

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# vLLM pulls these from PyPI built for another torch: they break `import torch.library`, and text models never use them
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# suffix decoding's trees (methods suffix, NAME+suffix, vllm:suffix): PyPI has arctic-inference as source only, and its
	# isolated build pins a torch of its own; built against this torch, cmake finding this venv's python and nanobind
	$(BIN)/python -m pip install -q nanobind==2.9.2 cmake ninja
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	touch $(STAMP)

# Every stage resumes: run it again after an interruption and it continues where it stopped.
reproduce: $(STAMP)
	$(BIN)/dlite run $(PIPELINE)

# The paper's ablations on the embedded default (Table 5, Figure 5): not part of reproduce; it reuses its regen.
ablations: $(STAMP)
	$(BIN)/dlite run smollm2-135m-ablations

test: $(STAMP)
	$(BIN)/python -m pytest -q

# On a GPU machine whose python3 already has torch, transformers, accelerate, typer, rich, pyyaml and
# pytest (no venv, no network): the tests on the GPU (less the server's, which need fastapi), the micro
# pipeline end to end, the profile at Qwen3-4B's shapes, and every stage's memory plan for Qwen3-4B and
# Qwen3-8B on an 80 GB and a 141 GB GPU (each must fit).  Not part of `make test`.  On a CPU,
# `make gpu-check PYTHON=.venv/bin/python` runs the same to its end: what a CPU cannot run is skipped,
# with its reason printed (pytest's -rs, the profile's skipped lines). Each test's name and outcome is printed as it
# ends (-v), so that a run stopped by a time limit still names its failures.
GPU_CHECK = PYTHONPATH=$(CURDIR)/src $(PYTHON)
gpu-check:
	$(GPU_CHECK) -m pytest -v -rfs --ignore tests/serve
	$(GPU_CHECK) -m dlite_cli run micro --run-dir runs/gpu-check-micro
	$(GPU_CHECK) -m dlite_cli profile --target qwen3-4b
	for target in qwen3-4b qwen3-8b; do for gigabytes in 80 141; do \
		$(GPU_CHECK) -m dlite_cli profile --target $$target --memory $$gigabytes || exit 1; done; done

# The documentation site (docs/, mkdocs.yml) into site/: the docs extra (mkdocs, mkdocs-material) goes into the venv
# once; docs/cli.md is generated from the CLI itself each time (not committed), its <placeholders> escaped so that
# they show; then the strict build fails on any broken link or page left out of the nav.
DOCS_STAMP = $(VENV)/.dlite-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/typer dlite_cli.cli utils docs --name dlite --title "CLI reference" --output docs/cli.md
	sed -e '/^\* /s/<\([A-Za-z][A-Za-z_-]*\)>/\&lt;\1\&gt;/g' docs/cli.md > docs/cli.md.tmp && mv docs/cli.md.tmp docs/cli.md
	$(BIN)/mkdocs build --strict --site-dir site
