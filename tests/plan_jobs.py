"""The job the planner's tests share: the paper's Llama3-8B recipe (``titan_upipe.plan``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked_ranks

from titan_upipe import plan as P

REPO = Path(__file__).resolve().parents[1]
GIB = P.GIB
LLAMA = P.KNOWN_MODELS["llama3_8b"]


def gpu_job(seq: str = "1M", **kw) -> P.PlanInput:
    """The paper's recipe: Llama3-8B, 8 ranks, UPipe U = C, bf16 FSDP, offloaded full AC, transforms."""
    return P.PlanInput(LLAMA, seq_len=P.parse_length(seq), cp=8, **{"ulysses": 8, **kw})


EMULATE = r"""
import json, sys
from titan_upipe.emulate import measure_step  # measure_step registers the plugin itself
from titan_upipe.torchtitan_0_2.config_parse import parse_config
out = []
for spec in json.loads(sys.argv[1]):
    m = measure_step(parse_config(spec["args"]), spec["world"], fake=True, time_attention=False)
    out.append({"total": m.total_peak_bytes, "baseline": m.baseline_bytes, "phases": m.phase_peak_bytes})
print(json.dumps(out))
"""


def run_split(code: str, specs: list, env: dict[str, str], processes: int = 2, timeout: int = 900,
              costs: list[float] | None = None) -> list:
    """``python -c code SPECS`` over ``specs`` dealt to ``processes`` subprocesses run at once (each
    prints one JSON list, a result per spec, as its last line); the results in the order of
    ``specs``. The CI machine's two cores each run one one-thread process (``OMP_NUM_THREADS=1``).
    ``costs``: each spec's estimated time, dealt heaviest first to the least-loaded process (else
    round-robin)."""
    order = sorted(range(len(specs)), key=lambda i: -costs[i]) if costs else range(len(specs))
    shares, loads = [[] for _ in range(processes)], [0.0] * processes
    for n, i in enumerate(order):
        p = loads.index(min(loads)) if costs else n % processes
        shares[p].append(i)
        loads[p] += costs[i] if costs else 1
    shares = [share for share in shares if share]
    argvs = [[json.dumps([specs[i] for i in share])] for share in shares]
    # forks of pre-imported processes where they run as fresh ones would: the same runs, less the imports
    runs = forked_ranks.run_python(code, argvs, {**env, "OMP_NUM_THREADS": "1"}, REPO, timeout)
    results = [None] * len(specs)
    for run, share in zip(runs, shares, strict=True):
        assert run.returncode == 0, run.stderr[-4000:]
        for i, result in zip(share, json.loads(run.stdout.strip().splitlines()[-1]), strict=True):
            results[i] = result
    return results


def _attention_cost(args: list[str], world: int) -> float:
    """A rank's attention work, the emulation's dominant cost: ``S^2 / world``."""
    seq = int(args[args.index("--training.seq_len") + 1]) if "--training.seq_len" in args else 512
    return seq * seq / world


def emulated_peaks(cases: list[tuple[list[str], int]]) -> list[dict]:
    """The rank emulator's ``total``, ``baseline`` and ``phases`` bytes of each ``(args, world)`` job (one
    rank on torch's fake process group, CPU), measured in subprocesses (a fake measurement starts its
    own default process group), two at once (``run_split``, the longest sequences first)."""
    return run_split(EMULATE, [{"args": args, "world": world} for args, world in cases],
                     {**os.environ, "TITAN_UPIPE_DEVICE": "cpu"}, timeout=600,
                     costs=[_attention_cost(args, world) for args, world in cases])
