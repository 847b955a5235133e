"""Job validation before any process group: each problem names the setting and valid choices."""

import pytest

from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.config import ConfigError
from titan_upipe.torchtitan_0_2.config_parse import parse_config

UPIPE = "configs/debug/llama3_upipe.toml"  # llama3 debug: 8 query heads, 2 KV heads, CP = 2


def job(*overrides: str, config: str = UPIPE):
    return parse_config(["--job.config_file", config, *overrides])


def test_committed_cp_configs_are_valid_for_their_world_size():
    check_job(job(), world_size=2)
    check_job(job(config="configs/debug/llama3_ulysses.toml"), world_size=2)
    check_job(job(config="configs/debug/qwen3_upipe.toml"), world_size=2)
    check_job(job("--parallelism.context_parallel_degree", "4"), world_size=4)  # C > KV heads


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (("--model.converters", "upipe,ulysses"), 2, "several context-parallel"),
        (("--model.converters", "tiled_mlp"), 2, "needs a context-parallel attention converter"),
        (("--parallelism.context_parallel_degree", "1"), 2, r"context_parallel_degree = 1: valid values are \[2\]$"),
        # CP 3 splits no heads, and no CP degree fits 3 ranks: the nearest launches that fit, not [2, 4, 8]
        (("--parallelism.context_parallel_degree", "3"), 3, r"degree 3 cannot split n_heads=8, n_kv_heads=2 exactly: "
                                                            r"launch 2 ranks with context_parallel_degree 2, or 4 ranks "
                                                            r"with context_parallel_degree 4$"),
        (("--upipe.heads_per_stage", "3"), 2, r"valid values .* are 0 \(= 2\) or \[2, 4, 8\]"),
        (("--upipe.heads_per_stage", "6"), 2, "upipe.heads_per_stage=6"),
        (("--training.seq_len", "511"), 2, "training.seq_len = 511 is not divisible"),
        ((), 3, r"^3 ranks are not a multiple of context_parallel_degree 2: launch 2 or 4 ranks \(no "
                r"context_parallel_degree fits both 3 ranks"),
        (("--parallelism.data_parallel_shard_degree", "3"), 2,
         r"^context_parallel_degree 2 x data_parallel_shard_degree 3 need 6 ranks, but 2 are launched: launch 6 "
         r"ranks, or set data_parallel_shard_degree to 1 \(or -1"),
        (("--parallelism.tensor_parallel_degree", "2"), 4, "tensor_parallel_degree"),
        (("--model.flavor", "tiny"), 2, "valid values are"),
        (("--model.name", "upipe_lama3"), 2, r"model.name = 'upipe_lama3' is not a registered train spec: valid "
                                             r"values are upipe_llama3, upipe_qwen3 .*did you mean \"upipe_llama3\""),
    ],
)
def test_invalid_jobs_name_setting_and_choices(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job(*overrides), world_size=world)


def test_cp_mode_picks_the_attention_converter():
    assert cp_mode(["upipe"]) == "upipe" and cp_mode(["float8"]) is None


# --- ring / USP / UPipe inside USP: [upipe] ulysses_degree ----------------------------------

USP = "configs/debug/llama3_usp.toml"  # CP = 4, ulysses_degree = 2 (ring 2)


def test_committed_ring_and_usp_configs_are_valid():
    for config in (USP, "configs/debug/llama3_upipe_usp.toml", "configs/debug/llama3_ring.toml"):
        check_job(job(config=config), world_size=4)
    check_job(job("--parallelism.context_parallel_degree", "8", "--upipe.ulysses_degree", "4", config=USP),
              world_size=8)  # 4 Ulysses ranks > 2 KV heads: K/V replicated
    check_job(job("--upipe.ulysses_degree", "1", config="configs/debug/llama3_upipe_usp.toml"), world_size=4)


@pytest.mark.parametrize(
    "config, overrides, world, message",
    [
        (USP, ("--upipe.ulysses_degree", "0"), 4, r"ulysses_degree = 0 is invalid for mode 'usp' .* valid values "
                                                  r"are \[2\] \(ulysses_degree = CP is mode 'ulysses'"),
        (USP, ("--upipe.ulysses_degree", "4"), 4, r"valid values are \[2\]"),
        (USP, ("--upipe.ulysses_degree", "3"), 4, r"ulysses_degree = 3 does not divide .*context_parallel_degree = 4"),
        (USP, ("--parallelism.context_parallel_degree", "2"), 2, r"ulysses_degree = 2 is invalid for mode 'usp' at "
                                                                 r"parallelism.context_parallel_degree = 2: launch 4 "
                                                                 r"ranks with context_parallel_degree 4$"),
        (USP, ("--training.seq_len", "500"), 4, r"not divisible by 2 x ring x ulysses = 2 x 2 x 2 = 8"),
        (USP, ("--parallelism.context_parallel_degree", "8"), 4, "^4 ranks are not a multiple of "
                                                                 "context_parallel_degree 8: launch 8 ranks, or set"),
        # a Ulysses degree of 3 splits neither the 8 query heads nor the 2 KV heads; 2 would, but not seq_len
        # 512 over 6 ranks (2 x 3 x 2 = 12): nothing fits 6 ranks
        (USP, ("--parallelism.context_parallel_degree", "6", "--upipe.ulysses_degree", "3"), 6,
         r"upipe.ulysses_degree 3 cannot split n_heads=8, n_kv_heads=2 exactly: launch 4 ranks with "
         r"context_parallel_degree 4 and upipe.ulysses_degree 2, or 8 ranks with context_parallel_degree 8 and "
         r"upipe.ulysses_degree 4$"),
        ("configs/debug/llama3_ring.toml", ("--upipe.ulysses_degree", "2"), 4,
         r"invalid for mode 'ring' .* valid values are \[0, 1\] \(for Ulysses x ring use mode 'usp'\)"),
        (UPIPE, ("--upipe.ulysses_degree", "1", "--upipe.heads_per_stage", "3"), 2, "upipe.heads_per_stage=3"),
        ("configs/debug/llama3_ulysses.toml", ("--upipe.ulysses_degree", "1"), 2,
         r"invalid for mode 'ulysses' .* valid values are \[0, 2\]"),
        ("configs/debug/llama3_upipe_usp.toml", ("--training.seq_len", "4"), 4, r"use a multiple of 8"),
    ],
)
def test_invalid_ring_and_usp_jobs(config, overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job(*overrides, config=config), world_size=world)


def test_the_old_custom_import_value_is_a_validate_warning_naming_the_new_one(capsys):
    """``custom_import = "titan_upipe"`` would register nothing under torchtitan.train now; under
    titan_upipe.train it still runs, so the job checks accept it and ``validate`` warns."""
    from titan_upipe.tools import preflight as validate

    check_job(job("--experimental.custom_import", "titan_upipe"), world_size=2)
    assert validate.main([UPIPE, "--world-size", "2", "--experimental.custom_import", "titan_upipe"]) == 0
    assert "warning: experimental.custom_import = 'titan_upipe'" in capsys.readouterr().out
    assert validate.main([UPIPE, "--world-size", "2"]) == 0
    assert "warning" not in capsys.readouterr().out


VALIDATION_ON = ("--validation.enable", "--validation.dataset", "synthetic_copy", "--validation.steps", "2",
                 "--validation.seq_len", "512")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--validation.seq_len", "1024"), r"validation.seq_len = 1024 exceeds training.seq_len = 512"),
        (("--validation.seq_len", "255", "--training.seq_len", "512"), r"validation.seq_len = 255 is not divisible by the context-parallel degree 2 \(parallelism.context_parallel_degree\): use a multiple of 2"),
        (("--validation.steps", "-1"), r"validation.steps = -1 reads 'synthetic_copy' until it ends.*never ends"),
        (("--validation.dataset", "local_text"), "different tokenizers"),
        (("--validation.dataset", "c4_validaton"), r"validation.dataset = 'c4_validaton' is unknown"),
        (("--validation.local_batch_size", "0"), r"validation.local_batch_size = 0"),
    ],
)
def test_invalid_validation_settings_are_refused_before_launch(overrides, message):
    check_job(job(*VALIDATION_ON), world_size=2)  # the valid baseline
    with pytest.raises(ConfigError, match=message):
        check_job(job(*VALIDATION_ON, *overrides), world_size=2)


def test_local_text_validation_needs_its_files(tmp_path):
    text = ("--training.dataset", "local_text", "--validation.enable", "--validation.dataset", "local_text",
            "--validation.steps", "1", "--validation.seq_len", "512")
    with pytest.raises(ConfigError, match="needs validation.dataset_path"):
        check_job(job(*text), world_size=2)
    from titan_upipe.torchtitan_0_2.job_assets import check_dataset

    missing = job(*text, "--validation.dataset_path", str(tmp_path / "*.jsonl"), "--local_data.paths",
                  str(tmp_path / "*.txt"))
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ConfigError, match=r"validation.dataset_path pattern .* matches no file"):
        check_dataset(missing)


# --- packed documents: attn_mask_type = "block_causal" (issue 17) ---------------------------

DOCS = "configs/debug/llama3_upipe_docs.toml"  # debug_flex (flex, block_causal), synthetic_docs, UPipe CP = 2
FSDP = "configs/debug/llama3_fsdp.toml"  # no CP converter


def test_block_causal_runs_under_every_cp_layout_and_torchtitan_flex():
    check_job(job(config=DOCS), world_size=2)
    check_job(job("--upipe.ulysses_degree", "1", config=DOCS), world_size=2)  # UPipe inside USP, ring 2
    check_job(job("--model.converters", "usp", "--parallelism.context_parallel_degree", "4",
                  "--upipe.ulysses_degree", "2", config=DOCS), world_size=4)
    check_job(job("--model.name", "upipe_qwen3", config=DOCS), world_size=2)
    # No converter: TorchTitan's own flex attention builds and reads the document mask.
    check_job(job("--model.flavor", "debug_flex", "--training.dataset", "synthetic_docs", config=FSDP), world_size=2)
    # Causal attention on packed documents is a choice (the e2e test's unmasked run), not a mistake.
    check_job(job("--model.flavor", "debug", config=DOCS), world_size=2)


@pytest.fixture
def flavor_with(monkeypatch):
    """Register a llama3 debug flavor with the given attention settings for one test; its name."""
    from torchtitan.models.llama3 import TransformerModelArgs

    from titan_upipe.torchtitan_0_2 import flavors

    def register(**attention) -> str:
        args = TransformerModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=512, **attention)
        monkeypatch.setitem(flavors.LLAMA3_DEBUG_FLAVORS, "debug_test", args)
        return "debug_test"

    return register


def test_block_causal_that_torchtitan_would_run_causally_is_refused(flavor_with):
    """TorchTitan builds no mask for attn_type sdpa: without a converter the documents would leak."""
    name = flavor_with(attn_type="sdpa", attn_mask_type="block_causal")
    docs_data = ("--model.flavor", name, "--training.dataset", "synthetic_docs")
    with pytest.raises(ConfigError, match=r"^model.flavor = 'debug_test' \(attn_type 'sdpa', attn_mask_type "
                                          r"'block_causal'\) without a context-parallel converter: TorchTitan builds "
                                          r"document masks for attn_type flex and varlen only.*use a flavor with "
                                          r"attn_type 'flex' or 'varlen' \(e.g. debug_flex, 8B_flex\), or add a CP "
                                          r"converter \(ulysses, upipe, ring, usp\)"):
        check_job(job(*docs_data, config=FSDP), world_size=2)
    check_job(job(*docs_data, config=DOCS), world_size=2)  # a converter reads it whatever the attn_type


def test_mask_types_the_attention_would_not_run_are_refused(flavor_with):
    name = flavor_with(attn_type="flex", attn_mask_type="sliding_window")
    with pytest.raises(ConfigError, match=r"the upipe converter runs attn_mask_type causal or block_causal only"):
        check_job(job("--model.flavor", name, config=DOCS), world_size=2)
    name = flavor_with(attn_type="sdpa", attn_mask_type="sliding_window")
    with pytest.raises(ConfigError, match=r"TorchTitan's sdpa attention runs attn_mask_type causal or block_causal"):
        check_job(job("--model.flavor", name, config=FSDP), world_size=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # TorchTitan's Llama3 args refuse varlen with CP (update_from_config) before conversion.
        (("--model.flavor", "debugmodel_varlen_attn"),
         r"^model.flavor = 'debugmodel_varlen_attn' \(attn_type 'varlen', attn_mask_type 'block_causal'\): "
         r"TorchTitan's model args refuse attn_type 'varlen' with context_parallel_degree 2 before the upipe "
         r"converter replaces the kernel; use the flavor's flex twin"),
        (("--training.dataset", "synthetic_copy"),
         r"with training.dataset = 'synthetic_copy', which has no EOS token: every row would be one document "
         r"\(plain causal attention\); use 'synthetic_docs' \(packed documents\) or a causal flavor"),
        (("--validation.enable", "--validation.dataset", "synthetic_copy", "--validation.steps", "1"),
         r"with validation.dataset = 'synthetic_copy', which has no EOS token"),
    ],
)
def test_block_causal_settings_that_cannot_mask_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job(*overrides, config=DOCS), world_size=2)


def test_block_causal_on_cuda_needs_a_varlen_backend(monkeypatch):
    """One kernel call per document would be the CUDA path of a backend without varlen kernels."""
    import torchtitan.tools.utils as titan_utils

    monkeypatch.setattr(titan_utils, "device_type", "cuda")
    with pytest.raises(ConfigError, match=r"under upipe: attention backend 'sdpa' has no varlen \(cu_seqlens\) "
                                          r"kernel.*set attention_backend to one of flash_attn4"):
        check_job(job(config=DOCS), world_size=2)
    check_job(job("--model.flavor", "debug", config=DOCS), world_size=2)  # causal: no documents


def test_auto_with_packed_documents_on_cuda_passes_over_backends_without_varlen(monkeypatch):
    """cuDNN attention has no varlen kernel: ``auto`` for a block_causal job on CUDA takes the next
    backend that has one (named explicitly, cuDNN would be refused by the document check)."""
    import torchtitan.tools.utils as titan_utils

    from titan_upipe.attention import backends
    from titan_upipe.torchtitan_0_2.checks import attention_backend_choice

    monkeypatch.setattr(titan_utils, "device_type", "cuda")
    monkeypatch.setattr(backends, "AUTO_ORDER", ("cudnn", "flash_attn4", "sdpa"))
    for name in ("cudnn", "flash_attn4"):
        monkeypatch.setattr(backends.BACKENDS[name], "unavailable_reason", classmethod(lambda cls, probe=True: None))
    documents = job("--upipe.attention_backend", "auto", "--training.mixed_precision_param", "bfloat16", config=DOCS)
    choice = attention_backend_choice(documents, probe=False)
    assert choice.name == "flash_attn4" and "no varlen" in dict(choice.passed_over)["cudnn"]
    check_job(documents, world_size=2)
    causal = job("--upipe.attention_backend", "auto", "--training.mixed_precision_param", "bfloat16", "--model.flavor",
                 "debug", config=DOCS)
    assert attention_backend_choice(causal, probe=False).name == "cudnn"


def test_prefetch_after_attention_needs_offloaded_checkpointing():
    """Without offloaded inputs the switch would change nothing: refused, with the fix."""
    with pytest.raises(ConfigError, match=r"prefetch_after_attention = true .* set activation_checkpoint.cpu_offload = true"):
        check_job(job("--activation_checkpoint.prefetch_after_attention"), world_size=2)
    check_job(job("--activation_checkpoint.prefetch_after_attention",
                  config="configs/debug/llama3_upipe_transforms.toml"), world_size=2)  # full AC, offloaded


TSP = "configs/debug/tsp.toml"  # llama3 debug_kv4: 8 query heads, 4 KV heads, FFN 384, CP = 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--tsp.kv_heads_per_bucket", "3"), r"tsp.kv_heads_per_bucket = 3 does not divide the 1 KV heads per rank"),
        (("--model.converters", "tsp,fused_rope"), r"'tsp' and 'fused_rope': .*full RoPE table; remove 'fused_rope'$"),
        (("--optimizer.state_on_host",), r"optimizer.state_on_host with tsp is not supported yet"),
        (("--model.flavor", "debug_flex", "--training.dataset", "synthetic_docs", "--parallelism.context_parallel_degree",
          "2"), r"under tsp: TSP attention is causal over the whole sequence \(no document masks yet\)"),
        (("--model.flavor", "debug_mha", "--parallelism.context_parallel_degree", "3", "--training.seq_len", "510"),
         r"^TSP degree 3 does not divide the 8 query heads.*; TSP degree 3 does not divide the 8 KV heads"),
    ],
)
def test_invalid_tsp_jobs_name_the_fix(overrides, message):
    config = job(*overrides, config=TSP)
    with pytest.raises(ConfigError, match=message):
        check_job(config, world_size=config.parallelism.context_parallel_degree)
    check_job(job(config=TSP), world_size=4)  # and the committed config passes


# --- suggestions are right (issue 33): every constraint at once, no advice the config follows ------

RECIPE_1M = "configs/llama3_8b/upipe_1m.toml"  # Llama3-8B: 32 query / 8 KV heads, UPipe CP = 8
UPIPE_DEBUG = "configs/debug/llama3_upipe.toml"  # 8 query / 2 KV heads, UPipe CP = 2


@pytest.mark.parametrize(
    "config, overrides, world, message",
    [
        # 7 ranks: 7 splits no heads and 1 has no CP attention; "one of 1, 7" before
        (RECIPE_1M, (), 7, r"^7 ranks are not a multiple of context_parallel_degree 8: launch 8 ranks \(no "
                           r"context_parallel_degree fits both 7 ranks and this job's heads, .*\)$"),
        # the divisors of 12 that split 32 / 8 heads
        (RECIPE_1M, (), 12, r"launch 8 or 16 ranks, or set context_parallel_degree to one of 2, 4$"),
        # U = 2 is a multiple of 2 only: 4 would need U in 4, 8, ...; and CP 8 itself does not fit U = 2,
        # so more ranks are no fix
        (RECIPE_1M, ("--upipe.heads_per_stage", "2"), 12, r"12 ranks are not a multiple of context_parallel_degree 8: "
                                                          r"set context_parallel_degree to 2$"),
        # CP 3 splits no heads of the debug model: "launch 3 ranks" would only meet the next error
        (UPIPE_DEBUG, ("--parallelism.context_parallel_degree", "3"), 2,
         r"^2 ranks are not a multiple of context_parallel_degree 3: set context_parallel_degree to 2$"),
        # USP with 2 Ulysses ranks: 6 = 3 x 2 splits the heads, but seq_len 512 is no multiple of 2 x 3 x 2
        (USP, (), 6, r"launch 4 or 8 ranks \(no context_parallel_degree fits"),
        (USP, ("--training.seq_len", "768"), 6, r"launch 4 or 8 ranks, or set context_parallel_degree to 6$"),
    ],
)
def test_suggested_cp_degrees_fit_every_constraint(config, overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job(*overrides, config=config), world_size=world)
    if suggested := [int(d) for d in message.rpartition("to ")[2].removesuffix("$").replace("one of ", "").split(", ")
                     if d.isdigit()]:
        for degree in suggested:  # each suggestion is a job the checks accept
            check_job(job(*overrides, "--parallelism.context_parallel_degree", str(degree), config=config), world)


def _host_memory_advice(*overrides: str) -> str:
    from titan_upipe.tools import preflight as validate

    problem = validate.host_memory_problem(job(*overrides, config=RECIPE_1M), 8, 1024**3, "this machine")
    assert problem is not None
    return problem


def test_host_memory_advice_leaves_out_what_the_config_already_does():
    advice = _host_memory_advice()  # pinned offload buffers and an async checkpoint
    assert "pin_memory = false" in advice and 'async_mode = "disabled"' in advice and "--host-mem" in advice
    advice = _host_memory_advice("--activation_checkpoint.no-pin_memory", "--checkpoint.async_mode", "disabled")
    assert "pin_memory" not in advice and "async_mode" not in advice, advice
    assert advice.endswith("use more nodes (fewer tokens and a smaller state shard per rank) or pass --host-mem GIB "
                           "when validating away from the compute nodes"), advice


def test_offload_advice_does_not_repeat_the_mode_already_set():
    with pytest.raises(ConfigError) as err:
        check_job(job("--activation_checkpoint.mode", "full", "--activation_checkpoint.resident_blocks", "1"), 2)
    assert str(err.value).endswith("set activation_checkpoint.cpu_offload = true or drop it")
    with pytest.raises(ConfigError, match=r'cpu_offload = true \(and mode = "full"\) or drop it'):
        check_job(job("--activation_checkpoint.mode", "none", "--activation_checkpoint.resident_blocks", "1"), 2)


# --- ignored settings are named (issue 33): a warning where a setting has no effect, an error where
# --- it contradicts the model

OFFLOADED = ("--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload")


@pytest.mark.parametrize(
    "config, overrides, warning",
    [
        ("configs/debug/llama3_ulysses.toml", ("--upipe.heads_per_stage", "4"),
         "upipe.heads_per_stage = 4 has no effect: it is U, UPipe's query heads per stage, and model.converters runs "
         "'ulysses'; drop it, or use the 'upipe' converter"),
        ("configs/debug/llama3_ring.toml", ("--upipe.heads_per_stage", "2"), "upipe.heads_per_stage = 2 has no effect"),
        (UPIPE, ("--transforms.mlp_tile_tokens", "64"),
         "transforms.mlp_tile_tokens = 64 has no effect: model.converters has no 'tiled_mlp'; drop it, or add "
         "'tiled_mlp' to model.converters"),
        (UPIPE, ("--transforms.rmsnorm_tile_tokens", "64"), "transforms.rmsnorm_tile_tokens = 64 has no effect"),
        (UPIPE, ("--transforms.ce_backend", "torch"), 'transforms.ce_backend = "torch" has no effect'),
        (UPIPE, ("--activation_checkpoint.no-pin_memory",),
         "activation_checkpoint.pin_memory = false has no effect: activation_checkpoint.cpu_offload is false"),
        (UPIPE, ("--tsp.kv_heads_per_bucket", "1"), "tsp.kv_heads_per_bucket = 1 has no effect: model.converters has "
                                                    "no 'tsp'"),
        ("configs/debug/llama3_fsdp.toml", ("--upipe.attention_backend", "math"),
         'upipe.attention_backend = "math" has no effect: model.converters has no context-parallel attention'),
        (UPIPE, ("--local_data.text_key", "body"), 'local_data.text_key = "body" has no effect: neither '
                                                   "training.dataset nor an enabled validation.dataset is 'local_text'"),
        # issue 35: the document layout needs packed documents on a ring
        (DOCS, ("--upipe.document_balance", "zigzag"), 'upipe.document_balance = "zigzag" has no effect: \'upipe\' '
         "on 2 ranks has no ring (Ulysses and UPipe alone are balanced already)"),
        ("configs/debug/llama3_usp.toml", ("--upipe.document_min_split", "64"), "upipe.document_min_split = 64 has no "
         "effect: model.flavor 'debug' has attn_mask_type 'causal' (no packed documents)"),
        (DOCS, ("--upipe.ulysses_degree", "1", "--upipe.document_balance", "zigzag", "--upipe.document_min_split", "64"),
         "upipe.document_min_split = 64 has no effect: upipe.document_balance is 'zigzag' (the fixed layout splits no "
         "document by size)"),
    ],
)
def test_a_setting_without_effect_is_a_warning(config, overrides, warning):
    from titan_upipe.torchtitan_0_2.checks import config_warnings

    assert config_warnings(job(config=config)) == []
    check_job(job(*overrides, config=config), world_size=4)  # it runs: a warning, not an error
    warnings = config_warnings(job(*overrides, config=config))
    assert len(warnings) == 1 and warnings[0].startswith(warning), warnings


def test_the_document_layout_is_validated_named_and_summarized():
    """``[upipe] document_balance`` / ``document_min_split``: a bad value is one message naming the choices;
    validate's summary says which layout a ring runs packed documents in; with effect, no warning."""
    from titan_upipe.tools.preflight import summarize
    from titan_upipe.torchtitan_0_2.checks import config_warnings

    with pytest.raises(ConfigError, match=r"invalid upipe.document_balance = 'zigzg': valid values are zigzag, "
                                          r"documents; did you mean \"zigzag\""):
        job("--upipe.document_balance", "zigzg", config=DOCS)
    with pytest.raises(ConfigError, match=r"invalid upipe.document_min_split = 0: valid values are a positive number"):
        job("--upipe.document_min_split", "0", config=DOCS)
    ring = ("--upipe.ulysses_degree", "1")
    for extra, line in (((), 'each batch in its own layout over the ring of 2 (upipe.document_balance = "documents": '
                              "documents of 512 tokens or more"),  # min(16384, max(512 / (4 x 2), 2 x 2 x 128))
                        (("--upipe.document_balance", "zigzag"), 'the fixed zigzag over the ring of 2 '
                                                                 '(upipe.document_balance = "zigzag"')):
        config = job(*ring, *extra, config=DOCS)
        assert config_warnings(config) == []
        rows = summarize(config, 2).lines()
        assert any(row.startswith("packed documents " + line) for row in rows), rows
    assert not any(row.startswith("packed documents") for row in summarize(job(config=DOCS), 2).lines())  # no ring


def test_settings_with_effect_are_not_warned_about():
    from titan_upipe.torchtitan_0_2.checks import config_warnings

    assert config_warnings(job("--upipe.heads_per_stage", "4", "--activation_checkpoint.no-pin_memory", *OFFLOADED,
                               "--model.converters", "upipe,tiled_mlp", "--transforms.mlp_tile_tokens", "64")) == []


def test_every_recipe_runs_without_a_warning():
    from pathlib import Path

    from titan_upipe.torchtitan_0_2.checks import config_warnings

    for path in sorted(Path("configs").glob("*/*.toml")):
        assert config_warnings(job(config=str(path))) == [], path


def test_resident_blocks_beyond_the_model_is_an_error():
    """The debug flavor has 2 blocks: 1 resident leaves one offloaded, 2 none (a warning), 5 is an error."""
    from titan_upipe.torchtitan_0_2.checks import config_warnings

    check_job(job(*OFFLOADED, "--activation_checkpoint.resident_blocks", "1"), world_size=2)
    assert config_warnings(job(*OFFLOADED, "--activation_checkpoint.resident_blocks", "1")) == []
    check_job(job(*OFFLOADED, "--activation_checkpoint.resident_blocks", "2"), world_size=2)
    assert config_warnings(job(*OFFLOADED, "--activation_checkpoint.resident_blocks", "2")) == [
        "activation_checkpoint.cpu_offload = true has no effect: resident_blocks = 2 keeps the input of every one of "
        "the 2 blocks on the device (full activation checkpointing); set cpu_offload = false, or resident_blocks "
        "below the block count"]
    with pytest.raises(ConfigError, match=r"^activation_checkpoint.resident_blocks = 5 is more than the 2 blocks of "
                                          r"model.flavor 'debug': valid values are 0 to 2 \(2: no block input "
                                          r"offloaded\)$"):
        check_job(job(*OFFLOADED, "--activation_checkpoint.resident_blocks", "5"), world_size=2)
