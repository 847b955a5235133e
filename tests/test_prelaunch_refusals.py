"""validate = the trainer (issue 42): a job the trainer would refuse before its first step is refused by
``python -m titan_upipe.validate`` (exit 1) and by the trainer's pre-launch checks
(``launch.checked_config``: ``check_job`` and ``check_assets``, before any process group), with the
same line. Each case below was refused only after launch, or trained wrong, before.

``test_every_refusal_after_launch_is_accounted_for`` walks the modules that run after the process
groups start and fails on a refusal there that no pre-launch check meets first."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from test_checkpoint_assets import LOCAL_TEXT_CURSOR, write_dcp
from text_assets import BOS, write_corpus, write_tokenizer
from trainer_utils import REPO

from titan_upipe.errors import ConfigError
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import launch
from titan_upipe.torchtitan_0_2.memory_guard import prepare_launch

UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # CP 2, float32, synthetic_copy
DOCS = str(REPO / "configs/debug/llama3_upipe_docs.toml")  # debug_flex (block_causal), synthetic_docs, CP 2
FSDP = str(REPO / "configs/debug/llama3_fsdp.toml")  # no CP converter


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A corpus and two tokenizers: ``hf`` (Llama-3-style BOS/EOS) and ``hf_no_eos`` (no eos_token)."""
    root = tmp_path_factory.mktemp("assets")
    write_corpus(root / "data")
    write_tokenizer(root / "hf")
    write_tokenizer(root / "hf_no_eos")
    (root / "hf_no_eos" / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    return root


def local_text(assets: Path, tokenizer: str = "hf") -> list[str]:
    return ["--training.dataset", "local_text", "--local_data.paths", str(assets / "data" / "*.jsonl"),
            "--model.hf_assets_path", str(assets / tokenizer)]


def resuming(tmp_path: Path, dataloader: dict | None = None) -> list[str]:
    """A checkpoint folder holding a full step 2 (a synthetic dataset's data cursor by default)."""
    write_dcp(tmp_path / "out" / "checkpoint" / "step-2", dataloader=dataloader)
    return ["--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable"]


def moved_file_cursor(assets: Path) -> dict:
    """A local_text cursor into a file that ``local_data.paths`` now lists elsewhere (its index 0 is a.jsonl)."""
    return {**LOCAL_TEXT_CURSOR, "stream": {**LOCAL_TEXT_CURSOR["stream"], "file": 0,
                                            "file_path": str(assets / "data" / "d.jsonl")}}


# (id, config, world size, args(tmp_path, assets), environment, the trainer's device, the message as a regex)
CASES = [
    ("dataset-typo", UPIPE, 2, lambda tmp, a: ["--training.dataset", "local_txt"], {}, None,
     r"^training.dataset = 'local_txt' is unknown: valid values are c4, c4_test, c4_validation, local_text, "
     r"synthetic_copy, synthetic_docs; did you mean \"local_text\"\?$"),
    ("validation-dataset-typo", UPIPE, 2,
     lambda tmp, a: ["--validation.enable", "--validation.dataset", "synthetic_cpy", "--validation.steps", "1",
                     "--validation.seq_len", "512"], {},
     None, r"^validation.dataset = 'synthetic_cpy' is unknown: .*; did you mean \"synthetic_copy\"\?$"),
    ("synthetic-checkpoint-resumed-on-local-text", FSDP, 1, lambda tmp, a: [*local_text(a), *resuming(tmp)], {}, None,
     r"/step-2 holds the data cursor of training.dataset = 'synthetic_copy' or 'synthetic_docs', but training.dataset "
     r"= 'local_text' resumes from dataloader.stream.epoch, dataloader.stream.file, dataloader.stream.file_path, "
     r"dataloader.stream.position, dataloader.stream.token_offset: resume with the dataset it was saved with, or "
     r"restart the data from its beginning with --checkpoint.exclude_from_loading dataloader$"),
    ("local-text-checkpoint-resumed-on-synthetic", FSDP, 1, lambda tmp, a: resuming(tmp, LOCAL_TEXT_CURSOR), {}, None,
     r"/step-2 holds the data cursor of training.dataset = 'local_text', but training.dataset = 'synthetic_copy' "
     r"resumes from dataloader.stream.index: resume with the dataset it was saved with, or restart the data"),
    ("local-text-cursor-into-another-file", FSDP, 1,
     lambda tmp, a: [*local_text(a), *resuming(tmp, moved_file_cursor(a))], {}, None,
     r"/step-2: the data cursor points into file 0 = .*/d.jsonl, but local_data.paths now lists .*/a.jsonl there: "
     r"resume with the files of the original run"),
    ("block-causal-tokenizer-without-eos", DOCS, 2, lambda tmp, a: local_text(a, "hf_no_eos"), {}, None,
     r"^model.flavor = 'debug_flex' \(attn_mask_type 'block_causal'\) ends a packed document at each EOS token, but "
     r"the tokenizer in model.hf_assets_path = '.*hf_no_eos' has none \(no eos_token in tokenizer_config.json\)"),
    # on this machine without a GPU (a login node), a bf16 job is a GPU job: its packed documents need a varlen kernel
    ("packed-documents-gpu-job-without-varlen", DOCS, 2,
     lambda tmp, a: ["--training.mixed_precision_param", "bfloat16", "--upipe.attention_backend", "sdpa"],
     {"TITAN_UPIPE_DEVICE": None}, "cuda",
     r"under upipe: attention backend 'sdpa' has no varlen \(cu_seqlens\) kernel, so packed documents on CUDA would "
     r"run one kernel call per document: set attention_backend to one of flash_attn4"),
    ("device-cuda-without-cuda", UPIPE, 2, lambda tmp, a: [], {"TITAN_UPIPE_DEVICE": "cuda"}, None,
     r"^TITAN_UPIPE_DEVICE=cuda but torch finds no CUDA device on this machine \(.*\): run the job on a GPU node with "
     r"a CUDA build of torch, or set TITAN_UPIPE_DEVICE=cpu to train on the CPU$"),
    ("device-typo", UPIPE, 2, lambda tmp, a: [], {"TITAN_UPIPE_DEVICE": "gpu"}, None,
     r"^TITAN_UPIPE_DEVICE=gpu is invalid: valid values are auto, cpu, cuda"),
    # the launch's memory guard (torchtitan_0_2.memory_guard.prepare_launch): a float32 job on this CPU machine
    ("a-length-no-machine-holds", UPIPE, 2, lambda tmp, a: ["--training.seq_len", str(2**40)], {}, None,
     r"^training.seq_len = 1,099,511,627,776 does not fit: the memory planner predicts [\d,.]+ GiB per rank"),
    ("replicas-without-sharding", FSDP, 2,
     lambda tmp, a: ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                     "1"], {}, None,
     r"^parallelism.data_parallel_replicate_degree = 2 without sharding \(DDP\) is not supported by titan_upipe"),
]


def _environment(monkeypatch, env: dict) -> None:
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_validate_refuses_what_the_trainer_refuses_before_launch(case, assets, tmp_path, monkeypatch, capsys):
    _, config, world, make_args, env, trainer_device, message = case
    if env.get("TITAN_UPIPE_DEVICE") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = make_args(tmp_path, assets)
    _environment(monkeypatch, env)

    assert validate.main([config, "--world-size", str(world), *args]) == 1
    reported = [line.removeprefix("  - ") for line in capsys.readouterr().out.splitlines()]
    assert any(re.search(message, line) for line in reported), reported

    if trainer_device is not None:  # the trainer on the job's GPU node: TorchTitan's device is cuda there
        import torchtitan.tools.utils as titan_utils

        monkeypatch.setattr(titan_utils, "device_type", trainer_device)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as refused:  # the trainer's checks, then its prepare hook (titan_upipe.train)
        prepare_launch(launch.checked_config(["--job.config_file", config, *args]), world)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert not torch.distributed.is_initialized()


def test_the_device_a_job_is_checked_for_is_named(capsys, monkeypatch):
    """validate names the device it checked for; ``--device cpu`` checks a CPU run of a bf16 job."""
    monkeypatch.delenv("TITAN_UPIPE_DEVICE", raising=False)
    gpu_job = [DOCS, "--world-size", "2", "--no-assets", "--training.mixed_precision_param", "bfloat16",
               "--upipe.attention_backend", "sdpa"]
    assert validate.main([*gpu_job, "--device", "cpu"]) == 0
    assert "device           cpu (--device)" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert validate.main([DOCS, "--world-size", "2", "--no-assets"]) == 0
        assert "device           cpu (no GPU here, training.mixed_precision_param = float32" in capsys.readouterr().out


def test_cuda_asked_for_leaves_torchtitans_device_alone(monkeypatch):
    """``TITAN_UPIPE_DEVICE=cuda`` never falls back to the CPU: ``activate`` leaves TorchTitan's device
    as it is, and the job checks refuse a machine without CUDA (the table above)."""
    import torchtitan.tools.utils as titan_utils

    from titan_upipe.torchtitan_common import cpu_runtime

    monkeypatch.setenv("TITAN_UPIPE_DEVICE", "cuda")
    monkeypatch.setattr(titan_utils, "device_type", "cuda")
    assert cpu_runtime.activate() is False and titan_utils.device_type == "cuda"
    monkeypatch.setenv("TITAN_UPIPE_DEVICE", "cpu")
    assert cpu_runtime.device_problem() is None


def test_a_loader_saves_the_keys_the_checkpoint_check_expects(assets):
    """``builders.loader_state_keys`` is what each plugin loader's ``state_dict`` holds, flattened."""
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.data_builders import build_dataloader, build_tokenizer, loader_state_keys

    def flattened(state: dict, prefix: str = "") -> set[str]:
        keys = set()
        for key, value in state.items():
            keys |= flattened(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
        return keys

    for dataset, args in (("synthetic_copy", []), ("synthetic_docs", ["--training.dataset", "synthetic_docs"]),
                          ("local_text", local_text(assets))):
        job = parse_config(["--job.config_file", FSDP, *args])
        loader = build_dataloader(1, 0, build_tokenizer(job), job)
        assert flattened(loader.state_dict()) == loader_state_keys(dataset), dataset


# --- the walk: every refusal after process-group start is met before launch ----------------------

PRE_LAUNCH = ("checks/", "job_assets/", "launch.py", "config.py", "config_parse.py", "flavors.py",
              "specs.py", "registry.py", "cpu_runtime.py", "torchtitan_launch.py", "job_spec.py", "job_plan.py",
              "memory_guard.py", "model_classes.py", "datasets.py")
"""Modules of ``torchtitan_0_2/`` that run before the process groups start (the rest, and ``data/``,
run after: the trainer builds them)."""

AFTER_LAUNCH = {
    "torchtitan_0_2/launched_job.py:LaunchedJob.required_cp_mesh":
        "checks.parallelism.check_context_parallel: a CP degree without a CP converter, or a CP converter "
        "at degree 1 (CPLayout)",
    "torchtitan_0_2/cp_inputs.py:document_eos_id":
        "checks.model.check_document_masking (mask types); torchtitan_common.job_inputs.check_document_eos "
        "(case block-causal-tokenizer-without-eos)",
    "torchtitan_0_2/parallelize.py:parallelize":
        "checks.parallelism.check_supported_parallelism (case replicas-without-sharding)",
    "torchtitan_0_2/parallelize.py:apply_fsdp":
        "the config parser: fsdp_reshard_after_forward is a Literal of TorchTitan's config",
    "torchtitan_0_2/launch_store.py:_master": "run time: the launch's environment (MASTER_ADDR/PORT), not the job's",
    "torchtitan_0_2/launch_store.py:_wait_for_server": "run time: rank 0's store does not answer (the launch)",
    "torchtitan_0_2/launch_store.py:join": "run time: ranks that never join the rendezvous (the launch)",
    "torchtitan_0_2/validation_loss.py:LayoutValidator.__init__":
        "checks.parallelism.check_supported_parallelism: pipeline_parallel_degree is 1",
    "torchtitan_0_2/validation_loss.py:LayoutValidator.validate":
        "run time: validation data that yields no batch (known only once it is read)",
    "data/local_text.py:expand_paths": "job_assets.inputs.check_dataset (the same function)",
    "data/local_text.py:BadRecords.__call__":
        "job_assets.inputs.check_dataset for the first records of each file; run time for a bad record further in",
    "data/local_text.py:check_first_records": "job_assets.inputs.check_dataset (the same function)",
    "data/local_text.py:check_some_document": "job_assets.inputs.check_dataset (the same function)",
    "data/local_text.py:LocalTextStream.__init__": "job_assets.inputs.check_dataset: no file matched",
    "data/local_text.py:LocalTextStream._documents": "job_assets.inputs.check_dataset: check_some_document",
    "data/local_text.py:LocalTextStream.load_state_dict":
        "job_assets.checkpoints (case local-text-cursor-into-another-file)",
}
"""Each ``raise ConfigError(...)`` (or of a ConfigError subclass) in a module that runs after launch, as
``path:function``, and the pre-launch check that refuses the same job first (with the case above
that shows it), or why only the run can find it (``run time: …``)."""


def _config_error_names(tree: ast.Module) -> set[str]:
    names = {"ConfigError"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(getattr(base, "id", "") in names for base in node.bases):
            names.add(node.name)
    return names


def _raise_sites(path: Path, relative: str) -> set[str]:
    tree = ast.parse(path.read_text())
    errors, sites = _config_error_names(tree), set()

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call):
                if getattr(child.exc.func, "id", None) in errors:
                    sites.add(f"{relative}:{'.'.join(scope)}")
            visit(child, scope)

    visit(tree, [])
    return sites


def test_every_refusal_after_launch_is_accounted_for():
    package = REPO / "titan_upipe"
    files = [*sorted((package / "torchtitan_0_2").rglob("*.py")), *sorted((package / "data").glob("*.py"))]
    found = set()
    for path in files:
        relative = path.relative_to(package).as_posix()
        if not relative.removeprefix("torchtitan_0_2/").startswith(PRE_LAUNCH):
            found |= _raise_sites(path, relative)
    unaccounted = sorted(found - set(AFTER_LAUNCH))
    assert not unaccounted, ("refusals reachable only after the process groups start: check the same settings "
                             f"before launch (checks/ or job_assets/) and list them in AFTER_LAUNCH: {unaccounted}")
    assert not sorted(set(AFTER_LAUNCH) - found), "AFTER_LAUNCH lists sites that no longer raise"
    cases = {c[0] for c in CASES}
    for site, how in AFTER_LAUNCH.items():
        for case in re.findall(r"\(case ([\w-]+)\)", how):
            assert case in cases, (site, case)
