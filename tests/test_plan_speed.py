"""The planner's kept attention (sizing ``auto``) and its predicted step time and tokens/s
(``titan_upipe.plan.speed``), against arithmetic written out here."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest

from titan_upipe.costs.kernel_speed import attention_rate
from titan_upipe.plan import PlanInput, model_dims, plan
from titan_upipe.plan.kept import kept_bytes, kept_tensor_bytes
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.speed import MATMUL_TFLOPS, predict_step, predicted_speeds
from titan_upipe.spec.units import GIB

REPO = Path(__file__).resolve().parents[1]
M = 2**20


def llama_1m(**changes) -> PlanInput:
    return replace(PlanInput(model=model_dims("llama3_8b"), seq_len=M, cp=8, mode="upipe",
                             attention_backend="flash_attn4"), **changes)


def test_prediction_is_the_arithmetic_of_the_kernel_table():
    """Llama3-8B, UPipe over 8 ranks at 1M: one rank attends 4 heads over 2^20 tokens. Causal
    attention forward FLOPs 2 H D S^2 / C, backward 2.5x; the rates are the table's FA4 on sm90."""
    rate = attention_rate("flash_attn4")
    assert rate.basis == "measured" and rate.arch == "sm90"
    fwd = 2 * 32 * 128 * M**2 / 8
    fwd_s, bwd_s = fwd / (rate.fwd_tflops * 1e12), 2.5 * fwd / (rate.bwd_tflops * 1e12)
    assert fwd_s == pytest.approx(1.668, abs=0.002) and bwd_s == pytest.approx(4.578, abs=0.002)
    tokens, linear, qkv = M // 8, 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336, 4096 * 6144
    gemm = (4 * 2 * tokens * linear + 2 * tokens * qkv) / (MATMUL_TFLOPS * 1e12)  # + UPipe's Q/K/V in backward
    head = 3 * 2 * tokens * 4096 * 128256 / (MATMUL_TFLOPS * 1e12)
    full = predict_step(llama_1m())
    assert full.attention_s == pytest.approx(32 * (2 * fwd_s + bwd_s), rel=1e-9)
    assert full.gemm_s == pytest.approx(32 * gemm, rel=1e-9) and full.head_s == pytest.approx(head, rel=1e-9)
    kept = predict_step(llama_1m(keep_device_blocks=32))
    assert kept.attention_s == pytest.approx(32 * (fwd_s + bwd_s), rel=1e-9)
    assert kept.gemm_s == pytest.approx(32 * (gemm - 2 * tokens * qkv / (MATMUL_TFLOPS * 1e12)), rel=1e-9)
    assert kept.comm_s < full.comm_s  # UPipe's kept recomputation runs no all-to-all
    assert full.tokens_per_s_per_gpu == pytest.approx(tokens / full.step_s)
    assert 480 < full.tokens_per_s_per_gpu < 495  # the corrected 480-497 from the same H200 data
    assert kept.tokens_per_s_per_gpu >= 580


def test_keep_auto_fills_the_gpu_then_the_host():
    job = llama_1m()
    assert size_keep_attention(job, "auto", None, 80 * GIB).device_blocks == 32  # 32.5 GiB beside a ~26 GiB peak
    long = replace(job, seq_len=4 * M)
    sized = size_keep_attention(long, "auto", None, 80 * GIB, 1900 * GIB)
    assert 0 < sized.device_blocks < 32 and sized.host_blocks > 0
    more = replace(long, keep_device_blocks=sized.device_blocks + 1)
    assert not plan(more).fits(80 * GIB)  # one more on the GPU would not fit
    assert plan(replace(long, keep_device_blocks=sized.device_blocks)).fits(80 * GIB)
    assert size_keep_attention(long, "device", 2, 80 * GIB).blocks == 2  # the cap
    assert size_keep_attention(long, "host", None, 80 * GIB, 1900 * GIB).device_blocks == 0
    assert size_keep_attention(long, "auto", None, 1 * GIB).blocks == 0  # nothing fits: full recompute


def test_kept_term_counts_each_tensor_of_each_mode():
    """The output ``T H D a`` and the LSE ``T H 4``, however the mode splits them into tensors."""
    for mode, extra in (("upipe", {}), ("ulysses", {}), ("usp", {"ulysses": 4}), ("tsp", {}),
                        ("upipe", {"ulysses": 4})):
        job = llama_1m(mode=mode, keep_device_blocks=1, **extra)
        if mode == "tsp":
            job = replace(job, tiled_mlp=False, fused_rope=False)
        s = StepSizes.of(job)
        assert kept_bytes(s) == sum(kept_tensor_bytes(s)) == (M // 8) * 32 * (128 * 2 + 4), mode


def test_kept_blocks_add_their_bytes_to_the_plan():
    """On the device: the loss moment (every block's forward done) grows by one term per block; on
    the host: the host bytes do, pinned tensor by tensor."""
    job = llama_1m()
    per_block = kept_bytes(StepSizes.of(replace(job, keep_device_blocks=1)))
    base, device = plan(job), plan(replace(job, keep_device_blocks=5))
    loss = {m.where: m.total for m in base.moments if m.phase == "loss"}
    kept_loss = {m.where: m.total for m in device.moments if m.phase == "loss"}
    assert all(kept_loss[k] - loss[k] == 5 * per_block for k in loss)
    host = plan(replace(job, keep_host_blocks=5))
    assert host.host_bytes_per_rank - base.host_bytes_per_rank == 5 * (2**30 + 4 * 2**22)  # pow2 rounded
    # a block's backward brings the next block's kept attention with its input
    label = "block 28: next block's kept attention output + LSE prefetched from host"
    assert any(m.terms.get(label) == per_block for m in host.moments if m.where.startswith("block 28 backward"))
    assert not any(label in m.terms for m in base.moments)


def test_plan_cli_shows_the_recipes_keep_plan_and_speed():
    """The issue's check: ``plan --job.config_file configs/llama3_8b/upipe_1m.toml`` shows the keep
    plan and a predicted tokens/s/GPU of at least 580 with the measured FA4 H200 rates."""
    from titan_upipe.tools.plan_cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--job.config_file", str(REPO / "configs/llama3_8b/upipe_1m.toml")])
    text = out.getvalue()
    assert "kept attention (keep_attention = auto): 32 of 32 blocks keep their attention (32 on the device)" in text
    planned = re.search(r"as planned +[\d.]+ s per step, +(\d+) tokens/s/GPU", text)
    full = re.search(r"full recompute +[\d.]+ s per step, +(\d+) tokens/s/GPU", text)
    assert planned and full and int(planned.group(1)) >= 580 > int(full.group(1)), text
    assert "GEMMs at an assumed 600 TFLOP/s" in text and "paper Table 3 (8xH100, FA3): 473" in text


def test_predicted_speed_doc_rows_are_the_planners():
    """``docs/benchmarks/predicted_speed.md``'s 1M rows against ``tools.speed_table`` now."""
    from titan_upipe.tools.speed_table import TABLES, recipe_row
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    doc = (REPO / "docs/benchmarks/predicted_speed.md").read_text()
    for table in TABLES:
        path = dict(table.recipes)["1M"]
        assert recipe_row("1M", path, REPO, table.model, table.method) in doc, table.title


def test_speeds_without_kept_blocks_are_alike():
    speeds = predicted_speeds(llama_1m())
    assert speeds["full recompute"] == speeds["as planned"]
