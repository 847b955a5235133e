"""The job the planner's tests share: the paper's Llama3-8B recipe (``titan_upipe.plan``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def emulated_peaks(cases: list[tuple[list[str], int]]) -> list[dict]:
    """The rank emulator's ``total``, ``baseline`` and ``phases`` bytes of each ``(args, world)`` job (one
    rank on torch's fake process group, CPU), measured in one subprocess (a fake measurement starts its
    own default process group)."""
    specs = [{"args": args, "world": world} for args, world in cases]
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", EMULATE, json.dumps(specs)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
