#!/usr/bin/env bash
# Download the wheels the GPU suite needs into .whl/ (git-ignored), where PyPI is reachable,
# and split any wheel over 60 MiB into parts with a manifest (titan_upipe/gpu_wheels.py).
# The GPU machines are x86-64, CPython 3.12, CUDA 13 (torch 2.11.0+cu130): see ../shared/notes/gpu.md.
#   scripts/gpu_wheels.sh [DEST]        # default .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
# name==version, one per line; --no-deps: every requirement is listed explicitly.
wheels=(
  torchtitan==0.2.2
  liger-kernel==0.8.5
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
  tomli
  einops
)
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
