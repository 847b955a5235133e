"""Memory planner: predicted per-rank peak memory of a training step, the longest context that
fits, and the UPipe head chunk ``U`` to use.

``python -m titan_upipe.plan --job.config_file X.toml [--world-size N] [--section.key value ...]``
``python -m titan_upipe.plan --model llama3_8b --seq-len 5M --cp 8 --ulysses 8 --gpu-mem 80 --host-mem 1900``
(add ``--json`` for one JSON object, ``--plot out.png`` for peak vs sequence length).

The model is a walk through one training step of *this* implementation (TorchTitan 0.2.2 +
FSDP2 + the plugin's attention and transforms), rank by rank and moment by moment: at each
moment the bytes of every live tensor are a named term, and the peak is the largest total.
Terms come from reading the code and were checked against the tracked live bytes of real
steps on CPU (``titan_upipe.emulate``; ``tests/test_plan.py``, ``docs/planner.md``):

* state: fp32 sharded parameters, AdamW's two fp32 moments (steady state: a step after the
  first), fp32 sharded gradients of the groups already reduced;
* FSDP2: the unsharded block in the compute dtype, its all-gather buffer (forward: FSDP keeps
  it until the next all-gather; backward: the next block's prefetch), the previous group's
  fp32 reduce-scatter input (held until this group's reduce-scatter), the norm+output group
  kept unsharded from forward to backward (TorchTitan: no reshard after forward);
* activations: what each block keeps between forward and backward (no AC: autograd's saved
  tensors; full AC: its input; offloaded AC: nothing on the device), the transients of the
  block being run (attention per mode, MLP plain or tiled, RMSNorm plain or tiled), RoPE
  tables, the loss (stock, chunked torch or Liger fused linear cross-entropy);
* UPipe's attention terms are ``titan_upipe.attention.memory_model`` (validated per stage
  against measurement in ``tests/test_attention_memory.py``: a stage's backward kernel and the
  final dX GEMM), plus the weight-gradient fp32 accumulators and, on GPU, the flash kernel's
  fp32 dQ accumulator.

Everything is bytes per rank. ``peak_gpu_bytes`` is comparable to
``torch.cuda.max_memory_allocated`` (what the paper's Table 4 reports). The runtime reserve
(CUDA context, NCCL buffers, allocator slack) is a separate, named line used only when
deciding whether a plan fits.

Pure arithmetic: importing this module loads no torch code of its own (the package
``titan_upipe`` does); TorchTitan is imported only to read a flavor or a TOML config.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from titan_upipe.attention.memory_model import (
    LayerShape,
    paper_table2_peak,
    paper_table6_peak,
    upipe_backward_terms,
    upipe_forward_terms,
    upipe_input_grad_terms,
    upipe_kv_projection_columns,
)
from titan_upipe.attention.schedule import build_schedule
from titan_upipe.attention.validation import valid_heads_per_stage

GIB = 2**30
K = 1024
MODES = ("none", "ulysses", "upipe", "ring", "usp", "upipe-in-usp")

PLAN_AUTO_BACKEND = "flash_attn4"
"""What ``attention_backend = "auto"`` resolves to on the GPUs the recipes target (Hopper with
the ``[gpu]`` extra, which installs flash-attn-4); the planner predicts another machine, so it
cannot probe what is installed there."""
RUNTIME_RESERVE_GIB_CUDA = 2.0
"""Device memory a CUDA rank uses outside PyTorch's allocated tensors, kept free when deciding
whether a plan fits (never added to ``peak_gpu_bytes``): the CUDA context and kernel images
(~0.5 GiB on H100 with torch), NCCL communicator buffers for the FSDP and CP groups
(~0.5-1 GiB), and caching-allocator slack with ``expandable_segments`` (~0.5 GiB).
Override with ``--reserve-gib``."""

PAPER_TABLES_CSV = Path(__file__).resolve().parents[1] / "docs" / "data" / "paper_tables.csv"
"""The paper's Tables 3-5 (Table 4: peak GiB per method and length) as data inside the repository
(``docs/data/README.md`` names the source)."""


# --------------------------------------------------------------------------- model and job


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that decide memory (TorchTitan flavor args)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False
    rope: str = "llama3"
    """``llama3``: complex64 ``[S, D/2]`` table; ``qwen3``: fp32 ``cos‖sin`` ``[S, 2D]``."""

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.dim * (2 * self.q_width + 2 * self.kv_width) + qk_norm

    @property
    def block_params(self) -> int:
        return self.attention_params + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def block_tensors(self) -> int:
        return 9 + (2 if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim

    @property
    def output_params(self) -> int:
        """The output projection plus the final norm (one FSDP group in TorchTitan)."""
        return (0 if self.tied else self.vocab * self.dim) + self.dim

    @property
    def total_params(self) -> int:
        return self.n_layers * self.block_params + self.embedding_params + self.output_params

    @property
    def param_tensors(self) -> int:
        return self.n_layers * self.block_tensors + (2 if self.tied else 3)


def _llama3_ffn(dim: int, multiple_of: int, multiplier: float | None) -> int:
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


KNOWN_MODELS = {
    # TorchTitan flavors upipe_llama3/8B and upipe_qwen3/32B (checked against them in tests/test_plan.py).
    "llama3_8b": ModelDims("llama3_8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn_dim=_llama3_ffn(4096, 1024, 1.3), vocab=128256, rope="llama3"),
    "qwen3_32b": ModelDims("qwen3_32b", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                           ffn_dim=25600, vocab=151936, qk_norm=True, rope="qwen3"),
}
MODEL_FLAVORS = {"llama3_8b": ("upipe_llama3", "8B"), "qwen3_32b": ("upipe_qwen3", "32B")}


def model_dims_from_args(name: str, args) -> ModelDims:
    """ModelDims of a TorchTitan Llama3 ``TransformerModelArgs`` or Qwen3 ``Qwen3ModelArgs``."""
    n_kv = args.n_kv_heads or args.n_heads
    if hasattr(args, "hidden_dim"):  # Qwen3
        return ModelDims(name, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=n_kv,
                         head_dim=args.head_dim, ffn_dim=args.hidden_dim, vocab=args.vocab_size,
                         tied=bool(getattr(args, "enable_weight_tying", False)), qk_norm=bool(args.qk_norm),
                         rope="qwen3")
    return ModelDims(name, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=n_kv,
                     head_dim=args.dim // args.n_heads,
                     ffn_dim=_llama3_ffn(args.dim, args.multiple_of, args.ffn_dim_multiplier),
                     vocab=args.vocab_size, rope="llama3")


def model_dims(spec: str) -> ModelDims:
    """``llama3_8b``, ``qwen3_32b`` or ``<model.name>:<flavor>`` (a registered train spec)."""
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(KNOWN_MODELS)} or <model.name>:<flavor>")
    name, flavor = spec.split(":", 1)
    from torchtitan.protocols.train_spec import get_train_spec

    flavors = get_train_spec(name).model_args
    if flavor not in flavors:
        raise ValueError(f"{flavor!r} is not a flavor of {name}: valid values are {', '.join(flavors)}")
    return model_dims_from_args(spec, flavors[flavor])


@dataclass(frozen=True)
class PlanInput:
    """One training job as the planner sees it (per-rank quantities are derived)."""

    model: ModelDims
    seq_len: int
    batch: int = 1
    """``training.local_batch_size``: sequences per data-parallel rank (all CP ranks share them)."""
    cp: int = 1
    ulysses: int = 0
    """Ulysses degree inside CP (0: all of CP for ulysses/upipe, 1 for ring); ring = cp / ulysses."""
    mode: str = "upipe"
    heads_per_stage: int | None = None
    """UPipe's U (None or 0: U = the Ulysses degree)."""
    world_size: int = 0
    """0: ``cp`` (FSDP over the CP ranks, no extra data parallelism)."""
    param_bytes: int = 2
    """``training.mixed_precision_param``: bytes of the unsharded (compute) parameters."""
    reduce_bytes: int = 4
    """``training.mixed_precision_reduce``."""
    tiled_mlp: bool = True
    tiled_rmsnorm: bool = True
    fused_rope: bool = True
    fused_ce: bool = True
    mlp_tile_tokens: int = 0
    rmsnorm_tile_tokens: int = 0
    ce_chunk_tokens: int = 0
    ce_backend: str = "liger"
    """``liger`` (CUDA, the GPU recipes' ``auto``) or ``torch`` (chunked torch path)."""
    attention_backend: str = "flash_attn3"
    """``[upipe] attention_backend``: sdpa, math, flash_attn, flash_attn3 (the paper's FA3), flash_attn4."""
    ac_mode: str = "full"
    cpu_offload: bool = True
    pin_memory: bool | None = None
    """None: pinned when the pinned host buffers fit ``host_mem``, else pageable (the paper's 5M run)."""
    device: str = "cuda"
    """``cuda``: flash kernels' workspaces, offload prefetch stream; ``cpu``: composite ops (gloo runs)."""
    gpus_per_node: int = 8
    reserve_bytes: int | None = None
    """Kept free when checking a fit; None: RUNTIME_RESERVE_GIB_CUDA on cuda, 0 on cpu."""

    # ---- derived
    @property
    def resolved_mode(self) -> str:
        if self.mode == "upipe" and self.ring > 1:
            return "upipe-in-usp"
        if self.mode == "usp" and self.ring == 1:
            return "ulysses"
        return self.mode

    @property
    def ulysses_degree(self) -> int:
        if self.mode == "none" or self.cp == 1:
            return 1
        if self.mode == "ring":
            return 1
        return self.ulysses or self.cp

    @property
    def ring(self) -> int:
        if self.mode == "none":
            return 1
        return max(self.cp // max(self.ulysses_degree, 1), 1)

    @property
    def u(self) -> int:
        """UPipe's U (meaningful for upipe modes)."""
        return self.heads_per_stage or self.ulysses_degree

    @property
    def ranks(self) -> int:
        return self.world_size or self.cp

    @property
    def fsdp(self) -> int:
        return self.ranks

    @property
    def compute_bytes(self) -> int:
        """Activation dtype: the FSDP param dtype; fp32 without FSDP (no mixed precision)."""
        return self.param_bytes if self.fsdp > 1 else 4

    @property
    def unsharded_bytes(self) -> int:
        return self.param_bytes if self.fsdp > 1 else 4

    @property
    def local_len(self) -> int:
        return self.seq_len // max(self.cp, 1)

    @property
    def tokens(self) -> int:
        """Tokens of this rank: batch x S / CP."""
        return self.batch * self.local_len

    @property
    def seq_unit(self) -> int:
        """seq_len must be a multiple of this (CP, or 2 x ring x ulysses with a ring)."""
        return self.cp if self.ring == 1 else 2 * self.ring * self.ulysses_degree

    @property
    def reserve(self) -> int:
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        return int(RUNTIME_RESERVE_GIB_CUDA * GIB) if self.device == "cuda" else 0

    @property
    def offloaded(self) -> bool:
        return self.ac_mode == "full" and self.cpu_offload

    def check(self) -> None:
        m = self.model
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: valid modes are {', '.join(MODES)}")
        if self.seq_len < 1 or self.cp < 1 or self.batch < 1:
            raise ValueError("seq_len, cp and batch must be positive")
        if self.cp % self.ulysses_degree:
            raise ValueError(f"ulysses degree {self.ulysses_degree} does not divide cp {self.cp}")
        if self.mode in ("upipe", "upipe-in-usp") and self.u not in valid_heads_per_stage(m.n_heads, self.ulysses_degree):
            raise ValueError(f"U = {self.u} is not valid for {m.n_heads} heads at Ulysses degree "
                             f"{self.ulysses_degree}: valid values are "
                             f"{valid_heads_per_stage(m.n_heads, self.ulysses_degree)}")
        if m.n_heads % self.ulysses_degree:
            raise ValueError(f"Ulysses degree {self.ulysses_degree} does not divide {m.n_heads} heads")
        if self.seq_len % self.seq_unit:
            raise ValueError(f"seq_len {self.seq_len} is not a multiple of {self.seq_unit}")
        if self.ranks % self.cp:
            raise ValueError(f"world size {self.ranks} is not a multiple of cp {self.cp}")


# --------------------------------------------------------------------------- the plan


@dataclass
class Moment:
    """Live bytes at one point of the step, by named term."""

    phase: str
    """forward | loss | backward | optimizer"""
    where: str
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class MemoryPlan:
    job: PlanInput
    moments: list[Moment]
    host_bytes_per_rank: int
    """Offloaded block inputs in host memory (pinned: rounded up as PyTorch's pinned allocator does)."""
    host_pinned: bool
    host_bytes_pageable_per_rank: int
    host_bytes_pinned_per_rank: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda m: m.total)

    @property
    def peak_gpu_bytes(self) -> int:
        return self.peak.total

    @property
    def peak_phase(self) -> str:
        return self.peak.phase

    @property
    def breakdown(self) -> dict[str, int]:
        """The peak moment's terms (they sum to ``peak_gpu_bytes``)."""
        return dict(self.peak.terms)

    @property
    def phase_peaks(self) -> dict[str, int]:
        peaks: dict[str, int] = {}
        for m in self.moments:
            peaks[m.phase] = max(peaks.get(m.phase, 0), m.total)
        return peaks

    @property
    def host_bytes(self) -> int:
        """Host bytes of one node (``gpus_per_node`` ranks, or fewer when the job is smaller)."""
        return self.host_bytes_per_rank * min(self.job.ranks, self.job.gpus_per_node)

    def fits(self, gpu_mem_bytes: float, host_mem_bytes: float | None = None) -> bool:
        if self.peak_gpu_bytes + self.job.reserve > gpu_mem_bytes:
            return False
        return host_mem_bytes is None or self.host_bytes <= host_mem_bytes


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


class _Step:
    """Builds the moments of one step for a job."""

    def __init__(self, job: PlanInput) -> None:
        job.check()
        self.job = job
        m = job.model
        self.m = m
        self.a = job.compute_bytes
        self.p = job.unsharded_bytes
        self.r = job.reduce_bytes if job.fsdp > 1 else 4
        self.T = job.tokens
        self.u = self.T * m.dim * self.a
        self.uh = self.T * m.head_dim * self.a
        self.W = job.fsdp
        self.cuda = job.device == "cuda"
        self.moments: list[Moment] = []
        self.notes: list[str] = []

    # ---------------------------------------------------------------- building blocks
    def state(self, grads: int) -> dict[str, int]:
        m, w = self.m, self.W
        terms = {
            "parameters (fp32, FSDP shard)": math.ceil(m.total_params / w) * 4,
            "AdamW exp_avg + exp_avg_sq (fp32 shards)": 2 * math.ceil(m.total_params / w) * 4 + 4 * m.param_tensors,
            "gradients (fp32 shards reduced so far)": grads,
            # global batch and this rank's shard of inputs and labels, positions (int64)
            "token ids, labels, positions (int64)": 2 * 8 * self.job.batch * (self.job.seq_len + self.job.local_len)
            + 3 * 8 * self.job.local_len,
        }
        terms.update(self.rope_terms())
        return terms

    def rope_terms(self) -> dict[str, int]:
        m, job = self.m, self.job
        per_row = 4 * m.head_dim if m.rope == "llama3" else 8 * m.head_dim
        if job.fused_rope:
            # inverse frequencies + the rows of this rank's positions, built each forward and
            # kept (in the blocks' arguments) until backward
            return {"RoPE rows of this rank's positions (fused_rope)": job.local_len * per_row + 2 * m.head_dim}
        # TorchTitan's model buffer: one row per position of the whole sequence, on every rank
        return {"RoPE table, full length (no fused_rope)": job.seq_len * per_row}

    def grad_shards(self, groups_params: int) -> int:
        return math.ceil(groups_params / self.W) * 4

    def fsdp_block(self, phase: str, block: int) -> dict[str, int]:
        if self.W == 1:
            return {}
        m, p = self.m, self.p
        terms = {"FSDP: unsharded block parameters": m.block_params * p}
        if phase == "forward":
            terms["FSDP: all-gather buffer of this block (kept until the next all-gather)"] = m.block_params * p
        else:
            prev = m.block_params if block > 0 else m.embedding_params
            terms["FSDP: all-gather buffer of the next block (backward prefetch)"] = prev * p
            held = m.block_params if block < m.n_layers - 1 else m.output_params
            terms["FSDP: reduce-scatter input of the previous group (fp32, held)"] = held * self.r
        return terms

    def norm_out(self, kind: str) -> dict[str, int]:
        """What a d-wide RMSNorm leaves alive after forward with grad (its output and saved stats)."""
        if self.job.tiled_rmsnorm:
            return {f"{kind} output": self.u}
        extra = self.T * 4
        if not self.cuda:  # composite rms_norm on CPU: saves x * rstd (fp32 math)
            extra += self.T * self.m.dim * 4
        return {f"{kind} output": self.u, f"{kind} saved statistics": extra}

    def mlp_saved(self) -> dict[str, int]:
        if self.job.tiled_mlp:
            return {}
        return {"MLP saved: w1 x, silu, w3 x, product (4 x d_ff)": 4 * self.T * self.m.ffn_dim * self.a}

    def mlp_tile(self) -> int:
        return min(self.job.mlp_tile_tokens or self.m.dim, self.T)

    # ---------------------------------------------------------------- attention
    def layer_shape(self) -> LayerShape:
        job, m = self.job, self.m
        cu = job.ulysses_degree
        return LayerShape(m.n_heads, m.n_kv_heads, m.head_dim, cp_degree=cu, seq_len=job.local_len * cu,
                          batch=job.batch, dim=m.dim, elem_bytes=self.a)

    def kv_units(self) -> int:
        """K (or V) per rank after the all-to-all, in heads over this rank's tokens: each rank
        holds max(1, KV/C) heads of the ring-local sequence (replicated when C > KV)."""
        cu = self.job.ulysses_degree
        return max(self.m.n_kv_heads, cu) if cu > 1 else self.m.n_kv_heads

    def upipe_width_fix(self, n_buffers: int) -> dict[str, int]:
        """memory_model sizes the stage buffers for U query heads; the code sizes them for
        max(U/C, KV heads per rank) x C heads (``StageBuffers.allocate``)."""
        job = self.job
        sched = build_schedule(self.m.n_heads, self.m.n_kv_heads, job.ulysses_degree, job.u)
        extra = max(sched.max_kv_heads_per_rank - sched.query_heads_per_rank, 0) * job.ulysses_degree
        if not extra:
            return {}
        return {"UPipe all-to-all buffers widened to the K/V heads per rank": n_buffers * extra * self.uh}

    def ring_terms(self, q_units: int, kv_units: int, backward: bool) -> dict[str, int]:
        """Zigzag ring attention (``ring.py``) inside one kernel call of q_units query heads and
        kv_units K/V heads (in heads over this rank's tokens), at its largest moment: step 0,
        whose local call covers the whole ring-local sequence. The caller's kernel outputs
        (out, or dQ/dK/dV) do not exist yet then: the ring returns them at the end."""
        if self.job.ring == 1:
            return {}
        uh, a, q_lse = self.uh, self.a, q_units * self.T * 4
        q32 = q_units * uh * 4 // a
        if not backward:
            return {
                "ring: fp32 output accumulator + LSE": q32 + q_lse,
                "ring: K/V block and its receive buffer": 4 * kv_units * uh,
                "ring: local kernel output + LSE": q_units * uh + q_lse,
                "ring: merge temporaries (fp32)": q32 * (2 if a != 4 else 1) + 2 * q_lse,
            }
        return {
            "ring: fp32 dQ accumulator": q32,
            "ring: K/V block and its receive buffer": 4 * kv_units * uh,
            "ring: fp32 dK/dV blocks (two in flight + receive)": 3 * 2 * kv_units * uh * 4 // a,
            "ring: local kernel dQ, dK, dV": (q_units + 2 * kv_units) * uh,
        }

    def kernel_fwd(self, q_units: int, kv_units: int) -> dict[str, int]:
        """Extra bytes inside the local attention kernel's forward (CUDA; ``backends.py``)."""
        if not self.cuda or not self._sdpa_expands_kv(q_units, kv_units):
            return {}
        return {"attention kernel: K/V expanded to the query heads (sdpa fp32: memory-efficient kernel)":
                2 * q_units * self.uh}

    def _sdpa_expands_kv(self, q_units: int, kv_units: int) -> bool:
        # The sdpa backend's fp32 path runs the memory-efficient kernel, which has no GQA;
        # its fp16/bf16 path runs aten's flash kernel with native GQA.
        return self.job.attention_backend == "sdpa" and self.a == 4 and q_units > kv_units

    def kernel_bwd(self, q_units: int, kv_units: int) -> dict[str, int]:
        """Extra bytes inside the local attention kernel's backward (CUDA; invisible on CPU),
        for q_units query and kv_units K/V heads over this rank's tokens. No backend recomputes
        a forward: each runs its fused backward from the saved out/lse."""
        if not self.cuda or self.job.attention_backend == "math":
            return {}
        backend, uh, a = self.job.attention_backend, self.uh, self.a
        gqa = q_units > kv_units
        terms = {"attention kernel: flash bwd fp32 dQ accumulator": q_units * uh * 4 // a}
        if backend in ("flash_attn3", "flash_attn4") and gqa:
            terms["attention kernel: flash bwd fp32 dK/dV accumulators (GQA)"] = 2 * kv_units * uh * 4 // a
        if backend in ("flash_attn", "sdpa") and gqa:
            terms["attention kernel: FA2 bwd dK/dV expanded to the query heads (GQA)"] = 2 * q_units * uh
        if self._sdpa_expands_kv(q_units, kv_units):
            terms["attention kernel: K/V expanded to the query heads (sdpa fp32: memory-efficient kernel)"] = (
                2 * q_units * uh)
        return terms

    def attention(self) -> dict[str, dict[str, int]]:
        """Attention terms (excluding its input, the norm output) at:
        ``saved`` (kept from a forward with autograd to backward), ``fwd`` (its forward peak with
        autograd), ``fwd_nograd`` (forward without autograd: the first pass under AC),
        ``bwd`` (its backward peak, incl. dO and weight-gradient accumulators)."""
        mode = self.job.resolved_mode
        if mode in ("upipe", "upipe-in-usp"):
            return self._upipe()
        return self._ulysses_like()

    def _upipe(self) -> dict[str, dict[str, int]]:
        job, m = self.job, self.m
        shape = self.layer_shape()
        u = job.u
        sched = build_schedule(m.n_heads, m.n_kv_heads, job.ulysses_degree, u)
        resident_kv = sched.max_kv_heads_per_rank * job.ulysses_degree
        saved = {"UPipe output buffer (H heads)": m.n_heads * shape.head_unit, "UPipe LSE (fp32, all stages)": shape.lse_bytes}
        fwd = {f"UPipe fwd: {k}": v for k, v in upipe_forward_terms(shape, u).items()}
        fwd["UPipe fwd: output buffer (H heads)"] = fwd.pop("UPipe fwd: output buffer (H heads)")
        fwd.update(self.upipe_width_fix(2))
        if job.ring > 1:
            fwd.pop("UPipe fwd: attention output of the stage (U heads)")
            fwd.update(self.ring_terms(u, resident_kv, backward=False))
        bwd = {f"UPipe bwd: {k}": v for k, v in upipe_backward_terms(shape, u).items()
               if k != "layer output held by caller"}
        accumulators = {"UPipe bwd: wq/wk/wv fp32 gradient accumulators": (m.q_width + 2 * m.kv_width) * m.dim * 4}
        bwd.update(accumulators)
        bwd.update(self.upipe_width_fix(4))
        kernel_out = ("UPipe bwd: dQ from the kernel (U heads)", "UPipe bwd: dK+dV from the kernel")
        if job.ring > 1:
            kernel = {k: v for k, v in bwd.items() if k not in kernel_out}
            kernel.update(self.ring_terms(u, resident_kv, backward=True))
        else:
            kernel = dict(bwd)
        kernel.update(self.kernel_bwd(u, resident_kv))
        fwd.update(self.kernel_fwd(u, resident_kv))
        # After a stage's kernel: dQ is sent back and backpropagated through the projection of each
        # destination's heads (recomputed, with RoPE under autograd), its gradient written into the
        # output buffer's slots and the wq rows' gradient accumulated in fp32.
        after = {k: v for k, v in bwd.items() if k not in kernel_out}
        hq = sched.query_heads_per_rank
        rope_rows = 4 * job.local_len * m.head_dim if m.rope == "llama3" else 8 * job.local_len * m.head_dim
        dq = {**after, "UPipe bwd: recomputed projection and its gradient (one destination)": 2 * hq * self.uh}

        def rope_backprop(n_heads: int) -> int:  # RoPE of n_heads recomputed and differentiated
            return n_heads * self.T * m.head_dim * (self.a + 12) + rope_rows

        rope = {**after, "UPipe bwd: RoPE under autograd in projection backprop (one destination)": rope_backprop(hq)}
        # A KV group's flush (after its last stage): dK/dV sent back, K backpropagated through RoPE
        # (and k-norm) one destination run at a time into the group's new projection-gradient buffer.
        group_cols = upipe_kv_projection_columns(shape, u, groups=slice(-1, None))
        flush = {**after, "UPipe bwd: K/V projections' gradients of the group being flushed": self.T * group_cols * self.a,
                 "UPipe bwd: RoPE under autograd in K's projection backprop (one run)":
                 rope_backprop(sched.max_kv_heads_per_rank)}
        # After the stages: dX as one GEMM over every head's projection gradient (ProjectionGrads).
        dx = {f"UPipe bwd: {k}": v for k, v in upipe_input_grad_terms(shape, u, weight_bytes=self.p).items()
              if k != "layer output held by caller"}
        dx.update(accumulators)
        dx.update(self.upipe_width_fix(4))
        return {"saved": saved, "fwd": fwd, "fwd_nograd": fwd,
                "bwd": [("kernel", kernel), ("dQ projection backprop", dq), ("projection RoPE backprop", rope),
                        ("K/V flush", flush), ("dX GEMM", dx)]}

    def _ulysses_like(self) -> dict[str, dict[str, int]]:
        """Ulysses (``ulysses_attention``, plain autograd); ring = Ulysses of degree 1 with the
        ring kernel; USP = Ulysses with the ring kernel."""
        job, m, uh, a = self.job, self.m, self.uh, self.a
        h, kv = m.n_heads, self.kv_units()
        cu = job.ulysses_degree
        rope_rows = 2 * job.local_len * m.head_dim * (4 if m.rope == "llama3" else 8)
        saved = {
            "attention saved: RoPE rows for Q and K": rope_rows,
            "attention saved: Q after all-to-all": h * uh,
            "attention saved: K, V after all-to-all": 2 * kv * uh,
            "attention saved: kernel output": h * uh,
            "attention saved: LSE (fp32)": h * self.T * 4,
            "attention saved: output after all-to-all (wo input)": h * uh,
        }
        ring = job.ring > 1
        pre_kv = kv if cu > m.n_kv_heads else m.n_kv_heads
        # forward with autograd, at the output all-to-all: Q (rotated, still referenced),
        # the K/V copies sent, the output's receive buffer; with a ring, at its step-0 merge
        if ring:
            fwd = {k: v for k, v in saved.items() if "kernel output" not in k and "wo input" not in k}
            if cu > 1:
                fwd["attention fwd: rotated Q, K/V before the all-to-all"] = (h + 2 * pre_kv) * uh
            fwd.update(self.ring_terms(h, kv, backward=False))
        else:
            fwd = dict(saved)
            fwd["attention fwd: rotated Q, K/V copies before the all-to-all"] = (h + 2 * pre_kv) * uh
            fwd["attention fwd: output all-to-all receive buffer"] = h * uh
        # RoPE of Q with autograd (fp32 copy and complex product) is an earlier, separate moment
        rope_fp32 = h * self.T * m.head_dim * (4 if a != 4 else 0) + h * self.T * m.head_dim * 4
        fwd_rope = {"attention fwd: Q projection": h * uh, "attention fwd: RoPE fp32 temporaries of Q": rope_fp32,
                    "attention fwd: rotated Q (cast back)": h * uh if a != 4 else 0}
        if sum(fwd_rope.values()) > sum(fwd.values()):
            fwd = fwd_rope
        # without autograd (first pass under AC): nothing saved, in-place RoPE with fused_rope
        nograd = {"attention fwd (no grad): Q, K, V after all-to-all": (h + 2 * kv) * uh}
        if ring:
            if cu > 1:
                nograd["attention fwd (no grad): rotated Q, K/V before the all-to-all"] = (h + 2 * pre_kv) * uh
            nograd.update(self.ring_terms(h, kv, backward=False))
        else:
            nograd["attention fwd (no grad): kernel output, its all-to-all, wo input"] = 3 * h * uh
            nograd["attention fwd (no grad): LSE"] = h * self.T * 4
        if not job.fused_rope:
            nograd["attention fwd (no grad): RoPE fp32 temporaries of Q"] = rope_fp32
        bwd = {k: v for k, v in saved.items() if "wo input" not in k}
        bwd["attention bwd: dO after all-to-all"] = h * uh
        if ring:
            bwd.update(self.ring_terms(h, kv, backward=True))
        else:
            bwd["attention bwd: dQ, dK, dV from the kernel"] = (h + 2 * kv) * uh
        bwd.update(self.kernel_bwd(h, kv))
        nograd.update(self.kernel_fwd(h, kv))
        if "attention fwd: Q projection" not in fwd:
            fwd.update(self.kernel_fwd(h, kv))
        return {"saved": saved, "fwd": fwd, "fwd_nograd": nograd, "bwd": [("kernel", bwd)]}

    # ---------------------------------------------------------------- block
    def block_retained(self) -> dict[str, int]:
        """Bytes a block leaves on the device from its forward to its backward, its output included."""
        job = self.job
        if job.ac_mode == "full":
            if job.offloaded:
                return {}
            return {"checkpointed block inputs": self.u}
        att = self.attention()
        terms: dict[str, int] = {}
        terms.update(self.norm_out("attention_norm"))
        terms.update(att["saved"])
        terms["h = x + attention (residual)"] = self.u
        terms.update(self.norm_out("ffn_norm"))
        terms.update(self.mlp_saved())
        terms["block output"] = self.u
        return terms

    def block_forward_peak(self, grad: bool, block_output: bool = True) -> tuple[str, dict[str, int]]:
        """(where, terms) of the largest moment inside one block's forward, beyond its input.
        ``block_output=False``: the recomputation of offloaded AC, which stops before the final
        residual add (``offload.OffloadedFeedForwardHalf``)."""
        job, m, u = self.job, self.m, self.u
        att = self.attention()
        cands: list[tuple[str, dict[str, int]]] = []
        if grad:
            n1 = self.norm_out("attention_norm")
            cands.append(("attention", {**n1, **att["fwd"]}))
            before_mlp = {**n1, **att["saved"], "h = x + attention (residual)": u,
                          **self.norm_out("ffn_norm")}
            if job.tiled_mlp:
                mlp = {"MLP output": u, "MLP tile intermediates (3 tiles x d_ff)": 3 * self.mlp_tile() * m.ffn_dim * self.a}
            else:
                mlp = {**self.mlp_saved(), "MLP output (w2)": u}
            cands.append(("MLP", {**before_mlp, **mlp}))
            if block_output:  # the final residual add: the MLP's output and the block output
                cands.append(("residual add after the MLP", {**before_mlp, **self.mlp_saved(), "MLP output": u,
                                                         "block output": u}))
        else:
            cands.append(("attention (no grad)", {"attention_norm output": u, **att["fwd_nograd"]}))
            if job.tiled_mlp:
                mlp = {"MLP output": u, "MLP tile intermediates (3 tiles x d_ff)": 3 * self.mlp_tile() * m.ffn_dim * self.a}
            else:
                mlp = {"MLP intermediates (no grad: 3 x d_ff)": 3 * self.T * m.ffn_dim * self.a, "MLP output (w2)": u}
            cands.append(("MLP (no grad)", {"h = x + attention (residual)": u, "ffn_norm output": u, **mlp}))
            cands.append(("residual add after the MLP (no grad)", {"h = x + attention (residual)": u, "MLP output": u,
                                                                   "block output": u}))
        return max(cands, key=lambda c: sum(c[1].values()))

    def block_backward_moments(self) -> list[tuple[str, dict[str, int], dict[str, int]]]:
        """(where, activation terms, unsharded-gradient terms) inside one block's backward,
        beyond the activations of the blocks before it (``below``) and the state. Includes the
        gradient arriving from the block above."""
        job, m, u, a, p = self.job, self.m, self.u, self.a, self.p
        att = self.attention()
        common: dict[str, int] = {"gradient w.r.t. the block output (incoming)": u}
        if job.ac_mode == "full":
            common["block input (fetched/checkpointed, recomputed from)"] = u
            if job.offloaded and self.cuda:
                common["next block's input prefetched from host"] = u
        n1 = self.norm_out("attention_norm")
        n2 = self.norm_out("ffn_norm")
        h = {"h = x + attention (residual)": u}
        # 1) MLP backward (everything of the block still saved)
        if job.tiled_mlp:
            tile = self.mlp_tile()
            end_cast = (3 * m.dim * m.ffn_dim * a if a != 4 else 0) + 2 * tile * m.ffn_dim * a
            mlp_bwd = {
                "MLP bwd: dX": u,
                "MLP bwd: w1/w2/w3 fp32 gradient accumulators": 3 * m.dim * m.ffn_dim * 4,
                "MLP bwd: tile intermediates / final casts": max(8 * tile * m.ffn_dim * a, end_cast),
            }
            mlp_grads: dict[str, int] = {}
        else:
            # w2's backward gives d(product) [F] and dW2; the product is freed, the mul's
            # backward gives d(silu) and d(w3 x) [2F] while w1 x, silu, w3 x are still saved
            mlp_bwd = {"MLP saved: w1 x, silu, w3 x (product freed)": 3 * self.T * m.ffn_dim * a,
                       "MLP bwd: d(product), d(silu), d(w3 x)": 3 * self.T * m.ffn_dim * a}
            mlp_grads = {"unsharded grads: w2": m.dim * m.ffn_dim * p}
        moments = [("MLP backward", {**common, **n1, **att["saved"], **h, **n2, **mlp_bwd}, mlp_grads)]
        if job.ac_mode == "full":  # the recomputation (forward with autograd) before it
            where, inner = self.block_forward_peak(grad=True, block_output=not job.offloaded)
            moments.insert(0, (f"recompute forward ({where})", {**common, **inner}, {}))
        # 2) ffn_norm backward (the MLP's saved tensors are gone, its dX is the norm's incoming grad)
        if job.tiled_rmsnorm:
            tile = min(job.rmsnorm_tile_tokens or m.dim, self.T)
            norm_bwd = {"ffn_norm bwd: dX": u, "ffn_norm bwd: RMSNorm tile temporaries (fp32)": 7 * tile * m.dim * 4}
        elif self.cuda:
            norm_bwd = {"ffn_norm bwd: dX": u}
        else:  # composite rms_norm backward on CPU (fp32 temporaries), measured: 4 hidden states
            norm_bwd = {"ffn_norm bwd: dX and fp32 temporaries": 4 * self.T * m.dim * 4}
        mlp_done = {"unsharded grads: w1, w2, w3": 3 * m.dim * m.ffn_dim * p}
        moments.append(("ffn_norm backward", {**common, **n1, **att["saved"], **h,
                                              "MLP bwd: dX (the norm's incoming gradient)": u, **norm_bwd}, mlp_done))
        # 3) attention backward (MLP and ffn_norm done; grad of h held for the residual)
        grads = {"unsharded grads: w1, w2, w3": 3 * m.dim * m.ffn_dim * p,
                 "unsharded grads: wo, ffn_norm": m.dim * m.q_width * p + m.dim * p}
        # The block output's gradient is gone by now: the engine frees it once the feed-forward
        # half's backward returned dh (offloaded AC splits TorchTitan's blocks at h; without AC or
        # with TorchTitan's checkpoint it is summed into dh and dropped the same way).
        attention_common = {k: v for k, v in common.items() if k != "gradient w.r.t. the block output (incoming)"}
        for where, terms in att["bwd"]:
            att_terms = {**attention_common, **n1, "gradient w.r.t. h (held for the residual)": u, **terms}
            moments.append((f"attention backward ({where})", att_terms, grads))
        return moments

    # ---------------------------------------------------------------- loss
    def loss_moments(self) -> tuple[dict[str, int], dict[str, int]]:
        """(forward-loss terms, backward-loss terms), each with the final norm."""
        job, m, a, T = self.job, self.m, self.a, self.T
        V, d = m.vocab, m.dim
        norm = {"final norm output": self.u, "last block output (final norm input)": self.u}
        if job.fused_ce and job.ce_backend == "liger":
            chunk = _pow2_ceil(math.ceil(T / math.ceil(V / d)))
            fwd = {**norm, "Liger CE: grad_input computed in forward": self.u,
                   "Liger CE: grad_weight (unsharded, compute dtype)": V * d * a,
                   "Liger CE: logits chunk": chunk * V * a, "Liger CE: per-token loss (fp32)": T * 4}
            bwd = {**norm, "Liger CE: grad_input": self.u, "unsharded grad: output weight": V * d * a}
            return fwd, bwd
        if job.fused_ce:
            chunk = job.ce_chunk_tokens or max(1, min(T, math.ceil(T * d / V)))
            fwd = {**norm, "fused CE: per-token LSE (fp32)": T * 4,
                   "fused CE: logits chunk and its fp32 copy": chunk * V * (a + 4 if a != 4 else 4)}
            bwd = {**norm, "fused CE: per-token LSE (fp32)": T * 4, "fused CE bwd: dH": self.u,
                   "fused CE bwd: dW fp32 accumulator": V * d * 4,
                   "fused CE bwd: chunk logits fp32 + cast": chunk * V * (4 + a),
                   "fused CE bwd: dW product (compute dtype)": V * d * a if a != 4 else 0}
            return fwd, bwd
        logits = T * V * a
        fwd = {**norm, "logits": logits, "logits fp32 copy": T * V * 4 if a != 4 else 0, "log_softmax (fp32)": T * V * 4}
        bwd = {**norm, "log_softmax (fp32, saved)": T * V * 4, "CE bwd: dlogits fp32 (2 buffers)": 2 * T * V * 4}
        return fwd, bwd

    # ---------------------------------------------------------------- the step
    def below(self, blocks: int) -> dict[str, int]:
        """Activations on the device kept by ``blocks`` blocks whose backward has not run yet
        (their inputs included: the embedding output is block 0's input)."""
        job = self.job
        if job.offloaded or blocks == 0:
            return {}
        if job.ac_mode == "full":
            return {f"checkpointed inputs of {blocks} block(s)": blocks * self.u}
        per_block = sum(self.block_retained().values())
        return {"embedding output (block 0 input)": self.u,
                f"activations kept by {blocks} block(s) ({_fmt(per_block)} each)": blocks * per_block}

    def build(self) -> MemoryPlan:
        job, m, u = self.job, self.m, self.u
        n = m.n_layers
        output_group = ({"FSDP: norm + output unsharded (kept from forward to backward)": m.output_params * self.p}
                        if self.W > 1 else {})

        # forward: embedding
        terms = self.state(0)
        if self.W > 1:
            terms["FSDP: embedding unsharded + all-gather buffer"] = 2 * m.embedding_params * self.p
        terms["embedding output"] = u
        self.moments.append(Moment("forward", "embedding", terms))

        # forward: blocks (the last one has the most below it)
        grad = job.ac_mode != "full"
        where, inner = self.block_forward_peak(grad)
        if job.ac_mode == "full" and not job.offloaded:
            # TorchTitan's (non-reentrant) checkpoint runs the first forward with autograd on and
            # drops what would be saved: the grad-mode temporaries (RoPE) appear, saves do not
            att = self.attention()
            grad_mode = {**self.norm_out("attention_norm"), **att["fwd"]}
            if sum(grad_mode.values()) > sum(inner.values()):
                where, inner = "attention (autograd, saves dropped)", grad_mode
        for i in sorted({0, n - 1}):
            terms = {**self.state(0), **self.fsdp_block("forward", i)}
            if job.ac_mode == "none":
                terms.update(self.below(i) or {"embedding output (block 0 input)": u})
            else:
                terms.update(self.below(i))
                terms["block input"] = u
            terms.update(_prefixed(f"block {i} fwd", inner))
            self.moments.append(Moment("forward", f"block {i} forward: {where}", terms))

        # loss: forward (outside the model's forward) and backward through the output projection
        fwd_loss, bwd_loss = self.loss_moments()
        if job.ac_mode == "none":  # the last block's output is in its kept activations
            fwd_loss.pop("last block output (final norm input)")
            bwd_loss.pop("last block output (final norm input)")
        base = {**self.state(0), **output_group, **self.below(n)}
        self.moments.append(Moment("loss", "loss forward", {**base, **fwd_loss}))
        liger = job.fused_ce and job.ce_backend == "liger"
        out_grad = {} if liger else {"unsharded grad: output weight": m.vocab * m.dim * self.p}
        terms = {**base, **bwd_loss, **out_grad}
        if self.W > 1:
            terms["FSDP: all-gather buffer of the next block (backward prefetch)"] = m.block_params * self.p
        self.moments.append(Moment("loss", "loss backward", terms))

        # backward: blocks, from the top (i = n-1) to the bottom (i = 0)
        out_grads = self.grad_shards(m.output_params)
        for i in sorted({n - 1, max(n - 2, 0), 0}, reverse=True):
            grads = out_grads + (n - 1 - i) * self.grad_shards(m.block_params)
            below = self.below(i)
            if job.ac_mode == "none" and i == 0:
                below = {"embedding output (block 0 input)": u}
            for where, act, ugrads in self.block_backward_moments():
                terms = {**self.state(grads), **self.fsdp_block("backward", i), **below}
                terms.update(_prefixed(f"block {i}", act))
                terms.update(ugrads)
                self.moments.append(Moment("backward", f"block {i} backward: {where}", terms))
            if self.W > 1:  # post-backward: this block's reduce-scatter
                terms = {**self.state(grads), **(self.below(i) if i > 0 else {})}
                prev = m.block_params if i > 0 else m.embedding_params
                terms["FSDP: all-gather buffer of the next block (backward prefetch)"] = prev * self.p
                terms["FSDP: unsharded block gradients (compute dtype)"] = m.block_params * self.p
                terms["FSDP: reduce-scatter input (fp32) + output"] = (m.block_params * self.r
                                                                      + self.grad_shards(m.block_params))
                terms["gradient w.r.t. the block input"] = u
                self.moments.append(Moment("backward", f"block {i} backward: reduce-scatter", terms))

        # backward: embedding
        grads = out_grads + n * self.grad_shards(m.block_params)
        terms = self.state(grads)
        terms["gradient w.r.t. the embedding output"] = u
        terms["embedding weight gradient (dense, compute dtype)"] = m.embedding_params * self.p
        if self.W > 1:
            terms["FSDP: embedding unsharded"] = m.embedding_params * self.p
            terms["FSDP: reduce-scatter input of the previous group (fp32, held)"] = m.block_params * self.r
        self.moments.append(Moment("backward", "embedding backward", terms))

        # optimizer: clip (in place) + foreach AdamW (one temporary: sqrt of exp_avg_sq)
        all_grads = self.grad_shards(m.total_params)
        terms = self.state(all_grads)
        terms["AdamW foreach temporary (sqrt(exp_avg_sq), fp32 shards)"] = self.grad_shards(m.total_params)
        self.moments.append(Moment("optimizer", "AdamW step", terms))

        # host: offloaded block inputs (PyTorch's pinned allocator rounds each up to a power of 2)
        pageable = n * u if job.offloaded else 0
        pinned = n * _pow2_ceil(u) if job.offloaded else 0
        use_pinned = job.offloaded and job.pin_memory is not False
        return MemoryPlan(job, self.moments, pinned if use_pinned else pageable, use_pinned, pageable, pinned,
                          self.notes)


def _prefixed(prefix: str, terms: dict[str, int]) -> dict[str, int]:
    return {f"{prefix}: {k}": v for k, v in terms.items()}


def _fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def plan(job: PlanInput, host_mem_bytes: float | None = None) -> MemoryPlan:
    """The memory plan of ``job``. With ``pin_memory=None`` the offload buffers are pinned when
    they fit ``host_mem_bytes`` (per node), else pageable."""
    result = _Step(job).build()
    if job.pin_memory is None and job.offloaded:
        nodes_ranks = min(job.ranks, job.gpus_per_node)
        pinned_fits = host_mem_bytes is None or result.host_bytes_pinned_per_rank * nodes_ranks <= host_mem_bytes
        result.host_pinned = pinned_fits
        result.host_bytes_per_rank = (result.host_bytes_pinned_per_rank if pinned_fits
                                      else result.host_bytes_pageable_per_rank)
        if not pinned_fits:
            result.notes.append("pinned offload buffers (rounded to powers of two by PyTorch's pinned allocator) "
                                "do not fit host memory: pageable buffers assumed (activation_checkpoint.pin_memory = false)")
    return result


def max_seq_len(job: PlanInput, gpu_mem_bytes: float, host_mem_bytes: float | None = None,
                limit: int = 1 << 30) -> int:
    """The longest multiple of ``job.seq_unit`` whose plan fits (0 if none does)."""
    unit = job.seq_unit

    def fits(k: int) -> bool:
        return plan(replace(job, seq_len=k * unit), host_mem_bytes).fits(gpu_mem_bytes, host_mem_bytes)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * unit <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // unit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi): the peak grows with the length
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit


def recommended_heads_per_stage(job: PlanInput, gpu_mem_bytes: float,
                                host_mem_bytes: float | None = None) -> tuple[int, bool]:
    """(U, fits): the largest valid U whose UPipe plan fits (fewest stages: fastest), or U = the
    Ulysses degree (least memory) when none fits. For non-UPipe jobs, the UPipe variant of the
    same cluster (UPipe-in-USP when there is a ring)."""
    base = replace(job, mode="upipe") if job.resolved_mode not in ("upipe", "upipe-in-usp") else job
    if base.ulysses_degree == 1:
        base = replace(base, ulysses=base.cp)
    choices = valid_heads_per_stage(job.model.n_heads, base.ulysses_degree)
    for u in sorted(choices, reverse=True):
        if plan(replace(base, heads_per_stage=u), host_mem_bytes).fits(gpu_mem_bytes, host_mem_bytes):
            return u, True
    return min(choices), False


# --------------------------------------------------------------------------- from a job config


def _dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def plan_input_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> PlanInput:
    """PlanInput of a parsed TorchTitan JobConfig (``titan_upipe.train.parse_config``)."""
    from titan_upipe.specs import flavor_args
    from titan_upipe.validation import cp_mode

    dims = model_dims_from_args(f"{job_config.model.name}:{job_config.model.flavor}",
                                flavor_args(job_config, update=False))
    converters = list(job_config.model.converters)
    par = job_config.parallelism
    cp = par.context_parallel_degree
    mode = cp_mode(converters) or "none"
    upipe = job_config.upipe
    if world_size is None:
        shard = par.data_parallel_shard_degree
        world_size = (shard if shard > 0 else 1) * cp * par.data_parallel_replicate_degree
    param_dtype = job_config.training.mixed_precision_param
    if device is None:
        device = "cpu" if param_dtype == "float32" else "cuda"
    transforms = job_config.transforms
    ac = job_config.activation_checkpoint
    backend = transforms.ce_backend
    if backend == "auto":
        backend = "liger" if device == "cuda" else "torch"
    if ac.mode not in ("none", "full"):
        raise ValueError(f"activation_checkpoint.mode = {ac.mode!r}: the planner models 'none' and 'full'")
    return PlanInput(
        model=dims, seq_len=job_config.training.seq_len, batch=job_config.training.local_batch_size, cp=cp,
        ulysses=upipe.ulysses_degree, mode=mode, heads_per_stage=upipe.heads_per_stage or None,
        world_size=world_size, param_bytes=_dtype_bytes(param_dtype),
        reduce_bytes=_dtype_bytes(job_config.training.mixed_precision_reduce),
        tiled_mlp="tiled_mlp" in converters, tiled_rmsnorm="tiled_rmsnorm" in converters,
        fused_rope="fused_rope" in converters, fused_ce="fused_ce" in converters,
        mlp_tile_tokens=transforms.mlp_tile_tokens, rmsnorm_tile_tokens=transforms.rmsnorm_tile_tokens,
        ce_chunk_tokens=transforms.ce_chunk_tokens, ce_backend=backend, ac_mode=ac.mode,
        attention_backend=PLAN_AUTO_BACKEND if upipe.attention_backend == "auto" else upipe.attention_backend,
        cpu_offload=bool(getattr(ac, "cpu_offload", False)), pin_memory=bool(getattr(ac, "pin_memory", True)),
        device=device,
    )


def plan_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> MemoryPlan:
    return plan(plan_input_from_job_config(job_config, world_size, device))


# --------------------------------------------------------------------------- paper tables


def paper_table4(model: str) -> dict[str, dict[int, float | None]] | None:
    """Table 4 (peak GiB) rows of ``model`` (llama3_8b / qwen3_32b) from the shared anchors:
    {method: {seq_len: GiB or None (OOM)}}; None when the file is missing."""
    if not PAPER_TABLES_CSV.exists():
        return None
    rows: dict[str, dict[int, float | None]] = {}
    with open(PAPER_TABLES_CSV, newline="") as f:
        for row in csv.DictReader(f):
            if row["table"] != "4" or row["model"] != model:
                continue
            values = {}
            for key in ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M"):
                cell = row.get(key, "")
                if cell == "":
                    continue
                values[parse_length(key)] = None if cell == "OOM" else float(cell)
            rows[row["method"]] = values
    return rows


# --------------------------------------------------------------------------- CLI


def parse_length(text: str) -> int:
    """``131072``, ``128K`` (x1024), ``5M`` (x1024^2), ``1.5M``."""
    t = str(text).strip().upper()
    scale = 1
    if t.endswith("K"):
        scale, t = K, t[:-1]
    elif t.endswith("M"):
        scale, t = K * K, t[:-1]
    value = float(t) * scale
    if value != int(value) or value <= 0:
        raise ValueError(f"invalid length {text!r}")
    return int(value)


def format_length(n: int) -> str:
    if n >= K * K and n % (K * K // 4) == 0:
        return f"{n / (K * K):g}M"
    if n >= K and n % K == 0 and n < K * K:
        return f"{n // K}K"
    if n >= K * K:
        return f"{n / (K * K):.2f}M"
    return str(n)


def summary(result: MemoryPlan, gpu_mem_bytes: float | None, host_mem_bytes: float | None) -> dict:
    job = result.job
    out = {
        "model": job.model.name,
        "mode": job.resolved_mode,
        "seq_len": job.seq_len,
        "cp": job.cp,
        "ulysses_degree": job.ulysses_degree,
        "ring_degree": job.ring,
        "heads_per_stage": job.u if job.resolved_mode in ("upipe", "upipe-in-usp") else None,
        "world_size": job.ranks,
        "tokens_per_rank": job.tokens,
        "device": job.device,
        "peak_gpu_gib": result.peak_gpu_bytes / GIB,
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "peak_phase": result.peak_phase,
        "peak_where": result.peak.where,
        "phase_peak_gib": {k: v / GIB for k, v in result.phase_peaks.items()},
        "breakdown_bytes": result.breakdown,
        "runtime_reserve_gib": job.reserve / GIB,
        "host_gib": result.host_bytes / GIB,
        "host_gib_per_rank": result.host_bytes_per_rank / GIB,
        "host_pinned": result.host_pinned,
        "notes": result.notes,
    }
    if gpu_mem_bytes is not None:
        out["gpu_mem_gib"] = gpu_mem_bytes / GIB
        out["fits"] = result.fits(gpu_mem_bytes, host_mem_bytes)
        out["max_seq_len"] = max_seq_len(job, gpu_mem_bytes, host_mem_bytes)
        u, ok = recommended_heads_per_stage(job, gpu_mem_bytes, host_mem_bytes)
        out["recommended_heads_per_stage"] = u
        out["recommended_heads_per_stage_fits"] = ok
    if host_mem_bytes is not None:
        out["host_mem_gib"] = host_mem_bytes / GIB
    return out


def render(result: MemoryPlan, info: dict) -> str:
    job = result.job
    lines = [
        f"{job.model.name}: {info['mode']} (ulysses {job.ulysses_degree} x ring {job.ring}"
        + (f", U = {job.u}, {job.model.n_heads // job.u} stages" if info["heads_per_stage"] else "")
        + f"), seq_len {format_length(job.seq_len)} ({job.seq_len}), {job.ranks} ranks, {job.tokens} tokens/rank, "
        f"{job.device}",
        f"peak {result.peak_gpu_bytes / GIB:.2f} GiB per rank, set by {result.peak_phase} ({result.peak.where}):",
    ]
    width = max(len(k) for k in result.breakdown)
    for k, v in sorted(result.breakdown.items(), key=lambda kv: -kv[1]):
        if v:
            lines.append(f"  {k:<{width}}  {v / GIB:9.3f} GiB")
    lines.append(f"  {'= peak (predicted max_memory_allocated)':<{width}}  {result.peak_gpu_bytes / GIB:9.3f} GiB")
    lines.append(f"  {'+ runtime reserve (not allocated; fit check only)':<{width}}  {job.reserve / GIB:9.3f} GiB")
    lines.append("phase peaks: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in result.phase_peaks.items()))
    pin = "pinned" if result.host_pinned else "pageable"
    lines.append(f"host (offloaded block inputs, {pin}): {result.host_bytes_per_rank / GIB:.1f} GiB per rank, "
                 f"{result.host_bytes / GIB:.1f} GiB per node")
    if "fits" in info:
        lines.append(f"fits in {info['gpu_mem_gib']:g} GiB"
                     + (f" / {info['host_mem_gib']:g} GiB host" if "host_mem_gib" in info else "")
                     + f": {'yes' if info['fits'] else 'no'}")
        lines.append(f"longest sequence that fits: {format_length(info['max_seq_len'])} ({info['max_seq_len']})")
        ok = "" if info["recommended_heads_per_stage_fits"] else " (nothing fits; least memory)"
        lines.append(f"recommended U (heads per stage): {info['recommended_heads_per_stage']}{ok}")
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


PLOT_LENGTHS = [parse_length(x) for x in ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M", "6M", "7M", "8M")]


def plot_variants(job: PlanInput) -> list[tuple[str, PlanInput]]:
    """Ulysses, UPipe (U = C) and USP on the job's model and cluster."""
    variants = []
    cu = job.ulysses_degree if job.ulysses_degree > 1 else job.cp
    ring = job.cp // cu
    if ring == 1:
        variants.append(("Ulysses", replace(job, mode="ulysses", ulysses=job.cp, heads_per_stage=None)))
        variants.append((f"UPipe (U = C = {cu})", replace(job, mode="upipe", ulysses=job.cp, heads_per_stage=None)))
        usp_u = next((d for d in range(job.cp // 2, 1, -1) if job.cp % d == 0 and job.model.n_heads % d == 0), None)
        if usp_u:
            variants.append((f"USP (ulysses {usp_u} x ring {job.cp // usp_u})",
                             replace(job, mode="usp", ulysses=usp_u, heads_per_stage=None)))
        variants.append((f"Ring (zigzag, {job.cp})", replace(job, mode="ring", ulysses=1, heads_per_stage=None)))
    else:
        variants.append((f"USP (ulysses {cu} x ring {ring})", replace(job, mode="usp", ulysses=cu, heads_per_stage=None)))
        variants.append((f"UPipe in USP (U = {cu})", replace(job, mode="upipe", ulysses=cu, heads_per_stage=None)))
        if job.model.n_heads % job.cp == 0:
            variants.append((f"Ulysses ({job.cp})", replace(job, mode="ulysses", ulysses=job.cp, heads_per_stage=None)))
    return variants


PAPER_ROWS = {"ulysses": "Ulysses", "upipe": "UPipe", "ring": "Ring"}


def make_plot(job: PlanInput, path: str, gpu_mem_bytes: float | None, host_mem_bytes: float | None,
              paper_model: str | None) -> str | None:
    """Write the PNG; returns a message about the paper's points when they are missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"Ulysses": "tab:blue", "UPipe": "tab:green", "USP": "tab:orange", "Ring": "tab:red", "FPDT": "tab:gray"}

    def color(label: str) -> str:
        return next((c for k, c in colors.items() if label.startswith(k)), "black")

    for label, variant in plot_variants(job):
        xs, ys = [], []
        for s in PLOT_LENGTHS:
            v = replace(variant, seq_len=s - s % variant.seq_unit)
            try:
                ys.append(plan(v, host_mem_bytes).peak_gpu_bytes / GIB)
            except ValueError:
                continue
            xs.append(s / (K * K))
        style = "--^" if label.startswith("Ring") else "-o"
        ax.plot(xs, ys, style, color=color(label), label=f"{label}: predicted", markersize=4)
    message = None
    table = paper_table4(paper_model) if paper_model else None
    if paper_model and table is None:
        message = f"paper Table 4 points not drawn: {PAPER_TABLES_CSV} not found"
    elif table:
        gpus = "8xH100" if paper_model == "llama3_8b" else "16xH100"
        for method, label in PAPER_ROWS.items():
            points = table.get(method, {})
            xs = [s / (K * K) for s, v in points.items() if v is not None]
            ys = [v for v in points.values() if v is not None]
            if xs:
                ax.plot(xs, ys, linestyle="none", marker="x" if method != "upipe" else "s", color=color(label),
                        markerfacecolor="none", markersize=8, label=f"paper Table 4 {label} ({gpus})")
    if gpu_mem_bytes:
        ax.axhline(gpu_mem_bytes / GIB, color="black", linewidth=0.8, linestyle="--", label="GPU memory")
        ax.axhline((gpu_mem_bytes - job.reserve) / GIB, color="black", linewidth=0.6, linestyle=":",
                   label="GPU memory - runtime reserve")
    top = max(max(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata()))
    if gpu_mem_bytes:
        top = min(top, 1.6 * gpu_mem_bytes / GIB)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("sequence length (M tokens, 1M = 2^20)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"{job.model.name}, {job.ranks} GPUs, {job.attention_backend}: predicted peak vs paper Table 4",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return message


def _model_job(args) -> PlanInput:
    dims = model_dims(args.model)
    mode = args.mode
    ulysses = args.ulysses
    if mode == "upipe-in-usp":
        mode = "upipe"
    if mode in ("ring",):
        ulysses = 1
    job = PlanInput(
        model=dims, seq_len=parse_length(args.seq_len), batch=args.batch, cp=args.cp, ulysses=ulysses, mode=mode,
        heads_per_stage=args.heads_per_stage, world_size=args.world_size or 0, device=args.device or "cuda",
        gpus_per_node=args.gpus_per_node, param_bytes=2 if (args.device or "cuda") == "cuda" else 4,
        pin_memory={"auto": None, "true": True, "false": False}[args.pin_memory],
        ce_backend="liger" if (args.device or "cuda") == "cuda" else "torch",
        attention_backend=args.attention_backend,
    )
    if args.no_transforms:
        job = replace(job, tiled_mlp=False, tiled_rmsnorm=False, fused_rope=False, fused_ce=False,
                      ac_mode="full", cpu_offload=False)
    return job


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m titan_upipe.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="llama3_8b, qwen3_32b or <model.name>:<flavor> (instead of a TOML)")
    parser.add_argument("--seq-len", default="128K", help="sequence length, e.g. 131072, 128K, 5M (2^20 per M)")
    parser.add_argument("--cp", type=int, default=8, help="context-parallel degree")
    parser.add_argument("--ulysses", type=int, default=0, help="Ulysses degree (0: all of CP); ring = cp / ulysses")
    parser.add_argument("--mode", default="upipe", choices=[m for m in MODES if m != "none"])
    parser.add_argument("--heads-per-stage", type=int, default=None, help="UPipe's U (default: the Ulysses degree)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: cp, or the TOML's degrees)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda (for a TOML: cpu when mixed_precision_param is float32)")
    parser.add_argument("--pin-memory", choices=["auto", "true", "false"], default="auto",
                        help="--model only: offload buffers pinned, pageable, or pinned when they fit (auto)")
    # No "auto" here: a TOML's auto is planned as PLAN_AUTO_BACKEND.
    parser.add_argument("--attention-backend", default="flash_attn3",
                        choices=["sdpa", "math", "flash_attn", "flash_attn3", "flash_attn4"],
                        help="--model only: local attention kernel (default flash_attn3, the paper's FA3)")
    parser.add_argument("--no-transforms", action="store_true",
                        help="--model only: full AC without offload and no tiling/fusing")
    parser.add_argument("--gpu-mem", type=float, default=None, help="GiB of device memory per GPU (e.g. 80)")
    parser.add_argument("--host-mem", type=float, default=None, help="GiB of host memory per node (e.g. 1900)")
    parser.add_argument("--reserve-gib", type=float, default=None,
                        help=f"runtime reserve kept free on each GPU (default {RUNTIME_RESERVE_GIB_CUDA} on cuda, 0 on cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, help="write a PNG of predicted peak vs sequence length")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    config_flags = ("--job.config_file", "--job.config-file")
    from_config = any(a.split("=", 1)[0] in config_flags for a in rest)
    if from_config == bool(args.model):
        parser.error("give either --job.config_file X.toml [--section.key value ...] or --model NAME")
    try:
        if from_config:
            from titan_upipe.train import parse_config

            job_config = parse_config(rest)
            job = plan_input_from_job_config(job_config, args.world_size, args.device)
            job = replace(job, gpus_per_node=args.gpus_per_node)
            paper_model = next((k for k, (name, flavor) in MODEL_FLAVORS.items()
                                if (name, flavor) == (job_config.model.name, job_config.model.flavor)), None)
        else:
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            job = _model_job(args)
            paper_model = args.model if args.model in KNOWN_MODELS else None
        if args.reserve_gib is not None:
            job = replace(job, reserve_bytes=int(args.reserve_gib * GIB))
        gpu = args.gpu_mem * GIB if args.gpu_mem is not None else None
        host = args.host_mem * GIB if args.host_mem is not None else None
        result = plan(job, host)
        info = summary(result, gpu, host)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.plot:
        message = make_plot(job, args.plot, gpu, host, paper_model)
        info["plot"] = args.plot
        if message:
            info["notes"].append(message)
            print(message, file=sys.stderr)
    if args.json:
        print(json.dumps({**info, "job": _job_dict(job)}, indent=1))
    else:
        print(render(result, info))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _job_dict(job: PlanInput) -> dict:
    d = asdict(job)
    d["model"] = asdict(job.model)
    return d


# Paper formulas re-exported for the docs/tests comparing the attention term with Tables 2/6.
__all__ = [
    "GIB", "KNOWN_MODELS", "MemoryPlan", "Moment", "ModelDims", "PlanInput", "max_seq_len", "model_dims",
    "paper_table2_peak", "paper_table4", "paper_table6_peak", "parse_length", "plan", "plan_from_job_config",
    "plan_input_from_job_config", "recommended_heads_per_stage",
]

if __name__ == "__main__":
    sys.exit(main())
