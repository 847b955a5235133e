"""Packed documents: the document of every token, as a mask over global positions, and its layout
over a ring (below the kernels: ``titan_upipe.attention.documents`` runs attention under it).

A packed row of ``S`` tokens holds several documents, each one contiguous run. Token ``i``
of row ``b`` belongs to document ``doc[b, i]``; a query at global position ``i`` sees the key
at global position ``j`` iff::

    visible[b, i, j] = (j <= i) and (doc[b, i] == doc[b, j])

``DocumentMask``: from document ids (``from_ids``) or from EOS tokens (``from_eos``, TorchTitan's
``block_causal`` rule); ``visible``, ``block_kind``, ``segments``, ``cu_seqlens``, ``positions``.
``document_mask`` is the public contract (global ``[B, S]`` ids -> the ``attention_masks`` a
converted attention accepts), ``balanced_for_mesh`` the layout ``[upipe] document_balance`` picks.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

import torch

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_layout import BatchDocumentLayout
from titan_upipe.parallel.mesh import mesh_degrees
from titan_upipe.parallel.sequence import layout_for
from titan_upipe.spec.document_deal import zigzag_ring_runs
from titan_upipe.spec.sections import check_document_balance
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT

Tensor = torch.Tensor
BlockKindName = Literal["skip", "masked", "causal", "full"]
Segment = tuple[int, int]


def _run_starts(ids: Tensor) -> Tensor:
    """``[B, S]`` bool: True where a token's id differs from the previous token's (and at 0)."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def _check_ids(document_ids: Tensor) -> None:
    if document_ids.dim() != 2:
        raise ConfigError(f"document ids must be [batch, seq_len], got shape {tuple(document_ids.shape)}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise ConfigError(f"document ids must be an integer tensor, got {document_ids.dtype}")
    if document_ids.shape[1] == 0:
        raise ConfigError("document ids hold no tokens (seq_len 0)")


def _check_contiguous(document_ids: Tensor, starts: Tensor) -> None:
    """Each id must be one run per row: runs per row == distinct ids per row."""
    for row in range(document_ids.shape[0]):
        ids = document_ids[row]
        run_ids = ids[starts[row]]
        if run_ids.numel() != torch.unique(ids).numel():
            values, counts = torch.unique(run_ids, return_counts=True)
            split = values[counts > 1][0].item()
            where = (ids == split).nonzero().flatten().tolist()
            raise ConfigError(
                f"document id {split} in batch row {row} is not one contiguous run (tokens {where[:8]}"
                f"{' ...' if len(where) > 8 else ''}): each packed document must occupy consecutive positions")


def _plain_causal(n: int, device: torch.device) -> Tensor:
    """``[n, n]`` bool lower triangle: local query ``i`` sees local keys ``[0, i]``."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _check_segments(segments: list[list[Segment]], q: Tensor) -> None:
    if len(segments) != q.shape[0]:
        raise ValueError(f"{len(segments)} rows of segments for a batch of {q.shape[0]}")
    for row in segments:
        # Tiling in order: each run starts where the previous stopped and the last ends at S
        # (O(segments): this runs in every attention call).
        bounds = [0, *(b for start, stop in row for b in (start, stop)), q.shape[2]]
        if not row or any(stop <= start for start, stop in row) or any(
                bounds[i] != bounds[i + 1] for i in range(0, len(bounds), 2)):
            raise ValueError(f"segments {row} do not tile [0, {q.shape[2]}) in order")


def _varlen_boundaries(segments: list[list[Segment]], seq_len: int, device: torch.device) -> tuple[Tensor, int]:
    """``cu_seqlens`` (int32 ``[n + 1]``) of every segment of every row with the rows end to end
    (row ``b``'s segment ``[a, c)`` is packed tokens ``[b S + a, b S + c)``), and the longest."""
    stops = [row * seq_len + stop for row, segs in enumerate(segments) for _, stop in segs]
    longest = max(stop - start for segs in segments for start, stop in segs)
    return torch.tensor([0, *stops], dtype=torch.int32, device=device), longest


class SegmentTable:
    """Each row's runs ``[a, c)`` tiling one block, checked once, and their varlen boundaries per
    device, built once (a host-to-device copy syncs the host: once per step, not per call)."""

    def __init__(self, rows: list[list[Segment]]) -> None:
        self.rows = rows
        self._boundaries: dict[tuple[str, int], tuple[Tensor, int]] = {}
        self._checked: set[tuple[int, int]] = set()

    def check(self, q: Tensor) -> None:
        if (q.shape[0], q.shape[2]) not in self._checked:
            _check_segments(self.rows, q)
            self._checked.add((q.shape[0], q.shape[2]))

    def boundaries(self, seq_len: int, device: torch.device) -> tuple[Tensor, int]:
        key = (str(device), seq_len)
        if key not in self._boundaries:
            self._boundaries[key] = _varlen_boundaries(self.rows, seq_len, device)
        return self._boundaries[key]


class DocumentMask:
    """The document of every token of a packed batch.

    ``doc`` is ``[B, S]`` int64: ``doc[b, i]`` numbers the documents of row ``b`` in order,
    ``0, 1, ...``, non-decreasing along the row (each document is one contiguous run).

    A plain class, not a dataclass: FSDP2 casts a module's forward inputs by rebuilding every
    dataclass field by field (``dataclasses.replace``), which would hand each block a fresh copy
    and lose the per-step caches (``document_segments``, the segment tables) at every layer.
    """

    def __init__(self, doc: Tensor, layout: BatchDocumentLayout | None = None) -> None:
        self.doc = doc
        self.layout = layout
        """The batch's document-aware layout over the ring (``[upipe] document_balance = "documents"``),
        or None: the mesh's fixed layout (``parallel.layout_for``)."""
        if layout is not None and (layout.batch, layout.seq_len) != tuple(doc.shape):
            raise ValueError(f"a layout of {layout.batch} x {layout.seq_len} tokens for documents of {tuple(doc.shape)}")
        self._tables: dict[tuple, SegmentTable] = {}
        """``SegmentTable`` by segments: each block's table (and its device boundaries) built once per step."""
        self._ring_calls: dict[tuple, tuple] = {}
        """The ring's calls by (plan, ring rank, ring size, step): planned once per batch, read by every layer."""

    @classmethod
    def from_ids(cls, document_ids: Tensor) -> DocumentMask:
        """From ``[B, S]`` integer labels: equal label = same document; each label must be one
        contiguous run per row (ConfigError otherwise). Labels are renumbered ``0, 1, ...``."""
        _check_ids(document_ids)
        starts = _run_starts(document_ids)
        _check_contiguous(document_ids, starts)
        return cls(torch.cumsum(starts.long(), dim=1) - 1)

    @classmethod
    def from_eos(cls, tokens: Tensor, eos_id: int) -> DocumentMask:
        """From ``[B, S]`` token ids: ``doc[b, i]`` = number of EOS tokens at positions ``< i``.

        The EOS token is the last token of its document and the next token starts a new one
        (TorchTitan's ``block_causal`` rule); a row without EOS is one document, and an EOS at
        the last position ends the row's last document.
        """
        _check_ids(tokens)
        eos = (tokens == eos_id).long()
        return cls(torch.cumsum(eos, dim=1) - eos)

    def balanced(self, ring_size: int, ulysses_size: int = 1, min_split: int = DEFAULT_MIN_SPLIT) -> DocumentMask:
        """This mask with the batch's ``BatchDocumentLayout`` over ``ring x ulysses`` ranks (each row
        balanced from its own document lengths; the same on every rank, from the same ids)."""
        return DocumentMask(self.doc, BatchDocumentLayout.of_document_ids(self.doc, ring_size, ulysses_size, min_split))

    def ring_runs(self, ring_size: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
        """``[B][R]`` each ring rank's runs of global positions per row: the batch layout's, or the
        fixed zigzag's chunks for every row."""
        if self.layout is not None:
            self.layout.check_degrees(ring_size, self.layout.ulysses_size)
            return self.layout.ring_runs()
        return (zigzag_ring_runs(self.seq_len, ring_size),) * self.batch

    def ring_calls(self, plan, ring_rank: int, ring_size: int, step: int) -> tuple:
        """``plan(ring_rank, ring_size, step, ring_runs, document_segments)`` (``ring_plan.DocumentPlan``),
        computed once per mask: every layer's forward and backward ring reads the same calls."""
        key = (plan, ring_rank, ring_size, step)
        if key not in self._ring_calls:
            self._ring_calls[key] = plan(ring_rank, ring_size, step, self.ring_runs(ring_size), self.document_segments)
        return self._ring_calls[key]

    @property
    def batch(self) -> int:
        return self.doc.shape[0]

    @property
    def seq_len(self) -> int:
        return self.doc.shape[1]

    def positions(self) -> Tensor:
        """``[B, S]`` int64: ``i - start(doc[b, i])``, each token's position inside its document."""
        index = torch.arange(self.seq_len, device=self.doc.device).expand_as(self.doc)
        start_index = torch.where(_run_starts(self.doc), index, torch.zeros_like(index))
        return index - torch.cummax(start_index, dim=1).values

    def _docs_at(self, positions: Tensor) -> Tensor:
        """``[B, len(positions)]``: the document of each given global position."""
        positions = positions.to(self.doc.device)
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D global indices, got shape {tuple(positions.shape)}")
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < self.seq_len:
            raise ValueError(f"positions outside [0, {self.seq_len})")
        return self.doc[:, positions]

    def visible(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """``[B, Sq, Sk]`` bool: ``k_pos[j] <= q_pos[i]`` and the two tokens share a document."""
        same = self._docs_at(q_positions).unsqueeze(2) == self._docs_at(k_positions).unsqueeze(1)
        q_pos, k_pos = q_positions.to(self.doc.device), k_positions.to(self.doc.device)
        return same & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).unsqueeze(0)

    def block_kind(self, q_positions: Tensor, k_positions: Tensor) -> BlockKindName:
        """Which kernel a (query positions, key positions) block needs, over every row:

        * ``skip``: no query sees any key (the block contributes nothing);
        * ``full``: every query sees every key (the unmasked ``causal=False`` kernel);
        * ``causal``: ``Sq == Sk`` and query ``i`` sees exactly local keys ``[0, i]`` (the
          unmasked ``causal=True`` kernel);
        * ``masked``: anything else (``masked_forward`` with ``visible``, or varlen segments).
        """
        vis = self.visible(q_positions, k_positions)
        if not vis.any():
            return "skip"
        if vis.all():
            return "full"
        sq, sk = vis.shape[1:]
        if sq == sk and torch.equal(vis, _plain_causal(sq, vis.device).expand_as(vis)):
            return "causal"
        return "masked"

    def segments(self, positions: Tensor) -> list[list[Segment]]:
        """Per row, the local index runs ``[start, stop)`` of ``positions`` that lie in one
        document and are consecutive in global position (``positions[i+1] == positions[i]+1``)."""
        docs = self._docs_at(positions)
        pos = positions.to(self.doc.device)
        breaks = torch.ones_like(docs, dtype=torch.bool)
        breaks[:, 1:] = (docs[:, 1:] != docs[:, :-1]) | (pos[1:] != pos[:-1] + 1).unsqueeze(0)
        n = positions.numel()
        rows = []
        for row in breaks:
            starts = row.nonzero().flatten().tolist()
            rows.append(list(zip(starts, starts[1:] + [n], strict=True)))
        return rows

    @cached_property
    def document_segments(self) -> list[list[Segment]]:
        """``segments`` of the whole sequence (positions ``0 .. S-1``: each document one run),
        computed once per mask: every layer's attention of a step reads the same mask."""
        return self.segments(torch.arange(self.seq_len, device=self.doc.device))

    def table(self, segments) -> SegmentTable:
        """The ``SegmentTable`` of ``segments`` (per row, runs tiling one block), shared by every layer
        and stage of the step: its varlen ``cu_seqlens`` reach the device once, not once per call."""
        key = tuple(tuple(row) for row in segments)
        if key not in self._tables:
            self._tables[key] = SegmentTable([list(row) for row in key])
        return self._tables[key]

    def cu_seqlens(self, positions: Tensor) -> list[Tensor]:
        """Per row, int32 ``[n_segments + 1]``: cumulative segment lengths ``0, ..., len(positions)``,
        the ``cu_seqlens_q`` (= ``cu_seqlens_k``) of a diagonal block for a varlen kernel."""
        return [torch.tensor([0] + [stop for _, stop in row], dtype=torch.int32) for row in self.segments(positions)]

    def segments_are_exact(self, positions: Tensor) -> bool:
        """True when ``visible(positions, positions)`` is the union of causal attention inside each
        segment: no document has two segments in any row (a document split across zigzag chunks
        would have its later segment's queries see the earlier segment's keys)."""
        docs = self._docs_at(positions)
        for row, segs in enumerate(self.segments(positions)):
            seg_docs = [int(docs[row, start]) for start, _ in segs]
            if len(set(seg_docs)) != len(seg_docs):
                return False
        return True


def balanced_for_mesh(mask: DocumentMask, cp_mesh, balance: str, min_split: int = DEFAULT_MIN_SPLIT) -> DocumentMask:
    """``mask`` in the layout ``balance`` picks on ``cp_mesh``: with ``"documents"`` and a ring, the
    batch's ``BatchDocumentLayout`` (``DocumentMask.balanced``); otherwise the mesh's own layout
    (without a ring every layout is the contiguous one: Ulysses and UPipe are balanced already)."""
    check_document_balance(balance, min_split)
    ring, ulysses = mesh_degrees(cp_mesh)
    if balance == "zigzag" or ring == 1:
        return mask
    return mask.balanced(ring, ulysses, min_split)


def document_mask(document_ids: Tensor, cp_mesh=None, *, balance: str = "zigzag",
                  min_split: int = DEFAULT_MIN_SPLIT) -> DocumentMask:
    """The public contract: the global ``[B, S]`` document ids of a packed batch (equal id = one
    document, each one contiguous run) as the ``attention_masks`` a converted attention accepts.

    ``balance = "documents"`` (needs ``cp_mesh``) gives the mask the batch's document-aware layout
    over the mesh's ring (``parallel.BatchDocumentLayout``: documents of ``min_split`` tokens, or of
    ``max(S/(4R), 2R x 128)`` when shorter, zigzagged inside themselves): shard the inputs with
    ``shard_sequence(t, cp_mesh, 1, mask.layout)`` and pass their ``[B, S/C]`` positions.

    Query ``i`` attends key ``j`` iff ``j <= i`` and both lie in the same document; RoPE keeps the
    global positions (per-document ``positions``, ``DocumentMask.positions()``, can be passed when
    calling a converted attention directly; the trainer passes the layout's). Every CP mode
    reads it: Ulysses and UPipe run each document causally after the all-to-all, the ring layouts
    (ring, usp, UPipe inside USP) plan each block pair from it (``ring_plan.document_step_calls``).
    With ``cp_mesh``, ``S`` is checked against the mesh's sequence layout here, once."""
    mask = DocumentMask.from_ids(document_ids)
    if cp_mesh is None:
        if balance != "zigzag":
            raise ConfigError(f"document_mask(balance={balance!r}) lays the batch out over a ring: pass the cp_mesh")
        return mask
    layout_for(cp_mesh, mask.seq_len)  # ConfigError when S does not split into the layout's shards
    return balanced_for_mesh(mask, cp_mesh, balance, min_split)


def check_attention_masks(attention_masks: object, seq_len: int, batch: int | None = None) -> DocumentMask | None:
    """The document mask of one attention call (None: plain causal); a flex ``BlockMask``, varlen
    metadata or a mask of another length raise ConfigError."""
    if attention_masks is None:
        return None
    if not isinstance(attention_masks, DocumentMask):
        raise ConfigError(
            f"context-parallel attention takes attention_masks from titan_upipe.attention.document_mask "
            f"(got {type(attention_masks).__name__}): pass the global [batch, seq_len] document ids through it")
    if attention_masks.seq_len != seq_len:
        raise ConfigError(f"the document mask covers {attention_masks.seq_len} tokens but the sequence has "
                          f"{seq_len}: build it from the global [batch, seq_len] batch, before CP sharding")
    if batch is not None and attention_masks.batch != batch:
        raise ConfigError(f"the document mask has {attention_masks.batch} rows but the batch has {batch}: build it "
                          "from the same global [batch, seq_len] batch the model reads")
    return attention_masks
