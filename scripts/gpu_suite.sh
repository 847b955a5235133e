#!/usr/bin/env bash
# The GPU validation suite on an offline GPU machine: reassemble and install the carried wheels
# (.whl/, from scripts/gpu_wheels.sh) beside the machine's torch, then run the suite.
#   scripts/gpu_suite.sh --stage kernels|memory|speed|all [--lengths 1M,2M] [--budget-s 540] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# A project .venv only where its torch sees the GPU (a CPU-only .venv would fail every stage).
py=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  py=.venv/bin/python
fi
site=${GPU_SUITE_SITE:-/tmp/titan_upipe_site}
if ! "$py" -c "import torchtitan" 2>/dev/null; then
  "$py" titan_upipe/tools/gpu_wheels.py install .whl --target "$site"
  # the target and what its .pth files add (the CuTe DSL's cutlass modules): PYTHONPATH runs no .pth
  export PYTHONPATH="$("$py" titan_upipe/tools/gpu_wheels.py pythonpath --target "$site")${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Compiled kernels (FlashAttention-4's CuTe DSL, Triton, inductor) persist in /tmp between the calls
# of one machine, so a second call does not compile again (titan_upipe/tools/compile_caches.py;
# a variable already set is kept). Not under .venv or the checkout: those travel with each call.
eval "$("$py" titan_upipe/tools/compile_caches.py)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec "$py" -m titan_upipe.gpu_suite "$@"
