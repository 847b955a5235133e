"""The GPU suite's ring_documents stage (issue 35) on CPU: its single-process ring driver runs the
ring's own calls (the pairs they cover equal ``costs.document_balance.step_work``, every rank's
merged output is attention over the whole sequence), its figures on a clock that counts work equal
the computed ones, the stage's report, and the queue's two items."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from titan_upipe.attention.backends import SdpaCpuKernels
from titan_upipe.attention.documents import masked_forward
from titan_upipe.attention.ring_plan import document_step_calls
from titan_upipe.costs.document_balance import imbalance, step_work
from titan_upipe.tools import gpu_queue, gpu_suite
from titan_upipe.tools import gpu_ring_documents as grd

ROWS = [[200, 9, 150, 3, 20, 4, 70, 56], [100, 12, 300, 100]]
"""Two packed rows of 512 tokens: documents over ``MIN_SPLIT`` (split into 2R pieces under
``"documents"``), short ones dealt whole, and documents crossing the zigzag's chunk boundaries."""
MIN_SPLIT = 64
SHAPE = grd.RingShape(2, 1, 8)


def _inputs(ring: int, dtype=torch.float32) -> grd.RingInputs:
    return grd.RingInputs(len(ROWS), sum(ROWS[0]) // ring, SHAPE, dtype, "cpu")


def _run(ring: int, balance: str, **kwargs) -> tuple[grd.RingTiming, object]:
    mask = grd.batch_mask(ROWS, ring, balance, MIN_SPLIT)
    timing = grd.time_ring_ranks(mask, ring, SdpaCpuKernels(), kwargs.pop("inputs", None) or _inputs(ring),
                                 SHAPE.head_dim ** -0.5, kwargs.pop("clock", None) or grd.Clock(), **kwargs)
    return timing, mask


def _layout_work(mask, ring: int) -> np.ndarray:
    """``step_work`` over the runs the mask itself carries (not the deal that made them)."""
    W = np.zeros((ring, ring), dtype=np.int64)
    for lengths, row in zip(ROWS, mask.ring_runs(ring), strict=True):
        intervals = [(a, b, r) for r, runs in enumerate(row) for a, b in runs]
        W += step_work(lengths, np.array(intervals), ring)
    return W


@pytest.mark.parametrize("balance", grd.BALANCES)
@pytest.mark.parametrize("ring", [2, 4])
def test_the_kernel_calls_cover_exactly_the_computed_work(ring, balance):
    """Per (rank, step) the pairs the driver hands the kernel are ``step_work``'s ``W[r, t]``, in
    closed form over the deal (``computed_work``) and over the runs the mask carries; all of them
    together are every visible pair once."""
    timing, mask = _run(ring, balance)
    W = grd.computed_work(ROWS, ring, balance, MIN_SPLIT)
    assert np.array_equal(timing.pairs, W)
    assert np.array_equal(W, _layout_work(mask, ring))
    assert timing.pairs.sum() == sum(n * (n + 1) // 2 for row in ROWS for n in row)
    if balance == "documents":  # the layout is not the zigzag: the test tells the two apart
        assert not np.array_equal(W, grd.computed_work(ROWS, ring, "zigzag", MIN_SPLIT))


@pytest.mark.parametrize("balance", grd.BALANCES)
def test_a_plan_reading_the_wrong_ring_step_is_caught(balance):
    """Sabotage: a plan of step ``-t`` (the K/V of rank ``r + t``, the ring turning the wrong way)."""
    def wrong(rank, ring, step, runs, docs):
        return document_step_calls(rank, ring, (-step) % ring, runs, docs)

    timing, _ = _run(4, balance, plan=wrong)
    assert not np.array_equal(timing.pairs, grd.computed_work(ROWS, 4, balance, MIN_SPLIT))


class GlobalInputs(grd.RingInputs):
    """Ring-local views of whole-sequence tensors at each rank's positions (the layout's shards)."""

    def __init__(self, mask, ring: int, q, k, v, dout) -> None:
        super().__init__(q.shape[0], q.shape[2] // ring, SHAPE, q.dtype, "cpu")
        self.positions = [grd.ring_positions(mask, ring, r) for r in range(ring)]
        self.q_all, self.k_all, self.v_all, self.dout_all = q, k, v, dout

    def _at(self, t, rank):
        pos = self.positions[rank]
        return torch.stack([t[b][:, pos[b]] for b in range(t.shape[0])])

    def q(self, rank):
        return self._at(self.q_all, rank)

    def dout(self, rank):
        return self._at(self.dout_all, rank)

    def kv(self, rank):
        return self._at(self.k_all, rank), self._at(self.v_all, rank)


def _output_errors(ring: int, balance: str) -> list[float]:
    torch.manual_seed(0)
    b, s = len(ROWS), sum(ROWS[0])
    q = torch.randn(b, SHAPE.q_heads, s, SHAPE.head_dim, dtype=torch.float32)
    k, v = (torch.randn(b, SHAPE.kv_heads, s, SHAPE.head_dim, dtype=torch.float32) for _ in range(2))
    mask = grd.batch_mask(ROWS, ring, balance, MIN_SPLIT)
    scale = SHAPE.head_dim ** -0.5
    every = torch.arange(s)
    out_ref, lse_ref = masked_forward(q, k, v, scale, mask.visible(every, every))
    inputs = GlobalInputs(mask, ring, q, k, v, torch.zeros_like(q))
    timing = grd.time_ring_ranks(mask, ring, SdpaCpuKernels(), inputs, scale, grd.Clock(), keep_outputs=True)
    errors = []
    for rank, (out, lse) in enumerate(timing.outputs):
        errors.append(max((out - inputs._at(out_ref, rank)).abs().max().item(),
                          (lse - inputs._at(lse_ref.unsqueeze(-1), rank).squeeze(-1)).abs().max().item()))
    return errors


@pytest.mark.parametrize("balance", grd.BALANCES)
def test_every_ranks_merged_output_is_attention_over_the_whole_sequence(balance):
    """The driver feeds each step the K/V of rank ``(r - t) mod R``: each rank's merged out/lse
    equal the exact masked attention of the whole batch at that rank's positions (fp32)."""
    assert max(_output_errors(4, balance)) < 2e-5


def test_a_driver_feeding_the_wrong_ranks_kv_is_caught(monkeypatch):
    """Sabotage: the K/V of rank ``(r + t) mod R`` at step ``t``."""
    monkeypatch.setattr(grd, "kv_source", lambda rank, ring, step: (rank + step) % ring)
    assert max(_output_errors(4, "zigzag")) > 1e-2


class WorkClock(grd.Clock):
    """A clock that stands still except inside the kernel: each call advances it by the pairs the
    kernel is handed (counted here from the tensors it receives), backward calls 2.5x."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self):
        return self.now

    @staticmethod
    def ms(start, stop):
        return stop - start


class CountingKernels(SdpaCpuKernels):
    def __init__(self, clock: WorkClock) -> None:
        self.clock = clock

    def _advance(self, q, k, causal, factor):
        rows, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        self.clock.now += factor * rows * (sq * (sq + 1) / 2 if causal else sq * sk)

    def forward(self, q, k, v, scale, causal=True):
        self._advance(q, k, causal, 1.0)
        return super().forward(q, k, v, scale, causal)

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        self._advance(q, k, causal, 2.5)
        return super().backward(dout, q, k, v, out, lse, scale, causal)


@pytest.mark.parametrize("balance", grd.BALANCES)
def test_the_measured_figures_on_a_clock_that_counts_work_are_the_computed_ones(balance):
    """With kernel time = pairs (forward) and 2.5 x pairs (backward), each (rank, step) is ``W``,
    each rank ``3.5 sum_t W``, busiest / mean ``imbalance(W)["total"]`` and the ring step
    ``3.5 sum_t max_r W`` (``/ mean``: ``imbalance(W)["stepwise"]``). A ring step summed the other
    way (``max_r sum_t``, the lower bound) fails it: the two differ here."""
    ring = 4
    clock = WorkClock()
    mask = grd.batch_mask(ROWS, ring, balance, MIN_SPLIT)
    timing = grd.time_ring_ranks(mask, ring, CountingKernels(clock), _inputs(ring), SHAPE.head_dim ** -0.5, clock)
    W = grd.computed_work(ROWS, ring, balance, MIN_SPLIT)
    assert np.array_equal(timing.fwd_ms, W) and np.array_equal(timing.bwd_ms, 2.5 * W)
    summary = grd.summarize(timing.fwd_ms, timing.bwd_ms)
    assert summary["rank_ms"] == pytest.approx((3.5 * W.sum(axis=1)).tolist())
    assert summary["busiest_over_mean"] == pytest.approx(imbalance(W)["total"])
    assert summary["ring_step_ms"] == pytest.approx(3.5 * sum(max(W[r, t] for r in range(ring)) for t in range(ring)))
    assert summary["ring_step_over_mean"] == pytest.approx(imbalance(W)["stepwise"])
    assert imbalance(W)["stepwise"] > imbalance(W)["total"] + 1e-3


def test_a_case_reports_the_computed_ratios_and_fails_on_uncovered_pairs(monkeypatch):
    case = grd.plan_cases("cpu")[1]
    assert (case.ring, case.balance) == (2, "documents")
    result = grd.time_case(case, "cpu", "sdpa")
    assert result["pairs_match"] and "error" not in result
    assert np.array(result["fwd_ms"]).shape == (2, 2) and result["dtype"] == "float32"
    W = grd.computed_work([case.lengths()], case.ring, case.balance, case.min_split)
    assert result["computed_busiest_over_mean"] == pytest.approx(W.sum(1).max() / W.sum(1).mean())
    assert result["computed_ring_step_over_mean"] == pytest.approx(W.max(0).sum() / W.sum(1).mean())
    # a plan that turns the ring the wrong way is reported as failed, not timed as if right
    wrong = functools.partial(grd.time_ring_ranks,
                              plan=lambda r, n, t, runs, docs: document_step_calls(r, n, (-t) % n, runs, docs))
    monkeypatch.setattr(grd, "time_ring_ranks", wrong)
    bad = grd.time_case(grd.plan_cases("cpu")[3], "cpu", "sdpa")
    assert not bad["pairs_match"] and bad["ok"] is False and "step_work" in bad["error"]


def test_the_batch_is_the_mix_the_docstring_names():
    one_m = grd.batch_lengths(grd.MIX, grd.RING_LENGTHS["1M"], grd.MIX_SEED)
    assert sum(one_m) == 2**20 and len(one_m) == 253 and max(one_m) == 271651
    short = grd.batch_lengths(grd.MIX, grd.RING_LENGTHS["128K"], grd.MIX_SEED)
    assert sum(short) == 2**17 and len(short) == 48 and max(short) < grd.DEFAULT_MIN_SPLIT
    assert grd.batch_lengths(grd.MIX, 4096, 0) == [2182, 1818, 96]  # the CPU case (module docstring)


def test_the_stage_runs_on_cpu_and_writes_its_report(tmp_path):
    args = gpu_suite.parse_args(["--stage", "ring_documents", "--out", str(tmp_path)])
    report = gpu_suite.run_stage("ring_documents", args, ["--stage", "ring_documents"], device="cpu")
    assert report.ok and len(report.results) == 4
    assert {(r["ring"], r["balance"]) for r in report.results} == {(n, b) for n in (2, 4) for b in grd.BALANCES}
    assert all(r["pairs_match"] and len(r["rank_ms"]) == r["ring"] for r in report.results)
    saved = json.loads((tmp_path / "ring_documents.json").read_text())
    assert saved["stage"] == "ring_documents" and saved["ok"]
    text = (tmp_path / "ring_documents.md").read_text()
    assert "| length | R | balance |" in text and "ring step zigzag / documents" in text
    for ring in (2, 4):
        zz, dd = (next(r for r in report.results if r["ring"] == ring and r["balance"] == b) for b in grd.BALANCES)
        busiest = max(zz["rank_ms"]) / (sum(zz["rank_ms"]) / ring)
        assert zz["busiest_over_mean"] == pytest.approx(busiest)
        assert (f"| 4K | {ring} | {zz['ring_step_ms'] / dd['ring_step_ms']:.2f} | "
                f"{zz['computed_ring_step_over_mean'] / dd['computed_ring_step_over_mean']:.2f} |") in text
    # a CPU report's 4K cases leave the GPU items pending
    items = {i.name: i for i in gpu_queue.build_queue(lambda *a: 1.0, "sdpa", ("sdpa",))}
    assert not items["ring_documents 128K"].done(gpu_queue.load_reports([tmp_path]))


def test_without_a_varlen_kernel_the_stage_says_why_and_stays_pending(monkeypatch):
    def none(device):
        raise grd.ConfigError("attention_backend = 'auto' found no usable backend: flash_attn4: not installed")

    monkeypatch.setattr(grd, "varlen_backend", none)
    results = grd.run_ring_documents_stage("cuda")
    assert len(results) == 1 and results[0]["skipped"] and "flash_attn4" in results[0]["detail"]
    item = next(i for i in gpu_queue.build_queue(lambda *a: 1.0, "sdpa", ("sdpa",)) if i.name == "ring_documents 1M")
    assert not item.done([{"stage": "ring_documents", "environment": {}, "results": results}])


# --- the queue -------------------------------------------------------------------------------------


def _result(length: str, ring: int, balance: str, **fields) -> dict:
    return {"check": "ring_documents", "length": length, "ring": ring, "balance": balance, **fields}


def test_the_queue_ends_with_the_two_ring_documents_items():
    items = gpu_queue.build_queue(lambda stage, lengths, select: 100.0, "sdpa", ("sdpa",))
    assert [i.name for i in items[-3:]] == ["attention 2M", "ring_documents 128K", "ring_documents 1M"]
    short, long = items[-2:]
    assert short.argv == ("--stage", "ring_documents", "--lengths", "128K")
    args = gpu_suite.parse_args([*long.argv, "--budget-s", "540"])
    assert args.stage == "ring_documents" and args.lengths == ("1M",)
    everything = [_result("1M", n, b, rank_ms=[1.0] * n, ok=True) for n in (8, 16) for b in grd.BALANCES]
    report = {"stage": "ring_documents", "environment": {}, "results": everything}
    assert long.done([report]) and not short.done([report])
    assert not long.done([{**report, "results": everything[:3]}])  # R = 16 documents still owed
    oom = [*everything[:3], _result("1M", 16, "documents", oom=True, ok=True)]
    assert long.done([{**report, "results": oom}])
    error = [*everything[:3], _result("1M", 16, "documents", ok=False, error="RuntimeError: x")]
    assert not long.done([{**report, "results": error}])  # retried by a later call
    wrong = [*everything[:3], _result("1M", 16, "documents", rank_ms=[1.0] * 16, ok=False, pairs_match=False)]
    assert not long.done([{**report, "results": wrong}])  # timed, but its calls missed pairs: retried
    rows = [line.split(None, 1) for line in gpu_queue.__doc__.splitlines() if line[:1].isdigit()]
    assert rows[-1][0] == "9" and rows[-1][1].startswith("``ring_documents`` 128K, then 1M")


@pytest.mark.parametrize("length, passes, rounded", [("128K", 4, 102), ("1M", 2, 221)])
def test_the_items_estimate_is_the_start_and_every_pass_at_the_assumed_rate(length, passes, rounded):
    """``STARTUP_S`` once, then per (R, balance) ``CASE_SETUP_S`` and ``passes`` (a warm-up and the
    timed ones) of forward + 2.5 x backward FLOPs, ``4 D Hq`` per visible pair, at 150 TFLOP/s
    (``rounded``: what docs/benchmarks/gpu/README.md says)."""
    lengths = grd.batch_lengths(grd.MIX, grd.RING_LENGTHS[length], grd.MIX_SEED)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    one = grd.CASE_SETUP_S + passes * 3.5 * 4 * 128 * 32 * pairs / 150e12
    expected = grd.STARTUP_S + 4 * one
    assert gpu_suite.call_estimate_s("ring_documents", (length,), None) == pytest.approx(expected)
    assert expected <= gpu_suite.DEFAULT_BUDGET_S and round(expected) == rounded


def test_the_stage_is_in_the_dry_run_and_refuses_other_lengths(capsys, tmp_path):
    assert gpu_suite.main(["--dry-run", "--next", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ring_documents 128K  (--stage ... --stage ring_documents --lengths 128K)" in out
    assert "stage ring_documents: 8 runs, 8 within 540 s" in out
    for argv, message in ((["--stage", "ring_documents", "--lengths", "2M"], "ring_documents stage: 128K, 1M"),
                          (["--stage", "ring_documents", "--select", "x"], "--select narrows")):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(argv)
        assert message in capsys.readouterr().err
