"""Issue 35's measurements: ``scripts/bench_attention.py --documents`` runs the ring modes under each
``document_balance`` (the fixed zigzag and the batch's document-aware layout), and the ring work it
prints beside the measured times is the work of the layout each row ran; docs/benchmarks/
document_balance.md's computed numbers are the scripts'. In-process checks are pure arithmetic; one
test spawns the bench's 2 gloo ranks at a tiny size (a few seconds)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_upipe.costs.document_balance import ring_work_ratios
from titan_upipe.parallel import ZigzagLayout

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks" / "document_balance.md"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    yield _load("bench_attention")
    del sys.modules["bench_attention"]


@pytest.fixture(scope="module")
def balance_script():
    yield _load("bench_document_balance")
    del sys.modules["bench_document_balance"]


class RingMesh:
    """A 1-D ring mesh of ``size`` ranks as the layout code reads it (no process group)."""

    ndim, mesh_dim_names = 1, ("ring",)

    def __init__(self, size: int) -> None:
        self._size = size
        self.shape = (size,)

    def size(self, dim=None):
        return self._size

    def get_local_rank(self, dim=None):
        return 0


def _args(bench, *extra: str):
    return bench.parse_args(["--documents", "--no-causal", *extra])


def _brute_force_work(ids: torch.Tensor, owner: torch.Tensor, ring_size: int) -> np.ndarray:
    """``W[r, t]`` from the ``S x S`` mask: visible pairs (key ``j <= i``, same document) with the query
    on ring rank ``r`` and the key on ring rank ``(r - t) mod R``; ``owner`` ``[B, S]``, each token's rank."""
    work = np.zeros((ring_size, ring_size), dtype=np.int64)
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for row_ids, row_owner in zip(ids, owner, strict=True):
        visible = causal & (row_ids[:, None] == row_ids[None, :])
        q, k = visible.nonzero(as_tuple=True)
        qr, kr = row_owner[q], row_owner[k]
        np.add.at(work, (qr.numpy(), ((qr - kr) % ring_size).numpy()), 1)
    return work


def _owners(positions_by_rank, batch: int, seq_len: int) -> torch.Tensor:
    owner = torch.full((batch, seq_len), -1, dtype=torch.int64)
    for rank, positions in enumerate(positions_by_rank):
        owner.scatter_(1, positions.reshape(batch, -1), rank)
    assert (owner >= 0).all()
    return owner


@pytest.mark.parametrize("ring_size", [2, 4])
def test_the_ring_work_printed_is_the_mask_count_on_the_layout_each_row_ran(bench, ring_size):
    args = _args(bench, "--seq-len", "512", "--batch", "2", "--doc-seed", "3", "--min-split", "32")
    masks = bench._document_masks(args, torch.device("cpu"), RingMesh(ring_size))
    assert [balance for balance, _ in masks] == ["zigzag", "documents"]  # --no-causal: no plain row
    (_, zigzag), (_, documents) = masks
    assert zigzag.layout is None and documents.layout is not None
    layouts = {balance: bench._ring_layout(args, RingMesh(ring_size), balance, mask) for balance, mask in masks}
    # the balanced variant runs on another layout than the zigzag, each row its own
    assert layouts["documents"].ring_runs != layouts["zigzag"].ring_runs
    assert layouts["documents"].ring_runs[0] != layouts["documents"].ring_runs[1]

    ids = bench.document_ids(args)
    lengths = [bench.document_lengths(512, 3 + b) for b in range(2)]
    owners = {"zigzag": _owners([ZigzagLayout(512, ring_size).positions(r).expand(2, -1)
                                 for r in range(ring_size)], 2, 512),
              "documents": _owners([documents.layout.positions(r) for r in range(ring_size)], 2, 512)}
    expected_ratio = dict(zip(("zigzag", "documents"), ring_work_ratios(lengths, ring_size, 32), strict=True))
    for balance, layout in layouts.items():
        work = bench.ring_step_work(lengths, layout.ring_runs, ring_size)
        assert np.array_equal(work, _brute_force_work(ids, owners[balance], ring_size))
        per_rank = work.sum(axis=1)
        computed = bench.ring_balance(lengths, layout)
        assert computed.busiest_over_mean == pytest.approx(per_rank.max() / per_rank.mean(), rel=1e-12)
        assert computed.busiest_over_mean == pytest.approx(expected_ratio[balance], rel=1e-12)
        assert computed.schedule >= computed.busiest_over_mean - 1e-12  # the ring can only add waiting
        assert computed.shared_cores is None  # every rank has a core
    # this mix is one the zigzag handles badly, and the balanced layout fixes it
    assert expected_ratio["zigzag"] > 1.2 and expected_ratio["documents"] < 1.05


def test_shared_cores_time_by_hand(bench):
    # R = 2: rank 0 does 6 pairs at step 0, rank 1 does 2 at step 0 and 4 at step 1 (total 12)
    work = np.array([[6, 0], [2, 4]], dtype=float)
    # two ranks on one core: step 0 takes max(6, 8 / 1) = 8, step 1 max(4, 4) = 4; balanced 6 + 6
    assert bench._shared_core_time(work, 1, 1) == 12.0
    assert bench._shared_core_time(np.full((2, 2), 3.0), 1, 1) == 12.0
    # U = 2 splits each ring rank's work: two cores for four ranks, max(6 / 2, 8 / 2) + max(2, 2)
    assert bench._shared_core_time(work, 2, 2) == 6.0
    # only when the ranks outnumber the cores
    layout = bench.RingLayout(2, 1, "zigzag", ((((0, 4),), ((4, 8),)),), 0.0)
    assert bench.ring_balance([[1, 3, 4]], layout, cores=1).shared_cores is not None
    assert bench.ring_balance([[1, 3, 4]], layout, cores=2).shared_cores is None


def test_modes_without_a_ring_have_one_documents_row(bench):
    from tests.fake_meshes import OneRankMesh

    args = _args(bench, "--seq-len", "256")
    assert [b for b, _ in bench._document_masks(args, torch.device("cpu"), OneRankMesh())] == [None]
    assert [b for b, _ in bench._document_masks(args, torch.device("cpu"))] == [None]  # the local kernel
    with_causal = bench.parse_args(["--documents", "--seq-len", "256"])
    assert [b for b, _ in bench._document_masks(with_causal, torch.device("cpu"), RingMesh(2))] == \
        [None, "zigzag", "documents"]


def test_the_bench_runs_both_balances_and_prints_their_work(bench):
    """Two gloo ranks, tiny sizes: the ring runs one row per balance (the ulysses one row), and the
    header's busiest / mean is ``ring_work_ratios`` of the batch."""
    argv = ["--cp", "2", "--modes", "ulysses", "ring", "--documents", "--no-causal", "--seq-len", "256",
            "--n-heads", "2", "--n-kv-heads", "1", "--head-dim", "8", "--dim", "16", "--min-split", "16",
            "--iters", "2", "--warmup", "0"]
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_attention.py"), *argv],
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    labels = re.findall(r"^\| ([^|]+?) \| \d+ \| [\d.]+ \|", out, flags=re.M)
    assert labels == ["ulysses, documents", "ring, documents, balance=zigzag", "ring, documents, balance=documents"]
    assert "busiest rank CPU ms" in out  # spawned CPU ranks: the compute time beside the wall time
    printed = dict(re.findall(r"^ring R=2 x U=1, balance=(\w+)[^:]*: busiest / mean ring work ([\d.]+)", out, re.M))
    zigzag, documents = ring_work_ratios([bench.document_lengths(256, 0)], 2, 16)
    assert printed == {"zigzag": f"{zigzag:.3f}", "documents": f"{documents:.3f}"}
    assert re.search(r"^ring: measured fwd\+bwd zigzag / documents [\d.]+ \(median of 2 step pairs", out, re.M)
    assert re.search(rf"computed busiest / mean ring work {zigzag / documents:.3f}$", out, re.M)



# ------------------------------------------------------------------ docs/benchmarks/document_balance.md


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_the_docs_computed_tables_are_the_scripts(balance_script):
    """Every row of the key table and of the full tables is the script's, in the script's order
    (the doc leaves out the lockstep table and long-end). ~7 s: the default sweep."""
    args = balance_script.parse_args([])
    rows, stats, elapsed = balance_script.compute(args)
    printed = _table_rows(balance_script.report(args, rows, stats, elapsed))
    doc = DOC.read_text()
    key = _table_rows(_section(doc, "## Key results"))
    assert key == _table_rows("\n".join(balance_script.key_results(rows, args.rings)))
    full = _table_rows(_section(doc, "## Full tables (script output)"))
    assert len(full) > 150
    it = iter(printed)
    missing = [row for row in full if row not in it]  # an ordered subsequence of the output
    assert missing == []
    assert "| doczz-g | 1480 | 2264 | 2909 | 3586 |" in full  # the layout sizes the text quotes
    assert "`doczz-g` up to 3586" in doc
    worst_step = max(r["model"] for r in rows if r["layout"] == "doczz-g")
    assert f"whole step within {100 * (worst_step - 1):.1f} % of balanced" in " ".join(doc.split())


def _measured_tables(doc: str) -> tuple[list[list[str]], list[list[str]]]:
    section = _section(doc, "## Measured on CPU")
    tables = [[[c.strip() for c in row.strip("|").split("|")] for row in _table_rows(part)[1:]]
              for part in section.split("\n\n") if part.startswith("| ring R × U")]
    assert len(tables) == 2
    return tables[0], tables[1]


def test_the_measured_sections_computed_numbers_are_the_benchs(bench):
    """The computed columns beside the CPU times: ``ring_balance`` of the bench's batch (S = 16384,
    seed 0, min_split 1024) on the layout each row ran, with 2 shared cores."""
    from titan_upipe.parallel.document_mask import DocumentMask

    doc = DOC.read_text()
    prose = " ".join(doc.split())
    lengths = bench.document_lengths(16384, 0)
    assert (f"{len(lengths)} documents, longest {max(lengths)}, median {int(np.median(lengths))} tokens, "
            f"{100 * bench.visible_fraction(lengths):.1f} % of causal's visible pairs") in prose
    long = [n for n in lengths if n >= 1024]
    assert f"two long documents ({long[0]} and {long[1]} tokens)" in prose and len(long) == 2
    base = DocumentMask.from_ids(bench.document_ids(bench.parse_args(["--seq-len", "16384"])))
    computed = {}
    for ring, ulysses in ((2, 1), (4, 1), (2, 2)):
        for balance, mask in (("zigzag", base), ("documents", base.balanced(ring, ulysses, 1024))):
            layout = bench.RingLayout(ring, ulysses, balance, mask.ring_runs(ring), 0.0)
            computed[(ring, ulysses, balance)] = bench.ring_balance([lengths], layout, cores=2)
    wall, cpu = _measured_tables(doc)
    assert len(wall) == len(cpu) == 6
    for row in wall:
        ring, ulysses = (int(x) for x in row[0].split(" (")[0].split(" × "))
        zz, dd = computed[(ring, ulysses, "zigzag")], computed[(ring, ulysses, "documents")]
        assert row[5] == f"{zz.schedule / dd.schedule:.3f}"
        if zz.shared_cores is None:
            assert row[6].startswith("—") and ring * ulysses <= 2
        else:
            assert row[6] == f"{zz.shared_cores / dd.shared_cores:.3f}"
    for row in cpu:
        ring, ulysses = (int(x) for x in row[0].split(" (")[0].split(" × "))
        zz, dd = computed[(ring, ulysses, "zigzag")], computed[(ring, ulysses, "documents")]
        assert row[4] == (f"{zz.busiest_over_mean:.3f} / {dd.busiest_over_mean:.3f} "
                          f"({zz.busiest_over_mean / dd.busiest_over_mean:.3f})")
        # the busiest rank's CPU time ratio is the two medians' paired ratio: within the range of times
        zz_ms, dd_ms = (float(x) for x in row[2].split(" / "))
        low, high = (float(x) for x in row[3].split("[")[1].rstrip("]").split("–"))
        assert low <= zz_ms / dd_ms <= high
    # the prose's figures are the tables'
    apart = max(max(a, b) / min(a, b) for a, b in
                ((float(x) for x in row[5].split(" / ")) for row in cpu))
    assert f"at most {100 * (apart - 1):.1f} % apart" in prose
    for ring in (2, 4):  # the answer's and the text's ranges are the ring rows' (runs a and b)
        rows = [(w, c) for w, c in zip(wall, cpu, strict=True) if w[0] == f"{ring} × 1 (ring)"]
        for column, table in ((4, 0), (3, 1)):
            measured = sorted(float(r[table][column].split(" [")[0]) for r in rows)
            assert f"{measured[0]:.2f}–{measured[-1]:.2f}×" in prose
    zz2, dd2 = computed[(2, 1, "zigzag")], computed[(2, 1, "documents")]
    zz4, dd4 = computed[(4, 1, "zigzag")], computed[(4, 1, "documents")]
    assert (f"against {zz2.busiest_over_mean / dd2.busiest_over_mean:.2f}× and "
            f"{zz4.busiest_over_mean / dd4.busiest_over_mean:.2f}× computed") in prose
    # the threshold's cap: the bench's mix at S = 8192, R = 4, dealt at fixed thresholds and at the job's
    from titan_upipe.costs.document_balance import document_zigzag_intervals, split_threshold, step_work

    short = bench.document_lengths(8192, 1)

    def busiest(threshold: int) -> float:
        work = step_work(short, document_zigzag_intervals(short, 4, threshold, greedy_fill=True), 4).sum(axis=1)
        return work.max() / work.mean()

    zigzag, capped = ring_work_ratios([short], 4, 2048)  # the job's layout: min(2048, max(S / 4R, 2R x 128))
    cap = split_threshold(8192, 4, 2048)
    assert (f"busiest / mean {zigzag:.3f} under zigzag, {busiest(1024):.3f} with a 1024-token threshold, "
            f"{busiest(2048):.3f} with a fixed 2048 — worse than zigzag; the cap ({cap} there) gives "
            f"{capped:.3f}") in prose
    assert busiest(2048) > zigzag > capped
    assert all(split_threshold(s, r, 16384) == 16384 for s in (1 << 20, 1 << 23) for r in (2, 4, 8, 16))
