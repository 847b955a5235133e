"""A data-parallel rank's batch prepared for the converted attention, in one place.

CP input preparation (the trainer, the validation loss, the parity check and the rank emulator
all call :func:`prepare_cp_batch`): every CP rank of a data-parallel group reads the same
``[B, S]`` batch and keeps the ``S / C`` tokens and labels its mesh's layout gives it
(``titan_upipe.parallel.sequence``: contiguous for Ulysses/UPipe on a 1-D mesh; zigzag over the
ring x contiguous over Ulysses for ring, USP and UPipe inside USP), with their global positions
(RoPE reads them; :class:`LayoutCheck` compares them with the layout at every forward). Packed
documents: the mask of the *whole* batch (a document ends at each EOS token), which every rank
holds (the attention reads global positions). The valid-token count is the whole batch's
``N_d``, before sharding: the loss is summed over a rank's shard and divided by ``sum_d N_d``.

TorchTitan shards head-tail for its own ring attention; the all-to-alls would join those shards
in the wrong order and attend another sequence, which :class:`LayoutCheck` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.attention.documents import DocumentMask
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.mesh import layout_rank
from titan_upipe.parallel.sequence import layout_for, shard_sequence

Tensor = torch.Tensor


@dataclass(frozen=True)
class CPBatch:
    """One rank's share of a ``[B, S]`` batch over a CP mesh of ``C`` ranks."""

    tokens: Tensor
    """``[B, S/C]`` token ids of this rank."""
    labels: Tensor
    """``[B, S/C]`` their labels."""
    positions: Tensor
    """``[S/C]`` their global positions."""
    attention_masks: DocumentMask | None
    """The whole batch's documents (None: one causal sequence per row)."""
    valid_tokens: Tensor
    """``N_d``: labels of the whole batch that count (before sharding; the same on every CP rank)."""

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword inputs the converted model takes with ``tokens``."""
        if self.attention_masks is None:
            return {"positions": self.positions}
        return {"positions": self.positions, "attention_masks": self.attention_masks}


def valid_tokens(labels: Tensor, ignore_index: int) -> Tensor:
    """The labels that count in the loss (``!= ignore_index``), as a 0-dim tensor."""
    return (labels != ignore_index).sum()


def prepare_cp_batch(tokens: Tensor, labels: Tensor, cp_mesh: DeviceMesh, *, eos_id: int | None,
                     ignore_index: int) -> CPBatch:
    """This rank's :class:`CPBatch` of ``tokens``/``labels`` ``[B, S]``; ``eos_id``: packed
    documents ending at that token (None: causal rows)."""
    masks = None if eos_id is None else DocumentMask.from_eos(tokens, eos_id)
    local_tokens, positions = shard_sequence(tokens, cp_mesh, seq_dim=1)
    local_labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
    return CPBatch(local_tokens, local_labels, positions, masks, valid_tokens(labels, ignore_index))


class LayoutCheck:
    """At every forward (training and validation): the tokens must be sharded in our layout.

    TorchTitan's own trainer and validator shard CP inputs head-tail (load balancing for its
    ring attention); the Ulysses all-to-all and our zigzag ring would then join shards in the
    wrong order and silently compute another sequence. ``titan_upipe.train`` shards in our
    layout (contiguous or zigzag, whichever this mesh's attention expects) for both. The check
    compares ``S/C`` positions with the layout's (one host sync per forward, not per layer).
    """

    def __init__(self, cp_mesh) -> None:
        self.cp_mesh = cp_mesh
        self._expected: dict[tuple[int, torch.device], torch.Tensor] = {}

    def expected_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        key = (local_len, device)
        if key not in self._expected:
            layout = layout_for(self.cp_mesh, local_len * self.cp_mesh.size())
            self._expected[key] = layout.positions(layout_rank(self.cp_mesh), device=device)
        return self._expected[key]

    def __call__(self, module, args, kwargs):
        positions = kwargs.get("positions")
        tokens = args[0] if args else kwargs["tokens"]
        local_len = tokens.shape[-1]
        expected = self.expected_positions(local_len, tokens.device)
        if positions is None or not torch.equal(positions.reshape(-1, local_len)[0].to(expected.dtype), expected):
            raise ConfigError(
                "context-parallel inputs are not in titan_upipe's sequence layout: launch with "
                "`-m titan_upipe.train` (TorchTitan's own trainer and validator shard CP inputs head-tail)"
            )
        return None
