"""Checks that run before any communication, each raising a ConfigError that names the fix.

A context-parallel attention that discovers a bad head split or an unsupported mask
inside an all-to-all either hangs or fails on one rank only; every check here is
local, so all ranks fail the same way before the first collective.
"""

from __future__ import annotations

import torch

from titan_upipe.config import ConfigError

SUPPORTED_MODES = ("ulysses", "upipe", "ring", "usp")


def check_mode(mode: str) -> None:
    if mode not in SUPPORTED_MODES:
        raise ConfigError(f"unknown context-parallel mode {mode!r}: valid modes are {', '.join(SUPPORTED_MODES)}")


def check_mesh_for_mode(mode: str, ring: int, ulysses: int, ndim: int, is_ring_mesh: bool) -> None:
    """Which meshes each mode runs on (the mesh decides the sequence layout, see
    ``titan_upipe.parallel.mesh``): a mismatch would shard the sequence one way and attend another."""
    if mode == "ulysses" and ndim != 1:
        raise ConfigError("mode 'ulysses' runs on a 1-D CP mesh; on a ('ring', 'ulysses') mesh use mode 'usp'")
    if mode in ("ulysses", "upipe") and is_ring_mesh:
        raise ConfigError(f"a 1-D mesh named 'ring' is sharded zigzag for ring attention: mode {mode!r} needs "
                          "a 1-D CP mesh with another name, or a 2-D ('ring', 'ulysses') mesh (upipe)")
    if mode == "ring" and not (is_ring_mesh or (ndim == 2 and ulysses == 1)):
        raise ConfigError("mode 'ring' needs a 1-D mesh named 'ring' (zigzag layout) or a ('ring', 'ulysses') mesh "
                          "with ulysses size 1: build it with titan_upipe.parallel.context_parallel_mesh(cp_mesh, 'ring')")
    if mode == "usp" and ndim != 2:
        raise ConfigError("mode 'usp' needs a 2-D ('ring', 'ulysses') mesh: build it with "
                          "titan_upipe.parallel.context_parallel_mesh(cp_mesh, 'usp', ulysses_degree)")


def valid_ulysses_degrees(mode: str, cp_degree: int) -> list[int]:
    """``[upipe] ulysses_degree`` values each mode accepts at CP degree ``cp_degree`` (before head checks)."""
    divisors = [d for d in range(1, cp_degree + 1) if cp_degree % d == 0]
    if mode == "ulysses":
        return [0, cp_degree]
    if mode == "ring":
        return [0, 1]
    if mode == "usp":
        return [d for d in divisors if 1 < d < cp_degree]
    return [0, *divisors]  # upipe: 0/C = 1-D UPipe; d < C = UPipe inside USP with d Ulysses ranks


def resolve_mesh_shape(mode: str, cp_degree: int, ulysses_degree: int) -> tuple[int, int, bool]:
    """``(ring degree, ulysses degree, 2-D mesh?)`` for a job's mode and ``[upipe] ulysses_degree``.

    ulysses: 0 or C (all of CP is Ulysses). upipe: 0 or C is plain UPipe; ``1 <= d < C``
    dividing C is UPipe inside USP (each stage's attention is a ring over ``C/d`` ranks).
    ring: 0 or 1 (no Ulysses). usp: ``1 < d < C`` dividing C (otherwise it is ulysses or ring).
    """
    check_mode(mode)
    valid = valid_ulysses_degrees(mode, cp_degree)
    if ulysses_degree not in valid:
        hint = {"usp": " (ulysses_degree = CP is mode 'ulysses', 1 is mode 'ring')",
                "ulysses": " (for Ulysses x ring use mode 'usp')",
                "ring": " (for Ulysses x ring use mode 'usp')"}.get(mode, "")
        raise ConfigError(
            f"upipe.ulysses_degree = {ulysses_degree} is invalid for mode {mode!r} at "
            f"parallelism.context_parallel_degree = {cp_degree}: valid values are {valid or 'none'}{hint}"
        )
    if mode == "ring":
        return cp_degree, 1, False
    if mode in ("ulysses", "upipe") and ulysses_degree in (0, cp_degree):
        return 1, cp_degree, False
    return cp_degree // ulysses_degree, ulysses_degree, True


def _kv_split_ok(n_kv_heads: int, cp_degree: int) -> bool:
    # Either every rank owns whole KV heads (C divides KV), or every KV head is shared
    # by a whole number of ranks whose query heads all belong to it (KV divides C).
    return n_kv_heads % cp_degree == 0 or cp_degree % n_kv_heads == 0


def valid_cp_degrees(n_heads: int, n_kv_heads: int) -> list[int]:
    """CP (Ulysses) degrees that split these heads exactly."""
    return [c for c in range(1, n_heads + 1) if n_heads % c == 0 and _kv_split_ok(n_kv_heads, c)]


def valid_heads_per_stage(n_heads: int, cp_degree: int) -> list[int]:
    """Values of U (query heads per UPipe stage): multiples of C that divide H."""
    return [u for u in range(cp_degree, n_heads + 1, cp_degree) if n_heads % u == 0]


def check_cp_degree(n_heads: int, n_kv_heads: int, cp_degree: int, what: str = "context-parallel degree") -> None:
    """``cp_degree`` is the Ulysses degree (all of CP for ulysses/upipe on a 1-D mesh)."""
    if n_heads % n_kv_heads != 0:
        raise ConfigError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if cp_degree < 1 or n_heads % cp_degree != 0 or not _kv_split_ok(n_kv_heads, cp_degree):
        raise ConfigError(
            f"{what} {cp_degree} cannot split n_heads={n_heads}, n_kv_heads={n_kv_heads} "
            f"exactly: valid CP degrees are {valid_cp_degrees(n_heads, n_kv_heads)}"
        )


def resolve_heads_per_stage(n_heads: int, n_kv_heads: int, cp_degree: int, heads_per_stage: int | None) -> int:
    """U for UPipe; None or 0 means U = C (the paper's most memory-frugal choice)."""
    check_cp_degree(n_heads, n_kv_heads, cp_degree)
    if heads_per_stage is None or heads_per_stage == 0:
        return cp_degree
    valid = valid_heads_per_stage(n_heads, cp_degree)
    if not isinstance(heads_per_stage, int) or heads_per_stage not in valid:
        why = (
            f"not a multiple of the CP degree {cp_degree}"
            if not isinstance(heads_per_stage, int) or heads_per_stage % cp_degree
            else f"n_heads={n_heads} is not divisible by it"
        )
        raise ConfigError(
            f"upipe.heads_per_stage={heads_per_stage!r} is invalid ({why}): valid values for "
            f"n_heads={n_heads} at CP degree {cp_degree} are 0 (= {cp_degree}) or {valid}"
        )
    return heads_per_stage


def check_attention_masks(attention_masks: object) -> None:
    if attention_masks is not None:
        raise ConfigError(
            "context-parallel attention supports plain causal attention only (attention_masks=None, "
            "model attn_type='sdpa'); document masks come in a later issue"
        )


def check_local_inputs(x: torch.Tensor, positions: torch.Tensor | None, cp_degree: int) -> None:
    if x.dim() != 3:
        raise ConfigError(f"x must be [batch, local_seq_len, dim], got shape {tuple(x.shape)}")
    batch, local_len = x.shape[0], x.shape[1]
    if local_len == 0:
        raise ConfigError("x has an empty sequence shard")
    if positions is None:
        return
    if positions.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"positions must be an integer tensor, got {positions.dtype}")
    ok = (positions.dim() == 1 and positions.shape[0] == local_len) or (
        positions.dim() == 2 and positions.shape[1] == local_len and positions.shape[0] in (1, batch)
    )
    if not ok:
        raise ConfigError(
            f"positions must have shape [{local_len}], [1, {local_len}] or [{batch}, {local_len}] "
            f"(the global positions of this rank's {local_len} tokens), got {tuple(positions.shape)}"
        )


def check_sequence_split(seq_len: int, cp_degree: int) -> None:
    if seq_len % cp_degree != 0:
        valid = [n for n in range(seq_len - seq_len % cp_degree, seq_len + cp_degree + 1, cp_degree) if n > 0]
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by the context-parallel degree {cp_degree}: "
            f"use a multiple of {cp_degree} (e.g. {valid})"
        )


def check_ring_sequence(seq_len: int, ring: int, ulysses: int) -> None:
    """Zigzag needs ``2R`` equal chunks split evenly over the ``U`` Ulysses ranks of a ring rank."""
    unit = 2 * ring * ulysses
    if ring > 1 and seq_len % unit:
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by 2 x ring x ulysses = 2 x {ring} x {ulysses} = {unit}: "
            f"use a multiple of {unit} (e.g. {seq_len - seq_len % unit or unit})"
        )
