#!/usr/bin/env bash
# Single-node titan_upipe training with torchrun.
#
#   NGPU=8 CONFIG=configs/llama3_8b/upipe_1m.toml scripts/run_train.sh
#   NGPU=2 CONFIG=configs/debug/llama3_ulysses.toml scripts/run_train.sh --training.steps 10   # CPU, gloo
#
# NGPU: ranks (default: the visible GPUs, or 2 on a machine without CUDA, which runs on CPU/gloo).
# CONFIG: the TOML (default: the embedded CPU debug run). Extra arguments are TorchTitan
# overrides (--section.key value). PYTHON: interpreter (default: the repo's .venv).
# The job is checked first, in one process (python -m titan_upipe.train --check-only): a job that
# cannot run stops there with one line and exit status 2, and no worker starts.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [[ "$NGPU" -gt 0 ]] || NGPU=2
fi
CONFIG=${CONFIG:-configs/debug/llama3_upipe.toml}

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# Every check the launch runs before its process group, in this one process: a job that cannot
# run stops here with its one line (exit status 2), before torchrun spawns any worker.
"$PYTHON" -m titan_upipe.train --check-only --world-size "$NGPU" --job.config_file "$CONFIG" "$@"
# torchrun through titan_upipe.tools.torchrun: the same launch, ended by the workers' one line
# (an error, or Ctrl-C/SIGTERM: exit 130/143) instead of torchrun's traceback.
exec "$PYTHON" -m titan_upipe.tools.torchrun --standalone --nproc-per-node="$NGPU" \
  -m titan_upipe.train --job.config_file "$CONFIG" "$@"
