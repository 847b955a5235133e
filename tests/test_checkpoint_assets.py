"""The checkpoints and folders a job opens, checked before any process group: each problem is one
ConfigError line naming the file, the cause and the fix, and ``validate`` exits 1 for it.

Every checkpoint here is written in-process (``torch.distributed.checkpoint.save`` without a
process group, or ``safetensors``) from the debug flavors, in TorchTitan's layout: the model's
parameters at the top level beside ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from asset_checks import accepted, refused
from text_assets import hf_model, write_hf_weights
from trainer_utils import REPO

from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_assets import asset_warnings, check_assets

LLAMA = str(REPO / "configs/debug/llama3_fsdp.toml")
QWEN = str(REPO / "configs/debug/qwen3_fsdp.toml")


SYNTHETIC_CURSOR = {"samples_consumed": 8, "global_batch_size": 2, "stream": {"index": 8}}
"""The data loader state a synthetic_copy or synthetic_docs job saves (``GlobalBatchLoader.state_dict``)."""
LOCAL_TEXT_CURSOR = {"samples_consumed": 8, "global_batch_size": 2,
                     "stream": {"epoch": 0, "file": 1, "position": 120, "token_offset": 3, "file_path": "/data/b.jsonl"}}
"""The one a local_text job saves."""


def write_dcp(path: Path, model_name: str = "upipe_llama3", flavor: str = "debug", full: bool = True,
              dataloader: dict | None = None) -> Path:
    """A DCP checkpoint of the flavor's seeded weights; ``full``: with optimizer, scheduler, data
    cursor (``dataloader``, default a synthetic dataset's) and train state, as a training save holds them."""
    import torch.distributed.checkpoint as dcp

    model, _ = hf_model(model_name, flavor)
    state = dict(model.state_dict())
    if full:
        state.update({"optimizer": {"state": {"output.weight.exp_avg": torch.zeros(4)}},
                      "lr_scheduler": {"last_epoch": 2}, "dataloader": dataloader or SYNTHETIC_CURSOR,
                      "train_state": {"step": 2, "ntokens_seen": 1024}})
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def truncate(file: Path, keep: float = 0.5) -> None:
    with open(file, "r+b") as f:
        f.truncate(int(file.stat().st_size * keep))


def job_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable", *overrides]


@pytest.fixture
def resumable(tmp_path) -> Path:
    """``out/checkpoint`` with full saves at steps 1 and 2 of the Llama3 debug flavor."""
    folder = tmp_path / "out" / "checkpoint"
    write_dcp(folder / "step-1")
    write_dcp(folder / "step-2")
    return folder


def test_a_complete_checkpoint_of_this_model_is_accepted(capsys, tmp_path, resumable):
    assert "OK for 1 ranks" in accepted(capsys, LLAMA, job_args(tmp_path))


def test_a_truncated_metadata_is_named_with_the_step_to_fall_back_to(capsys, tmp_path, resumable):
    truncate(resumable / "step-2" / ".metadata")
    refused(capsys, LLAMA, job_args(tmp_path), f"{resumable}/step-2/.metadata cannot be read (",
            "cut short", f"move {resumable}/step-2 away to resume from step 1")


def test_a_truncated_or_missing_shard_is_named(capsys, tmp_path, resumable):
    shard = resumable / "step-2" / "__0_0.distcp"
    size = shard.stat().st_size
    truncate(shard)
    refused(capsys, LLAMA, job_args(tmp_path), f"{shard} holds {size // 2} bytes but", f"reads {size} from it",
            "cut short", "move")
    shard.unlink()
    refused(capsys, LLAMA, job_args(tmp_path), f"{shard} is missing", "incomplete")


def test_a_checkpoint_of_another_model_names_the_missing_tensors_and_its_model(capsys, tmp_path, resumable):
    """A Qwen3 job resuming from Llama3's checkpoint (no qk-norm weights), and a Llama3 job from
    Qwen3's (extra weights, same shapes otherwise: DCP would load it without a word)."""
    message = refused(capsys, QWEN, job_args(tmp_path), f"{resumable}/step-2 is not a checkpoint of upipe_qwen3 / debug",
                      "missing layers.0.attention.q_norm.weight", "(checkpoint vs model)",
                      "model.name = 'upipe_llama3', model.flavor = 'debug'", "or move")
    assert "and 1 more" in message  # 2 layers x 2 norms: 3 listed, the others counted
    shutil.rmtree(resumable)
    write_dcp(resumable / "step-2", "upipe_qwen3", "debug")
    refused(capsys, LLAMA, job_args(tmp_path), "unexpected layers.0.attention.q_norm.weight",
            "model.name = 'upipe_qwen3', model.flavor = 'debug'")


def test_a_checkpoint_of_another_flavor_names_the_shapes_and_the_flavor(capsys, tmp_path, resumable):
    shutil.rmtree(resumable / "step-2")
    write_dcp(resumable / "step-2", flavor="debug_mha")
    refused(capsys, LLAMA, job_args(tmp_path), "shape [128, 128] vs [32, 128] for layers.0.attention.wk.weight",
            "model.flavor = 'debug_mha'", f"move {resumable}/step-2 away to resume from step 1")


def test_an_initial_checkpoint_is_checked_like_a_resume_point(capsys, tmp_path):
    other = write_dcp(tmp_path / "weights" / "step-0", flavor="debug_mha", full=False)
    args = job_args(tmp_path, "--checkpoint.initial_load_path", str(other))
    refused(capsys, LLAMA, args, f"{other} is not a checkpoint of upipe_llama3 / debug",
            "point checkpoint.initial_load_path at a complete checkpoint of this model")
    seed = write_dcp(tmp_path / "seed" / "step-0", full=False)
    accepted(capsys, LLAMA, job_args(tmp_path, "--checkpoint.initial_load_path", str(seed)))
    truncate(seed / ".metadata", 0.3)
    refused(capsys, LLAMA, job_args(tmp_path, "--checkpoint.initial_load_path", str(seed)),
            f"{seed}/.metadata cannot be read")


def test_hf_weights_are_checked_by_their_safetensors_headers(capsys, tmp_path):
    hf = tmp_path / "hf"
    write_hf_weights(hf)
    args = job_args(tmp_path, "--checkpoint.initial_load_in_hf", "--model.hf_assets_path", str(hf))
    accepted(capsys, LLAMA, args)
    write_hf_weights(hf, flavor="debug_mha")
    refused(capsys, LLAMA, args, f"{hf} is not a checkpoint of upipe_llama3 / debug",
            "shape [128, 128] vs [32, 128] for model.layers.0.self_attn.k_proj.weight", "model.flavor = 'debug_mha'")
    truncate(hf / "model.safetensors", 0.9)
    refused(capsys, LLAMA, args, f"{hf}/model.safetensors holds", "cut short", "download the weights again")
    for header in (b"[1, 2]", b'{"w": {"dtype": "F32"}}'):  # JSON, but no safetensors header
        (hf / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
        refused(capsys, LLAMA, args, f"{hf}/model.safetensors is not a safetensors file", "download the weights again")


def test_a_checkpoint_folder_without_a_complete_step_would_skip_the_initial_load(capsys, tmp_path):
    seed = write_dcp(tmp_path / "seed" / "step-0", full=False)
    partial = write_dcp(tmp_path / "out" / "checkpoint" / "step-4")
    (partial / ".metadata").unlink()
    refused(capsys, LLAMA, job_args(tmp_path, "--checkpoint.initial_load_path", str(seed)),
            "holds only save(s) cut short: step 4", f"ignores checkpoint.initial_load_path = '{seed}'",
            f"remove {tmp_path / 'out' / 'checkpoint'}")


def test_a_partial_save_skipped_on_resume_is_a_warning_with_the_step_resumed(capsys, caplog, tmp_path, resumable):
    partial = write_dcp(resumable / "step-3")
    (partial / ".metadata").unlink()
    job = parse_config(["--job.config_file", LLAMA, *job_args(tmp_path)])
    expected = "step-3 has no .metadata (a save cut short) and is skipped: the job resumes from step 2"
    assert any(expected in w for w in asset_warnings(job))
    with caplog.at_level(logging.WARNING):
        check_assets(job)  # the trainer's pre-launch check logs it
    assert expected in caplog.text
    assert validate.main([LLAMA, "--world-size", "1", *job_args(tmp_path)]) == 0
    assert expected in capsys.readouterr().out
    job.checkpoint.load_step = 1  # a step asked for: nothing skipped silently
    assert not any("cut short" in w for w in asset_warnings(job))


@pytest.mark.parametrize("overrides, fragments", [
    (("--checkpoint.keep_latest_k", "1"), ("checkpoint.keep_latest_k = 1 is invalid", "0 or less (keep all) or 2 or more")),
    (("--checkpoint.interval", "0"), ("checkpoint.interval = 0 is invalid", "1 or more")),
    (("--checkpoint.exclude_from_loading", "dataloder"), ("'dataloder'", 'did you mean "dataloader"?')),
    (("--checkpoint.initial_load_in_hf", "--checkpoint.no_initial_load_model_only"), ("initial_load_model_only",)),
    (("--checkpoint.last_save_in_hf", "--checkpoint.no_last_save_model_only"), ("last_save_model_only = true",)),
], ids=["keep_latest_k", "interval", "exclude_from_loading", "initial_load_in_hf", "last_save_in_hf"])
def test_torchtitans_checkpoint_rules_are_checked_before_launch(capsys, tmp_path, overrides, fragments):
    refused(capsys, LLAMA, job_args(tmp_path, *overrides), *fragments)


def test_the_dump_folder_must_be_writable_whatever_writes_there(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = ["--job.dump_folder", str(blocker / "out")]
    refused(capsys, LLAMA, [*out, "--checkpoint.enable"], f"checkpoint.enable writes to {blocker}/out/checkpoint",
            f"{blocker} is a file, not a folder", "set job.dump_folder")
    # checkpoints off: TensorBoard still writes there (the debug configs enable it)
    refused(capsys, LLAMA, out, f"metrics.enable_tensorboard writes to {blocker}/out/tb",
            "turn metrics.enable_tensorboard off")
    accepted(capsys, LLAMA, [*out, "--metrics.no_enable_tensorboard"])


def test_the_dump_folder_needs_room_for_one_checkpoint(capsys, tmp_path, monkeypatch):
    """Llama3 debug: 2 x 512 x 128 (embedding, head) + 2 x (40,960 attention + 147,456 feed-forward + 256
    norms) + 128 = 508,544 parameters, x 12 bytes (fp32 weights + 2 AdamW moments) = 6.1 MB."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=5_000_000))
    full = job_args(tmp_path, "--checkpoint.no_last_save_model_only")
    refused(capsys, LLAMA, full, "whose disk has 5.0 MB free", "takes about 6.1 MB",
            "(508,544 parameters x 12 bytes: fp32 weights + 2 AdamW moments)", "set job.dump_folder on a larger disk")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=7_000_000))
    accepted(capsys, LLAMA, full)
    # saving only the final, model-only weights (the debug config's 30 steps < the interval): 4 bytes per parameter
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1_000_000))
    refused(capsys, LLAMA, job_args(tmp_path), "takes about 2.0 MB", "x 4 bytes: float32 weights")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=3_000_000))
    accepted(capsys, LLAMA, job_args(tmp_path))
