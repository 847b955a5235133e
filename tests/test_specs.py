"""Train specs and debug flavors (the parallelize_fn's guard rails: test_validation.py)."""
import pytest
from torchtitan.protocols.train_spec import get_train_spec

from titan_upipe.data.tokenizer import VOCAB_SIZE


def test_specs_registered_with_stock_and_debug_flavors():
    llama, qwen = get_train_spec("upipe_llama3"), get_train_spec("upipe_qwen3")
    assert {"debug", "8B"} <= set(llama.model_args) and {"debug", "32B"} <= set(qwen.model_args)
    debug = llama.model_args["debug"]
    assert (debug.n_heads, debug.n_kv_heads, debug.vocab_size) == (8, 2, VOCAB_SIZE)
    qdebug = qwen.model_args["debug"]
    assert qdebug.qk_norm and not qdebug.enable_weight_tying and qdebug.n_kv_heads < qdebug.n_heads


def test_flavors_are_private_copies():
    assert get_train_spec("upipe_llama3").model_args["8B"] is not get_train_spec("llama3").model_args["8B"]


def test_flavor_args_are_a_copy_updated_from_the_config():
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.torchtitan_0_2.config import ConfigError
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.flavors import flavor_args

    job = parse_config(["--job.config_file", "configs/debug/upipe.toml", "--training.seq_len", "8192"])
    shared = get_train_spec(job.model.name).model_args[job.model.flavor]
    before = shared.max_seq_len
    args = flavor_args(job)
    assert args.max_seq_len == 8192 and args is not shared
    assert shared.max_seq_len == before  # the spec's flavor dict is not mutated
    job.model.flavor = "no_such_flavor"
    with pytest.raises(ConfigError, match="valid values are"):
        flavor_args(job)
