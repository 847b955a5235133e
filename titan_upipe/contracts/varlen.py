"""The varlen kernels' contract (``backends.py``), as a check any backend with ``varlen`` can be put to.

A batch of rows, each cut into documents of random lengths (one of them a single token), runs
through ``documents.segmented_causal_forward/backward``: with a varlen backend that is *one*
``varlen_forward`` and one ``varlen_backward`` for every document of every row. It is compared
with

* the reference: exact fp32 ``masked_forward``/``masked_backward`` under ``DocumentMask.visible``
  (query ``i`` sees key ``j`` iff ``j <= i`` in the same document), and
* the same backend's dense kernel called once per document (the loop the varlen call replaces):
  its error against the reference is the dtype's own error for this backend.

For ``out``, ``lse``, ``dq``, ``dk``, ``dv`` the error is ``max|x - ref| / max|ref|``; the varlen
error may be at most ``ERROR_FACTOR`` times the per-document error plus a quarter of the dtype's
epsilon, and the per-document error itself at most ``LOOP_SANITY`` (a broken dense kernel would
make the yardstick meaningless). Each path's backward gets its own forward's out/lse, which for
a whole attention is the merged out/lse of the contract. A varlen LSE laid out wrongly
(tokens and heads swapped, padded per sequence) or a packing error is off by O(1) and fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_upipe.attention.backends import LocalAttentionBackend
from titan_upipe.attention.documents import (
    _loop_backward,
    _loop_forward,
    masked_backward,
    masked_forward,
    segmented_causal_backward,
    segmented_causal_forward,
)
from titan_upipe.contracts.backend import ERROR_FACTOR
from titan_upipe.parallel.document_mask import DocumentMask

Tensor = torch.Tensor

TENSORS = ("out", "lse", "dq", "dk", "dv")
LOOP_SANITY = 0.05
"""Largest per-document (dense kernel) error against fp32 that still reads as half-precision
rounding; above it the dense kernel itself is wrong and the comparison means nothing."""


@dataclass(frozen=True)
class VarlenCase:
    n_heads: int
    n_kv_heads: int
    dtype: torch.dtype
    seq_len: int = 256
    head_dim: int = 64
    batch: int = 2
    scale: float = 0.1
    """Not ``head_dim ** -0.5``: a kernel that ignored the scale it is given would pass otherwise."""
    seed: int = 0

    @property
    def id(self) -> str:
        return (f"docs-H{self.n_heads}KV{self.n_kv_heads}-S{self.seq_len}D{self.head_dim}-"
                f"{str(self.dtype).removeprefix('torch.')}")


def varlen_cases(dtype: torch.dtype, seq_len: int = 256) -> list[VarlenCase]:
    """MHA and GQA 4:1 at head_dim 64, and GQA at Llama3/Qwen3's head_dim 128."""
    return [VarlenCase(4, 4, dtype, seq_len), VarlenCase(8, 2, dtype, seq_len),
            VarlenCase(8, 2, dtype, seq_len, head_dim=128)]


def document_lengths(seq_len: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Per row, document lengths summing to ``seq_len``: ``2 + row`` random cuts plus a 1-token
    document at a random place, so the rows are split differently."""
    rows = []
    for row in range(batch):
        gen = torch.Generator().manual_seed(seed * 1000 + row)
        cuts = set((torch.randperm(seq_len - 1, generator=gen)[: 2 + row] + 1).tolist())
        single = int(torch.randint(1, seq_len - 1, (1,), generator=gen))
        bounds = [0, *sorted(cuts | {single, single + 1}), seq_len]
        rows.append([stop - start for start, stop in zip(bounds, bounds[1:], strict=False)])
    return rows


def document_ids(lengths: list[list[int]]) -> Tensor:
    """``[B, S]`` int64 ids: document ``n`` of a row repeated over its length."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


@dataclass(frozen=True)
class VarlenResult:
    case: str
    backend: str
    lengths: list[list[int]]
    loop: dict[str, float]
    """max|x - ref| / max|ref| of the backend's dense kernel called once per document."""
    varlen: dict[str, float]
    """The same for its one varlen call over the whole batch."""
    allowed: dict[str, float]

    @property
    def ok(self) -> bool:
        return all(self.varlen[n] <= self.allowed[n] and self.loop[n] <= LOOP_SANITY for n in TENSORS)

    def worst(self) -> str:
        return max(TENSORS, key=lambda n: max(self.varlen[n] / self.allowed[n], self.loop[n] / LOOP_SANITY))


def _inputs(case: VarlenCase, device: torch.device | str) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(case.seed)
    b, s, d = case.batch, case.seq_len, case.head_dim
    shapes = ((b, case.n_heads, s, d), (b, case.n_kv_heads, s, d), (b, case.n_kv_heads, s, d), (b, case.n_heads, s, d))
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=case.dtype) for shape in shapes)


def _run(forward, backward, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> dict[str, Tensor]:
    """One path's forward, then its backward from that forward's out/lse."""
    out, lse = forward(q, k, v)
    dq, dk, dv = backward(dout, q, k, v, out, lse)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _errors(got: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, float]:
    return {n: float((got[n].detach().double() - ref[n].double()).abs().max() / ref[n].double().abs().max())
            for n in TENSORS}


def check_varlen(backend: LocalAttentionBackend, case: VarlenCase,
                 device: torch.device | str = "cuda") -> VarlenResult:
    """The varlen path of ``backend`` on ``case``'s documents against fp32 masked attention,
    within ``ERROR_FACTOR`` times the error of the same backend's per-document dense calls."""
    if not backend.varlen:
        raise ValueError(f"attention backend {backend.name!r} has no varlen kernel to check")
    q, k, v, dout = _inputs(case, device)
    lengths = document_lengths(case.seq_len, case.batch, case.seed)
    mask = DocumentMask.from_ids(document_ids(lengths))
    segments = mask.document_segments
    positions = torch.arange(case.seq_len)
    visible = mask.visible(positions, positions).to(device)
    scale = case.scale
    ref = _run(lambda *t: masked_forward(*t, scale, visible),
               lambda *t: masked_backward(*t, scale, visible), *(t.float() for t in (q, k, v, dout)))
    varlen = _run(lambda *t: segmented_causal_forward(*t, scale, segments, backend),
                  lambda *t: segmented_causal_backward(*t, scale, segments, backend), q, k, v, dout)
    loop = _run(lambda *t: _loop_forward(*t, scale, segments, backend),
                lambda *t: _loop_backward(*t, scale, segments, backend), q, k, v, dout)
    loop_errors = _errors(loop, ref)
    floor = torch.finfo(case.dtype).eps / 4
    return VarlenResult(case.id, backend.name, lengths, loop_errors, _errors(varlen, ref),
                        {n: ERROR_FACTOR * loop_errors[n] + floor for n in TENSORS})
