"""``titan_upipe.check`` on TorchTitan 0.3 (``tools.parity`` with the 0.3 adapter's ``parity_job``): the
CP model's loss, logits and every gradient against 0.3's unconverted model on the whole batch, on the
shared gloo rank pools (fp32), for every CP mode; a wrong layout fails."""

from __future__ import annotations

import pytest
from check_ranks import check_in_pool
from dist_utils import run_distributed

CASES = [
    # (config, ranks, overrides)
    ("configs/debug/llama3_upipe_transforms.toml", 2, ()),  # UPipe, tiled MLP/RMSNorm, fused RoPE (compact)
    ("configs/debug/usp.toml", 4, ()),  # ring 2 x Ulysses 2 on the 2-D mesh
    ("configs/debug/tsp.toml", 2, ("--parallelism.context_parallel_degree", "2")),  # TSP weights sharded, GQA 8/4
    ("configs/debug/llama3_upipe_docs.toml", 2, ()),  # packed documents, against 0.3's model per document
    ("configs/debug/qwen3_upipe.toml", 2, ()),  # QK norms, cos||sin RoPE
]


@pytest.mark.parametrize("config, ranks, overrides", CASES, ids=["upipe-transforms", "usp", "tsp", "documents",
                                                                  "qwen3"])
def test_the_parity_check_passes_on_0_3(config, ranks, overrides):
    results = run_distributed(ranks, check_in_pool, config, *overrides)
    report = results[0][1]
    assert [code for code, _ in results] == [0] * ranks, report[-3000:]
    assert "PARITY OK" in report and "gradients:" in report, report


def _check_with_flipped_tokens(rank, world, mesh, config):
    """The check with a sabotaged layout: the shards' tokens come from the reversed sequence while their
    positions are right."""
    import titan_upipe.parallel.inputs as inputs

    real = inputs.shard_sequence

    def flipped(t, cp_mesh, seq_dim, batch_layout=None):
        return real(t.flip(seq_dim), cp_mesh, seq_dim, batch_layout)

    inputs.shard_sequence = flipped
    try:
        return check_in_pool(rank, world, mesh, config)
    finally:
        inputs.shard_sequence = real


def test_the_parity_check_fails_a_wrong_layout_on_0_3():
    results = run_distributed(2, _check_with_flipped_tokens, "configs/debug/llama3_upipe.toml")
    assert [code for code, _ in results] == [1, 1]
    assert "PARITY FAILED" in results[0][1]
