"""Causal attention FLOPs and the TensorBoard dashboard of a real training run."""

from __future__ import annotations

import glob
import io
import math
from types import SimpleNamespace

import pytest
from trainer_utils import assert_progress_lines, read_scalars

from titan_upipe.costs.model_flops import (
    causal_attention_flops_per_token,
    torchtitan_attention_flops_per_token,
)
from titan_upipe.torchtitan_0_2.metrics import LongContextMetricsProcessor
from titan_upipe.torchtitan_common.console import console_colors
from titan_upipe.torchtitan_common.dashboard import CUSTOM_SCALARS_LAYOUT


def _counted_causal_attention_flops(n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Brute force: for every query, the unmasked keys times the multiply-adds of QK^T and PV,
    forward (1x) and backward (2x: dQ, dK from dS and dP, dV from P)."""
    total = 0
    for query in range(seq_len):
        visible_keys = query + 1  # causal: keys 0..query
        forward = 2 * 2 * head_dim * visible_keys  # QK^T and PV, one mul + one add each
        total += 3 * forward
    return n_layers * n_heads * total // seq_len


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 8, 16, 7), (32, 32, 128, 64), (4, 64, 128, 1000)])
def test_causal_flops_match_a_brute_force_count(shape):
    assert causal_attention_flops_per_token(*shape) == _counted_causal_attention_flops(*shape)


def test_torchtitan_overstates_causal_attention_about_twice():
    shape = (32, 32, 128, 1 << 20)  # Llama3-8B at 1M tokens
    ratio = torchtitan_attention_flops_per_token(*shape) / causal_attention_flops_per_token(*shape)
    assert math.isclose(ratio, 2.0, rel_tol=1e-5)
    # Short sequences: the (S + 1) / 2 average, not S / 2.
    assert causal_attention_flops_per_token(1, 1, 1, 1) == 6 * 2
    assert torchtitan_attention_flops_per_token(1, 1, 1, 1) == 12


def test_processor_replaces_torchtitan_attention_term():
    """The trainer assigns TorchTitan's estimate; the processor keeps its parameter term and
    swaps the attention term for the causal one."""
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec("upipe_llama3").model_args["8B"]
    seq = 1 << 20
    job = SimpleNamespace(training=SimpleNamespace(seq_len=seq))
    proc = LongContextMetricsProcessor.__new__(LongContextMetricsProcessor)
    LongContextMetricsProcessor._set_flops_model(proc, job, args)
    shape = (args.n_layers, args.n_heads, args.dim // args.n_heads, seq)
    params_term = 6 * 7_000_000_000
    proc.num_flops_per_token = params_term + torchtitan_attention_flops_per_token(*shape)
    assert proc.num_flops_per_token == params_term + 6 * 32 * 32 * 128 * (seq + 1)
    proc.num_flops_per_token = -1  # TorchTitan's "not set yet" marker stays as is
    assert proc.num_flops_per_token == -1


def _plugin_values(run_dir: str, plugin: str) -> list[tuple[str, bytes]]:
    """(tag, payload) of every summary of one TensorBoard plugin in the run."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    values = []
    for path in glob.glob(f"{run_dir}/events.out.tfevents.*"):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == plugin:
                    values.append((value.tag, value.tensor.string_val[0]))
    return values


def test_dashboard_tags_of_a_upipe_run(upipe_text_job):
    """``conftest.upipe_text_job``: UPipe CP=2, backend auto, local text (so the Data group too),
    batch 2 x 128 tokens, 4 steps."""
    tmp_path = upipe_text_job
    scalars = read_scalars(tmp_path)
    final = {tag: values[-1][1] for tag, values in scalars.items()}
    expected = {tag for group in CUSTOM_SCALARS_LAYOUT.values() for _, tags in group.values() for tag in tags}
    # packed documents on a ring only (this job: causal, no ring): tests/test_train_e2e.py checks them
    from titan_upipe.torchtitan_0_2.cp_inputs import RING_WORK_TAGS

    assert set(RING_WORK_TAGS) <= expected and not set(RING_WORK_TAGS) & set(final)
    expected -= set(RING_WORK_TAGS)
    assert expected <= set(final), sorted(expected - set(final))
    assert [step for step, _ in scalars["throughput/step_time_s"]] == [1, 2, 3, 4]
    assert final["throughput/tokens_per_s_per_gpu"] > 0 and final["throughput/step_time_s"] > 0
    # tokens/s/GPU x step time = the tokens one rank processes per step: batch 2 x 128 / CP 2.
    tokens = final["throughput/tokens_per_s_per_gpu"] * final["throughput/step_time_s"]
    assert math.isclose(tokens, 2 * 128 / 2, rel_tol=1e-6)
    assert 0 < final["throughput/mfu_pct"] < 100
    # TorchTitan's own tflops tag uses the corrected (causal) FLOPs too.
    assert math.isclose(final["tflops"], final["throughput/tflops_per_gpu"], rel_tol=0.2)
    assert 0.05 < final["memory/peak_allocated_gib"] < 16  # CPU: the rank's resident set
    assert final["memory/peak_reserved_gib"] >= final["memory/peak_allocated_gib"] * 0.99
    assert final["memory/alloc_retries"] == 0
    assert final["memory/offload_host_gib"] == 0  # no offload in this config
    assert math.isclose(final["loss/global_avg"], final["loss_metrics/global_avg_loss"])
    runs = sorted(glob.glob(str(tmp_path / "tb" / "*")))
    layouts = [payload for _, payload in _plugin_values(runs[-1], "custom_scalars")]
    assert len(layouts) == 1
    assert all(name.encode() in layouts[0] for name in ("Loss", "Throughput", "Memory", "Data"))
    # The kernel "auto" resolved to, with why the faster ones were passed over (fp32 config).
    texts = dict(_plugin_values(runs[-1], "text"))
    choice = texts["upipe/attention_backend/text_summary"].decode()
    assert choice.startswith("attention backend auto -> sdpa (passed over flash_attn4: flash_attn4 runs "
                             "float16, bfloat16 inputs, not float32")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_colors_only_on_a_terminal():
    """TorchTitan colours its step line with escape codes; in a redirected log they are noise."""
    assert console_colors(False, _Terminal()).red == "\033[31m"
    assert console_colors(True, _Terminal()).red == ""  # metrics.disable_color_printing
    assert console_colors(False, io.StringIO()).red == ""  # a file or a pipe
    assert console_colors(False, object()).red == ""  # a stream that cannot tell


def test_progress_lines_of_a_upipe_run(upipe_text_job):
    """``conftest.upipe_text_job`` (2 ranks, 2 blocks, 4 steps, ``progress_after_seconds = 0``): each
    step's progress lines once (rank 0), validation forwards not counted, the phase times in
    TensorBoard, no colour codes in the redirected console."""
    console = (upipe_text_job / "console.log").read_text()
    assert "\033[" not in console
    lines = assert_progress_lines(console, 4)
    assert "(from this step's blocks)" in lines[0] and "(from step 1)" in lines[6]
    scalars = read_scalars(upipe_text_job)
    phases = {phase: dict(scalars[f"progress/{phase}_seconds"]) for phase in ("forward", "backward", "optimizer")}
    step_time = dict(scalars["throughput/step_time_s"])
    for step in range(1, 5):
        assert 0 < sum(times[step] for times in phases.values()) <= step_time[step]
