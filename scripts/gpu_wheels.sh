#!/usr/bin/env bash
# Download the wheels the GPU suite needs into .whl/ (git-ignored), where PyPI is reachable,
# and split any wheel over 60 MiB into parts with a manifest (titan_upipe/gpu_wheels.py).
# The GPU machines are x86-64, CPython 3.12, CUDA 13 (torch 2.11.0+cu130): see ../shared/notes/gpu.md.
#   scripts/gpu_wheels.sh [DEST]        # default .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
# name==version of every wheel, from one list (titan_upipe/gpu_wheels.py REQUIRED); --no-deps:
# every requirement is listed there explicitly.
mapfile -t wheels < <(python3 titan_upipe/gpu_wheels.py list)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
for w in "${wheels[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$w"
done
python3 titan_upipe/gpu_wheels.py split "$dest"
python3 titan_upipe/gpu_wheels.py check "$dest"
