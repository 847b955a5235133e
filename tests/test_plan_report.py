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
