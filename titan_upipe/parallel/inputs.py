"""A data-parallel rank's batch prepared for the converted attention, in one place.

CP input preparation (the trainer, the validation loss, the parity check and the rank emulator
all call :func:`prepare_cp_batch`): every CP rank of a data-parallel group reads the same
``[B, S]`` batch and keeps the ``S / C`` tokens and labels its mesh's layout gives it
(``titan_upipe.parallel.sequence``: contiguous for Ulysses/UPipe on a 1-D mesh; zigzag over the
ring x contiguous over Ulysses for ring, USP and UPipe inside USP), with their global positions
(RoPE reads them; :class:`LayoutCheck` compares them with the layout at every forward). Packed
documents: the mask of the *whole* batch (a document ends at each EOS token), which every rank
holds (the attention reads global positions); with ``document_balance = "documents"`` on a ring the
mask also carries the batch's document-aware layout, and the tokens, labels and ``[B, S/C]``
positions follow it (every rank derives it from the same ids). The valid-token count is the whole batch's
``N_d``, before sharding: the loss is summed over a rank's shard and divided by ``sum_d N_d``.

TorchTitan shards head-tail for its own ring attention; the all-to-alls would join those shards
in the wrong order and attend another sequence, which :class:`LayoutCheck` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_layout import BatchDocumentLayout
from titan_upipe.parallel.document_mask import DocumentMask, balanced_for_mesh
from titan_upipe.parallel.mesh import layout_rank
from titan_upipe.parallel.sequence import layout_for, shard_sequence
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT

Tensor = torch.Tensor


@dataclass(frozen=True)
class CPBatch:
    """One rank's share of a ``[B, S]`` batch over a CP mesh of ``C`` ranks."""

    tokens: Tensor
    """``[B, S/C]`` token ids of this rank."""
    labels: Tensor
    """``[B, S/C]`` their labels."""
    positions: Tensor
    """``[S/C]`` their global positions (``[B, S/C]`` in a document-aware layout, one per row)."""
    attention_masks: DocumentMask | None
    """The whole batch's documents (None: one causal sequence per row)."""
    valid_tokens: Tensor
    """``N_d``: labels of the whole batch that count (before sharding; the same on every CP rank)."""

    @property
    def batch_layout(self) -> BatchDocumentLayout | None:
        """The batch's document-aware layout (``gather_sequence`` needs it), or None: the mesh's."""
        return None if self.attention_masks is None else self.attention_masks.layout

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword inputs the converted model takes with ``tokens``."""
        if self.attention_masks is None:
            return {"positions": self.positions}
        return {"positions": self.positions, "attention_masks": self.attention_masks}


def valid_tokens(labels: Tensor, ignore_index: int) -> Tensor:
    """The labels that count in the loss (``!= ignore_index``), as a 0-dim tensor."""
    return (labels != ignore_index).sum()


def prepare_cp_batch(tokens: Tensor, labels: Tensor, cp_mesh: DeviceMesh, *, eos_id: int | None,
                     ignore_index: int, document_balance: str = "zigzag",
                     document_min_split: int = DEFAULT_MIN_SPLIT) -> CPBatch:
    """This rank's :class:`CPBatch` of ``tokens``/``labels`` ``[B, S]``; ``eos_id``: packed
    documents ending at that token (None: causal rows). ``document_balance = "documents"``: packed
    documents on a ring are laid out per batch (``BatchDocumentLayout``, carried by the mask)."""
    masks = None
    if eos_id is not None:
        masks = balanced_for_mesh(DocumentMask.from_eos(tokens, eos_id), cp_mesh, document_balance, document_min_split)
    layout = None if masks is None else masks.layout
    local_tokens, positions = shard_sequence(tokens, cp_mesh, seq_dim=1, batch_layout=layout)
    local_labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1, batch_layout=layout)
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
        batch_layout = getattr(kwargs.get("attention_masks"), "layout", None)
        if batch_layout is not None:  # this batch's document-aware layout: every row in its own
            expected = batch_layout.positions(layout_rank(self.cp_mesh), device=tokens.device)
            if positions is None or tuple(positions.shape) != tuple(expected.shape) or not torch.equal(
                    positions.to(expected.dtype), expected):
                raise ConfigError(
                    "context-parallel inputs are not in the batch's document-aware layout (the mask carries one): "
                    "shard them with titan_upipe.parallel.shard_sequence(t, cp_mesh, 1, mask.layout) and pass its "
                    "[batch, S/C] positions, as titan_upipe.parallel.inputs.prepare_cp_batch does")
            return None
        expected = self.expected_positions(local_len, tokens.device)
        rows = None if positions is None else positions.reshape(-1, local_len).to(expected.dtype)
        if rows is None or not torch.equal(rows, expected.expand_as(rows)):  # every row: the mesh's layout
            raise ConfigError(
                "context-parallel inputs are not in titan_upipe's sequence layout: launch with "
                "`-m titan_upipe.train` (TorchTitan's own trainer and validator shard CP inputs head-tail)"
            )
        return None
