"""Train specs, debug flavors and the parallelize_fn's guard rails."""

import pytest
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from titan_upipe.config import ConfigError
from titan_upipe.data.tokenizer import VOCAB_SIZE
from titan_upipe.parallelize import check_parallelism
from titan_upipe.train import parse_config


def test_specs_registered_with_stock_and_debug_flavors():
    llama, qwen = get_train_spec("upipe_llama3"), get_train_spec("upipe_qwen3")
    assert {"debug", "8B"} <= set(llama.model_args) and {"debug", "32B"} <= set(qwen.model_args)
    debug = llama.model_args["debug"]
    assert (debug.n_heads, debug.n_kv_heads, debug.vocab_size) == (8, 2, VOCAB_SIZE)
    qdebug = qwen.model_args["debug"]
    assert qdebug.qk_norm and not qdebug.enable_weight_tying and qdebug.n_kv_heads < qdebug.n_heads


def test_flavors_are_private_copies():
    assert get_train_spec("upipe_llama3").model_args["8B"] is not get_train_spec("llama3").model_args["8B"]


def _dims(**kw):
    base = {"dp_shard": 1, "dp_replicate": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "world_size": 2}
    return ParallelDims(**{**base, **kw})


def test_parallelize_rejects_unsupported_layouts():
    job = parse_config([])
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        check_parallelism(_dims(tp=2), job)
    with pytest.raises(ConfigError, match="model.converters"):
        check_parallelism(_dims(cp=2), job)
    check_parallelism(_dims(dp_shard=2), job)  # FSDP alone is fine
