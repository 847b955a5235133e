"""The planner's packed-document terms (``titan_upipe.plan.documents``) against the live bytes
``LiveTensorTracker`` measures when a ``DocumentMask`` is built on CPU, and how the plan, the
job-config reader, the report and the CLI show them. Fast: no processes."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from plan_jobs import LLAMA, gpu_job

from titan_upipe import plan as P
from titan_upipe.parallel.document_mask import DocumentMask
from titan_upipe.plan import documents as D
from titan_upipe.toolkit.memory_tracker import LiveTensorTracker
from titan_upipe.tools.plan_cli import main as plan_main

DOC_INDEX = "document index of the global batch (int64 [B, S], every rank)"
SHAPES = [(1, 4096, 97), (2, 4096, 7), (3, 1000, 250), (1, 777, 1000)]
"""(B, S, EOS every n tokens): a few long documents, many short ones, one document per row."""


def _tokens(batch: int, seq_len: int, every: int) -> torch.Tensor:
    tokens = torch.randint(1, 100, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    tokens[:, every - 1::every] = 0  # EOS ends a document every `every` tokens
    return tokens


def _job(batch: int, seq_len: int) -> P.PlanInput:
    return P.PlanInput(LLAMA, seq_len=seq_len, batch=batch, cp=1, documents=True)


@pytest.mark.parametrize("batch,seq_len,every", SHAPES)
def test_mask_build_and_index_are_the_tracked_bytes(batch, seq_len, every):
    """from_eos peaks at three [B, S] int64 (eos, cumsum, result) and keeps one."""
    tokens = _tokens(batch, seq_len, every)
    with LiveTensorTracker() as mem:
        mask = DocumentMask.from_eos(tokens, 0)
        peak, held = mem.peak_bytes, mem.current_bytes
    job = _job(batch, seq_len)
    assert held == D.document_index_bytes(job) == 8 * batch * seq_len == mask.doc.nbytes
    assert peak == D.document_index_bytes(job) + D.mask_build_bytes(job) == 24 * batch * seq_len
    with LiveTensorTracker() as mem:  # from_ids (document_mask) peaks lower: docs/planner.md's 17 B S
        DocumentMask.from_ids(mask.doc)
    assert mem.peak_bytes == 17 * batch * seq_len <= peak


@pytest.mark.parametrize("batch,seq_len,every", SHAPES)
def test_segment_build_is_the_tracked_bytes_and_leaves_no_device_tensor(batch, seq_len, every):
    mask = DocumentMask.from_eos(_tokens(batch, seq_len, every), 0)
    with LiveTensorTracker() as mem:
        segments = mask.document_segments
        peak, held = mem.peak_bytes, mem.current_bytes
    s, b = seq_len, batch  # positions, their documents, breaks, change, positions[:-1] + 1, its compare
    assert peak == D.segments_build_bytes(_job(batch, seq_len)) == 8 * s + 8 * b * s + b * s + b * (s - 1) \
        + 8 * (s - 1) + (s - 1)
    assert held == 0  # the segments are host lists
    n_docs = sum(len(row) for row in segments)
    assert n_docs == batch * -(-seq_len // every)
    assert _host_bytes(segments) <= D.SEGMENT_HOST_BYTES * n_docs + 128 * (batch + 1)


def _host_bytes(obj) -> int:
    """sys.getsizeof over the distinct objects of nested lists/tuples (shared ints once)."""
    seen: dict[int, int] = {}

    def walk(o) -> None:
        if id(o) not in seen:
            seen[id(o)] = sys.getsizeof(o)
            if isinstance(o, list | tuple):
                for x in o:
                    walk(x)

    walk(obj)
    return sum(seen.values())


def test_the_plan_holds_the_index_in_every_moment_and_adds_the_build_moments():
    off, on = P.plan(gpu_job("8M")), P.plan(gpu_job("8M", documents=True))
    index = 8 * 8 * 2**20  # 8 B per token of the global 8M sequence: 64 MiB on every rank
    assert index == 64 * 2**20
    assert all(m.terms[DOC_INDEX] == index for m in on.moments)
    assert not any(DOC_INDEX in m.terms for m in off.moments)
    assert on.peak.where == off.peak.where and on.peak_gpu_bytes - off.peak_gpu_bytes == index
    wheres = {m.where: m for m in on.moments}
    build = wheres["document mask built (from_eos)"]
    assert build.terms["document mask build: EOS as int64 and its cumsum (from_eos)"] == 2 * index
    segments = wheres["block 0 forward: document segments built"]
    s = 8 * 2**20
    assert segments.terms["block 0 fwd: document segments build: positions, their documents, run breaks"] \
        == 10 * s + 17 * s - 1 - 9
    assert segments.total < on.peak_gpu_bytes  # far below the attention backward at any real size
    assert any("100 B per document" in n for n in on.notes)
    # the longest fitting length loses what the index costs, and no more than a little
    gpu, host = 80 * P.GIB, 1900 * P.GIB
    longest_off, longest_on = P.max_seq_len(gpu_job(), gpu, host), P.max_seq_len(gpu_job(documents=True), gpu, host)
    assert 0.99 * longest_off < longest_on < longest_off


def test_the_job_config_reader_takes_block_causal_from_the_model_args():
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    base = ["--job.config_file", "configs/debug/upipe.toml", "--training.seq_len", "256"]
    assert not plan_input_from_job_config(parse_config(base), 4).documents  # the debug flavor is causal
    # TorchTitan's own packed-document flavor: attn_mask_type = "block_causal"
    job = plan_input_from_job_config(parse_config([*base, "--model.flavor", "debugmodel_flex_attn"]), 4)
    assert job.documents
    assert P.plan(job).peak.terms[DOC_INDEX] == 8 * job.batch * 256


def test_report_and_cli_show_the_mask_metadata(capsys):
    job = gpu_job("1M", documents=True)
    result = P.plan(job)
    info = P.summary(result, None, None)
    assert info["documents"] == {"document_index_bytes": 8 * 2**20, "mask_build_bytes": 16 * 2**20,
                                 "segments_build_bytes": 10 * 2**20 + 17 * 2**20 - 10,
                                 "segment_host_bytes_per_document": 100, "document_layout": False,
                                 "layout_positions_bytes": 0, "layout_host_bytes_per_document": 0}
    assert P.summary(P.plan(replace(job, documents=False)), None, None)["documents"] is None
    text = P.render(result, info)
    assert "packed documents: document index 8.00 MiB per rank" in text
    assert DOC_INDEX in text  # a breakdown line like the other terms
    assert plan_main(["--model", "llama3_8b", "--seq-len", "8M", "--cp", "8", "--documents", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["job"]["documents"] and out["documents"]["document_index_bytes"] == 64 * 2**20
    assert out["breakdown_bytes"][DOC_INDEX] == 64 * 2**20


# --- issue 35: each batch in its own document-aware layout over the ring ([upipe] document_balance)

TOKENS = "token ids, labels, positions (int64)"
LAYOUT = "document-aware layout: each row's positions of this rank (int64 [B, S/C])"


def _ring_job(batch: int, seq_len: int, balance: str, device: str = "cpu") -> P.PlanInput:
    """UPipe inside USP on a ring of 2 (ulysses 1), packed documents."""
    return P.PlanInput(LLAMA, seq_len=seq_len, batch=batch, cp=2, ulysses=1, documents=True,
                       document_balance=balance, device=device)


def _state(job: P.PlanInput) -> dict[str, int]:
    return P.plan(job).moments[0].terms


@pytest.mark.parametrize("batch,seq_len,every", [(1, 4096, 97), (2, 4096, 7), (3, 8000, 250), (1, 4096, 5000)])
def test_the_document_layouts_bytes_are_the_tracked_bytes(batch, seq_len, every):
    """``prepare_cp_batch`` on rank 1 of a ring of 2 under each balance, tracked: the layout keeps each row's
    positions of the rank (``DOC_LAYOUT``, on CPU) and the positions become ``[B, S/C]`` (the token term);
    the planner's difference between the balances is the tracked one at B = 1 and bounds it above at B > 1
    (its token term counts three position tensors per row). Nothing of the build outlives it, and its
    peak stays under the planner's mask-build moment."""
    from test_layout_check import RingMesh

    from titan_upipe.parallel.inputs import prepare_cp_batch

    tokens = _tokens(batch, seq_len, every)
    measured = {}
    for balance in ("zigzag", "documents"):
        with LiveTensorTracker() as mem:
            prepared = prepare_cp_batch(tokens, tokens.clone(), RingMesh(), eos_id=0, ignore_index=-100,
                                        document_balance=balance, document_min_split=64)
            measured[balance] = (mem.peak_bytes, mem.current_bytes)
        assert (prepared.batch_layout is not None) == (balance == "documents")
        del prepared
    zig, doc = _state(_ring_job(batch, seq_len, "zigzag")), _state(_ring_job(batch, seq_len, "documents"))
    local = seq_len // 2
    assert LAYOUT not in zig and doc[LAYOUT] == D.layout_positions_bytes(_ring_job(batch, seq_len, "documents")) \
        == 8 * batch * local
    planned = doc[TOKENS] + doc[LAYOUT] - zig[TOKENS]
    tracked = measured["documents"][1] - measured["zigzag"][1]
    assert tracked == 8 * (batch - 1) * local + 8 * batch * local  # [B, S/C] positions and the layout's copy
    assert tracked == planned if batch == 1 else tracked < planned
    build = {m.where: m for m in P.plan(_ring_job(batch, seq_len, "documents")).moments}["document mask built (from_eos)"]
    held_before = 2 * 8 * batch * seq_len  # the global tokens and labels, made before the tracker
    assert measured["documents"][0] <= sum(build.terms[t] for t in (TOKENS, DOC_INDEX, LAYOUT,
                                           "document mask build: EOS as int64 and its cumsum (from_eos)")) - held_before


def test_the_layout_is_planned_only_on_a_ring_with_packed_documents_and_named():
    """No layout without a ring or with zigzag; on CUDA its copy of the positions is host memory (a note);
    the JSON summary, the note and the CLI switch say so."""
    assert _ring_job(1, 4096, "documents").document_layout
    assert not _ring_job(1, 4096, "zigzag").document_layout
    assert not replace(_ring_job(1, 4096, "documents"), ulysses=2).document_layout  # Ulysses alone: no ring
    assert not replace(_ring_job(1, 4096, "documents"), documents=False).document_layout
    cuda = P.plan(_ring_job(1, 4096, "documents", device="cuda"))
    assert LAYOUT not in cuda.moments[0].terms
    assert any("document-aware layout" in n and "0.02 MiB on the host" in n for n in cuda.notes), cuda.notes
    info = P.summary(P.plan(_ring_job(2, 4096, "documents")), None, None)["documents"]
    assert info["document_layout"] and info["layout_positions_bytes"] == 2 * 8 * 2048
    assert info["layout_host_bytes_per_document"] == D.LAYOUT_HOST_BYTES


def test_the_layouts_host_lists_stay_under_their_per_document_bound():
    """``LAYOUT_HOST_BYTES`` per document bounds the runs and every ring step's planned calls of a batch
    with many short and a few long documents, on a ring of 4."""
    from titan_upipe.attention.ring_plan import document_step_calls

    ring, tokens = 4, _tokens(2, 16384, 37)
    tokens[0, :6000] = 5  # one long document in row 0
    mask = DocumentMask.from_eos(tokens, 0).balanced(ring, 1, min_split=1024)
    calls = [mask.ring_calls(document_step_calls, r, ring, t) for r in range(ring) for t in range(ring)]
    n_docs = sum(len(row) for row in mask.document_segments)
    assert _host_bytes((mask.layout.ring_runs(), calls)) <= D.LAYOUT_HOST_BYTES * n_docs
