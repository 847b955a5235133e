"""The real trainer with every memory transform on (UPipe CP=2 + FSDP, tiled MLP/RMSNorm, fused
RoPE, fused CE, offloaded full AC): the loss trajectory equals the plain 1-rank run (fp32)."""

import pytest
from trainer_utils import E2E_STEPS, assert_losses_close, load_seed, losses, torchrun

STEPS = E2E_STEPS
CONFIG = "configs/debug/llama3_upipe_transforms.toml"


@pytest.mark.parametrize("batch", [("--training.local_batch_size", "4"),
                                   ("--training.local_batch_size", "2", "--training.global_batch_size", "4",
                                    "--activation_checkpoint.keep_attention", "auto")],
                         ids=["one-microbatch", "two-accumulation-steps-keep-attention"])
def test_all_transforms_match_plain_one_rank(llama3_seed, llama3_one_rank, tmp_path, batch):
    """Every transform; the second case also keeps the blocks' attention (``keep_attention = "auto"``,
    sized by the planner at launch for this machine: every block on the "device"), two micro-batches
    each with its own kept record."""
    proc = torchrun(2, "titan_upipe.train", CONFIG, tmp_path, "--training.steps", STEPS, *batch,
                    # small tiles and chunks so every transform really splits the 512/2 local tokens
                    "--transforms.mlp_tile_tokens", "96", "--transforms.rmsnorm_tile_tokens", "100",
                    "--transforms.ce_chunk_tokens", "200", *load_seed(llama3_seed))
    log = proc.stdout + proc.stderr
    for line in ("tiled_mlp: 2 feed-forwards", "tiled_rmsnorm: 5 norms", "fused_rope:", "fused_ce: torch backend",
                 "block inputs offloaded to host memory"):
        assert line in log, line
    keeps = "2 of 2 blocks keep their attention (2 on the device)" if "--activation_checkpoint.keep_attention" in batch else "no block of 2"
    assert keeps in log, log[-3000:]
    reference = losses(llama3_one_rank)
    assert len(reference) == int(STEPS)
    assert_losses_close(losses(tmp_path), reference, rtol=1e-5)
