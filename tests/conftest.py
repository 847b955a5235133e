import os

# Tests run on CPU with gloo even on a GPU machine; registering the plugin first
# picks the device before TorchTitan reads it. validate reads it too (the device a job trains on):
# a test that validates a GPU recipe for its GPU passes --device cuda.
os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from text_assets import text_job_overrides, write_corpus, write_hf_weights, write_tokenizer  # noqa: E402
from trainer_utils import E2E_STEPS, create_seed_checkpoint, e2e_validation, load_seed, torchrun  # noqa: E402

from titan_upipe.torchtitan_0_2.registry import register_plugin  # noqa: E402

register_plugin()


@pytest.fixture(scope="session")
def llama3_seed(tmp_path_factory):
    """One seed checkpoint of the Llama3 debug flavor, shared by every end-to-end test."""
    return create_seed_checkpoint("configs/debug/llama3_fsdp.toml", tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="session")
def llama3_one_rank(llama3_seed, tmp_path_factory):
    """The reference: the plain model on 1 rank, fp32, batch 4, from ``llama3_seed``, validated
    (``e2e_validation``); its dump folder."""
    out = tmp_path_factory.mktemp("one_rank")
    torchrun(1, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, "--training.steps", E2E_STEPS,
             "--training.local_batch_size", "4", *e2e_validation(), *load_seed(llama3_seed))
    return out


@pytest.fixture(scope="session")
def llama3_two_ranks(llama3_seed, tmp_path_factory):
    """The same global batch as plain FSDP over 2 data-parallel ranks of 2 sequences, validated."""
    out = tmp_path_factory.mktemp("two_ranks")
    torchrun(2, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, "--training.steps", E2E_STEPS,
             "--training.local_batch_size", "2", *e2e_validation(2), *load_seed(llama3_seed))
    return out


@pytest.fixture(scope="session")
def text_job_assets(tmp_path_factory):
    """A local corpus, a BPE tokenizer and HF safetensors weights of the Llama3 debug flavor."""
    root = tmp_path_factory.mktemp("text_job_assets")
    write_corpus(root / "data")
    write_tokenizer(root / "hf")
    write_hf_weights(root / "hf")
    return root


@pytest.fixture(scope="session")
def upipe_text_job(text_job_assets, tmp_path_factory):
    """A training job as the GPU recipes run one, on 2 CPU ranks: UPipe CP=2 (backend ``auto``),
    local text, HF weights, full checkpoints at steps 2 and 4, the progress of every step
    (``metrics.progress_after_seconds = 0``); its dump folder, with the launch's console output in
    ``console.log``. Shared by the resume tests and the dashboard tests."""
    out = tmp_path_factory.mktemp("upipe_text_job")
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_upipe.toml", out, *text_job_overrides(text_job_assets),
                    "--training.local_batch_size", "2", "--upipe.attention_backend", "auto",
                    "--metrics.progress_after_seconds", "0")
    (out / "console.log").write_text(proc.stdout + proc.stderr)
    return out


# ---- test tiers: `pytest -m unit` (in-process), `-m dist` (gloo rank pools), `-m e2e` (launches)

TIERS = ("unit", "dist", "e2e")
E2E_CALLS = ("torchrun(", "create_seed_checkpoint(", "torch.distributed.run", "sbatch", "srun")
"""What an end-to-end test calls: a real launch (torchrun, SLURM scripts)."""
DIST_CALLS = ("run_distributed(",)
"""What a distributed test calls: jobs on the shared gloo rank pools (``dist_utils``)."""


def _source(obj) -> str:
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_LAUNCHERS: dict[tuple[str, str], set[str]] = {}


def _launchers(module, calls: tuple[str, ...]) -> set[str]:
    """Names of ``module``'s functions that make one of ``calls``, directly or through another."""
    import inspect

    key = (module.__name__, calls[0])
    if key not in _LAUNCHERS:
        functions = {name: _source(f) for name, f in vars(module).items()
                     if inspect.isfunction(f) and f.__module__ == module.__name__}
        found = {name for name, text in functions.items() if any(c in text for c in calls)}
        while True:
            more = {name for name, text in functions.items() if name not in found
                    and any(f"{other}(" in text or f"{other}," in text for other in found)}
            if not more:
                break
            found |= more
        _LAUNCHERS[key] = found
    return _LAUNCHERS[key]


def _makes(item, calls: tuple[str, ...]) -> bool:
    """The test, or a fixture it uses, makes one of ``calls`` (directly or through its module's
    functions: run_distributed is often a helper's)."""
    objects = [item.function, *(d.func for name in item.fixturenames
                                for d in item._fixtureinfo.name2fixturedefs.get(name, ()))]
    for obj in objects:
        text = _source(obj)
        module = __import__(obj.__module__, fromlist=["_"])
        names = _launchers(module, calls)
        if any(c in text for c in calls) or any(f"{n}(" in text or f"{n}," in text for n in names):
            return True
    return False


def tier_of(item) -> str:
    if _makes(item, E2E_CALLS):
        return "e2e"
    return "dist" if _makes(item, DIST_CALLS) else "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
