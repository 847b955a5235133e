"""The planner's report module (``titan_upipe.plan.report``): the paper's Table 4 and the plot
when the table is missing."""

from __future__ import annotations

from plan_jobs import GIB, gpu_job

from titan_upipe.plan import report as P  # the module whose PAPER_TABLES_CSV the plot reads


def test_paper_table_absence_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "PAPER_TABLES_CSV", tmp_path / "missing.csv")
    assert P.paper_table4("llama3_8b") is None
    message = P.make_plot(gpu_job(), str(tmp_path / "p.png"), 80 * GIB, None, "llama3_8b")
    assert message and "not found" in message and (tmp_path / "p.png").exists()


def test_plot_has_ulysses_upipe_and_upipe_with_the_long_context_switches():
    """Issue 18's plot: Ulysses, UPipe with the paper's settings and UPipe with the switches that
    reach 7M; the switched line lies below UPipe's at 7M (one hidden state: 5 GiB less at 5M-ish
    lengths is the late prefetch; the resident block costs nothing at block 0's peak)."""
    from dataclasses import replace

    from titan_upipe.plan import plan

    variants = dict(P.plot_variants(gpu_job()))
    plain, switched = variants["UPipe (U = C = 8)"], variants[f"UPipe (U = C = 8), {P.LONG_CONTEXT_LABEL}"]
    assert "Ulysses" in variants
    assert (switched.prefetch_after_attention, switched.resident_blocks) == (True, 1)
    assert (plain.prefetch_after_attention, plain.resident_blocks) == (False, 0)
    at_7m = [plan(replace(v, seq_len=7 * 2**20)).peak_gpu_bytes for v in (plain, switched)]
    assert at_7m[1] < at_7m[0]
