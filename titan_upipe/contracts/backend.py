"""The local-attention backend contract (``backends.py``), as a check any backend can be put to.

Keys (and, for causal attention, queries) are split into two halves, as ring attention
splits them across ranks. The forward runs block by block and merges by LSE; each block's
backward then gets the *merged* ``out``/``lse`` and the block gradients are summed:

=========== ================================================ ==============================
case        blocks (query rows x key rows, kind)             merged over
=========== ================================================ ==============================
full        [0,S) x [0,h) full;  [0,S) x [h,S) full           both blocks, every row
causal      [0,h) x [0,h) causal; [h,S) x [0,h) full;         rows [h,S): blocks 2 and 3
            [h,S) x [h,S) causal
=========== ================================================ ==============================

(``h = S/2``). The merged output and the summed gradients must equal the whole attention's,
computed in fp64 by autograd. The tolerance is tied to the dtype's own error, measured, not
a constant: plain attention (``softmax(q k^T) v`` and its autograd backward, computed in the
case's dtype on the same device) is compared with the fp64 reference, and both the backend's
whole-attention call and its split run may be at most ``ERROR_FACTOR`` times that error
(plus a quarter of the dtype's epsilon, at least ``ABSOLUTE_FLOOR``, for tensors where plain attention happens to be
nearly exact). A backward that recomputes its own block's softmax instead of using the merged
one is off by O(1) and fails (``tests/test_backend_contract.py`` shows it, and that a 1 %
error in one gradient fails in fp32).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from titan_upipe.attention.backends import LocalAttentionBackend

Tensor = torch.Tensor

ERROR_FACTOR = 4.0
"""How much larger than plain attention's error in the same dtype a backend's may be (fused
kernels are usually *more* accurate; the split run also rounds each block's output to the
dtype before the fp32 merge)."""

ABSOLUTE_FLOOR = 2.0**-18
"""Least relative error always allowed (3.8e-6, 32 fp32 ulps; far below bf16's eps/4, so only fp32
cases see it). In fp32, plain attention through cuBLAS is accurate to a few ulps, and a fused kernel
summing in another order is a few ulps off too: SDPA's fp32 kernel on an H100 (2026-11-23) was
1.63e-6 off where 4x plain attention's error allowed 1.56e-6. A wrong kernel is off by O(1e-2)."""

TENSORS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class ContractCase:
    causal: bool
    n_heads: int
    n_kv_heads: int
    dtype: torch.dtype
    seq_len: int = 64
    head_dim: int = 64
    batch: int = 2
    scale: float = 0.1
    """Not ``head_dim ** -0.5``: a kernel that ignored the scale it is given would pass otherwise."""

    @property
    def id(self) -> str:
        kind = "causal" if self.causal else "full"
        shape = "" if (self.seq_len, self.head_dim) == (64, 64) else f"-S{self.seq_len}D{self.head_dim}"
        return f"{kind}-H{self.n_heads}KV{self.n_kv_heads}{shape}-{str(self.dtype).removeprefix('torch.')}"


def contract_cases(dtypes: tuple[torch.dtype, ...]) -> list[ContractCase]:
    """Causal and full blocks, GQA 4:1 and MHA, in each dtype; plus Llama3/Qwen3's head_dim 128
    with blocks of 100 rows (not a multiple of the kernels' 32/64/128-row tiles and LSE padding)."""
    small = [ContractCase(causal, h, kv, dtype) for dtype in dtypes for causal in (True, False)
             for h, kv in ((8, 2), (4, 4))]
    return small + [ContractCase(True, 8, 2, dtype, seq_len=200, head_dim=128, batch=1) for dtype in dtypes]


@dataclass(frozen=True)
class ContractResult:
    case: str
    backend: str
    dtype_error: dict[str, float]
    """max|x - ref| / max|ref| of plain attention computed in the case's dtype, per tensor."""
    whole: dict[str, float]
    """The same for the backend's one call over the whole attention."""
    split: dict[str, float]
    """The same for the backend's two-block run with merged out/lse."""
    allowed: dict[str, float]

    @property
    def ok(self) -> bool:
        return all(max(self.whole[n], self.split[n]) <= self.allowed[n] for n in TENSORS)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _inputs(case: ContractCase, device: torch.device | str, seed: int = 0) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    b, s, d = case.batch, case.seq_len, case.head_dim

    def rand(heads: int) -> Tensor:
        return torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)

    q, k, v, dout = rand(case.n_heads), rand(case.n_kv_heads), rand(case.n_kv_heads), rand(case.n_heads)
    return tuple(t.to(device=device, dtype=case.dtype) for t in (q, k, v, dout))


def plain_attention(case: ContractCase, q: Tensor, k: Tensor, v: Tensor, dout: Tensor,
                    dtype: torch.dtype) -> dict[str, Tensor]:
    """``softmax(scale q k^T + mask) v`` and its gradients by autograd, every op in ``dtype``
    on the inputs' device: fp64 is the reference, the case's dtype its own error."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    n_rep = case.n_heads // case.n_kv_heads
    scores = qd @ kd.repeat_interleave(n_rep, 1).transpose(-1, -2) * case.scale
    if case.causal:
        s = case.seq_len
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vd.repeat_interleave(n_rep, 1)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout.to(dtype))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _merge(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """LSE-merge block results in fp32; the output handed to backward is in the input dtype."""
    lse = torch.logsumexp(torch.stack([p_lse for _, p_lse in parts]), dim=0)
    out = sum(p_out.float() * torch.exp(p_lse - lse).unsqueeze(-1) for p_out, p_lse in parts)
    return out.to(dtype), lse


def _rows(t: Tensor, start: int, stop: int) -> Tensor:
    return t[:, :, start:stop]


def split_run(backend: LocalAttentionBackend, case: ContractCase, q: Tensor, k: Tensor, v: Tensor,
              dout: Tensor) -> dict[str, Tensor]:
    """Forward by blocks merged by LSE, each block's backward from the merged out/lse, summed."""
    s, h, scale = case.seq_len, case.seq_len // 2, case.scale
    # (query rows, key rows, causal) of each block
    if case.causal:
        blocks = [((0, h), (0, h), True), ((h, s), (0, h), False), ((h, s), (h, s), True)]
    else:
        blocks = [((0, s), (0, h), False), ((0, s), (h, s), False)]
    results = [backend.forward(_rows(q, *qr), _rows(k, *kr), _rows(v, *kr), scale, causal=c) for qr, kr, c in blocks]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows in sorted({qr for qr, _, _ in blocks}):
        merged = _merge([res for (qr, _, _), res in zip(blocks, results, strict=True) if qr == rows], q.dtype)
        _rows(out, *rows).copy_(merged[0])
        _rows(lse, *rows).copy_(merged[1])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for qr, kr, c in blocks:
        bq, bk, bv = backend.backward(_rows(dout, *qr), _rows(q, *qr), _rows(k, *kr), _rows(v, *kr),
                                      _rows(out, *qr), _rows(lse, *qr).contiguous(), scale, causal=c)
        _rows(dq, *qr).add_(bq.float())
        _rows(dk, *kr).add_(bk.float())
        _rows(dv, *kr).add_(bv.float())
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def whole_run(backend: LocalAttentionBackend, case: ContractCase, q: Tensor, k: Tensor, v: Tensor,
              dout: Tensor) -> dict[str, Tensor]:
    """One call over the whole attention: the dtype's own error for this backend."""
    out, lse = backend.forward(q, k, v, case.scale, causal=case.causal)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, case.scale, causal=case.causal)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def relative_errors(got: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, float]:
    return {name: float((got[name].detach().cpu().double() - ref[name]).abs().max() / ref[name].abs().max())
            for name in TENSORS}


def check_contract(backend: LocalAttentionBackend, case: ContractCase,
                   device: torch.device | str = "cpu") -> ContractResult:
    q, k, v, dout = _inputs(case, device)
    ref = {n: t.cpu() for n, t in plain_attention(case, q, k, v, dout, torch.float64).items()}
    dtype_error = relative_errors(plain_attention(case, q, k, v, dout, case.dtype), ref)
    whole = relative_errors(whole_run(backend, case, q, k, v, dout), ref)
    split = relative_errors(split_run(backend, case, q, k, v, dout), ref)
    floor = max(torch.finfo(case.dtype).eps / 4, ABSOLUTE_FLOOR)
    allowed = {n: ERROR_FACTOR * dtype_error[n] + floor for n in TENSORS}
    return ContractResult(case.id, getattr(backend, "name", type(backend).__name__), dtype_error, whole, split,
                          allowed)
