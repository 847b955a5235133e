"""One training job as the planner sees it: the model, the sequence, the context-parallel layout
and the memory settings (``PlanInput``), with the per-rank quantities derived from them.

Per rank: ``T = B S / C`` tokens (``tokens``) of a sequence of ``S`` split over ``C`` CP ranks;
activations in FSDP's param dtype (fp32 without FSDP); ``S`` a multiple of ``seq_unit`` (``C``,
or ``2 R C_u`` with a ring of ``R = C / C_u`` ranks: zigzag chunks over the Ulysses ranks).

The CP degrees, U and the sequence divisor are ``titan_upipe.spec.cp_layout.CPLayout``'s.
The planner accepts a few settings the plugin's layout does not, and plans them as the layout
they amount to (``_layout_settings``): no CP attention (``none``) or a CP degree of 1 under any
mode, ``ring`` whatever ``ulysses`` says, ``ulysses``/``usp`` with all of CP on Ulysses or none
of it (plain Ulysses, plain ring), and ``upipe-in-usp`` (``upipe`` with a ring).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from titan_upipe.spec.cp_layout import CP_MODES, CPLayout, CPMode, valid_heads_per_stage
from titan_upipe.spec.keep_attention import KeepAttentionPlan
from titan_upipe.spec.model_dims import ModelDims
from titan_upipe.spec.tsp_shards import bucket_problems, tsp_problems
from titan_upipe.spec.units import GIB

MODES: tuple[str, ...] = ("none", *CP_MODES, "upipe-in-usp")
"""The planner's modes: no CP attention, the plugin's CP attentions (``CP_MODES``: ulysses,
upipe, ring, usp, tsp) and ``upipe-in-usp`` (UPipe whose stages attend over a ring: ``upipe``
with ``ulysses`` < ``cp``)."""

UPIPE_MODES = ("upipe", "upipe-in-usp")

RUNTIME_RESERVE_GIB_CUDA = 2.0
"""Device memory a CUDA rank uses outside PyTorch's allocated tensors, kept free when deciding
whether a plan fits (never added to ``peak_gpu_bytes``): the CUDA context and kernel images
(~0.5 GiB on H100 with torch), NCCL communicator buffers for the FSDP and CP groups
(~0.5-1 GiB), and caching-allocator slack with ``expandable_segments`` (~0.5 GiB).
Override with ``--reserve-gib``."""


def _check_planned_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: valid modes are {', '.join(MODES)}")


def _layout_settings(mode: str, cp: int, ulysses: int) -> tuple[CPMode | None, int, int]:
    """``(mode, cp_degree, ulysses_setting)`` of the CPLayout that the planner's settings plan.

    Raises the planner's ValueError for an unknown mode, a CP degree below 1 and a Ulysses
    degree (``ulysses``, 0: all of CP) that does not divide ``cp``.
    """
    _check_planned_mode(mode)
    if cp < 1:
        raise ValueError("seq_len, cp and batch must be positive")
    if mode == "none" or cp == 1:  # no CP attention: one rank's attention over its tokens
        return None, 1, 0
    if mode in (CPMode.RING, CPMode.TSP):  # no Ulysses ranks, whatever the setting says
        return CPMode(mode), cp, 0
    degree = ulysses or cp
    if cp % degree:
        raise ValueError(f"ulysses degree {degree} does not divide cp {cp}")
    if mode in UPIPE_MODES:
        return CPMode.UPIPE, cp, degree
    # ulysses and usp: the Ulysses degree decides (all of CP: Ulysses; 1: ring; between: USP)
    if degree == cp:
        return CPMode.ULYSSES, cp, degree
    if degree == 1:
        return CPMode.RING, cp, 0
    return CPMode.USP, cp, degree


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
    rope_tables: int = 1
    """Full-length RoPE tables a rank holds without ``fused_rope``: TorchTitan 0.2's model has one,
    0.3's one per attention (``JobSpec.rope_tables``)."""
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
    resident_blocks: int = 0
    """``[activation_checkpoint] resident_blocks``: the last N blocks' inputs stay on the device
    (N fewer on the host; on the device from their forward to their backward)."""
    prefetch_after_attention: bool = False
    """``[activation_checkpoint] prefetch_after_attention``: the next block's input is fetched from
    the host after this block's attention backward, so it is not on the device at the peak."""
    keep_device_blocks: int = 0
    """``[activation_checkpoint] keep_attention``, sized: the last N blocks keep their attention's
    output and LSE on the device from forward to backward (``attention.keep``)."""
    keep_host_blocks: int = 0
    """The blocks below those keep them in host memory (prefetched with the block input)."""
    device: str = "cuda"
    """``cuda``: flash kernels' workspaces, offload prefetch stream; ``cpu``: composite ops (gloo runs)."""
    gpus_per_node: int = 8
    reserve_bytes: int | None = None
    """Kept free when checking a fit; None: RUNTIME_RESERVE_GIB_CUDA on cuda, 0 on cpu."""
    optimizer_state_on_host: bool = False
    """``[optimizer] state_on_host``: AdamW's moments in host memory (pinned on cuda), streamed
    through two device buffers of the largest shard in the step (``titan_upipe.optim.host_adamw``)."""
    documents: bool = False
    """Packed documents: the model args' ``attn_mask_type == "block_causal"``. Every rank holds the
    global batch's ``DocumentMask`` (``titan_upipe.plan.documents``)."""
    document_balance: str = "documents"
    """``[upipe] document_balance``: with packed documents on a ring, ``documents`` lays each batch out
    by its documents (``[B, S/C]`` positions and the layout's, ``titan_upipe.plan.documents``)."""
    tsp_kv_heads_per_bucket: int = 0
    """``[tsp] kv_heads_per_bucket`` (0: all of a rank's ``K/D`` KV heads in one all-gather)."""
    tsp_overlap: bool = True
    """``[tsp] overlap``: the MLP ring's shard gradient travels during the dX GEMMs (one more fp32 buffer)."""
    tsp_mlp_recompute: bool = True
    """``[tsp] mlp_recompute``: the ring MLP saves only its shards (else each step's projections too)."""

    # ---- the CP layout
    @cached_property
    def degrees(self) -> CPLayout:
        """The CP layout without the heads: mode, ring and Ulysses degrees, sequence divisor."""
        return CPLayout(*_layout_settings(self.mode, self.cp, self.ulysses))

    @cached_property
    def layout(self) -> CPLayout:
        """The CP layout with the model's heads and U, validated (ConfigError) by CPLayout."""
        m = self.model
        return CPLayout(*_layout_settings(self.mode, self.cp, self.ulysses), n_heads=m.n_heads,
                        n_kv_heads=m.n_kv_heads, heads_per_stage_setting=self.heads_per_stage or 0)

    @property
    def resolved_mode(self) -> str:
        """``upipe`` with a ring is ``upipe-in-usp``, ``usp`` without one is ``ulysses``; other
        modes keep their name (for the plugin's settings: ``CPLayout.name``)."""
        if self.mode == CPMode.UPIPE and self.ring > 1:
            return "upipe-in-usp"
        if self.mode == CPMode.USP and self.ring == 1:
            return "ulysses"
        return self.mode

    @property
    def ulysses_degree(self) -> int:
        return self.degrees.ulysses_degree

    @property
    def ring(self) -> int:
        return self.degrees.ring_degree

    @property
    def document_layout(self) -> bool:
        """Each batch in its own document-aware layout: packed documents on a ring, ``document_balance = "documents"``."""
        return self.documents and self.ring > 1 and self.document_balance == "documents"

    @property
    def u(self) -> int:
        """UPipe's U (meaningful for upipe modes)."""
        if self.degrees.mode is CPMode.UPIPE:
            return self.layout.heads_per_stage
        return self.heads_per_stage or self.ulysses_degree

    @property
    def seq_unit(self) -> int:
        """seq_len must be a multiple of this (CP, or 2 x ring x ulysses with a ring). Without a
        CP attention the planner still splits the sequence over the ``cp`` ranks."""
        return self.degrees.seq_divisor if self.degrees.mode is not None else self.cp

    # ---- per rank
    @property
    def tsp(self) -> bool:
        """TSP: the blocks' weights sharded over the CP ranks (``titan_upipe.plan.tsp``)."""
        return self.mode == CPMode.TSP and self.cp > 1

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
    def reserve(self) -> int:
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        return int(RUNTIME_RESERVE_GIB_CUDA * GIB) if self.device == "cuda" else 0

    @property
    def offloaded(self) -> bool:
        return self.ac_mode == "full" and self.cpu_offload

    @property
    def keep(self) -> KeepAttentionPlan:
        """Which blocks keep their attention, and where (``spec.keep_attention.KeepAttentionPlan``)."""
        return KeepAttentionPlan(self.keep_device_blocks, self.keep_host_blocks)

    def check(self) -> None:
        """ValueError naming the first problem: the mode, the counts and the Ulysses degree, then
        CPLayout's head checks (ConfigError: heads, K/V heads, U), then the sequence and ranks."""
        m = self.model
        _check_planned_mode(self.mode)
        if self.seq_len < 1 or self.cp < 1 or self.batch < 1:
            raise ValueError("seq_len, cp and batch must be positive")
        cu = self.ulysses_degree  # the planner's ValueError when it does not divide cp
        # CPLayout's head checks first: a degree that splits no heads is named as such (with the
        # degrees that do), not as an empty list of U values
        _ = self.layout
        valid_u = valid_heads_per_stage(m.n_heads, cu)
        u = self.heads_per_stage or cu
        if self.mode in UPIPE_MODES and u not in valid_u:
            raise ValueError(f"U = {u} is not valid for {m.n_heads} heads at Ulysses degree {cu}: "
                             f"valid values are {valid_u}")
        if m.n_heads % cu:
            raise ValueError(f"Ulysses degree {cu} does not divide {m.n_heads} heads")
        if self.seq_len % self.seq_unit:
            raise ValueError(f"seq_len {self.seq_len} is not a multiple of {self.seq_unit}")
        if self.ranks % self.cp:
            raise ValueError(f"world size {self.ranks} is not a multiple of cp {self.cp}")
        if self.keep.blocks and not (self.offloaded and self.degrees.mode is not None):
            raise ValueError("kept attention (keep_attention, --keep-attention) needs offloaded full AC and a "
                             "context-parallel mode: set activation_checkpoint.mode = \"full\" with cpu_offload = "
                             "true (drop --no-transforms) and a CP converter, or keep_attention = \"off\"")
        if self.keep.blocks > m.n_layers:
            raise ValueError(f"{self.keep.blocks} blocks keep their attention, but the model has {m.n_layers}")
        if self.tsp:
            self.check_tsp()

    def check_tsp(self) -> None:
        """TSP's own rules (``spec.tsp_shards.tsp_problems``, the converter's checks): the degree splits
        the heads, KV heads and FFN width; no data parallelism on top; the KV bucket divides ``K/D``;
        no tiled MLP, fused RoPE or host optimizer state (refused by ``validate`` too)."""
        m = self.model
        problems = tsp_problems(m.n_heads, m.n_kv_heads, m.ffn_dim, self.cp, self.seq_len)
        if self.ranks != self.cp:
            problems.append(f"tsp runs without data parallelism: world size {self.ranks} must equal the TSP degree "
                            f"{self.cp}")
        problems += bucket_problems(m.n_kv_heads, self.cp, self.tsp_kv_heads_per_bucket)
        for setting, on in (("tiled_mlp", self.tiled_mlp), ("fused_rope", self.fused_rope),
                            ("optimizer.state_on_host", self.optimizer_state_on_host), ("packed documents", self.documents)):
            if on:
                problems.append(f"tsp does not compose with {setting}")
        if problems:
            raise ValueError("; ".join(problems))


def as_tsp(job: PlanInput) -> PlanInput:
    """``job`` under TSP on its CP ranks, with the recipes' transforms: TSP's MLP is a weight ring
    (no tiled MLP) and its attention rotates with the full table (no fused RoPE)."""
    return replace(job, mode=CPMode.TSP.value, ulysses=0, heads_per_stage=None, tiled_mlp=False, fused_rope=False)
