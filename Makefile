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

# On a GPU machine whose python3 already has torch, transformers, accelerate, typer, rich, pyyaml and pytest (no venv,
# no network), in about 8 minutes: the tests on the GPU, the micro pipeline, the profile at Qwen3-4B's shapes, then
# every stage's memory plan for Qwen3-4B and Qwen3-8B on an 80 GB and a 141 GB GPU (each must fit).  Not part of
# `make test`.  Each step has a time limit of its own (seconds below; coreutils' timeout sends SIGINT, then SIGKILL
# 10 s later), so that one running long cannot eat the others; every step runs, each prints its exit status and time,
# and the target fails at the end naming the steps that failed.
# - tests: each fails after GPU_CHECK_TEST_LIMIT seconds of its call (its fixtures' setup is not limited) and the run
#   goes on (DLITE_TEST_TIMEOUT, tests/conftest.py); each name and outcome is printed as it ends (-v, and -rfs's
#   summary even when stopped), so that a stopped run still names its failures.  Left out: the server's (they need
#   fastapi) and those that run on the CPU whatever the machine, slow there and nothing to see on a GPU (-k): the CPU
#   kernels' (a fresh machine compiles them first), the two-process `accelerate launch` ones (gloo) and the kill -9
#   ones (the micro pipeline killed and resumed).
# - micro: from scratch, its stages up to stable-parallel, then a bench of one workload that needs no download
#   (swe_bench; the pipeline's own bench stage runs every suite).  PIP_RETRIES=0: with no network a wheel fails at
#   once, not after pip's retries.
# On a CPU, `make gpu-check PYTHON=.venv/bin/python GPU_CHECK_SCALE=8` rehearses the same with every limit 8 times
# longer (a whole number): what a CPU cannot run is skipped, with its reason printed (pytest's -rs, the profile's
# skipped lines).
GPU_CHECK = PYTHONPATH=$(CURDIR)/src PIP_RETRIES=0 $(PYTHON)
GPU_CHECK_SCALE ?= 1
GPU_CHECK_TEST_LIMIT = 60
GPU_CHECK_MICRO = runs/gpu-check-micro
GPU_CHECK_FAILED = runs/gpu-check-failed
# $(call gpu_check_step,NAME,SECONDS,COMMAND): COMMAND under its limit, its exit status and time printed, and NAME
# added to GPU_CHECK_FAILED if it failed
gpu_check_step = limit=$$(($(2) * $(GPU_CHECK_SCALE))); echo "gpu-check $(1), limit $$limit s: $(3)"; start=$$(date +%s); \
	timeout -s INT -k 10 $$limit env $(3); status=$$?; \
	echo "gpu-check $(1): exit status $$status after $$(($$(date +%s) - start)) s of its $$limit"; \
	[ $$status = 0 ] || echo "$(1)" >> $(GPU_CHECK_FAILED)
gpu-check:
	@rm -rf $(GPU_CHECK_MICRO) && mkdir -p runs && : > $(GPU_CHECK_FAILED)
	@$(call gpu_check_step,tests,270,DLITE_TEST_TIMEOUT=$$(($(GPU_CHECK_TEST_LIMIT) * $(GPU_CHECK_SCALE))) \
		$(GPU_CHECK) -m pytest -v -rfs --durations=20 --ignore tests/serve -k 'not (cpu_kernels or accelerate or kill_9)')
	@$(call gpu_check_step,micro pipeline,75,$(GPU_CHECK) -m dlite_cli run micro --run-dir $(GPU_CHECK_MICRO) --until stable-parallel)
	@$(call gpu_check_step,micro bench,60,$(GPU_CHECK) -m dlite_cli bench --target micro --run-dir $(GPU_CHECK_MICRO) --workload swe_bench)
	@$(call gpu_check_step,profile,150,$(GPU_CHECK) -m dlite_cli profile --target qwen3-4b)
	@for target in qwen3-4b qwen3-8b; do for gigabytes in 80 141; do \
		$(call gpu_check_step,memory plan $$target $$gigabytes GB,20,$(GPU_CHECK) -m dlite_cli profile --target $$target --memory $$gigabytes); \
	done; done
	@if [ -s $(GPU_CHECK_FAILED) ]; then sed 's/^/gpu-check failed: /' $(GPU_CHECK_FAILED); exit 1; fi

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
