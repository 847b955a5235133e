"""How long the planner's command line takes to answer ``--help`` (issue 43: under 1.5 s on the
2-core CI machine), and what it loads: each run is a fresh interpreter, as a user's shell starts it.

    python scripts/bench_plan_help.py [--runs 7]

Prints the median and the slowest wall time of ``python -m titan_upipe.plan --help`` and of a bare
``python -c pass`` (the interpreter's own start), and the torch/TorchTitan modules ``--help`` loaded
(none expected). Results: docs/benchmarks/planner_cli.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LOADED = ("import runpy, sys\nsys.argv = ['plan', '--help']\ntry:\n    runpy.run_module('titan_upipe.plan', "
          "run_name='__main__')\nexcept SystemExit:\n    pass\nprint(sum(m == 'torch' or m.startswith(('torch.', "
          "'torchtitan')) for m in sys.modules))")


def wall(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    bare = wall([sys.executable, "-c", "pass"], runs)
    plan_help = wall([sys.executable, "-m", "titan_upipe.plan", "--help"], runs)
    loaded = subprocess.run([sys.executable, "-c", LOADED], check=True, capture_output=True, text=True).stdout.split()[-1]
    for name, times in (("python -c pass", bare), ("python -m titan_upipe.plan --help", plan_help)):
        print(f"{name:36s} median {statistics.median(times):.3f} s, slowest {max(times):.3f} s ({runs} runs)")
    print(f"torch/TorchTitan modules loaded by --help: {loaded}")


if __name__ == "__main__":
    main()
