"""``titan_upipe.check``: the parity command passes for every debug config and catches a wrong layout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from check_ranks import check_in_pool
from dist_utils import run_distributed
from trainer_utils import REPO

from titan_upipe.errors import ConfigError
from titan_upipe.tools.parity import relative_error

# (config, ranks, overrides): the check through torchrun. The other CP modes' configs run in-process
# on the shared rank pools (no torchrun start on the 2-core CI machine): USP and UPipe with C = 4 >
# KV heads (test_parity_check_in_process), qwen3_upipe in bf16, TSP (test_parity_check_tsp); Ulysses
# and the ring at CP 2 through the trainer (test_train_e2e).
PARITY_CONFIGS = [
    # Plain Ulysses and ring run through the real trainer against one rank (test_train_e2e), and
    # qwen3_upipe through the bf16 check below: the check tool's own paths are the 2-D layouts
    # (ring inside Ulysses: test_parity_check_in_process; UPipe inside USP in
    # test_parity_check_with_packed_documents and, at 2 x 2, through the trainer:
    # test_train_e2e[upipe-in-usp-u2r2]) and the memory transforms, here through torchrun.
    ("configs/debug/llama3_upipe_transforms.toml", 2, ()),
]


def _run_check(config: str, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titan_upipe.check", "--job.config_file", config, "--seq-len", "64", *extra]
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("config,nproc,overrides", PARITY_CONFIGS, ids=[c for c, _, _ in PARITY_CONFIGS])
def test_parity_check_passes(config, nproc, overrides):
    proc = _run_check(config, nproc, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PARITY OK" in proc.stdout
    assert "gradients:" in proc.stdout


IN_PROCESS_CONFIGS = [
    # USP: ring 2 x Ulysses 2 on a 2-D mesh
    ("configs/debug/usp.toml", 4),
    # UPipe at C = 4 > 2 KV heads (K/V replicated over the Ulysses ranks), U = C
    ("configs/debug/upipe.toml", 4),
]


@pytest.mark.parametrize("config,nproc", IN_PROCESS_CONFIGS, ids=[c for c, _ in IN_PROCESS_CONFIGS])
def test_parity_check_in_process(config, nproc):
    results = run_distributed(nproc, check_in_pool, config)
    assert [code for code, _ in results] == [0] * nproc, results[0][1][-3000:]
    assert "PARITY OK" in results[0][1] and "gradients:" in results[0][1]


def test_parity_check_bf16_reports_nonzero_errors_within_tolerance():
    results = run_distributed(2, check_in_pool, "configs/debug/qwen3_upipe.toml", "--dtype", "bfloat16")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    lines = results[0][1].splitlines()
    # Without fused_rope the converted attention keeps TorchTitan's op order: the forward is
    # bit-exact even in bf16. Its backward sums stages in fp32 where autograd rounds to bf16,
    # so the gradients differ: bf16 rounding is visible there, the comparison is live.
    logits_line = next(line for line in lines if line.strip().startswith("logits"))
    assert float(logits_line.split()[1]) == 0
    worst = next(line for line in lines if line.strip().startswith("gradients:"))
    assert 0 < float(worst.split()[-1]) <= 3e-2, worst


def test_parity_check_rejects_wrong_world_size(monkeypatch):
    """One process for a CP 2 config: refused before any process group (in-process: no torchrun)."""
    from titan_upipe.tools.parity import run_check

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--nproc_per_node 2"):  # main prints it once (tests/test_tool_errors.py)
        run_check(["--job.config_file", str(REPO / "configs/debug/llama3_upipe.toml"), "--seq-len", "64"])


def _check_with_shifted_positions(rank, world, mesh, config):
    """The check with a sabotaged layout: the shards' tokens come from the reversed sequence
    while their positions are right (positions alone would trip the converters' layout check)."""
    import titan_upipe.parallel.inputs as inputs
    from titan_upipe.tools.parity import run_check

    real = inputs.shard_sequence

    def shifted(t, cp_mesh, seq_dim, batch_layout=None):
        return real(t.flip(seq_dim), cp_mesh, seq_dim, batch_layout)

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    inputs.shard_sequence = shifted  # what CP input preparation calls
    try:
        return run_check(["--job.config_file", str(REPO / config), "--seq-len", "32"])
    finally:
        inputs.shard_sequence = real


def test_parity_check_fails_on_a_wrong_layout():
    codes = run_distributed(2, _check_with_shifted_positions, "configs/debug/llama3_upipe.toml")
    assert codes == [1, 1]


def test_relative_error():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert relative_error(ref, ref) == 0
    assert relative_error(ref + torch.tensor([0.0, 0.0, 0.4]), ref) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0


DOCS_CONFIG = "configs/debug/llama3_upipe_docs.toml"  # debug_flex: attn_mask_type = "block_causal"


def _check_documents(rank, world, mesh, overrides, drop_mask):
    """The check on packed documents; ``drop_mask``: the parallel model gets no document mask
    (plain causal attention across the EOS tokens), which the per-document reference must catch."""
    import titan_upipe.tools.parity as check

    real = check.prepare_cp_batch
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if drop_mask:  # the batch prepared without its documents
        check.prepare_cp_batch = lambda *args, eos_id, **kwargs: real(*args, eos_id=None, **kwargs)
    try:
        return check.run_check(["--job.config_file", str(REPO / DOCS_CONFIG), "--seq-len", "48", "--batch", "2",
                                *overrides])
    finally:
        check.prepare_cp_batch = real


def test_parity_check_with_packed_documents():
    """block_causal: UPipe inside USP (ring 2 x Ulysses 1, the document-aware ring plan) equals
    TorchTitan's model run on each document alone; the same check without the mask fails."""
    assert run_distributed(2, _check_documents, ("--upipe.ulysses_degree", "1"), False) == [0, 0]
    assert run_distributed(2, _check_documents, (), True) == [1, 1]


def test_packed_document_tokens_and_runs():
    from titan_upipe.toolkit.packed_documents import document_runs, packed_document_tokens

    tokens = packed_document_tokens(torch.zeros(2, 12, dtype=torch.long), eos_id=9)
    # EOS at 0, S/3 + b, S/3 + b + 1, 2S/3 + 1 - b: each ends its document
    assert document_runs(tokens, 9) == [[(0, 1), (1, 5), (5, 6), (6, 10), (10, 12)],
                                        [(0, 1), (1, 6), (6, 7), (7, 9), (9, 12)]]


TSP_CONFIG = "configs/debug/tsp.toml"  # llama3 debug_kv4 (8 / 4 heads), tsp over context_parallel_degree ranks


def _check_tsp(rank, world, mesh, overrides, flip_tokens):
    """The check of ``tsp`` on ``world`` ranks; ``flip_tokens``: the shards' tokens come from the
    reversed sequence (their positions right), which the check must catch."""
    import titan_upipe.parallel.inputs as inputs
    from titan_upipe.tools.parity import run_check

    real = inputs.shard_sequence
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if flip_tokens:
        inputs.shard_sequence = lambda t, cp_mesh, seq_dim, batch_layout=None: real(t.flip(seq_dim), cp_mesh, seq_dim, batch_layout)
    try:
        return run_check(["--job.config_file", str(REPO / TSP_CONFIG), "--seq-len", "32",
                          "--parallelism.context_parallel_degree", str(world), *overrides])
    finally:
        inputs.shard_sequence = real


def test_parity_check_tsp():
    """TSP (weights DTensor-sharded over the ranks, gradients gathered from their owners) equals one
    device: GQA 8 / 4 on 4 ranks, MHA on 2, Qwen3 (qk-norm, GQA 8 / 2) on 2; a wrong layout fails."""
    assert run_distributed(4, _check_tsp, (), False) == [0] * 4
    assert run_distributed(2, _check_tsp, ("--model.flavor", "debug_mha"), False) == [0, 0]
    assert run_distributed(2, _check_tsp, ("--model.name", "upipe_qwen3", "--model.flavor", "debug"), False) == [0, 0]
    assert run_distributed(2, _check_tsp, (), True) == [1, 1]
