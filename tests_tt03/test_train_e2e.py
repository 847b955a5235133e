"""The debug recipes train on TorchTitan 0.3 (``python -m titan_upipe.train``, the ranks on gloo) with the
losses of a one-rank run on 0.3, for every CP mode: Ulysses, ring, UPipe, USP, UPipe inside USP and TSP;
Llama3 and Qwen3.

Every run starts from one seed checkpoint, written by TorchTitan 0.2.2's trainer and converted to
0.3's key names (``tools.checkpoint_convert``), so the layouts start from the same weights and the
0.3 runs can be held against a 0.2.2 run of the same job: the one-rank losses are the same on both
versions. The one-rank reference runs 0.3's own attention (SDPA, causal), the CP runs the plugin's.
Each CP run must log its conversion: a run whose attention was left alone would match too, and prove
nothing.
"""

from __future__ import annotations

import pytest
from on_0_2 import DOCS_ARGS, REFERENCE_BATCH, REFERENCE_STEPS
from trainer_utils import (
    assert_losses_close,
    assert_progress_lines,
    create_seed_checkpoint,
    load_seed,
    losses,
    read_scalars,
    torchrun,
)

from titan_upipe.tools import checkpoint_convert as convert_checkpoint

STEPS = "3"
SEQ = 512
GLOBAL_BATCH = 4
VALIDATION = ("--validation.enable", "--validation.dataset", "synthetic_copy", "--validation.seq_len", str(SEQ),
              "--validation.local_batch_size", "2", "--validation.steps", "1", "--validation.freq", "2")
"""Held-out synthetic validation after steps 1 and 2: one batch of 2 sequences, sharded like training."""
VALIDATION_LOSS = "validation_metrics/loss"


def train(ranks: int, config: str, out, seed, *overrides: str):
    return torchrun(ranks, "titan_upipe.train", config, out, "--training.steps", STEPS, *overrides, *load_seed(seed))


@pytest.fixture(scope="module")
def llama3_seed_0_2(on_0_2):
    return on_0_2["seed"]


@pytest.fixture(scope="module")
def llama3_seed(llama3_seed_0_2, tmp_path_factory):
    converted = tmp_path_factory.mktemp("seed03") / "step-0"
    assert convert_checkpoint.main([str(llama3_seed_0_2), str(converted), "--to", "0.3"]) == 0
    return converted


@pytest.fixture(scope="module")
def llama3_one_rank(llama3_seed, tmp_path_factory):
    out = tmp_path_factory.mktemp("one03")
    train(1, "configs/debug/llama3_fsdp.toml", out, llama3_seed, "--training.local_batch_size", str(GLOBAL_BATCH),
          *VALIDATION)
    return out


def converted(mode: str, ranks: int, mesh: str) -> str:
    return f"Converted attention to {mode} over a CP mesh of {ranks} ranks ({mesh})"


CP_CASES = [
    # (config, ranks, what the conversion logs, overrides): a global batch of 4 sequences each
    ("configs/debug/llama3_ulysses.toml", 2, [converted("ulysses", 2, "{'cp': 2}")],
     ("--training.local_batch_size", "4")),
    ("configs/debug/llama3_ring.toml", 2, [converted("ring", 2, "{'ring': 2}")],
     ("--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2")),
    # U = 4 of 8 heads over 2 ranks: two stages
    ("configs/debug/llama3_upipe.toml", 2, [converted("upipe", 2, "{'cp': 2}")],
     ("--training.local_batch_size", "4", "--upipe.heads_per_stage", "4")),
    ("configs/debug/llama3_usp.toml", 4, [converted("usp", 4, "{'ring': 2, 'ulysses': 2}")],
     ("--training.local_batch_size", "4")),
    # UPipe's stages, each a ring over 2, on the 2-D (ring, ulysses) mesh
    ("configs/debug/llama3_upipe_usp.toml", 4, [converted("upipe", 4, "{'ring': 2, 'ulysses': 2}")],
     ("--training.local_batch_size", "4")),
    # TSP: the blocks' 7 weights each (2 blocks) DTensors sharded over the 2 CP ranks, outside FSDP; zigzag
    # tokens; GQA 8 / 2
    ("configs/debug/tsp.toml", 2, ["Converted attention and feed-forward to TSP over 2 ranks",
                                   "every parameter but the 14 TSP-sharded weights"],
     ("--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2", "--model.flavor", "debug")),
]


@pytest.mark.parametrize("config, ranks, logged, overrides", CP_CASES,
                         ids=["ulysses-cp2", "ring-cp2", "upipe-cp2-u4", "usp-r2u2", "upipe-in-usp-r2u2", "tsp-cp2"])
def test_context_parallel_matches_one_rank_on_0_3(llama3_seed, llama3_one_rank, tmp_path, config, ranks, logged,
                                                  overrides):
    proc = train(ranks, config, tmp_path, llama3_seed, *overrides, *VALIDATION)
    log = proc.stdout + proc.stderr
    for line in logged:
        assert line in log, line
    reference = losses(llama3_one_rank)
    assert len(reference) == int(STEPS)
    assert_losses_close(losses(tmp_path), reference, rtol=1e-5)
    assert [s for s, _ in read_scalars(tmp_path)[VALIDATION_LOSS]] == [1, 2]  # the evaluation under CP
    assert_losses_close(losses(tmp_path, VALIDATION_LOSS), losses(llama3_one_rank, VALIDATION_LOSS), rtol=1e-5)
    check_counters(tmp_path, cp=ranks)


def test_tflops_count_the_causal_attention_on_0_3(llama3_one_rank):
    """``tflops`` x 10^12 / ``throughput(tps)`` is the FLOPs per token: 6 x the non-embedding parameters (counted
    here on the flavor's built model) + the causal attention's 6 L H D (S + 1), as on 0.2 (0.3's own count takes
    the full square, 6 L H 2D S); ``mfu(%)`` is the same FLOPs against the device's peak."""
    import torch

    from titan_upipe.torchtitan_0_3.flavors import model_spec

    with torch.device("meta"):
        model = model_spec("upipe_llama3", "debug").model.build()
    attention = model.layers["0"].attention
    matmul_params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    flops = 6 * matmul_params + 6 * len(model.layers) * attention.n_heads * attention.head_dim * (SEQ + 1)
    scalars = read_scalars(llama3_one_rank)
    for (_, tflops), (_, tps), (_, mfu) in zip(scalars["tflops"], scalars["throughput(tps)"], scalars["mfu(%)"],
                                                strict=True):
        assert tflops * 1e12 / tps == pytest.approx(flops, rel=1e-5)
        # TorchTitan knows no CPU's peak: it divides by an A100's, 312 TFLOP/s (docs/dashboard.md)
        assert mfu == pytest.approx(100 * flops * tps / 312e12, rel=1e-5)


def test_the_plugins_grouped_tags_on_0_3(llama3_one_rank):
    """The plugin's Loss, Throughput and Memory tags (``torchtitan_common.dashboard``) beside 0.3's own, at every
    logged step, each the same quantity as 0.3's counterpart (read a few microseconds apart)."""
    from titan_upipe.torchtitan_common.dashboard import CUSTOM_SCALARS_LAYOUT

    scalars = read_scalars(llama3_one_rank)
    steps = list(range(1, int(STEPS) + 1))
    grouped = [tag for group in ("Loss", "Throughput", "Memory") for _, tags in CUSTOM_SCALARS_LAYOUT[group].values()
               for tag in tags if tag.startswith(("loss/", "throughput/", "memory/"))]
    assert len(grouped) == 9 and all([s for s, _ in scalars[tag]] == steps for tag in grouped), sorted(scalars)
    same = {"loss/global_avg": ("loss_metrics/global_avg_loss", 1e-7), "throughput/tokens_per_s_per_gpu":
            ("throughput(tps)", 1e-2), "throughput/tflops_per_gpu": ("tflops", 1e-2),
            "throughput/mfu_pct": ("mfu(%)", 1e-2), "throughput/step_time_s": ("time_metrics/end_to_end(s)", 1e-2)}
    for tag, (theirs, rel) in same.items():
        for (_, ours), (_, value) in zip(scalars[tag], scalars[theirs], strict=True):
            assert ours == pytest.approx(value, rel=rel), (tag, ours, value)
    assert all(0 < v < 24 for _, v in scalars["memory/peak_allocated_gib"])  # the CPU's resident set, in GiB


def test_a_0_2_checkpoint_trains_on_0_3_as_on_0_2(on_0_2, llama3_one_rank):
    """The same job from the same weights on both versions: 0.2.2 from its own checkpoint (``on_0_2``), 0.3
    from the converted one (the one-rank reference above): equal losses, step by step."""
    assert STEPS == REFERENCE_STEPS and str(GLOBAL_BATCH) == REFERENCE_BATCH
    reference = losses(on_0_2["one_rank"])
    assert len(reference) == int(STEPS)
    assert_losses_close(losses(llama3_one_rank), reference, rtol=1e-5)


@pytest.mark.parametrize("config, overrides", [
    ("configs/debug/llama3_upipe.toml", ()),
    ("configs/debug/llama3_ring.toml", ("--parallelism.context_parallel_degree", "2", "--upipe.document_min_split", "64")),
], ids=["upipe-cp2", "ring-cp2-document-layout"])
def test_packed_documents_train_on_0_3_as_on_0_2(on_0_2, llama3_seed, tmp_path, config, overrides):
    """Packed documents (``debug_flex`` on ``synthetic_docs``: each document ends at EOS and attends within
    itself, RoPE positions through the row) under UPipe and under the ring's document-aware layout on 0.3,
    from the converted 0.2.2 seed: training and validation losses equal TorchTitan 0.2.2's one rank, whose
    attention is its own flex document mask."""
    proc = train(2, config, tmp_path, llama3_seed, *DOCS_ARGS, *overrides)
    log = proc.stdout + proc.stderr
    assert "Converted attention to" in log
    reference = on_0_2["docs_one_rank"]
    assert len(losses(reference)) == int(STEPS)
    assert_losses_close(losses(tmp_path), losses(reference), rtol=1e-5)
    assert_losses_close(losses(tmp_path, VALIDATION_LOSS), losses(reference, "validation_metrics/loss"), rtol=1e-5)


def test_memory_transforms_and_offloaded_checkpointing_match_one_rank_on_0_3(llama3_seed, llama3_one_rank, tmp_path):
    """UPipe with every memory transform (tiled MLP and RMSNorm, fused RoPE with compact per-layer tables,
    fused CE as 0.3's chunked loss), offloaded checkpointing and one block keeping its attention."""
    proc = train(2, "configs/debug/llama3_upipe_transforms.toml", tmp_path, llama3_seed, "--training.local_batch_size",
                 "4", "--activation_checkpoint.keep_attention", "device", "--activation_checkpoint.keep_attention_blocks",
                 "1", "--transforms.ce_chunk_tokens", "128")
    log = proc.stdout + proc.stderr
    for line in ("tiled_mlp: 2 feed-forwards", "tiled_rmsnorm: 5 norms", "fused_rope: Q/K rotated in place",
                 "fused_ce: TorchTitan 0.3's chunked loss, 8 chunks of 128 tokens",
                 "offloaded checkpointing: 2 blocks, inputs to host memory (pinned: False), 1 of 2 blocks keep their "
                 "attention (1 on the device)"):
        assert line in log, line
    assert_losses_close(losses(tmp_path), losses(llama3_one_rank), rtol=1e-5)


def test_tsp_with_offloaded_checkpointing_and_a_kept_block_matches_one_rank_on_0_3(llama3_seed, llama3_one_rank,
                                                                                   tmp_path):
    """TSP's blocks under offloaded full AC, one keeping its attention (the recomputation then gathers no K/V for
    it): the one-rank losses."""
    proc = train(2, "configs/debug/tsp.toml", tmp_path, llama3_seed, "--training.local_batch_size", "4",
                 "--parallelism.context_parallel_degree", "2", "--model.flavor", "debug", "--activation_checkpoint.mode",
                 "full", "--activation_checkpoint.cpu_offload", "--activation_checkpoint.keep_attention", "device",
                 "--activation_checkpoint.keep_attention_blocks", "1")
    log = proc.stdout + proc.stderr
    for line in ("Converted attention and feed-forward to TSP over 2 ranks", "1 of 2 blocks keep their attention"):
        assert line in log, line
    assert_losses_close(losses(tmp_path), losses(llama3_one_rank), rtol=1e-5)


def check_counters(out, cp: int) -> None:
    """Against independent counts: the global batch's tokens per step (once, not once per CP rank),
    the rank's 1/C share per device, and the max over data-parallel batches (one here: the mean)."""
    scalars = read_scalars(out)
    steps = range(1, int(STEPS) + 1)
    assert scalars["n_tokens_seen"] == [(s, s * GLOBAL_BATCH * SEQ) for s in steps]
    for (_, tps), (_, seconds) in zip(scalars["throughput(tps)"], scalars["time_metrics/end_to_end(s)"], strict=True):
        assert tps * seconds == pytest.approx(GLOBAL_BATCH * SEQ / cp, rel=1e-4)
    assert_losses_close(losses(out, "loss_metrics/global_max_loss"), losses(out), rtol=1e-6)


def test_qwen3_upipe_matches_one_rank_on_0_3(tmp_path_factory):
    """Qwen3 (QK norms, the cos||sin RoPE table) under UPipe on 2 ranks equals one rank. The run prints every
    step's progress (``metrics.progress_after_seconds = 0``) once, from rank 0 (rank 1 logs errors only), each
    block of each phase and the step's end with the run's ETA, without colour codes (the console is not a
    terminal), and writes the phase times to TensorBoard."""
    import re

    seed = create_seed_checkpoint("configs/debug/qwen3_fsdp.toml", tmp_path_factory.mktemp("qwen_seed03"))
    one, cp = tmp_path_factory.mktemp("qwen_one03"), tmp_path_factory.mktemp("qwen_cp03")
    train(1, "configs/debug/qwen3_fsdp.toml", one, seed, "--training.local_batch_size", "2")
    proc = train(2, "configs/debug/qwen3_upipe.toml", cp, seed, "--training.local_batch_size", "2",
                 "--metrics.progress_after_seconds", "0")
    log = proc.stdout + proc.stderr
    assert "Converted attention to upipe over a CP mesh of 2 ranks" in log
    assert_losses_close(losses(cp), losses(one), rtol=1e-5)
    assert_progress_lines(log, 3)
    for step in range(1, 4):
        assert len(re.findall(rf"- INFO - .*step:\s+{step}\s", log)) == 1, log[-4000:]  # TorchTitan's step line
    assert "\033[" not in log  # a redirected console: no colour codes
    scalars = read_scalars(cp)
    for phase in ("forward", "backward", "optimizer"):
        assert [s for s, v in scalars[f"progress/{phase}_seconds"] if v > 0] == [1, 2, 3], phase


def test_a_diverging_learning_rate_stops_the_job_in_one_line_on_0_3(tmp_path):
    """``training.on_nonfinite = "stop"`` (the default) on 0.3: step 1 is finite and checkpointed, its update
    (lr = 1e9) leaves the gradient norm NaN at step 2, where the job stops with 0.2's line and status 3;
    TensorBoard counts the non-finite step."""
    import re

    from trainer_utils import rank_exit_codes

    out = tmp_path / "run"
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_ulysses.toml", out, "--training.steps", STEPS,
                    "--optimizer.lr", "1e9", "--checkpoint.enable", "--checkpoint.interval", "1", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and 3 in rank_exit_codes(proc), output[-4000:]
    lines = [x for x in output.splitlines() if x.startswith("titan_upipe.train: error")]
    assert lines and all(re.fullmatch(r"titan_upipe.train: error( on rank \d)?: training stopped at step 2: the gradient "
                                      r"norm is nan .*likely cause: the learning rate, optimizer.lr = 1e\+09.*", x)
                         for x in lines), output[-4000:]
    assert not (out / "checkpoint" / "step-2").exists() and (out / "checkpoint" / "step-1").exists()
    assert read_scalars(out)["health/nonfinite_steps"] == [(1, 0.0), (2, 1.0)]


def test_a_checkpoint_resumes_under_another_layout_on_0_3(llama3_seed, llama3_one_rank, tmp_path):
    """Ulysses on 2 ranks, AdamW's moments in host memory (``optimizer.state_on_host``), trains with the one-rank
    losses and saves step 2; the ring on 2 ranks resumes it with 0.3's own AdamW (the model, AdamW's state, the
    LR schedule and the data loader's one global cursor) and trains step 3 with the one-rank run's loss and
    token count."""
    import shutil

    first, resumed = tmp_path / "ulysses", tmp_path / "ring"
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_ulysses.toml", first, "--training.steps", STEPS,
                    "--training.local_batch_size", "4", "--optimizer.state_on_host", "--checkpoint.enable",
                    "--checkpoint.initial_load_path", str(llama3_seed),
                    "--checkpoint.interval", "2")  # saves, unlike load_seed's load_only
    assert "AdamW moments in host memory (optimizer.state_on_host)" in proc.stdout + proc.stderr
    assert_losses_close(losses(first), losses(llama3_one_rank), rtol=1e-5)
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(first / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_ring.toml", resumed, "--training.steps", STEPS,
                    "--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2",
                    "--checkpoint.enable")
    assert "Converted attention to ring" in proc.stdout + proc.stderr
    scalars = read_scalars(resumed)
    assert [s for s, _ in scalars["loss_metrics/global_avg_loss"]] == [3]
    assert_losses_close(losses(resumed), losses(llama3_one_rank)[2:], rtol=1e-5)
    assert scalars["n_tokens_seen"] == [(3, 3 * GLOBAL_BATCH * SEQ)]


def test_torchtitans_own_entry_point_trains_a_registered_recipe(llama3_seed, llama3_one_rank, tmp_path):
    """``torchtitan.train --module titan_upipe.torchtitan_0_3 --config debug_llama3_upipe`` (0.3's own launch,
    on torchrun: it reads ``sys.argv`` when imported) trains the plugin's job, TorchTitan's flags applied:
    UPipe on 2 ranks, the one-rank losses."""
    import os
    import subprocess
    import sys

    from trainer_utils import REPO

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "torchtitan.train",
           "--module", "titan_upipe.torchtitan_0_3", "--config", "debug_llama3_upipe", "--dump_folder", str(tmp_path),
           "--training.steps", STEPS, "--training.local_batch_size", str(GLOBAL_BATCH), "--checkpoint.enable",
           "--checkpoint.initial_load_path", str(llama3_seed), "--checkpoint.load_only"]
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Converted attention to upipe over a CP mesh of 2 ranks" in proc.stdout + proc.stderr
    assert_losses_close(losses(tmp_path), losses(llama3_one_rank), rtol=1e-5)
