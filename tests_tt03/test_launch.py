"""What ``python -m titan_upipe.train`` refuses on TorchTitan 0.3 before any process group: one message
naming the setting, its valid values and the fix (``torchtitan_0_3.launch.build_trainer``, in-process:
it raises before ``init_process_group``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_3.launch import build_trainer


@pytest.fixture(autouse=True)
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: the debug recipes' degrees


def refusal(*args: str) -> str:
    with pytest.raises(ConfigError) as refused:
        build_trainer(["--job.config_file", *args])
    assert not dist.is_initialized()
    return str(refused.value)


def test_what_0_3_does_not_host_is_refused_by_name():
    assert refusal("configs/debug/llama3_upipe.toml", "--optimizer.state_on_host", "--optimizer.implementation",
                   "fused_opt_states_bf16").startswith("optimizer.state_on_host = true keeps fp32 moments in host "
                                                       "memory: valid optimizer.implementation values with it are")
    assert "keep_attention keeps the plugin's context-parallel attention inside offloaded checkpointing" in refusal(
        "configs/debug/llama3_upipe.toml", "--activation_checkpoint.keep_attention", "device")
    assert "validation.steps = -1 (every sample) never ends on the plugin's datasets" in refusal(
        "configs/debug/llama3_upipe.toml", "--validation.enable")
    assert refusal("configs/debug/llama3_upipe.toml", "--validation.enable", "--validation.steps", "1").startswith(
        "validation.dataset = 'c4_validation' is not read by titan_upipe on TorchTitan 0.3 yet")
    assert refusal("configs/debug/llama3_upipe.toml", "--model.converters", "upipe", "float8").startswith(
        "unknown model.converters entry 'float8': valid converters on TorchTitan 0.3 are ulysses, upipe, ring, usp, tsp, "
        "tiled_mlp")
    assert "validation.seq_len = 1024 is longer than training.seq_len = 512" in refusal(
        "configs/debug/llama3_upipe.toml", "--validation.enable", "--validation.steps", "1", "--validation.dataset",
        "synthetic_copy", "--validation.seq_len", "1024")
    assert "transforms.ce_backend = 'liger' is not run on TorchTitan 0.3" in refusal(
        "configs/debug/llama3_upipe_transforms.toml", "--transforms.ce_backend", "liger")


def test_tsp_settings_it_does_not_run_are_refused_before_launch():
    """The rules both versions share (``spec.tsp_shards.tsp_job_problems``), and 0.3's own: every problem of a
    job in one message."""
    tsp = ("configs/debug/tsp.toml", "--parallelism.context_parallel_degree", "2")
    message = refusal(*tsp, "--tsp.kv_heads_per_bucket", "3", "--model.converters", "tsp", "fused_rope")
    assert message.startswith("tsp.kv_heads_per_bucket = 3 does not divide the 2 KV heads per rank")
    assert "; model.converters has 'tsp' and 'fused_rope': tsp rotates Q/K with the model's full RoPE table" in message
    assert "packs documents; TSP attention is causal over the whole sequence" in refusal(*tsp, "--model.flavor",
                                                                                        "debug_flex")
    assert "optimizer.state_on_host with tsp is not supported yet" in refusal(*tsp, "--optimizer.state_on_host")
    from titan_upipe.torchtitan_0_3.recipe import load_recipe
    from titan_upipe.torchtitan_0_3.trainer import plugin_config

    config = plugin_config(load_recipe(["--job.config_file", *tsp]))
    config.training.enable_cpu_offload = True  # torchtitan.train's flag (no recipe key on 0.3)
    with pytest.raises(ConfigError, match="training.enable_cpu_offload with tsp is not supported"):
        config.build()
    assert not dist.is_initialized()


def test_torchtitans_own_flags_the_plugin_does_not_run_are_refused():
    """Set through ``torchtitan.train``'s flags on a registered recipe's config: refused by ``build()`` before
    any process group (``job.check_torchtitan_settings``)."""
    from titan_upipe.torchtitan_0_3.recipe import load_recipe
    from titan_upipe.torchtitan_0_3.trainer import plugin_config

    for setting, value, message in (("compile", "enable", "compile.enable is not run on TorchTitan 0.3 yet"),
                                    ("parallelism", "tensor_parallel_degree",
                                     "parallelism.tensor_parallel_degree = 2 is not run on TorchTitan 0.3 yet"),
                                    ("training", "seq_len", "training.seq_len = 514 is not divisible by 2 x "
                                                            "context_parallel_degree = 4")):
        config = plugin_config(load_recipe(["--job.config_file", "configs/debug/llama3_upipe.toml"]))
        setattr(getattr(config, setting), value, {"enable": True, "tensor_parallel_degree": 2, "seq_len": 514}[value])
        with pytest.raises(ConfigError, match=message):
            config.build()
        assert not dist.is_initialized()


def test_degrees_that_do_not_make_the_launch_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert refusal("configs/debug/llama3_upipe.toml").startswith(
        "the launch has 3 ranks but parallelism's degrees make 2 x data_parallel_shard_degree")


def test_a_job_that_does_not_fit_is_refused_with_the_length_that_fits():
    message = refusal("configs/debug/llama3_upipe.toml", "--training.seq_len", str(2**36))
    assert message.startswith(f"training.seq_len = {2**36:,} does not fit: the memory planner predicts")
    assert "set training.seq_len to" in message


def test_a_0_2_checkpoint_is_refused_with_its_conversion(tmp_path):
    state = {"layers.0.attention.wq.weight": torch.zeros(2, 2), "output.weight": torch.zeros(2, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "v02"), no_dist=True)
    message = refusal("configs/debug/llama3_upipe.toml", "--job.dump_folder", str(tmp_path / "out"),
                      "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "v02"))
    assert "was written by TorchTitan 0.2.2, which names model keys otherwise" in message
    assert f"checkpoint_convert {tmp_path / 'v02'} NEW_FOLDER --to 0.3" in message


@pytest.mark.parametrize("recipe, overrides", [
    ("configs/qwen3_32b/upipe_usp_1m.toml", ()), ("configs/llama3_8b/upipe_1m.toml", ()),
    ("configs/debug/llama3_upipe_transforms.toml", ("--transforms.ce_chunk_tokens", "100")),
])
def test_the_chunked_loss_splits_every_row_evenly(recipe, overrides):
    """0.3's ``ChunkedLossWrapper`` needs ``S/C`` divisible by its chunk count (the default size gave Qwen3-32B
    30 chunks of 131072-token rows): the count divides the row, chunks no larger than asked."""
    from titan_upipe.torchtitan_0_3.job_spec import job_spec
    from titan_upipe.torchtitan_0_3.recipe import load_recipe
    from titan_upipe.torchtitan_0_3.transforms import loss_config
    from titan_upipe.transforms.fused_ce import default_chunk_tokens

    spec = job_spec(load_recipe(["--job.config_file", recipe, *overrides]))
    row = spec.seq_len // spec.layout.cp_degree
    chunks = loss_config(spec).num_chunks
    asked = spec.ce_chunk_tokens or default_chunk_tokens(spec.local_batch * row, spec.model.dim, spec.model.vocab)
    assert row % chunks == 0 and spec.local_batch * row / chunks <= asked
    validation_chunks = loss_config(spec, spec.seq_len // 2).num_chunks  # and the validation's rows
    assert row % validation_chunks == 0 and (row // 2) % validation_chunks == 0


def test_the_tokenizer_and_data_files_are_checked_before_launch_as_on_0_2(tmp_path):
    """``torchtitan_common.job_inputs``, the checks 0.2.2's launch runs (``tests/test_prelaunch_refusals.py``,
    ``tests/test_job_assets.py``), with the same messages: a missing tokenizer, one without the EOS a
    document-packing flavor ends documents at, data patterns that match no file; the good job passes."""
    import json

    from text_assets import BOS, write_corpus, write_tokenizer

    write_corpus(tmp_path / "data")
    write_tokenizer(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf_no_eos")
    (tmp_path / "hf_no_eos" / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))

    def local_text(config: str, tokenizer: str, pattern: str = "*.jsonl") -> str:
        return refusal(config, "--training.dataset", "local_text", "--local_data.paths", str(tmp_path / "data" / pattern),
                       "--model.hf_assets_path", str(tmp_path / tokenizer))

    assert local_text("configs/debug/llama3_upipe.toml", "missing").startswith(
        f"model.hf_assets_path = '{tmp_path / 'missing'}' does not exist: training.dataset = 'local_text' is tokenized "
        "with the Hugging Face tokenizer there")
    assert local_text("configs/debug/llama3_upipe_docs.toml", "hf_no_eos").startswith(
        f"model.flavor = 'debug_flex' (attn_mask_type 'block_causal') ends a packed document at each EOS token, but "
        f"the tokenizer in model.hf_assets_path = '{tmp_path / 'hf_no_eos'}' has none")
    assert local_text("configs/debug/llama3_upipe.toml", "hf", "*.none").startswith(
        f"local_data.paths pattern '{tmp_path / 'data' / '*.none'}' matches no file")
    from titan_upipe.torchtitan_0_3.load_job import checked_job

    good = checked_job(["--job.config_file", "configs/debug/llama3_upipe_docs.toml", "--training.dataset", "local_text",
                        "--local_data.paths", str(tmp_path / "data" / "*.jsonl"), "--model.hf_assets_path",
                        str(tmp_path / "hf")])  # its EOS, 356 tokens of the 512 the flavor embeds: no refusal
    assert good.spec.documents


def test_ranks_other_than_0_log_errors_only_unless_log_all_ranks(monkeypatch):
    """``metrics.log_all_ranks`` (``torchtitan_common.console``), set as the recipe is read, before the
    job's checks (here a launch of 3 ranks, which they refuse)."""
    import logging

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    root = logging.getLogger()
    level = root.level
    try:
        refusal("configs/debug/llama3_upipe.toml")
        assert root.level == logging.ERROR
        refusal("configs/debug/llama3_upipe.toml", "--metrics.log_all_ranks")
        assert root.level == logging.INFO
    finally:
        root.setLevel(level)
