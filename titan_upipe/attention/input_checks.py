"""Checks that run before any communication, each raising a ConfigError that names the fix.

A context-parallel attention that discovers a bad head split or an unsupported mask
inside an all-to-all either hangs or fails on one rank only; every check here is
local, so all ranks fail the same way before the first collective.
"""

from __future__ import annotations

import torch

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CP_MODES, check_sequence_length

SUPPORTED_MODES = CP_MODES
"""The context-parallel modes (``titan_upipe.spec.cp_layout.CPMode``)."""


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


def check_ring_sequence(seq_len: int, ring: int, ulysses: int) -> None:
    """This call's sequence splits over the mesh (zigzag: ``2R`` chunks over the Ulysses ranks)."""
    check_sequence_length(seq_len, ring, ulysses)
