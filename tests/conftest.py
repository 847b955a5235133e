import os

# Tests run on CPU with gloo even on a GPU machine; registering the plugin first
# picks the device before TorchTitan reads it.
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
    local text, HF weights, full checkpoints at steps 2 and 4; its dump folder. Shared by the
    resume tests and the dashboard test."""
    out = tmp_path_factory.mktemp("upipe_text_job")
    torchrun(2, "titan_upipe.train", "configs/debug/llama3_upipe.toml", out, *text_job_overrides(text_job_assets),
             "--training.local_batch_size", "2", "--upipe.attention_backend", "auto")
    return out
