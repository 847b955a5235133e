"""UPipe (Untied Ulysses, paper section 3.3): attention in H/U stages of U query heads.

Forward, per stage (``h = U/C`` query heads per rank, ``L = S/C`` local tokens):

1. if the stage's K/V are new (``Stage.sends_kv``): drop the previous group's K/V, project
   the needed KV heads from ``x``, k-norm + RoPE, replicate per destination rank when
   C > KV, all-to-all; the received K/V stay resident for the following stages;
2. project only this stage's query heads (row slices of ``wq``, per destination rank)
   straight into the reused send buffer, q-norm + RoPE, all-to-all into the reused
   receive buffer;
3. causal attention for my ``h`` heads over the full sequence -> (out, lse);
4. out goes into the same send buffer, all-to-all back into the same receive buffer,
   and is copied into its heads' slot of the one output buffer allocated up front.

The layer's ``wo`` is applied inside the function. Only ``x``, the output buffer (the
stage-independent attention output before ``wo``) and the per-stage LSE are saved.
With kept attention (``keep.py``) a checkpointed block's forward records exactly these two, and
its recomputation takes them back and runs no stage at all (no projection, all-to-all or kernel):
only ``wo``.

Backward computes ``wo``'s gradient first (the output buffer's last full use), then replays
the schedule: it recomputes each stage's projections, norms, RoPE and all-to-alls, forms the
stage's dO slice from the layer output's gradient (``grad_y @ wo[:, heads]``: the full dO is
never formed), runs the backend's backward, sends dQ back at once and dK/dV back when a KV
group is finished (summed over its query stages in fp32). The projections' gradients are
kept in the compute dtype -- the query heads' in their output-buffer slots, which are free
by then -- and dX is one GEMM over all heads at the end (fp32 accumulation inside the GEMM,
one rounding), so no ``[tokens, dim]`` fp32 accumulator exists during the stages.
dWq/dWk/dWv (full-size buffers, only this stage's rows) and the norm weights accumulate in
fp32 and are cast once at the end.

Buffers: one flat send buffer, one (forward) or three (backward) flat receive buffers and
the resident K/V pair are allocated once per call, sized for the widest exchange, and
reused by every stage and every KV group; only the fp32 dK/dV sums are allocated per KV
group. Nothing a collective touched is freed mid-call, so the peak does not depend on when
the communication backend drops its references (gloo does so from its own thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from titan_upipe.attention.collectives import all_to_all, heads_view, seq_major
from titan_upipe.attention.keep import recording, replaying
from titan_upipe.attention.run import AttentionRun
from titan_upipe.spec.head_schedule import INPUT_GRAD_TILES, HeadSchedule, Stage

Tensor = torch.Tensor


@dataclass
class StageBuffers:
    """Flat all-to-all buffers sized for the widest exchange of the call, viewed per use as
    ``[C, L, B, n_heads, D]`` (a contiguous prefix)."""

    send: Tensor
    recv: list[Tensor]
    k: Tensor
    v: Tensor
    """The resident K/V of the current KV group (received, head-sharded); reused by every group."""
    cp_degree: int
    local_len: int
    batch: int
    head_dim: int

    @classmethod
    def allocate(cls, x: Tensor, schedule: HeadSchedule, head_dim: int, n_recv: int) -> StageBuffers:
        b, seq = x.shape[:2]
        heads = max(schedule.query_heads_per_rank, schedule.max_kv_heads_per_rank)
        numel = schedule.cp_degree * seq * b * heads * head_dim
        kv_numel = schedule.cp_degree * seq * b * schedule.max_kv_heads_per_rank * head_dim
        return cls(x.new_empty(numel), [x.new_empty(numel) for _ in range(n_recv)], x.new_empty(kv_numel),
                   x.new_empty(kv_numel), schedule.cp_degree, seq, b, head_dim)

    def view(self, flat: Tensor, n_heads: int) -> Tensor:
        shape = (self.cp_degree, self.local_len, self.batch, n_heads, self.head_dim)
        return flat[: self.cp_degree * self.local_len * self.batch * n_heads * self.head_dim].view(shape)


@dataclass
class ResidentKV:
    """K/V of the current KV group, head-sharded over the full sequence, ``[B, h_kv, S, D]`` views."""

    k: Tensor
    v: Tensor

    def for_stage(self, stage: Stage, run: AttentionRun) -> tuple[Tensor, Tensor, Tensor | None]:
        """K/V as the kernel sees them for this stage's query heads, and the per-query KV
        index when they had to be expanded (uneven groups; see ``Stage.local_kv_index``)."""
        index = stage.local_kv_index(run.rank, run.schedule.n_rep)
        if index is None:
            return self.k, self.v, None
        index_t = torch.tensor(index, device=self.k.device)
        return self.k.index_select(1, index_t), self.v.index_select(1, index_t), index_t


def _fold_expanded(grad: Tensor, index: Tensor | None, like: Tensor) -> Tensor:
    """Sum the gradients of expanded K/V heads back onto the heads the rank holds."""
    if index is None:
        return grad
    return torch.zeros_like(like).index_add_(1, index, grad)


def _project_queries(x: Tensor, wq: Tensor, q_norm_weight: Tensor | None, stage: Stage, run: AttentionRun,
                     send: Tensor) -> None:
    for rank, heads in enumerate(stage.query_heads_per_rank):
        q = run.projection.project(x, wq, heads, q_norm_weight, use_norm=run.qk_norm)
        send[rank].copy_(q.transpose(0, 1))
        del q  # keep at most one destination's temporaries alive


def _exchange_kv_tensor(x: Tensor, weight: Tensor, norm_weight: Tensor | None, stage: Stage, run: AttentionRun,
                        is_key: bool, send: Tensor, recv: Tensor) -> Tensor:
    for heads, ranks in stage.kv_destinations():
        kv = run.projection.project(x, weight, heads, norm_weight, use_rope=is_key, use_norm=is_key and run.qk_norm)
        for rank in ranks:  # C > KV: the same activations go to every rank of the group
            send[rank].copy_(kv.transpose(0, 1))
        del kv
    return heads_view(all_to_all(send, recv, run.group))


def _exchange_kv(x: Tensor, wk: Tensor, wv: Tensor, k_norm_weight: Tensor | None, stage: Stage,
                 run: AttentionRun, buffers: StageBuffers) -> ResidentKV:
    n_kv = len(stage.kv_heads_per_rank[0])
    send = buffers.view(buffers.send, n_kv)
    k = _exchange_kv_tensor(x, wk, k_norm_weight, stage, run, True, send, buffers.view(buffers.k, n_kv))
    v = _exchange_kv_tensor(x, wv, None, stage, run, False, send, buffers.view(buffers.v, n_kv))
    return ResidentKV(k, v)


def _gather_stage_heads(source: Tensor, stage: Stage, send: Tensor) -> None:
    """Heads of each destination rank from ``source`` ``[B, L, H, D]`` into ``send``."""
    for rank, heads in enumerate(stage.query_heads_per_rank):
        send[rank].copy_(source[:, :, heads[0] : heads[-1] + 1].transpose(0, 1))


def _scatter_stage_heads(recv: Tensor, stage: Stage, target: Tensor) -> None:
    """Inverse of ``_gather_stage_heads``: chunk ``i`` of ``recv`` into rank ``i``'s heads of ``target``."""
    for rank, heads in enumerate(stage.query_heads_per_rank):
        target[:, :, heads[0] : heads[-1] + 1].copy_(recv[rank].transpose(0, 1))


def _kv_group_sizes(stages: tuple[Stage, ...]) -> list[int]:
    """For each stage, how many query stages share its K/V (its KV group's length)."""
    sizes: list[int] = []
    for stage in stages:
        if stage.sends_kv:
            sizes.append(0)
        sizes[-1] += 1
    return [size for size in sizes for _ in range(size)]


@dataclass
class WeightGradAccumulators:
    """fp32 weight gradients summed over stages (K/V rows over KV groups that share a head);
    None where autograd does not need them."""

    wq: Tensor | None
    wk: Tensor | None
    wv: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None

    @classmethod
    def zeros(cls, needs: tuple[bool, ...], *weights: Tensor | None) -> WeightGradAccumulators:
        return cls(*[
            torch.zeros(t.shape, dtype=torch.float32, device=t.device) if need and t is not None else None
            for need, t in zip(needs, weights, strict=True)
        ])

    def cast(self, like: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        grads = (self.wq, self.wk, self.wv, self.q_norm, self.k_norm)
        return tuple(None if g is None else g.to(w.dtype) for g, w in zip(grads, like, strict=True))


@dataclass
class ProjectionGrads:
    """Gradients of the projections (``x @ rows.T``, before norm and RoPE) kept until dX.

    dX is their sum over every head (all stages, all KV groups) times the weights. Instead of
    an fp32 ``[tokens, dim]`` accumulator updated per stage, the gradients are kept in the
    compute dtype (query heads in the output buffer's slots, freed by then; K/V in one
    buffer per KV group) and multiplied once by the stacked weights: the GEMM sums over all
    heads in fp32 and rounds once.
    """

    queries: Tensor
    """``[tokens, H*D]``: the output buffer, slot of head h = dQ projection of head h."""
    kv: list[Tensor]
    """Per KV group, ``[tokens, width]``: its K then V runs' projection gradients."""
    kv_rows: list[Tensor]
    """The ``wk``/``wv`` rows of each column block of ``kv`` (in order)."""

    def input_grad(self, wq: Tensor) -> Tensor:
        """dX ``[tokens, dim]`` = ``[dQ | dK, dV parts] @ [wq; their rows]``, tile by tile."""
        weight = torch.cat([wq, *self.kv_rows]) if self.kv_rows else wq
        tokens = self.queries.shape[0]
        grad_x = self.queries.new_empty(tokens, weight.shape[1])
        tile = -(-tokens // INPUT_GRAD_TILES)
        for start in range(0, tokens, tile):
            rows = slice(start, start + tile)
            operand = torch.cat([self.queries[rows], *(g[rows] for g in self.kv)], dim=1)
            torch.mm(operand, weight, out=grad_x[rows])
            del operand
        return grad_x


def _project_output_grad(grad_y: Tensor, wo: Tensor, stage: Stage, head_dim: int, send: Tensor) -> None:
    """dO of each destination's heads, ``grad_y @ wo[:, heads]`` (``grad_y`` ``[B, L, dim]``),
    into ``send``: the stage's slice only, so the full dO ``[tokens, H*D]`` never exists."""
    b, seq, dim = grad_y.shape
    for rank, heads in enumerate(stage.query_heads_per_rank):
        cols = wo[:, heads[0] * head_dim : (heads[-1] + 1) * head_dim]
        grad_out = torch.mm(grad_y.view(b * seq, dim), cols).view(b, seq, len(heads), head_dim)
        send[rank].copy_(grad_out.transpose(0, 1))
        del grad_out


def _stages_forward(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, q_norm_weight: Tensor | None,
                    k_norm_weight: Tensor | None, run: AttentionRun) -> tuple[Tensor, list[Tensor]]:
    """The forward's stage loop (module docstring, steps 1-4): the attention output before ``wo``,
    ``[B, L, H*D]``, and each stage's LSE ``[B, U/C, S]`` (fp32)."""
    schedule = run.schedule
    b, seq, _ = x.shape
    n_heads, d, hq = schedule.n_heads, run.head_dim, schedule.query_heads_per_rank
    output = x.new_empty(b, seq, n_heads * d)
    output_heads = output.view(b, seq, n_heads, d)
    buffers = StageBuffers.allocate(x, schedule, d, n_recv=1)
    send, recv = buffers.view(buffers.send, hq), buffers.view(buffers.recv[0], hq)
    kv: ResidentKV | None = None
    lses: list[Tensor] = []
    for stage in schedule.stages:
        if stage.sends_kv:
            kv = None  # the previous group's K/V go before the next group's arrive
            kv = _exchange_kv(x, wk, wv, k_norm_weight, stage, run, buffers)
        _project_queries(x, wq, q_norm_weight, stage, run, send)
        all_to_all(send, recv, run.group)
        k, v, _ = kv.for_stage(stage, run)
        out, lse = run.backend.forward(heads_view(recv), k, v, run.scale)
        del k, v
        lses.append(lse)
        seq_major(heads_view(send)).copy_(seq_major(out))
        del out
        all_to_all(send, recv, run.group)
        _scatter_stage_heads(recv, stage, output_heads)
    del kv, buffers, send, recv
    return output, lses


class UPipeAttentionFunction(torch.autograd.Function):
    """UPipe attention and ``wo``: ``x`` ``[B, L, dim]`` -> the layer output ``[B, L, dim]``.

    ``wo`` is inside so that backward can form dO one stage slice at a time from the layer
    output's gradient (which autograd holds for the residual anyway) instead of receiving the
    full ``[tokens, H*D]`` dO from ``wo``'s backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, q_norm_weight: Tensor | None,
                k_norm_weight: Tensor | None, run: AttentionRun) -> Tensor:
        if replaying(run.kept):  # the recomputation of a block that kept them: no stage runs again
            output, *lses = run.kept.replay()
        else:
            output, lses = _stages_forward(x, wq, wk, wv, q_norm_weight, k_norm_weight, run)
            if recording(run.kept):
                run.kept.record(output, *lses)
        ctx.run = run
        ctx.save_for_backward(x, wq, wk, wv, wo, q_norm_weight, k_norm_weight, output, *lses)
        return F.linear(output, wo)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        run: AttentionRun = ctx.run
        schedule, proj, d = run.schedule, run.projection, run.head_dim
        hq = schedule.query_heads_per_rank
        x, wq, wk, wv, wo, q_norm_weight, k_norm_weight, output, *lses = ctx.saved_tensors
        b, seq, dim = x.shape
        needs_x, needs_wo = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        grad_y = grad_y.contiguous()
        flat_output = output.view(b * seq, schedule.n_heads * d)
        # wo's gradient first: it is the last use of the whole output buffer, whose head slots
        # then take the query projections' gradients, stage by stage.
        grad_wo = grad_y.view(b * seq, dim).t().mm(flat_output) if needs_wo else None
        output_heads = output.view(b, seq, schedule.n_heads, d)
        weights = (wq, wk, wv, q_norm_weight, k_norm_weight)
        needs = tuple(ctx.needs_input_grad[i] for i in (1, 2, 3, 5, 6))
        acc = WeightGradAccumulators.zeros(needs, *weights)
        grads = ProjectionGrads(flat_output, [], []) if needs_x else None

        buffers = StageBuffers.allocate(x, schedule, d, n_recv=3)
        send = buffers.view(buffers.send, hq)
        recv_q, recv_out, recv_dout = (buffers.view(flat, hq) for flat in buffers.recv)
        kv: ResidentKV | None = None
        kv_stage: Stage | None = None
        grad_k = grad_v = None
        for stage, lse, group_size in zip(schedule.stages, lses, _kv_group_sizes(schedule.stages), strict=True):
            if stage.sends_kv:
                if kv_stage is not None:
                    _flush_kv_grads(x, wk, wv, k_norm_weight, kv_stage, grad_k, grad_v, acc, grads, run, buffers)
                kv = grad_k = grad_v = None
                kv = _exchange_kv(x, wk, wv, k_norm_weight, stage, run, buffers)
                kv_stage = stage
                if group_size > 1:
                    # dK/dV of the group, summed over its query stages in fp32, in the
                    # [S, B, h_kv, D] order the all-to-all back sends.
                    grad_k = torch.zeros(seq_major(kv.k).shape, dtype=torch.float32, device=x.device)
                    grad_v = torch.zeros_like(grad_k)
            _project_queries(x, wq, q_norm_weight, stage, run, send)
            all_to_all(send, recv_q, run.group)
            _gather_stage_heads(output_heads, stage, send)
            all_to_all(send, recv_out, run.group)
            _project_output_grad(grad_y, wo, stage, d, send)
            all_to_all(send, recv_dout, run.group)
            k, v, kv_index = kv.for_stage(stage, run)
            dq, dk, dv = run.backend.backward(
                heads_view(recv_dout), heads_view(recv_q), k, v, heads_view(recv_out), lse, run.scale
            )
            del k, v
            dk, dv = _fold_expanded(dk, kv_index, kv.k), _fold_expanded(dv, kv_index, kv.v)
            if group_size > 1:
                grad_k += seq_major(dk)
                grad_v += seq_major(dv)
            else:  # a KV group with one query stage: nothing to sum, send the kernel's dK/dV
                grad_k, grad_v = seq_major(dk), seq_major(dv)
            del dk, dv
            seq_major(heads_view(send)).copy_(seq_major(dq))
            del dq
            all_to_all(send, recv_q, run.group)  # dQ of my tokens, chunk j = rank j's heads
            for rank, heads in enumerate(stage.query_heads_per_rank):
                # These heads' output slots were last read above (recv_out): they now keep the
                # gradient of the heads' projections until dX.
                slot = output_heads[:, :, heads[0] : heads[-1] + 1] if needs_x else None
                proj.backprop(
                    x, wq, heads, recv_q[rank].transpose(0, 1), grad_projection=slot, grad_weight=acc.wq,
                    norm_weight=q_norm_weight, grad_norm_weight=acc.q_norm, use_norm=run.qk_norm,
                )
        del kv
        _flush_kv_grads(x, wk, wv, k_norm_weight, kv_stage, grad_k, grad_v, acc, grads, run, buffers)
        del grad_k, grad_v
        grad_x = grads.input_grad(wq).view(b, seq, dim) if needs_x else None
        # The all-to-all buffers go last: freed earlier, the dX GEMM's peak would depend on when
        # gloo's thread lets go of them (module docstring). At the paper's shapes the kernel
        # moment, not this one, is the backward peak, so keeping them costs nothing there.
        del grads, buffers, send, recv_q, recv_out, recv_dout
        grad_wq, grad_wk, grad_wv, grad_q_norm, grad_k_norm = acc.cast(weights)
        return grad_x, grad_wq, grad_wk, grad_wv, grad_wo, grad_q_norm, grad_k_norm, None


def _flush_kv_grads(x: Tensor, wk: Tensor, wv: Tensor, k_norm_weight: Tensor | None, stage: Stage,
                    grad_k: Tensor, grad_v: Tensor, acc: WeightGradAccumulators, grads: ProjectionGrads | None,
                    run: AttentionRun, buffers: StageBuffers) -> None:
    """Send a finished KV group's dK/dV (``[S, B, h_kv, D]``) back to the ranks that own the
    tokens, backprop them through K's norm/RoPE into the weight accumulators, and keep their
    projections' gradients (one new ``grads.kv`` buffer) for dX."""
    b, seq, _ = x.shape
    n_kv, d = len(stage.kv_heads_per_rank[0]), run.head_dim
    send, recv = buffers.view(buffers.send, n_kv), buffers.view(buffers.recv[0], n_kv)
    runs = stage.kv_destinations()
    width = sum(len(heads) for heads, _ in runs) * d
    group_grads = x.new_empty(b * seq, 2 * width) if grads is not None else None
    column = 0
    for grad_full, weight, is_key in ((grad_k, wk, True), (grad_v, wv, False)):
        # Communicated in the model dtype like every other activation gradient.
        send.view(grad_full.shape).copy_(grad_full)
        all_to_all(send, recv, run.group)
        for heads, ranks in runs:
            # Replicated K/V (C > KV): the copies' gradients add up, in fp32.
            grad_kv = recv[ranks[0]] if len(ranks) == 1 else recv[ranks].float().sum(0).to(x.dtype)
            slot = None
            if group_grads is not None:
                cols = len(heads) * d
                slot = group_grads[:, column : column + cols].view(b, seq, len(heads), d)
                grads.kv_rows.append(run.projection.rows(weight, heads))
                column += cols
            run.projection.backprop(
                x, weight, heads, grad_kv.transpose(0, 1), grad_projection=slot,
                grad_weight=acc.wk if is_key else acc.wv,
                norm_weight=k_norm_weight if is_key else None,
                grad_norm_weight=acc.k_norm if is_key else None,
                use_rope=is_key, use_norm=is_key and run.qk_norm,
            )
            del grad_kv
    if group_grads is not None:
        grads.kv.append(group_grads)
