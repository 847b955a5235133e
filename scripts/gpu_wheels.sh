#!/usr/bin/env bash
# Download the wheels the GPU suite carries into .whl/ (git-ignored), where PyPI is reachable,
# and split any wheel over 60 MiB into parts with a manifest (titan_upipe/tools/gpu_wheels.py).
# The set is the lock, titan_upipe/resources/gpu_wheels.json: pip's resolver's closure of the plugin's needs over
# the GPU image's packages (titan_upipe/resources/gpu_image_packages.txt), each wheel by URL and sha256.
#   scripts/gpu_wheels.sh [DEST]        # default .whl
#   python3 titan_upipe/tools/gpu_wheels.py lock --python python3.12   # re-resolve (new image list or versions)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python3 titan_upipe/tools/gpu_wheels.py download "$dest"
python3 titan_upipe/tools/gpu_wheels.py split "$dest"
python3 titan_upipe/tools/gpu_wheels.py check "$dest"
