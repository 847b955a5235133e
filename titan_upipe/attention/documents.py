"""Packed documents: block-causal masks over global positions, and exact masked local kernels.

A packed row of ``S`` tokens holds several documents, each one contiguous run. Token ``i``
of row ``b`` belongs to document ``doc[b, i]``; a query at global position ``i`` sees the key
at global position ``j`` iff::

    visible[b, i, j] = (j <= i) and (doc[b, i] == doc[b, j])

Positions are *global* indices into the sequence, as a context-parallel layout hands them
out (``ContiguousLayout.positions(rank)``, ``ZigzagLayout.positions(rank)``), so a rank can
ask about its own shard or about any (query shard, key shard) block of a ring step.

What is here (single process, no collectives):

* ``DocumentMask``: the document of every token, from document ids (``from_ids``) or from
  EOS tokens (``from_eos``, TorchTitan's ``block_causal`` rule: the EOS token ends its
  document, the token after it starts the next); ``visible``, ``block_kind`` (skip / masked /
  causal / full: whether a block needs the masked kernel at all), ``segments`` and
  ``cu_seqlens`` (varlen runs of one block), ``positions`` (position inside the document,
  for datasets that want per-document RoPE; RoPE stays global by default).
* ``masked_forward`` / ``masked_backward``: exact fp32 attention under an arbitrary
  ``[B, Sq, Sk]`` mask, honouring the merged out/lse contract of ``backends.py``; rows with
  no visible key give ``out = 0``, ``lse = -inf`` and zero gradient.
* ``segmented_causal_forward`` / ``segmented_causal_backward``: a diagonal block as causal
  attention on each document segment through a local backend (torch SDPA by default),
  exact when every document of the block is one segment (``segments_are_exact``): one varlen
  (``cu_seqlens``) call for the whole batch with a flash-attn backend, else one call per
  segment, which CUDA refuses (``document_kernel_problem``).

Tensors use the SDPA layout of ``backends.py``: ``q [B, Hq, Sq, D]``, ``k``/``v``
``[B, Hkv, Sk, D]``, ``Hq`` a multiple of ``Hkv`` (GQA), ``lse`` fp32 ``[B, Hq, Sq]``.
"""

from __future__ import annotations

import torch

from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, LocalAttentionBackend, SdpaBackend
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import DocumentMask, Segment, SegmentTable

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Exact masked kernel (fp32)
# ---------------------------------------------------------------------------------------------


def _grouped_scores(q: Tensor, k: Tensor, scale: float, mask: Tensor) -> Tensor:
    """``s = scale q k^T`` in fp32, ``-inf`` where ``mask`` is False: ``[B, Hkv, G, Sq, Sk]``,
    with ``G = Hq / Hkv`` query heads per KV head (GQA)."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if mask.shape != (b, sq, k.shape[2]):
        raise ValueError(f"mask shape {tuple(mask.shape)}, expected {(b, sq, k.shape[2])}")
    qg = q.float().reshape(b, hkv, hq // hkv, sq, d)
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (a row with no visible key) replaced by 0, so ``exp(s - lse)`` is
    ``exp(-inf) = 0`` on that row instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _probabilities(scores: Tensor, lse_g: Tensor) -> Tensor:
    """``P = exp(s - lse)``, ``[B, Hkv, G, Sq, Sk]``; 0 on masked entries and empty rows."""
    return torch.exp(scores - _finite(lse_g).unsqueeze(-1))


def masked_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``lse_i = log sum_{j: mask_ij} exp(scale q_i . k_j)`` (fp32 ``[B, Hq, Sq]``, ``-inf`` on a
    row with no visible key) and ``out_i = sum_j exp(scale q_i . k_j - lse_i) v_j`` (q's dtype,
    ``[B, Hq, Sq, D]``, 0 on such a row). ``mask`` is bool ``[B, Sq, Sk]``, shared by the heads."""
    scores = _grouped_scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(_probabilities(scores, lse), v.float().unsqueeze(2))
    b, hq, sq, d = q.shape
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def masked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                    mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This block's gradient given the *merged* ``out``/``lse`` (``backends.py`` contract), fp32::

        P = exp(s - lse) (0 where masked),  delta_i = sum_d dout_id out_id,
        dS = P * (dout v^T - delta),  dq = scale dS k,  dk = scale dS^T q,  dv = P^T dout

    ``dk``/``dv`` are summed over the query heads of each KV head. A row with ``lse = -inf``
    or no visible key in this block has ``P = 0``: it contributes nothing."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    scores = _grouped_scores(q, k, scale, mask)
    probs = _probabilities(scores, lse.reshape(b, hkv, hq // hkv, sq))
    do = dout.float().reshape(b, hkv, hq // hkv, sq, d)
    delta = (do * out.float().reshape(b, hkv, hq // hkv, sq, d)).sum(dim=-1, keepdim=True)
    dscores = probs * (torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2)) - delta)
    dq = torch.matmul(dscores, k.float().unsqueeze(2)) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q.float().reshape(b, hkv, hq // hkv, sq, d)).sum(2) * scale
    dv = torch.matmul(probs.transpose(-1, -2), do).sum(2)
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Segmented fast path for diagonal blocks
# ---------------------------------------------------------------------------------------------


def document_kernel_problem(backend: LocalAttentionBackend | type[LocalAttentionBackend],
                            device_type: str) -> str | None:
    """None when ``backend`` (an instance or its class) runs packed documents well on
    ``device_type``, else why not, in one line. On CUDA a document block needs one varlen kernel
    call (``backend.varlen``): without it every document of every row is a kernel launch of its
    own. On CPU (and meta) the per-segment loop is the exact path and is allowed."""
    if device_type != "cuda" or getattr(backend, "varlen", False):
        return None
    choices = [BACKENDS[name] for name in AUTO_ORDER if BACKENDS[name].varlen]  # fastest first
    return (f"attention backend {backend.name!r} has no varlen (cu_seqlens) kernel, so packed documents on CUDA "
            f"would run one kernel call per document: set attention_backend to one of "
            f"{', '.join(c.name for c in choices)} (install one of "
            f"{', '.join(getattr(c, 'distribution', c.name) for c in choices)} with pip)")


def _packed(t: Tensor) -> Tensor:
    """``[B, H, S, D] -> [B*S, H, D]``: the rows' tokens end to end (a view when ``t`` is a
    transposed ``[B, S, H, D]`` tensor, as the projections make it)."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def _unpacked(t: Tensor, batch: int) -> Tensor:
    """``[B*S, H, D] -> [B, H, S, D]``, a view."""
    return t.reshape(batch, -1, *t.shape[1:]).transpose(1, 2)


def _as_table(segments: list[list[Segment]] | SegmentTable) -> SegmentTable:
    return segments if isinstance(segments, SegmentTable) else SegmentTable(segments)


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: SegmentTable,
                    backend: LocalAttentionBackend) -> tuple[Tensor, Tensor]:
    """Every segment of every row in one ``backend.varlen_forward``; ``lse [Hq, B*S] -> [B, Hq, S]``."""
    b, hq, s, _ = q.shape
    cu_seqlens, longest = segments.boundaries(s, q.device)
    out, lse = backend.varlen_forward(_packed(q), _packed(k), _packed(v), scale, cu_seqlens, longest)
    return _unpacked(out, b), lse.reshape(hq, b, s).transpose(0, 1).contiguous()


def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                     segments: SegmentTable, backend: LocalAttentionBackend) -> tuple[Tensor, Tensor, Tensor]:
    """The gradient of ``_varlen_forward`` in one ``backend.varlen_backward``, from the merged out/lse."""
    b, hq, s, _ = q.shape
    cu_seqlens, longest = segments.boundaries(s, q.device)
    packed_lse = lse.transpose(0, 1).reshape(hq, b * s)  # [B, Hq, S] -> [Hq, B*S]
    grads = backend.varlen_backward(_packed(dout), _packed(q), _packed(k), _packed(v), _packed(out),
                                    packed_lse.contiguous(), scale, cu_seqlens, longest)
    return tuple(_unpacked(g, b) for g in grads)  # type: ignore[return-value]


def _loop_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: list[list[Segment]],
                  backend: LocalAttentionBackend) -> tuple[Tensor, Tensor]:
    """One ``backend.forward(causal=True)`` per segment of each row (the exact CPU path)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for row, segs in enumerate(segments):
        for start, stop in segs:
            piece = (slice(row, row + 1), slice(None), slice(start, stop))
            o, s = backend.forward(q[piece], k[piece], v[piece], scale, causal=True)
            out[piece], lse[piece] = o, s
    return out, lse


def _loop_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   segments: list[list[Segment]], backend: LocalAttentionBackend) -> tuple[Tensor, Tensor, Tensor]:
    """One ``backend.backward(causal=True)`` per segment of each row, from the merged out/lse."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for row, segs in enumerate(segments):
        for start, stop in segs:
            piece = (slice(row, row + 1), slice(None), slice(start, stop))
            grads = backend.backward(dout[piece], q[piece], k[piece], v[piece], out[piece],
                                     lse[piece].contiguous(), scale, causal=True)
            dq[piece], dk[piece], dv[piece] = grads
    return dq, dk, dv


def segmented_causal_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                             segments: list[list[Segment]] | SegmentTable,
                             backend: LocalAttentionBackend | None = None) -> tuple[Tensor, Tensor]:
    """A diagonal block (``q``, ``k``, ``v`` of the same positions) as causal attention inside
    each segment: for row ``b`` and segment ``[a, c)``, ``out[b, :, a:c], lse[b, :, a:c] =
    backend.forward(q[b, :, a:c], k[b, :, a:c], v[b, :, a:c], causal=True)``.

    Equal to ``masked_forward`` with ``visible(pos, pos)`` when ``segments`` come from
    ``DocumentMask.segments(pos)`` and ``segments_are_exact(pos)``. ``backend``: torch SDPA by
    default. A backend with ``varlen`` runs every segment of the batch in one varlen call;
    otherwise one call per segment, which only CPU allows (``document_kernel_problem``).
    ``segments`` may be a ``SegmentTable`` (``DocumentMask.table``): checked and moved once per step."""
    backend = SdpaBackend() if backend is None else backend
    problem = document_kernel_problem(backend, q.device.type)
    if problem is not None:
        raise ConfigError(problem)
    table = _as_table(segments)
    table.check(q)
    if getattr(backend, "varlen", False):  # duck-typed test backends have no flag
        return _varlen_forward(q, k, v, scale, table, backend)
    return _loop_forward(q, k, v, scale, table.rows, backend)


def segmented_causal_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              scale: float, segments: list[list[Segment]] | SegmentTable,
                              backend: LocalAttentionBackend | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradient of ``segmented_causal_forward`` given the merged ``out``/``lse``: each
    segment's ``backend.backward(..., causal=True)`` written into its rows of ``dq, dk, dv``
    (one ``varlen_backward`` for the whole batch with a varlen backend)."""
    table = _as_table(segments)
    table.check(q)
    backend = SdpaBackend() if backend is None else backend
    if getattr(backend, "varlen", False):
        return _varlen_backward(dout, q, k, v, out, lse, scale, table, backend)
    return _loop_backward(dout, q, k, v, out, lse, scale, table.rows, backend)


class DocumentMaskedBackend(LocalAttentionBackend):
    """``inner`` run causally on each document of a whole head-sharded sequence: block-causal attention.

    After Ulysses' (or a UPipe stage's) all-to-all a rank holds global positions ``0 .. S-1`` of its
    heads, so every document is one segment ``[a, c)`` of each row and ``out[b, :, a:c], lse[b, :, a:c]
    = inner.forward(q[b, :, a:c], k[b, :, a:c], v[b, :, a:c], causal=True)``; the backward is each
    segment's, given the merged out/lse (the contract of ``backends.py``)."""

    def __init__(self, inner: LocalAttentionBackend, mask: DocumentMask) -> None:
        self.inner = inner
        self.name = inner.name
        self.merged_backward = inner.merged_backward
        self.segments = mask.document_segments
        self.table = mask.table(self.segments)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
        self._check_causal(causal)
        return segmented_causal_forward(q, k, v, scale, self.table, self.inner)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        self._check_causal(causal)
        return segmented_causal_backward(dout, q, k, v, out, lse, scale, self.table, self.inner)

    @staticmethod
    def _check_causal(causal: bool) -> None:
        if not causal:
            raise ConfigError("a document-masked kernel runs whole sequences (causal blocks) only")
