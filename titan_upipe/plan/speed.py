"""Predicted step time and tokens/s per GPU of a plan, with and without kept attention.

One rank's step, its ``L`` blocks alike (Llama3-8B at 1M tokens on 8 GPUs: the attention is ~95 %):

    step  = L x block + head + communication
    block = attention + GEMMs
    attention = r x F / fwd rate + 2.5 F / bwd rate          F = 2 B H D S^2 / C (causal, this rank's share)
    GEMMs     = (2 + 2 + r') x 2 T P_lin / matmul rate        (forward, backward twice, recomputation)
    head      = 3 x 2 T d V / matmul rate                     (output projection and its backward)
    comm      = all-to-all wire bytes / a2a GB/s + ring / TSP bytes / p2p GB/s

``r`` is how often a block runs its attention kernel's forward: 2 under full activation
checkpointing, 1 for a block that keeps its attention (``attention.keep``); ``r'`` the GEMMs its
recomputation runs (UPipe's kept recomputation runs no projection, only ``wo``; the other modes
recompute Q/K/V for their backward). A kept block's recomputation also skips the communication
that only fed its kernel (UPipe: the stage loop's all-to-alls; ring: its passes; TSP: the K/V
all-gathers).

The attention rates are the measured kernel table's (``costs.kernel_speed.attention_rate``:
the backend's forward and backward TFLOP/s on the newest measured GPU architecture at this head_dim
and dtype, or its place in ``auto``'s order). The GEMMs run at ``MATMUL_TFLOPS``, an assumption
(not measured yet: the GPU suite times attention kernels, not GEMMs), stated in every report. The
optimizer (memory-bound, ~0.1 s at 8B parameters over 8 GPUs) and elementwise work are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_upipe.costs.attention_comm import attention_comm_bytes
from titan_upipe.costs.kernel_speed import KernelRate, attention_rate, causal_flops
from titan_upipe.costs.tsp_comm import layer_comm_bytes
from titan_upipe.costs.tsp_comm import step_bytes as tsp_step_bytes
from titan_upipe.plan.job import UPIPE_MODES, PlanInput
from titan_upipe.spec.head_schedule import build_schedule
from titan_upipe.spec.tsp_shards import TSPShardSizes

MATMUL_TFLOPS = 600.0
"""Assumed bf16 dense GEMM rate of one Hopper GPU (cuBLAS on the blocks' large GEMMs reaches about
600-750 of the H100's 989 TFLOP/s peak); an assumption until the GPU suite measures GEMMs."""
A2A_GBPS = 150.0
"""All-to-all (and ring) bandwidth per GPU and direction of one NVLink node, as the rank emulator
models it (``emulate.DEFAULT_A2A_GBPS``)."""
GB = 1e9


@dataclass(frozen=True)
class StepTime:
    """One rank's predicted step (seconds) and what it adds up from."""

    attention_s: float
    gemm_s: float
    head_s: float
    comm_s: float
    tokens_per_rank: int
    rate: KernelRate

    @property
    def step_s(self) -> float:
        return self.attention_s + self.gemm_s + self.head_s + self.comm_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_rank / self.step_s


def _block_attention_flops(job: PlanInput) -> tuple[float, float]:
    """(fwd, bwd) FLOPs of one block's causal attention on one rank: its share of the whole."""
    m = job.model
    fwd, bwd = causal_flops([job.seq_len], m.n_heads, m.head_dim)
    share = job.batch / job.cp
    return fwd * share, bwd * share


def _linear_params(job: PlanInput) -> tuple[int, int]:
    """(the block's linear weights, of them Q/K/V's): what its GEMMs multiply each token by."""
    m = job.model
    qkv = m.dim * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    return qkv + m.n_heads * m.head_dim * m.dim + 3 * m.dim * m.ffn_dim, qkv


def _comm_bytes(job: PlanInput, kept: int) -> tuple[float, float]:
    """(all-to-all wire bytes, ring/TSP bytes) one rank sends or receives in one step; ``kept``
    blocks' recomputations skip what only fed their kernel (module docstring)."""
    m, n = job.model, job.model.n_layers
    recompute = 1.0 if job.ac_mode == "full" else 0.0
    if job.tsp:
        shards = TSPShardSizes(m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, job.cp)
        volumes = layer_comm_bytes(shards, m.dim, job.batch, job.seq_len, job.compute_bytes)
        return 0.0, tsp_step_bytes(volumes, n, recompute, kept)
    if job.degrees.mode is None:
        return 0.0, 0.0
    upipe = job.resolved_mode in UPIPE_MODES
    schedule = build_schedule(m.n_heads, m.n_kv_heads, job.ulysses_degree, job.u if upipe else m.n_heads)
    call = attention_comm_bytes(schedule, "upipe" if upipe else "ulysses", job.ring, job.batch, job.local_len,
                                m.head_dim, job.compute_bytes)
    step = call.per_step(n, recompute, kept, upipe)
    return step["a2a_wire_bytes"], step["p2p_bytes"]


def predict_step(job: PlanInput, arch: str | None = None, matmul_tflops: float = MATMUL_TFLOPS,
                 a2a_gbps: float = A2A_GBPS) -> StepTime:
    """The step of ``job`` as planned (its kept blocks, ``job.keep``), on ``arch`` (None: the newest
    measured GPU architecture of the kernel table)."""
    m, n, kept = job.model, job.model.n_layers, job.keep.blocks if job.offloaded else 0
    rate = attention_rate(job.attention_backend, arch, m.head_dim, "bf16" if job.compute_bytes == 2 else "fp32")
    fwd, bwd = _block_attention_flops(job)
    recompute = 1 if job.ac_mode == "full" else 0
    attention = (n - kept) * rate.seconds(fwd, bwd, forwards=1 + recompute) + kept * rate.seconds(fwd, bwd)
    linear, qkv = _linear_params(job)
    per_pass = 2.0 * job.tokens * linear  # one forward of one block's GEMMs
    gemms = n * 3 * per_pass + recompute * n * per_pass
    if job.resolved_mode in UPIPE_MODES:  # its backward recomputes Q/K/V itself; a kept recomputation runs none
        gemms += n * 2.0 * job.tokens * qkv - kept * 2.0 * job.tokens * qkv
    head = 3 * 2.0 * job.tokens * m.dim * m.vocab
    a2a, p2p = _comm_bytes(job, kept)
    return StepTime(attention_s=attention, gemm_s=gemms / (matmul_tflops * 1e12),
                    head_s=head / (matmul_tflops * 1e12), comm_s=(a2a + p2p) / (a2a_gbps * GB),
                    tokens_per_rank=job.tokens, rate=rate)


def predicted_speeds(job: PlanInput, arch: str | None = None) -> dict[str, StepTime]:
    """``{"full recompute": ..., "as planned": ...}``: the step without any kept attention and with
    the job's kept blocks (the same when it keeps none)."""
    without = replace(job, keep_device_blocks=0, keep_host_blocks=0)
    return {"full recompute": predict_step(without, arch), "as planned": predict_step(job, arch)}
