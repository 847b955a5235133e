#!/bin/bash
# Bitwise fingerprints of every CP mode's debug config (scripts/fingerprint_modes.py), one JSON line each.
# usage: scripts/fingerprint_modes.sh TREE OUT   (TREE: a checkout, e.g. `git worktree add /tmp/parent HEAD~1`)
# Two trees compute the same thing bit for bit when `diff <(sort A) <(sort B)` is empty.
set -u
TREE=$(cd "$1" && pwd); OUT=$2; SCRIPT=$(cd "$(dirname "$0")" && pwd)/fingerprint_modes.py
PYTHON=${PYTHON:-python}; : > "$OUT"
cd "$TREE"
for cfg in llama3_ulysses:2 llama3_upipe:2 llama3_upipe_docs:2 llama3_upipe_transforms:2 qwen3_upipe:2 \
           llama3_ring:4 llama3_usp:4 llama3_upipe_usp:4 tsp:4 llama3_fsdp:1; do
  name=${cfg%%:*}; ranks=${cfg##*:}
  PYTHONPATH=$TREE TITAN_UPIPE_DEVICE=cpu OMP_NUM_THREADS=1 timeout 600 "$PYTHON" -m torch.distributed.run \
    --nproc_per_node "$ranks" --master_port $((29700 + RANDOM % 200)) "$SCRIPT" \
    --job.config_file "configs/debug/$name.toml" 2>/dev/null | grep FINGERPRINT >> "$OUT" || echo "FAILED $name" >> "$OUT"
done
