#!/usr/bin/env bash
# The GPU validation suite on an offline GPU machine: reassemble and install the carried wheels
# (.whl/, from scripts/gpu_wheels.sh) beside the machine's torch, then run the suite.
#   scripts/gpu_suite.sh --stage kernels|memory|speed|all [--lengths 1M,2M] [--budget-s 540]
set -euo pipefail
cd "$(dirname "$0")/.."
site=${GPU_SUITE_SITE:-/tmp/titan_upipe_site}
if [ ! -x .venv/bin/python ] && ! python3 -c "import torchtitan" 2>/dev/null; then
  python3 titan_upipe/gpu_wheels.py install .whl --target "$site"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" -m titan_upipe.gpu_suite "$@"
