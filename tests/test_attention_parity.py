"""Ulysses and UPipe against the unconverted single-process TorchTitan attention.

Every case builds a Llama3 or Qwen3 ``Attention`` from TorchTitan's model args (head_dim 16),
runs it on the full sequence as the reference, then converts the *same* module and runs it
on each rank's shard over real gloo process groups (C = 2, 4, 8). Outputs, dX and the
gradients of wq/wk/wv/wo (and q_norm/k_norm) must match: fp32 to 1e-5 and bf16 to 2e-2,
both as max|error| / max|reference| per tensor. Weight gradients are summed over ranks
first (what FSDP's reduce-scatter does in training).

One process group per world size runs all its cases; each case is its own test.
Two cases are built to fail (a schedule that reuses stale K/V, wrong RoPE positions) to
show the comparison detects a wrong head or position mapping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

FP32_TOL = 1e-5
BF16_TOL = 2e-2
HEAD_DIM = 16


@dataclass(frozen=True)
class Case:
    model: str  # "llama3" | "qwen3"
    n_heads: int
    n_kv_heads: int
    mode: str  # "ulysses" | "upipe"
    heads_per_stage: int | None
    seq_len: int
    batch: int
    dtype: str = "float32"
    positions: str = "derived"  # "derived" (None), "1d", "batch" ([B, L] with per-sample offsets)
    backend: str = "sdpa"
    sabotage: str = ""  # "", "schedule", "positions", "documents" (mask not passed): must NOT match
    documents: bool = False  # packed documents (``document_ids``) under a document mask

    @property
    def id(self) -> str:
        u = "" if self.mode == "ulysses" else f"U{self.heads_per_stage}"
        extra = "".join(f"-{v}" for v in (self.positions if self.positions != "derived" else "",
                                          self.backend if self.backend != "sdpa" else "",
                                          "docs" if self.documents else "", self.sabotage) if v)
        return (f"{self.model}-H{self.n_heads}KV{self.n_kv_heads}-{self.mode}{u}-S{self.seq_len}"
                f"B{self.batch}-{self.dtype}{extra}")


LAYOUTS = ((8, 8), (8, 2), (16, 4), (32, 8))


def _cases(world: int) -> list[Case]:
    from titan_upipe.attention import valid_cp_degrees, valid_heads_per_stage

    if world == 1:  # a 1-rank mesh is accepted and is the unconverted module
        return [Case("llama3", 8, 2, "upipe", None, 8, 2), Case("qwen3", 16, 4, "upipe", 8, 12, 1),
                Case("qwen3", 8, 8, "ulysses", None, 8, 2)]
    cases: list[Case] = []
    i = 0
    for n_heads, n_kv in LAYOUTS:
        if world not in valid_cp_degrees(n_heads, n_kv):
            continue
        us = sorted({u for u in (world, 2 * world, n_heads) if u in valid_heads_per_stage(n_heads, world)})
        for model in ("llama3", "qwen3"):
            for mode, u in [("ulysses", None)] + [("upipe", u) for u in us]:
                seq = world * (4, 8, 6)[i % 3]
                cases.append(Case(model, n_heads, n_kv, mode, u, seq, batch=1 + i % 2))
                i += 1
    # bf16, explicit positions, the math backend, and the deliberately wrong runs.
    cases += [
        Case("qwen3", 16, 4, "upipe", world, world * 8, 2, dtype="bfloat16"),
        Case("llama3", 8, 2, "upipe", world, world * 8, 1, dtype="bfloat16"),
        Case("llama3", 8, 2, "ulysses", None, world * 8, 2, dtype="bfloat16"),
        Case("qwen3", 8, 2, "upipe", world, world * 4, 2, positions="batch"),
        Case("llama3", 16, 4, "upipe", world, world * 4, 2, positions="batch"),
        Case("llama3", 8, 8, "ulysses", None, world * 4, 1, positions="1d"),
        Case("qwen3", 16, 4, "upipe", world, world * 4, 2, backend="math"),
        Case("qwen3", 16, 16, "upipe", world, world * 4, 1, sabotage="schedule"),
        Case("llama3", 8, 8, "upipe", world, world * 4, 1, sabotage="positions"),
    ]
    if world in (2, 4):  # packed documents: MHA and GQA, both models, U = C and 2C
        cases += [
            Case("llama3", 8, 2, "upipe", world, world * 8, 2, documents=True),
            Case("qwen3", 16, 4, "upipe", 2 * world, world * 8, 2, documents=True),
            Case("llama3", 8, 8, "ulysses", None, world * 8, 2, documents=True),
            Case("qwen3", 8, 8, "ulysses", None, world * 8, 2, documents=True, sabotage="documents"),
        ]
    if world == 2:
        cases.append(Case("qwen3", 8, 2, "upipe", 2, 16, 2, dtype="bfloat16", documents=True))
    if world == 2:  # U/C = 3 heads per rank, groups of 4: stages hold 1 or 2 KV heads
        cases += [Case("qwen3", 24, 6, "upipe", 6, 12, 2), Case("llama3", 24, 6, "upipe", 6, 16, 1)]
    return cases


def build_reference(model: str, n_heads: int, n_kv_heads: int, max_seq_len: int):
    """A TorchTitan attention module and its model's full RoPE table."""
    if model == "llama3":
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Attention, precompute_freqs_cis

        args = TransformerModelArgs(dim=n_heads * HEAD_DIM, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                    max_seq_len=max_seq_len)
        module = Attention(args)
        table = precompute_freqs_cis(HEAD_DIM, args.max_seq_len, args.rope_theta, args.rope_scaling_args)
    else:
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Attention, precompute_rope_cache

        args = Qwen3ModelArgs(dim=48, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=HEAD_DIM,
                              qk_norm=True, max_seq_len=max_seq_len, rope_theta=1000.0)
        module = Attention(args)
        with torch.no_grad():  # non-trivial norm weights so their gradients are checked properly
            module.q_norm.weight.uniform_(0.5, 1.5)
            module.k_norm.weight.uniform_(0.5, 1.5)
        table = precompute_rope_cache(HEAD_DIM, args.max_seq_len, args.rope_theta)
    return module, table


def document_ids(batch: int, seq_len: int) -> torch.Tensor:
    """``[B, S]`` ids: row 0 splits after token 1 (a 1-token document) and after S/2 + 1 (a document
    across the shard boundaries); row 1 after 3, 4 (1 token) and S - 5; other rows one document."""
    splits = {0: (1, seq_len // 2 + 1), 1: (3, 4, seq_len - 5)}
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        for start in splits.get(row, ()):
            ids[row, start:] += 1
    return ids


def document_reference(module, x: torch.Tensor, table, ids: torch.Tensor, grad_y: torch.Tensor):
    """``reference_results`` with the unconverted module run on each document separately (its
    tokens at their global positions: RoPE stays global)."""
    x_ref = x.clone().requires_grad_(True)
    rows = []
    for row in range(x.shape[0]):
        _, counts = torch.unique_consecutive(ids[row], return_counts=True)
        starts = [0, *torch.cumsum(counts, 0).tolist()]
        rows.append(torch.cat([module(x_ref[row:row + 1, a:c], table, None, torch.arange(a, c).unsqueeze(0))[0]
                               for a, c in zip(starts[:-1], starts[1:], strict=True)]))
    y_ref = torch.stack(rows)
    y_ref.backward(grad_y)
    ref = {"out": y_ref.detach(), "dx": x_ref.grad}
    ref.update({f"d{name}": p.grad.clone() for name, p in module.named_parameters()})
    module.zero_grad(set_to_none=True)
    return ref


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def case_inputs(case, seed: int):
    """The unconverted module (in the case's dtype), its RoPE table, input, output gradient and
    positions (``case.positions``: None, "1d" ``[1, S]`` or "batch" ``[B, S]``, per-sequence offsets)."""
    dtype = getattr(torch, case.dtype)
    torch.manual_seed(seed)
    module, table = build_reference(case.model, case.n_heads, case.n_kv_heads, max_seq_len=4 * case.seq_len)
    module = module.to(dtype)
    dim = module.wq.in_features
    x = torch.randn(case.batch, case.seq_len, dim, dtype=dtype)
    grad_y = torch.randn(case.batch, case.seq_len, dim, dtype=dtype)
    positions = None
    if case.positions == "1d":
        positions = torch.arange(case.seq_len).unsqueeze(0)
    elif case.positions == "batch":
        positions = torch.arange(case.seq_len).unsqueeze(0) + 3 * torch.arange(1, case.batch + 1).unsqueeze(1)
    return module, table, x, grad_y, positions


def reference_results(module, x: torch.Tensor, table, positions, grad_y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients (input and every parameter) of the unconverted single-process module;
    leaves the module's gradients cleared."""
    x_ref = x.clone().requires_grad_(True)
    y_ref = module(x_ref, table, None, positions)
    y_ref.backward(grad_y)
    ref = {"out": y_ref.detach(), "dx": x_ref.grad}
    ref.update({f"d{name}": p.grad.clone() for name, p in module.named_parameters()})
    module.zero_grad(set_to_none=True)
    return ref


def parallel_errors(converted, y: torch.Tensor, x_local: torch.Tensor, gather, group,
                    ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative errors of the gathered output and input gradient and of the parameter
    gradients summed over the CP ranks (in fp32, like FSDP's reduce_dtype) against ``ref``."""
    got = {"out": gather(y), "dx": gather(x_local.grad)}
    for name, p in converted.named_parameters():
        grad = p.grad.float()
        dist.all_reduce(grad, group=group)
        got[f"d{name}"] = grad
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    return {name: _rel_err(got[name], ref[name]) for name in ref}


def _run_cases(rank: int, world: int, mesh, run, cases: list, seed_base: int) -> dict[str, dict[str, float]]:
    return {case.id: run(case, mesh, seed=seed_base + i) for i, case in enumerate(cases)}


def run_cases(world: int, run, cases: list, seed_base: int) -> dict[str, dict[str, float]]:
    """``run(case, mesh, seed)`` for every case in one ``world``-rank gloo job; rank 0's errors."""
    return run_distributed(world, _run_cases, run, cases, seed_base, timeout=600)[0]


def _sabotage_schedule(schedule):
    """Skip every K/V exchange after the first: later stages attend stale K/V heads."""
    stages = tuple(dataclasses.replace(s, sends_kv=s.index == 0) for s in schedule.stages)
    assert stages != schedule.stages, "the sabotage must change something"
    return dataclasses.replace(schedule, stages=stages)


def run_case(case: Case, mesh, seed: int) -> dict[str, float]:
    from titan_upipe.attention import convert_attention
    from titan_upipe.parallel import gather_sequence, shard_sequence

    module, table, x, grad_y, positions = case_inputs(case, seed)

    masks = None
    if case.documents:
        from titan_upipe.parallel.document_mask import document_mask

        ids = document_ids(case.batch, case.seq_len)
        ref = document_reference(module, x, table, ids, grad_y)
        masks = None if case.sabotage == "documents" else document_mask(ids, mesh)
    else:
        ref = reference_results(module, x, table, positions, grad_y)

    converted = convert_attention(module, case.mode, mesh, heads_per_stage=case.heads_per_stage,
                                  backend=case.backend)
    if case.sabotage == "schedule":
        converted.schedule = _sabotage_schedule(converted.schedule)
    x_local, local_positions = shard_sequence(x, mesh, seq_dim=1)
    x_local.requires_grad_(True)
    if positions is not None:
        local_positions = shard_sequence(positions, mesh, seq_dim=1)[0]
        if case.positions == "1d":
            local_positions = local_positions[0]
    elif case.sabotage == "positions":
        local_positions = torch.arange(x_local.shape[1])  # every rank claims to start at 0
    else:
        local_positions = None
    y = converted(x_local, table, masks, positions=local_positions)
    y.backward(shard_sequence(grad_y, mesh, seq_dim=1)[0])

    assert all(a is b for a, b in zip(converted.parameters(), module.parameters(), strict=True))
    return parallel_errors(converted, y, x_local, lambda t: gather_sequence(t, mesh, 1), mesh.get_group(), ref)


_RESULTS: dict[int, dict[str, dict[str, float]]] = {}


def results_for(world: int) -> dict[str, dict[str, float]]:
    if world not in _RESULTS:
        _RESULTS[world] = run_cases(world, run_case, _cases(world), seed_base=1000)
    return _RESULTS[world]


PARAMS = [pytest.param(world, case, id=f"C{world}-{case.id}") for world in (1, 2, 4, 8) for case in _cases(world)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_matches_unconverted_module(world: int, case: Case) -> None:
    errors = results_for(world)[case.id]
    expected_keys = {"out", "dx", "dwq.weight", "dwk.weight", "dwv.weight", "dwo.weight"}
    if case.model == "qwen3":
        expected_keys |= {"dq_norm.weight", "dk_norm.weight"}
    assert set(errors) == expected_keys
    tol = FP32_TOL if case.dtype == "float32" else BF16_TOL
    worst = max(errors.values())
    if case.sabotage:
        # A wrong KV mapping or wrong positions must be visible far above tolerance.
        assert errors["out"] > 100 * tol, errors
    else:
        assert worst <= tol, errors


def test_matrix_covers_the_issue() -> None:
    """The parity matrix includes every C, head layout, U choice, model and C > KV case."""
    ids = {(w, c.n_heads, c.n_kv_heads, c.heads_per_stage, c.model, c.mode) for w in (2, 4, 8) for c in _cases(w)
           if not c.sabotage}
    for world in (2, 4, 8):
        for model in ("llama3", "qwen3"):
            assert (world, 32, 8, world, model, "upipe") in ids
            assert (world, 32, 8, 32, model, "upipe") in ids
            assert (world, 8, 8, None, model, "ulysses") in ids
    assert (4, 8, 2, 4, "qwen3", "upipe") in ids and (8, 8, 2, 8, "qwen3", "upipe") in ids  # C > KV
    assert (8, 16, 4, 16, "llama3", "upipe") in ids  # U = 2C with C > KV
