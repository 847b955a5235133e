# titan_upipe — `make install`, `make test`, `make run` each work alone on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
RUN_CONFIG ?= configs/debug/llama3_upipe.toml
RUN_ARGS ?=

.PHONY: install test run lint clean bench-attention bench-memory gpu-suite

install: $(STAMP)

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

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The embedded default: UPipe context parallelism (CP=2, U=C) + FSDP on 2 CPU gloo ranks,
# ~30 steps of the synthetic copy task. At the end the trainer logs the TensorBoard command for
# the dump folder it used (RUN_ARGS="--job.dump_folder X" included).
run: $(STAMP)
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m titan_upipe.train \
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

lint: $(STAMP)
	$(BIN)/ruff check titan_upipe tests scripts

clean:
	rm -rf outputs .pytest_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
