"""``CPLayout``: a job's context-parallel layout, derived and validated in one place (pure)."""

import pytest

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CP_MODES, CPLayout, CPMode, cp_mode

LLAMA3_8B_HEADS = {"n_heads": 32, "n_kv_heads": 8}


@pytest.mark.parametrize(
    "mode, cp, ulysses, expected",
    [
        # mode, CP, [upipe] ulysses_degree -> (ring, ulysses, 2-D, U, seq divisor, name)
        ("ulysses", 8, 0, (1, 8, False, 32, 8, "ulysses")),
        ("ulysses", 8, 8, (1, 8, False, 32, 8, "ulysses")),
        ("upipe", 8, 0, (1, 8, False, 8, 8, "upipe")),
        ("upipe", 8, 4, (2, 4, True, 4, 16, "upipe-in-usp")),
        ("upipe", 8, 1, (8, 1, True, 1, 16, "upipe-in-usp")),
        ("ring", 8, 0, (8, 1, False, 32, 16, "ring")),
        ("usp", 8, 2, (4, 2, True, 32, 16, "usp")),
        (None, 1, 0, (1, 1, False, 32, 1, "none")),
    ],
)
def test_each_mode_resolves_its_degrees_u_and_sequence_divisor(mode, cp, ulysses, expected):
    layout = CPLayout(mode, cp, ulysses, **LLAMA3_8B_HEADS, seq_len=1 << 20)
    got = (layout.ring_degree, layout.ulysses_degree, layout.two_d, layout.heads_per_stage,
           layout.seq_divisor, layout.name)
    assert got == expected
    assert layout.ring_degree * layout.ulysses_degree == max(cp, 1)
    assert layout.has_ring == (layout.ring_degree > 1)
    assert layout.local_len == (1 << 20) // cp


def test_mode_is_an_enum_and_the_only_list_of_modes():
    assert CP_MODES == ("ulysses", "upipe", "ring", "usp", "tsp")
    assert CPLayout("upipe", 2).mode is CPMode.UPIPE
    assert cp_mode(["tiled_mlp", "usp"]) is CPMode.USP and cp_mode(["fused_ce"]) is None


def test_heads_per_stage_setting_is_upipe_u():
    assert CPLayout("upipe", 8, heads_per_stage_setting=16, **LLAMA3_8B_HEADS).heads_per_stage == 16
    assert CPLayout("upipe", 4, 2, heads_per_stage_setting=4, **LLAMA3_8B_HEADS).heads_per_stage == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": None, "cp_degree": 2}, "needs a context-parallel attention converter"),
        ({"mode": "upipe", "cp_degree": 1}, "set it to 2 or more"),
        ({"mode": "sideways", "cp_degree": 2}, "valid modes are ulysses, upipe, ring, usp"),
        ({"mode": "usp", "cp_degree": 8, "ulysses_setting": 3}, "does not divide"),
        ({"mode": "usp", "cp_degree": 8, "ulysses_setting": 8}, r"valid values are \[2, 4\]"),
        ({"mode": "ulysses", "cp_degree": 3, **LLAMA3_8B_HEADS}, r"valid CP degrees are \[2, 4, 8, 16, 32\]"),
        ({"mode": "usp", "cp_degree": 6, "ulysses_setting": 3, **LLAMA3_8B_HEADS}, "use upipe.ulysses_degree in"),
        ({"mode": "upipe", "cp_degree": 8, "heads_per_stage_setting": 12, **LLAMA3_8B_HEADS},
         r"valid values .* are 0 \(= 8\) or \[8, 16, 32\]"),
        ({"mode": "ring", "cp_degree": 4, "seq_len": 1004}, r"2 x ring x ulysses = 2 x 4 x 1 = 8"),
        ({"mode": "ulysses", "cp_degree": 4, "seq_len": 1001}, r"not divisible by the context-parallel degree 4 \(parallelism.context_parallel_degree\)"),
    ],
)
def test_every_invalid_layout_is_one_config_error_naming_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CPLayout(**kwargs)


def test_unknown_heads_skip_the_head_checks():
    layout = CPLayout("ulysses", 3)
    assert (layout.ring_degree, layout.ulysses_degree, layout.heads_per_stage) == (1, 3, 0)
