"""The job the planner's tests share: the paper's Llama3-8B recipe (``titan_upipe.plan``)."""

from __future__ import annotations

from pathlib import Path

from titan_upipe import plan as P

REPO = Path(__file__).resolve().parents[1]
GIB = P.GIB
LLAMA = P.KNOWN_MODELS["llama3_8b"]


def gpu_job(seq: str = "1M", **kw) -> P.PlanInput:
    """The paper's recipe: Llama3-8B, 8 ranks, UPipe U = C, bf16 FSDP, offloaded full AC, transforms."""
    return P.PlanInput(LLAMA, seq_len=P.parse_length(seq), cp=8, **{"ulysses": 8, **kw})
