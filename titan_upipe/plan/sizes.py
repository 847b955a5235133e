"""The per-rank sizes every term is written in (docs/planner.md's symbols in brackets)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.plan.job import PlanInput
from titan_upipe.spec.model_dims import ModelDims


@dataclass(frozen=True)
class StepSizes:
    """Per-rank sizes of one training step of ``job``.

    ``tokens`` ``T = B S / C``; ``hidden`` ``u = T d a`` bytes (one hidden state ``[B, S/C, d]``);
    ``head`` ``u_h = T D a`` bytes (one head over this rank's tokens ``[B, S/C, D]``).
    """

    job: PlanInput
    act_bytes: int
    """[a] bytes of an activation element: FSDP's param dtype, fp32 without FSDP."""
    weight_bytes: int
    """[p] bytes of an unsharded (all-gathered) parameter element."""
    reduce_bytes: int
    """[r] bytes of a reduce-scatter input element (fp32 without FSDP)."""
    tokens: int
    """[T] tokens of this rank."""
    hidden: int
    """[u] bytes of one hidden state."""
    head: int
    """[u_h] bytes of one head."""
    fsdp: int
    """[W] FSDP degree (the world size)."""
    cuda: bool
    """CUDA kernels' workspaces and the offload prefetch stream (False: CPU composite ops)."""

    @classmethod
    def of(cls, job: PlanInput) -> StepSizes:
        m, a, tokens = job.model, job.compute_bytes, job.tokens
        return cls(job=job, act_bytes=a, weight_bytes=job.unsharded_bytes,
                   reduce_bytes=job.reduce_bytes if job.fsdp > 1 else 4, tokens=tokens,
                   hidden=tokens * m.dim * a, head=tokens * m.head_dim * a, fsdp=job.fsdp,
                   cuda=job.device == "cuda")

    @property
    def model(self) -> ModelDims:
        return self.job.model

    @property
    def fsdp_block_params(self) -> int:
        """Parameters of one block that FSDP all-gathers and reduce-scatters: all of them, or with
        TSP only the norms (the TSP-sharded weights are ignored by FSDP: ``torchtitan_0_2.parallelize.apply_fsdp``)."""
        m = self.model
        if self.job.tsp:
            return 2 * m.dim + (2 * m.head_dim if m.qk_norm else 0)
        return m.block_params
