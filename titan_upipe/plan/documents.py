"""Packed documents (``attn_mask_type = "block_causal"``): the mask metadata every rank holds.

A ``DocumentMask`` (``titan_upipe.parallel.document_mask``) is built from the *global* batch on
every rank: after the all-to-all a rank attends over positions ``0 .. S-1`` of its heads, so it
needs the document of every token, not only of its shard. With ``B`` rows of ``S`` tokens:

* ``doc`` ``[B, S]`` int64, held for the step: ``8 B S`` bytes per rank whatever the CP degree
  (8 MiB per 1M tokens: 64 MiB at 8M).
* ``DocumentMask.from_eos`` (TorchTitan's ``block_causal`` EOS rule): ``eos`` as int64 and its
  ``cumsum`` live beside the result at ``cumsum - eos``: ``16 B S`` more (the bool comparison,
  ``B S``, is freed before the cumsum). ``from_ids`` peaks lower (``9 B S`` beside the result).
* ``document_segments`` (once per mask, at the first layer's attention call): the positions
  ``0 .. S-1`` (``8 S``), their documents (``8 B S``), the run breaks (bool ``B S``), the
  document change (bool ``B (S-1)``) and, at the peak, ``positions[:-1] + 1`` (int64
  ``8 (S-1)``) and its comparison (bool ``S-1``): ``10 B S + 17 S - B - 9`` bytes.
  After the peak, each row's ``nonzero`` (int64 ``8 n`` for its ``n`` documents, ``n <= S``)
  replaces the freed ``8 (S-1) + (S-1)``: below the peak.
* the segments themselves are host Python lists: one ``(start, stop)`` tuple per document
  (``SEGMENT_HOST_BYTES`` each, at most ``S`` documents per row) and under 128 B per row. Not
  device memory: a note, not a term. Nor is ``cu_seqlens``, int32 ``[n + 1]`` for the ``n``
  documents of the batch: on the host, or on the device for one varlen kernel call (CUDA), a
  transient of at most ``4 (B S + 1)`` bytes.

With ``[upipe] document_balance = "documents"`` on a ring, each batch has its own layout
(``parallel.BatchDocumentLayout``), built from the same ids on every rank before the forward:

* the positions a rank feeds the model are ``[B, S/C]`` (one row per batch row) instead of
  ``[S/C]``: ``8 B S/C`` bytes, in the token term;
* the layout keeps each row's positions of this rank, ``8 B S/C`` bytes, for the step (host
  memory on CUDA, where the shards' index is copied to the device; a term on CPU);
* nothing else outlives the build: its transients (the document lengths from the ids, the runs)
  stay below the shards it returns, measured;
* host lists: each row's runs per ring rank (a few per long document, one per short one) and the
  ring's calls per step, planned once per batch (one rectangle per shared document and step):
  ``LAYOUT_HOST_BYTES`` per document at most, a note.

The measured bytes are in ``tests/test_plan_documents.py`` (``LiveTensorTracker``).
"""

from __future__ import annotations

from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.terms import Term, Terms
from titan_upipe.spec.units import format_bytes

SEGMENT_HOST_BYTES = 100
"""Host bytes per document of ``DocumentMask.document_segments`` (CPython 3.11): a 2-tuple (56),
its list slot (8) and one int (28: a segment's stop is the next one's start object), rounded up."""


LAYOUT_HOST_BYTES = 400
"""Host bytes per document of a batch's document-aware layout: its runs (two 2-tuples per zigzagged
piece pair, one per whole document) and the ring's planned segments and rectangles, rounded up
(measured in tests/test_plan_documents.py)."""


def layout_positions_bytes(job: PlanInput) -> int:
    """The layout's own copy of each row's positions of this rank, ``8 B S/C`` (0 without one)."""
    return 8 * job.batch * job.local_len if job.document_layout else 0


def document_index_bytes(job: PlanInput) -> int:
    """``doc``: ``[B, S]`` int64 of the global batch, ``8 B S``."""
    return 8 * job.batch * job.seq_len


def mask_build_bytes(job: PlanInput) -> int:
    """``from_eos`` temporaries beside the result: ``eos`` (int64) and its ``cumsum``, ``16 B S``."""
    return 16 * job.batch * job.seq_len


def segments_build_bytes(job: PlanInput) -> int:
    """``document_segments``' device temporaries at their peak: ``10 B S + 17 S - B - 9``."""
    b, s = job.batch, job.seq_len
    return 8 * s + 8 * b * s + b * s + b * (s - 1) + 8 * (s - 1) + (s - 1)


def document_index_terms(job: PlanInput) -> Terms:
    """The held mask (and on CPU its layout's positions): state terms of every moment (built with
    the batch, read by every layer)."""
    if not job.documents:
        return {}
    terms = {Term.DOC_INDEX: document_index_bytes(job)}
    if job.document_layout and job.device == "cpu":  # on CUDA the layout's copy is host memory
        terms[Term.DOC_LAYOUT] = layout_positions_bytes(job)
    return terms


def segment_host_bound(job: PlanInput) -> int:
    """Host bytes of the segment lists if every token were its own document (``B S`` documents)."""
    return SEGMENT_HOST_BYTES * job.batch * job.seq_len


def documents_note(job: PlanInput) -> str:
    """The host-side metadata, bounded by the number of documents."""
    note = (f"packed documents: the document segments are host lists, ~{SEGMENT_HOST_BYTES} B per document "
            f"(at most {format_bytes(segment_host_bound(job))} per rank with a document per token); "
            "cu_seqlens 4 B per document (per varlen kernel call on CUDA)")
    if job.document_layout:
        note += (f"; the batch's document-aware layout (document_balance = \"documents\"): runs and ring calls "
                 f"~{LAYOUT_HOST_BYTES} B per document on the host, each row's positions of this rank "
                 f"{format_bytes(layout_positions_bytes(job))}" + (" on the host" if job.device == "cuda" else ""))
    return note


def documents_summary(job: PlanInput) -> dict[str, int] | None:
    """The mask metadata in bytes (``--json``), None without packed documents."""
    if not job.documents:
        return None
    return {"document_index_bytes": document_index_bytes(job), "mask_build_bytes": mask_build_bytes(job),
            "segments_build_bytes": segments_build_bytes(job),
            "segment_host_bytes_per_document": SEGMENT_HOST_BYTES,
            "document_layout": job.document_layout, "layout_positions_bytes": layout_positions_bytes(job),
            "layout_host_bytes_per_document": LAYOUT_HOST_BYTES if job.document_layout else 0}
