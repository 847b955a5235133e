# titan_upipe — `make install`, `make test`, `make run` each work alone on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# TorchTitan 0.3 beside the default 0.2.2: its wheels (no dependencies: the venv has them) in a folder
# put first on PYTHONPATH for the second test pass (tests_tt03/; docs/torchtitan_versions.md).
TT03 := .tt03
TT03_STAMP := $(TT03)/.installed
TT03_WHEELS := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1
NPROC ?= 2
RUN_CONFIG ?= configs/debug/llama3_upipe.toml
RUN_ARGS ?=

.PHONY: install test run lint clean bench-attention bench-memory gpu-suite fa4-compile

install: $(STAMP) $(TT03_STAMP)

# Without CUDA, torch==2.13.0 first: pip then keeps the local CPU build instead of
# resolving `torch>=2.11` to a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install --quiet "torch>=2.11"; \
	else \
		$(BIN)/python -m pip install --quiet "torch==2.13.0"; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(TT03_STAMP): $(STAMP)
	rm -rf $(TT03)
	$(BIN)/python -m pip install --quiet --no-deps --target $(TT03) $(TT03_WHEELS)
	touch $(TT03_STAMP)

# The whole suite on TorchTitan 0.2.2, then the 0.3 adapter's tests on TorchTitan 0.3.0.
test: $(STAMP) $(TT03_STAMP)
	$(BIN)/python -m pytest -q tests
	PYTHONPATH=$(TT03) $(BIN)/python -m pytest -q tests_tt03

# The embedded default: UPipe context parallelism (CP=2, U=C) + FSDP on 2 CPU gloo ranks,
# ~30 steps of the synthetic copy task. At the end the trainer logs the TensorBoard command for
# the dump folder it used (RUN_ARGS="--job.dump_folder X" included). The launch's checks run
# first in one process (a job that cannot run stops with one line, no worker started); torchrun
# runs through titan_upipe.tools.torchrun (Ctrl-C: one line, exit 130, no traceback).
run: $(STAMP)
	$(BIN)/python -m titan_upipe.train --check-only --world-size $(NPROC) --job.config_file $(RUN_CONFIG) $(RUN_ARGS)
	$(BIN)/python -m titan_upipe.tools.torchrun --standalone --nproc_per_node $(NPROC) -m titan_upipe.train \
		--job.config_file $(RUN_CONFIG) $(RUN_ARGS)

# Benchmarks (not tests): results go to docs/benchmarks/ with device, date and command.
# BENCH_ARGS passes options through, e.g. make bench-memory BENCH_ARGS="--device cuda --seq 65536".
BENCH_ARGS ?=

bench-attention: $(STAMP)
	$(BIN)/python scripts/bench_attention.py $(BENCH_ARGS)

bench-memory: $(STAMP)
	$(BIN)/python scripts/bench_memory.py $(BENCH_ARGS)

# The GPU validation suite (docs/quickstart.md#validating-a-gpu-machine). On an offline GPU
# machine without .venv it installs the carried wheels (.whl/, scripts/gpu_wheels.sh) first.
STAGE ?= all
gpu-suite:
	scripts/gpu_suite.sh --stage $(STAGE) $(GPU_SUITE_ARGS)

# FlashAttention-4's binding compiled for Hopper (sm_90a) with no GPU: every call FlashAttn4Backend makes,
# under torch's FakeTensorMode (tests/test_fa4_compile.py, docs/attention.md; ~40 s on 2 cores). Installs
# the [gpu] extra as pip resolves it, but for nvidia-cutlass-dsl-libs-cu12: the CuTe DSL metapackage
# requires that CUDA 12 compiler (92 MB) unconditionally, one compiler flavor suffices and the GPU
# machines (CUDA 13) load libs-cu13, so the lock (titan_upipe/resources/gpu_wheels.json) leaves cu12 out and so
# does this: pip resolves (--dry-run --report, metadata only), then installs that list --no-deps.
# TITAN_UPIPE_REQUIRE_FA4=1: a flash-attn-4 that is missing or does not import fails, never skips.
FA4_STAMP := $(VENV)/.fa4-installed
GPU_EXTRA_REPORT := $(VENV)/gpu-extra-report.json

$(FA4_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet --dry-run --report $(GPU_EXTRA_REPORT) -e ".[gpu]"
	$(BIN)/python -c 'import json, sys; wheels = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]; \
		print("\n".join(m["name"] + "==" + m["version"] for m in wheels if m["name"].replace("_", "-") not in sys.argv[2:]))' \
		$(GPU_EXTRA_REPORT) titan-upipe nvidia-cutlass-dsl-libs-cu12 > $(VENV)/gpu-extra.txt
	$(BIN)/python -m pip install --quiet --no-deps -r $(VENV)/gpu-extra.txt
	touch $(FA4_STAMP)

fa4-compile: $(FA4_STAMP)
	TITAN_UPIPE_REQUIRE_FA4=1 $(BIN)/python -m pytest -q tests/test_fa4_compile.py

lint: $(STAMP)
	$(BIN)/ruff check titan_upipe tests tests_tt03 scripts

clean:
	rm -rf outputs .pytest_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
