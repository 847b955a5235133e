"""Packed-document batches of the tools (the parity check, the rank emulator): a fixed EOS pattern
whose documents cross the CP shard boundaries, and the runs of each row's documents."""

from __future__ import annotations

import torch


def packed_document_tokens(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``tokens [B, S]`` (none equal to ``eos_id``) with EOS at positions ``0`` (a 1-token
    document), ``S/3 + b`` and ``S/3 + b + 1`` (another 1-token document) and ``2S/3 + 1 - b``
    for row ``b``: documents that cross the CP shard boundaries, split differently per row."""
    packed = tokens.clone()
    seq = tokens.shape[1]
    for row in range(tokens.shape[0]):
        for position in (0, seq // 3 + row, seq // 3 + row + 1, 2 * seq // 3 + 1 - row):
            packed[row, min(max(position, 0), seq - 1)] = eos_id
    return packed


def document_runs(inputs: torch.Tensor, eos_id: int) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, stop)`` runs of each document: a document ends at its EOS token."""
    runs = []
    for row in inputs.tolist():
        stops = [i + 1 for i, token in enumerate(row) if token == eos_id]
        stops = [s for s in stops if s < len(row)] + [len(row)]
        runs.append(list(zip([0, *stops[:-1]], stops, strict=True)))
    return runs
