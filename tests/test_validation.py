"""Job validation before any process group: each problem names the setting and valid choices."""

import pytest

from titan_upipe.config import ConfigError
from titan_upipe.train import parse_config
from titan_upipe.validation import check_job, cp_mode

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
        (("--model.converters", "float8"), 2, "needs a context-parallel attention converter"),
        (("--parallelism.context_parallel_degree", "1"), 2, "set it to 2 or more"),
        (("--parallelism.context_parallel_degree", "3"), 3, r"valid CP degrees are \[1, 2, 4, 8\]"),
        (("--upipe.heads_per_stage", "3"), 2, r"valid values .* are 0 \(= 2\) or \[2, 4, 8\]"),
        (("--upipe.heads_per_stage", "6"), 2, "upipe.heads_per_stage=6"),
        (("--training.seq_len", "511"), 2, "training.seq_len = 511 is not divisible"),
        ((), 3, r"do not match the world size 3: valid context_parallel_degree values for 3 ranks are \[1, 3\]"),
        (("--parallelism.tensor_parallel_degree", "2"), 4, "tensor_parallel_degree"),
        (("--model.flavor", "tiny"), 2, "valid values are"),
    ],
)
def test_invalid_jobs_name_setting_and_choices(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job(*overrides), world_size=world)


def test_cp_mode_picks_the_attention_converter():
    assert cp_mode(["upipe"]) == "upipe" and cp_mode(["float8"]) is None
