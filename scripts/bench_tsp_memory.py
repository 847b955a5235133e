"""Per-rank memory and communication of TSP against Ulysses and UPipe, measured with the rank emulator.

One rank of an 8-rank CPU job (``python -m titan_upipe.emulate``: fake process group, real kernels,
live-tensor tracker), fp32, for each converter:

* ``8b``: TorchTitan's Llama3-8B flavor, 2 blocks built and extrapolated to 32, 8192 tokens (1024
  per rank), full activation checkpointing: the state and the weights in flight dominate.
* ``long``: the llama3 ``debug_mha`` flavor (8 / 8 heads, dim 128), 2 blocks, 65536 tokens (8192
  per rank), no activation checkpointing: the activations each block keeps dominate.

Communication per step at full depth: Ulysses/UPipe's all-to-all bytes (``attention.comm_model``)
plus FSDP's traffic for the blocks' weights (fp32 all-gather in forward and backward,
reduce-scatter: ``fsdp_block_bytes``); TSP's every byte received (``tsp.comm.layer_comm_bytes``:
its weights travel inside the layer, no FSDP of block weights). ``scripts/tsp_compare.py`` puts the
bytes of all three side by side with FSDP at 128K-1M.

    python scripts/bench_tsp_memory.py             # ~10 min on a 2-core CPU
    python scripts/bench_tsp_memory.py --only long

Results: docs/benchmarks/tsp_memory_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024**2
MODES = {"ulysses": "configs/debug/ulysses.toml", "upipe": "configs/debug/upipe.toml", "tsp": "configs/debug/tsp.toml"}
SETS = {
    "8b": ("--model.flavor", "8B", "--n-layers", "2", "--seq-len", "8192", "--training.local_batch_size", "1",
           "--activation_checkpoint.mode", "full"),
    "long": ("--model.flavor", "debug_mha", "--seq-len", "65536", "--training.local_batch_size", "1",
             "--activation_checkpoint.mode", "none"),
}
RANKS = 8


def measure(mode: str, overrides: tuple[str, ...]) -> dict:
    cmd = [sys.executable, "-m", "titan_upipe.emulate", "--job.config_file", MODES[mode], "--cp-world", str(RANKS),
           "--parallelism.context_parallel_degree", str(RANKS), "--json", *overrides]
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])


def fsdp_block_bytes(r: dict) -> float:
    """Bytes one rank receives per step for the blocks' weights under FSDP over all ranks (fp32 here):
    the all-gather in forward, again in backward, the reduce-scatter; ``(D-1)/D`` of each."""
    block = r["layer_param_bytes"] / r["n_layers"] * RANKS  # one block's weights, unsharded
    return r["full"]["n_layers"] * 3 * block * (RANKS - 1) / RANKS


def row(mode: str, r: dict) -> str:
    full = r["full"]
    attention = full["a2a_bytes"] + full["p2p_bytes"]
    fsdp = 0.0 if mode == "tsp" else fsdp_block_bytes(r)
    cells = [mode, full["param_bytes"] / MIB, full["grad_bytes"] / MIB, full["optimizer_bytes"] / MIB,
             r["retained_bytes_per_layer"] / MIB, r["peak_bytes"] / MIB, full["peak_bytes"] / MIB, attention / GB,
             fsdp / GB, (attention + fsdp) / GB]
    return "| " + " | ".join(c if isinstance(c, str) else f"{c:,.1f}" for c in cells) + " |"


GB = 1e9
HEADER = ("| converter | params MiB | grads MiB | AdamW MiB | kept per block MiB | peak MiB (blocks built) | "
          "peak MiB (full depth) | attention / TSP comm GB | FSDP of blocks GB | comm GB per step |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=tuple(SETS), default=None)
    args = parser.parse_args(argv)
    for name, overrides in SETS.items():
        if args.only and name != args.only:
            continue
        print(f"\n{name}: {' '.join(overrides)} (per rank; comm at full depth, bytes received or sent)\n\n{HEADER}",
              flush=True)
        for mode in MODES:
            print(row(mode, measure(mode, overrides)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
