"""Training jobs through torchrun on gloo: local text, HF weights, checkpoints, resume on another layout.

One reference run (UPipe CP=2, data parallel 1, global batch 2: ``conftest.upipe_text_job``)
starts from a Hugging Face safetensors checkpoint, reads a local corpus and saves full
checkpoints at steps 2 and 4. Resumed from its step 2 under the same layout, under zigzag ring
attention (Ulysses 1 x ring 2), under TSP (weights sharded over the 2 ranks), and as plain FSDP over 2 data-parallel ranks (CP 2 x DP 1 ->
CP 1 x DP 2, the same global batch), each run's
steps 3 and 4 must have the reference's losses: the same weights, optimizer state and samples.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from text_assets import (
    TEXT_JOB_SEQ,
    TEXT_JOB_STEPS,
    TEXT_VALIDATION_BATCH,
    TEXT_VALIDATION_FILE,
    hf_model,
    text_job_overrides,
)
from trainer_utils import assert_losses_close, losses, read_scalars, torchrun

from titan_upipe.data.local_text import LocalTextStream, expand_paths
from titan_upipe.torchtitan_0_2.job_assets import check_resume_point, checkpoint_keys

SEQ = TEXT_JOB_SEQ
STEPS = TEXT_JOB_STEPS


@pytest.fixture(scope="module")
def assets(text_job_assets):
    return text_job_assets


@pytest.fixture(scope="module")
def reference(upipe_text_job):
    return upipe_text_job


def resume_from_step_2(reference, out):
    (out / "checkpoint").mkdir(parents=True)
    shutil.copytree(reference / "checkpoint" / "step-2", out / "checkpoint" / "step-2")


def test_reference_starts_from_the_hf_weights_on_the_local_data(assets, reference):
    """Step 1's loss is the pretrained model's loss on the corpus's first two packed samples,
    computed here without the trainer, the loader or CP."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(assets / "hf"))
    stream = LocalTextStream(expand_paths([str(assets / "data" / "*")]),
                             lambda text: tokenizer.encode(text, add_bos=True, add_eos=True), SEQ)
    batch = torch.stack([torch.from_numpy(stream.next_sample()) for _ in range(2)])
    model, _ = hf_model(seed=0)
    with torch.no_grad():
        logits = model(batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()
    loss = losses(reference)
    assert len(loss) == STEPS and loss[0] == pytest.approx(expected, rel=1e-5)
    random_start, _ = hf_model(seed=1)
    with torch.no_grad():
        other = F.cross_entropy(random_start(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(other - expected) > 1e-3  # another initialisation is told apart
    # Document statistics reach TensorBoard: every step reads the documents of 2 x 129 tokens.
    documents = read_scalars(reference)["data/documents"]
    assert [s for s, _ in documents] == [1, 2, 3, 4] and all(v > 0 for _, v in documents)


def test_validation_loss_is_the_saved_weights_loss_on_the_held_out_file(assets, reference):
    """Validation after step 2 scores the step-2 checkpoint's weights on the first packed samples of
    the held-out file, computed here from the checkpoint without the trainer, the loader or CP."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    model, _ = hf_model(seed=1)  # overwritten by the checkpoint
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(reference / "checkpoint" / "step-2"), no_dist=True)
    model.load_state_dict(state)
    tokenizer = HuggingFaceTokenizer(str(assets / "hf"))
    stream = LocalTextStream([str(assets / "data" / TEXT_VALIDATION_FILE)],
                             lambda text: tokenizer.encode(text, add_bos=True, add_eos=True), SEQ)
    batch = torch.stack([torch.from_numpy(stream.next_sample()) for _ in range(TEXT_VALIDATION_BATCH)])
    with torch.no_grad():
        expected = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    validation = read_scalars(reference)["validation_metrics/loss"]
    assert [s for s, _ in validation] == [1, 2, 4]
    assert validation[1][1] == pytest.approx(expected, rel=1e-5)
    assert abs(validation[2][1] - validation[1][1]) > 1e-3  # later weights score differently
    # The token counter counts each global batch once (2 sequences of SEQ tokens), not once per CP rank.
    assert read_scalars(reference)["n_tokens_seen"] == [(s, s * 2 * SEQ) for s in range(1, STEPS + 1)]


def test_final_save_is_a_full_checkpoint_that_a_longer_run_resumes(reference):
    keys = checkpoint_keys(str(reference / "checkpoint" / f"step-{STEPS}"))
    assert {"optimizer", "train_state", "lr_scheduler", "dataloader"} <= {k.split(".")[0] for k in keys}
    assert "dataloader.samples_consumed" in keys
    assert not any("dp_rank" in k for k in keys)  # nothing keyed by rank: any layout resumes it


RESUMES = {
    "same-layout": ("configs/debug/llama3_upipe.toml", ("--training.local_batch_size", "2")),
    "ring": ("configs/debug/llama3_ring.toml", ("--training.local_batch_size", "2",
                                                "--parallelism.context_parallel_degree", "2")),
    # TSP: the FSDP checkpoint's weights and AdamW moments resharded onto the TSP weight shards (DCP)
    "tsp": ("configs/debug/tsp.toml", ("--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2",
                                       "--model.flavor", "debug")),
    # the same global batches: 2 ranks x 1 sequence (training and validation)
    "cp1-dp2": ("configs/debug/llama3_fsdp.toml", ("--training.local_batch_size", "1",
                                                   "--validation.local_batch_size", "1")),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_from_step_2_continues_the_reference(assets, reference, tmp_path, name):
    config, overrides = RESUMES[name]
    resume_from_step_2(reference, tmp_path)
    torchrun(2, "titan_upipe.train", config, tmp_path, *text_job_overrides(assets), *overrides)
    assert [s for s, _ in read_scalars(tmp_path)["loss_metrics/global_avg_loss"]] == [3, 4]
    assert_losses_close(losses(tmp_path), losses(reference)[2:], rtol=1e-5)
    # Validation under the resumed layout scores the same weights: the reference's value at step 4.
    resumed, ref_validation = (read_scalars(out)["validation_metrics/loss"] for out in (tmp_path, reference))
    assert resumed[-1][0] == 4 and resumed[-1][1] == pytest.approx(ref_validation[-1][1], rel=1e-5)
    # The token counter resumes where the checkpoint left it, under any layout.
    assert read_scalars(tmp_path)["n_tokens_seen"] == [(3, 3 * 2 * SEQ), (4, 4 * 2 * SEQ)]
    # Sensitive: the reference's steps differ from each other by far more than the tolerance.
    ref = losses(reference)
    assert abs(ref[2] - ref[1]) > 1e-3 * abs(ref[1])


def test_a_model_only_final_save_is_refused_before_training(reference, text_job_assets, tmp_path):
    """TorchTitan's default final save holds the model only; resuming from it would die inside
    DCP (``Missing key ... dataloader``): the check names the full checkpoint to use instead."""
    import torch.distributed.checkpoint as dcp

    from titan_upipe.errors import ConfigError
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    folder = tmp_path / "checkpoint"
    shutil.copytree(reference / "checkpoint" / "step-2", folder / "step-2")
    dcp.save({"tok_embeddings.weight": torch.zeros(4, 4)}, checkpoint_id=str(folder / "step-4"), no_dist=True)
    job = parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml", "--job.dump_folder", str(tmp_path),
                        "--checkpoint.enable", *text_job_overrides(text_job_assets)])  # the data step 2 was saved with
    with pytest.raises(ConfigError, match=r"holds the model only.*--checkpoint.load_step N \(full: \[2\]\)"):
        check_resume_point(job)
    job.checkpoint.load_step = 2
    check_resume_point(job)  # the full one is accepted
