"""Expected activation memory of one attention layer on one CP rank: this implementation's
terms, and the paper's Table 2/6 formulas, for comparing with measured peaks.

Units: ``u`` is one head at the local sequence length (``B * S/C * D`` elements); the
paper's unit ``P = S/C * d_model`` with ``d_model = H * D`` is ``H`` u. ``x`` (the layer
input) is excluded everywhere: it exists before the layer, and its width is the model
dim, which may differ from ``H * D``.

Paper symbols: ``g = H/KV`` (GQA ratio), ``gamma = 1 + 2/g`` (Q+K+V), ``beta = 4 + 4/g``
(Q, K, V, Out, dOut, dQ, dK, dV), ``nu = H/U`` (UPipe stages). The paper's K/V terms shrink
by ``nu`` like the query terms; that only holds when each stage needs its own K/V heads
(MHA). With GQA at C >= KV every rank must hold the full-sequence K and V of its query's
KV head whatever U is (``resident K/V`` below), which sets a floor on UPipe's savings.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.spec.head_schedule import INPUT_GRAD_TILES, build_schedule


@dataclass(frozen=True)
class LayerShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    cp_degree: int
    seq_len: int
    batch: int
    dim: int
    elem_bytes: int = 4

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_degree

    @property
    def head_unit(self) -> int:
        """Bytes of one head over this rank's tokens (``u``)."""
        return self.batch * self.local_len * self.head_dim * self.elem_bytes

    @property
    def paper_unit(self) -> int:
        """Bytes of the paper's ``S/C`` (times d_model = H * D)."""
        return self.n_heads * self.head_unit

    @property
    def lse_bytes(self) -> int:
        """fp32 LSE of all stages: H/C heads over the full sequence."""
        return self.n_heads // self.cp_degree * self.batch * self.seq_len * 4


def _kv_heads_per_rank(shape: LayerShape, u: int) -> tuple[int, int]:
    """(KV heads each rank holds per stage, query stages per KV group)."""
    schedule = build_schedule(shape.n_heads, shape.n_kv_heads, shape.cp_degree, u)
    return schedule.max_kv_heads_per_rank, schedule.n_stages // schedule.kv_exchanges


def upipe_forward_terms(shape: LayerShape, u: int) -> dict[str, int]:
    """Live at the forward peak (the attention kernel of a stage)."""
    n_kv, _ = _kv_heads_per_rank(shape, u)
    unit, c = shape.head_unit, shape.cp_degree
    return {
        "output buffer (H heads)": shape.n_heads * unit,
        "LSE (all stages)": shape.lse_bytes,
        "send buffer (U heads)": u * unit,
        "receive buffer = stage Q (U heads)": u * unit,
        "attention output of the stage (U heads)": u * unit,
        "resident K+V (full sequence)": 2 * n_kv * c * unit,
    }


def upipe_backward_terms(shape: LayerShape, u: int) -> dict[str, int]:
    """Live at the backward peak (the attention backward kernel of a stage), weights frozen,
    with the layer's output still held by the caller. The layer output's gradient is the
    caller's too (autograd holds it for the residual); dO exists one stage slice at a time
    (in the send buffer) and dX only after the stages (``ProjectionGrads``)."""
    n_kv, group = _kv_heads_per_rank(shape, u)
    unit, c = shape.head_unit, shape.cp_degree
    kv = 2 * n_kv * c * unit
    terms = {
        # also holds the gradients of earlier stages' query projections (kept for dX)
        "saved output buffer (H heads)": shape.n_heads * unit,
        "LSE (all stages)": shape.lse_bytes,
        "layer output held by caller": shape.batch * shape.local_len * shape.dim * shape.elem_bytes,
        "send buffer (U heads)": u * unit,
        "receive buffers Q, Out, dOut (3 U heads)": 3 * u * unit,
        "dQ from the kernel (U heads)": u * unit,
        "resident K+V": kv,
        "dK+dV from the kernel": kv,
    }
    if group > 1:
        terms["dK+dV fp32 sums over the group's stages"] = kv * 4 // shape.elem_bytes
    finished = upipe_kv_projection_columns(shape, u, groups=slice(None, -1))
    if finished:  # the last stage's kernel runs after every earlier KV group was flushed
        terms["K/V projections' gradients of the finished KV groups"] = shape.batch * shape.local_len * finished * shape.elem_bytes
    return terms


def upipe_kv_projection_columns(shape: LayerShape, u: int, groups: slice = slice(None)) -> int:
    """Columns of the K/V projections' gradients UPipe keeps for dX: per KV group, each
    distinct per-rank KV run's heads, for K and for V (``upipe._flush_kv_grads``); ``groups``
    selects KV groups (in schedule order)."""
    schedule = build_schedule(shape.n_heads, shape.n_kv_heads, shape.cp_degree, u)
    firsts = [stage for stage in schedule.stages if stage.sends_kv][groups]
    return sum(2 * len(heads) * shape.head_dim for stage in firsts for heads, _ in stage.kv_destinations())


def upipe_input_grad_terms(shape: LayerShape, u: int, weight_bytes: int | None = None) -> dict[str, int]:
    """Live at the end of UPipe's backward, in the dX GEMM's last tile (``ProjectionGrads``):
    the projections' gradients, the stacked ``wq``/K/V rows, dX and one concatenated tile, and
    the all-to-all buffers (freed after it)."""
    tokens = shape.batch * shape.local_len
    a, q_cols = shape.elem_bytes, shape.n_heads * shape.head_dim
    kv_cols = upipe_kv_projection_columns(shape, u)
    tile = -(-tokens // INPUT_GRAD_TILES)
    kernel = upipe_backward_terms(shape, u)
    buffers = ("send buffer (U heads)", "receive buffers Q, Out, dOut (3 U heads)", "resident K+V")
    return {
        "output buffer = query projections' gradients (H heads)": shape.n_heads * shape.head_unit,
        "send buffer, receive buffers Q, Out, dOut, resident K+V (kept to the end)":
            sum(kernel[name] for name in buffers),
        "LSE (all stages)": shape.lse_bytes,
        "layer output held by caller": tokens * shape.dim * a,
        "K/V projections' gradients": tokens * kv_cols * a,
        "stacked wq and K/V rows": (q_cols + kv_cols) * shape.dim * (weight_bytes or a),
        "dX": tokens * shape.dim * a,
        "dX GEMM operand tile": tile * (q_cols + kv_cols) * a,
    }


def upipe_backward_peak(shape: LayerShape, u: int, weight_bytes: int | None = None) -> int:
    """The larger of the two backward moments (a stage's kernel, the dX GEMM)."""
    return max(sum(upipe_backward_terms(shape, u).values()),
               sum(upipe_input_grad_terms(shape, u, weight_bytes).values()))


def _gamma_beta(shape: LayerShape) -> tuple[float, float]:
    g = shape.n_heads / shape.n_kv_heads
    return 1 + 2 / g, 4 + 4 / g


def paper_table2_peak(shape: LayerShape, u: int | None) -> float:
    """Table 2 forward peak without the input x: Ulysses ``(gamma+1) S/C`` (u None),
    UPipe ``S/C + (gamma+1) S/(C nu)`` (its ``2 S/C`` less x)."""
    gamma, _ = _gamma_beta(shape)
    if u is None:
        return (gamma + 1) * shape.paper_unit
    return (1 + (gamma + 1) * u / shape.n_heads) * shape.paper_unit


def paper_table6_peak(shape: LayerShape, u: int | None) -> float:
    """Table 6 backward peak without x: Ulysses ``(beta+1) S/C`` during the backward kernel.

    Table 6 as published has no UPipe row; by the same construction as Table 2 (the output
    and its gradient stay whole, the kernel's eight tensors shrink by nu) it is
    ``2 S/C + beta S/(C nu)``, which is what this returns for UPipe.
    """
    _, beta = _gamma_beta(shape)
    if u is None:
        return (beta + 1) * shape.paper_unit
    return (2 + beta * u / shape.n_heads) * shape.paper_unit
