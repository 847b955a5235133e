"""Our TOML recipes on TorchTitan 0.3: the same JobSpec and the same plan as on TorchTitan 0.2.2.

TorchTitan 0.3 reads no TOML; ``torchtitan_0_3.recipe`` maps a recipe onto its ``Trainer.Config`` and
the plugin's sections, and ``torchtitan_0_3.job_spec`` builds the spec. Every recipe of
``configs/llama3_8b`` and ``configs/qwen3_32b`` is read on both versions (0.2.2 in one subprocess,
the ``on_0_2`` fixture
without the 0.3 environment on its path) and the specs compared field by field; ``plan`` prints the
same JSON on both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_3 import recipe as recipes
from titan_upipe.torchtitan_0_3.job_spec import job_spec
from titan_upipe.torchtitan_0_3.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(str(p.relative_to(REPO)) for folder in ("llama3_8b", "qwen3_32b")
                 for p in (REPO / "configs" / folder).glob("*.toml"))

PLAN_RECIPES = ["configs/llama3_8b/upipe_1m.toml", "configs/qwen3_32b/upipe_usp_1m.toml"]

def as_json(spec) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(spec), default=str, sort_keys=True))


@pytest.fixture(scope="module")
def specs_on_0_2(on_0_2) -> dict:
    return on_0_2["specs"]


ADAPTER_FIELDS = ("rope_tables",)
"""JobSpec fields that tell the versions' models apart: 0.3 holds a RoPE table per attention."""


def test_every_recipe_has_the_same_spec_on_both_versions(specs_on_0_2):
    assert len(RECIPES) >= 60
    differences = {path: [name for name, value in as_json(job_spec(load_recipe(["--job.config_file", path]))).items()
                          if value != specs_on_0_2[path][name] and name not in ADAPTER_FIELDS]
                   for path in RECIPES}
    assert {path: names for path, names in differences.items() if names} == {}
    spec = job_spec(load_recipe(["--job.config_file", RECIPES[0]]))
    assert (spec.rope_tables, specs_on_0_2[RECIPES[0]]["rope_tables"]) == (spec.model.n_layers, 1)


def test_every_recipe_passes_the_checks_of_a_0_3_launch():
    """What ``validate --no-assets`` and the launch check before any process group (``job.checked_spec``) but
    the files (the recipes' tokenizers and data are on the cluster) and the memory verdict (some recipes are
    the paper's out-of-memory lengths): every Llama3-8B and Qwen3-32B recipe, TSP and host optimizer state
    included, passes them on 0.3 (a refusal raises here)."""
    from titan_upipe.torchtitan_0_3.load_job import checked_job

    for path in RECIPES:
        checked_job(["--job.config_file", path], files=False)


def test_a_recipe_key_mapped_to_the_wrong_field_breaks_the_comparison(specs_on_0_2, monkeypatch):
    """The comparison fails a broken mapping: ``training.seq_len`` set on another field, 0.3 trains its default
    length."""
    path = "configs/llama3_8b/upipe_1m.toml"
    monkeypatch.setitem(recipes.STOCK_KEYS, "training.seq_len", "training.gc_freq")  # the wrong field
    spec = as_json(job_spec(load_recipe(["--job.config_file", path])))
    assert spec["seq_len"] != specs_on_0_2[path]["seq_len"]


@pytest.mark.parametrize("recipe", PLAN_RECIPES)
def test_plan_prints_the_same_json_on_both_versions(recipe, on_0_2, capsys):
    from titan_upipe.tools.plan_cli import main as plan

    assert plan(["--job.config_file", recipe, "--json"]) == 0
    printed = capsys.readouterr()
    here, there = json.loads(printed.out), json.loads(on_0_2["plans"][recipe])
    # the one difference: 0.3's model holds a RoPE table per layer, which fused_rope (every recipe) replaces
    assert (here["job"].pop("rope_tables"), there["job"].pop("rope_tables")) == (here["job"]["model"]["n_layers"], 1)
    assert here == there and printed.err == ""
    assert here["model"] == there["model"]


def test_the_recipe_lands_in_the_trainer_config():
    loaded = load_recipe(["--job.config_file", "configs/llama3_8b/upipe_1m.toml", "--training.seq_len", "524288",
                          "--activation_checkpoint.no-pin_memory", "--context_parallel.heads_per_stage", "16",
                          "--training.max_norm", "0.5"])
    trainer = loaded.trainer
    assert (trainer.training.seq_len, trainer.dataloader.dataset, trainer.dump_folder) == \
        (524288, "local_text", "./outputs/llama3_8b_upipe_1m")
    assert trainer.optimizer.param_groups[0].optimizer_kwargs["lr"] == 2e-05
    assert type(trainer.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert (trainer.checkpoint.enable, trainer.checkpoint.async_mode, trainer.parallelism.context_parallel_degree) == \
        (True, "async", 8)
    assert loaded.plugin["activation_checkpoint"].pin_memory is False and trainer.training.max_norm == 0.5
    assert loaded.plugin["upipe"].heads_per_stage == 16 and job_spec(loaded).layout.heads_per_stage == 16
    assert loaded.converters == ("upipe", "tiled_mlp", "tiled_rmsnorm", "fused_rope", "fused_ce")


def test_context_parallel_is_the_same_section_as_upipe(tmp_path):
    text = (REPO / "configs/llama3_8b/upipe_2m.toml").read_text()
    aliased = tmp_path / "aliased.toml"
    aliased.write_text(text.replace("[upipe]", "[context_parallel]"))
    assert job_spec(load_recipe(["--job.config_file", str(aliased)])) == \
        job_spec(load_recipe(["--job.config_file", "configs/llama3_8b/upipe_2m.toml"]))


@pytest.mark.parametrize("args,message", [
    (["--training.seq_lne", "4096"], r"training.seq_lne \(in the flags\) is not read on TorchTitan 0.3 yet: .*"
                                     r"did you mean \"training.seq_len\""),
    (["--upipe.attention_backend", "sdpaa"], r"invalid upipe.attention_backend = 'sdpaa': valid values are auto, sdpa, "
                                             r"math, cudnn, .*did you mean \"sdpa\""),
    (["--model.flavor", "debug_gqa"], r"model.flavor = 'debug_gqa' is not a flavor of upipe_llama3 on TorchTitan 0.3: "
                                      r"valid values are debugmodel, 1B, 3B, 8B, 70B, 405B, debug, debug_mha, debug_kv4"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
     r"selective_ac_option = '2' \(per-block selective AC: one block in 2 checkpointed\) is not in TorchTitan 0.3"),
    (["--activation_checkpoint.keep_attention_blocks", "40"],
     r"invalid activation_checkpoint.keep_attention_blocks = '40': valid values are \"auto\" .* from 0 to the 32"),
    (["--upipe.heads_per_stage", "3"], r"upipe.heads_per_stage=3 is invalid"),
    (["--training.seq_len", "many"], r"invalid --training.seq_len 'many': valid values are integers"),
    (["--activation_checkpoint.cpu_offload", "false"],
     r"--activation_checkpoint.cpu_offload is a true/false flag and takes no value \('false'\): pass "
     r"--activation_checkpoint.cpu_offload alone for true, --activation_checkpoint.no-cpu_offload for false"),
    (["--debug.seed", "abc"], r"invalid --debug.seed 'abc': valid values are integers"),
    (["--optimizer.name", "Adam"], r"optimizer.name = 'Adam' is not run by titan_upipe on TorchTitan 0.3"),
])
def test_a_wrong_setting_is_one_message_naming_the_valid_ones(args, message):
    with pytest.raises(ConfigError, match=message):
        job_spec(load_recipe(["--job.config_file", "configs/llama3_8b/upipe_1m.toml", *args]))


def test_no_recipe_is_one_message():
    with pytest.raises(ConfigError, match=r"no recipe: give --job.config_file X.toml"):
        load_recipe(["--training.seq_len", "4096"])
    with pytest.raises(ConfigError, match=r"nothere.toml"):
        load_recipe(["--job.config_file", "nothere.toml"])


@pytest.mark.parametrize("key,value,message", [
    ("cpu_offload", '"false"', r"invalid activation_checkpoint.cpu_offload = 'false' \(str\): valid values are true, "
                               r"false"),
    ("keep_attention_blocks", "4", r"invalid activation_checkpoint.keep_attention_blocks = 4 \(int\): valid values "
                                   r"are strings \(in quotes\)"),
])
def test_a_toml_value_of_the_wrong_type_is_refused_as_on_0_2(tmp_path, key, value, message):
    """TOML values are typed by the key's field (0.2.2's wording): ``"false"`` is not false."""
    text = (REPO / "configs/llama3_8b/upipe_1m.toml").read_text()
    line = next(row for row in text.splitlines() if row.startswith(f"{key} ="))
    broken = tmp_path / "typed.toml"
    broken.write_text(text.replace(line, f"{key} = {value}"))
    with pytest.raises(ConfigError, match=message):
        load_recipe(["--job.config_file", str(broken)])


@pytest.mark.parametrize("section_key,value,message", [
    ("training.local_batch_size", '"2"', r"invalid training.local_batch_size = '2' \(str\): valid values are integers"),
    ("model.converters", '"upipe"', r"invalid model.converters = 'upipe' \(str\): valid values are lists of strings"),
])
def test_a_stock_or_model_key_of_the_wrong_type_is_refused(tmp_path, section_key, value, message):
    section, key = section_key.split(".")
    text = (REPO / "configs/llama3_8b/upipe_1m.toml").read_text()
    start = text.index(f"[{section}]")
    line = next(row for row in text[start:].splitlines() if row.startswith(f"{key} ="))
    broken = tmp_path / "typed.toml"
    broken.write_text(text[:start] + text[start:].replace(line, f"{key} = {value}", 1))
    with pytest.raises(ConfigError, match=message):
        load_recipe(["--job.config_file", str(broken)])


def test_a_recipe_without_an_ac_mode_takes_0_3s_default():
    """0.3's default AC is per-op selective (0.2's was every second block, which 0.3 has not)."""
    loaded = load_recipe(["--job.config_file", "configs/llama3_8b/upipe_1m.toml", "--activation_checkpoint.mode",
                          "selective"])
    assert type(loaded.trainer.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    assert (loaded.ac_mode, loaded.selective_ac_option) == ("selective", "op")


def test_every_stock_key_of_every_recipe_lands_where_the_table_says():
    """An independent read (tomllib) of each recipe against the Trainer.Config: every stock key's value at
    its 0.3 path, lr in the AdamW group, the model's spec from its name and flavor."""
    import tomllib

    for path in RECIPES:
        with open(REPO / path, "rb") as file:
            written = {f"{section}.{key}": value for section, table in tomllib.load(file).items()
                       for key, value in table.items()}
        loaded = load_recipe(["--job.config_file", path])
        for key, attribute in recipes.STOCK_KEYS.items():
            if key in written:
                value = loaded.trainer
                for name in attribute.split("."):
                    value = getattr(value, name)
                assert value == written[key], (path, key)
        assert loaded.trainer.optimizer.param_groups[0].optimizer_kwargs["lr"] == written["optimizer.lr"], path
        assert (loaded.trainer.model_spec.flavor, loaded.model_name) == (written["model.flavor"], written["model.name"])
        assert loaded.converters == tuple(written["model.converters"]), path


def test_every_recipe_is_a_config_function_of_torchtitans_entry_point():
    """``torchtitan.train --module titan_upipe.torchtitan_0_3 --config NAME [flags]`` parses into the plugin
    trainer's config with the recipe's job (0.3's own ConfigManager: module lookup, tyro flags); the
    functions are generated with the TOML files (``scripts/gen_configs.py --check`` in tests/test_recipes.py)."""
    from torchtitan.config.manager import ConfigManager

    from titan_upipe.torchtitan_0_3 import config_registry
    from titan_upipe.torchtitan_0_3.trainer import ContextParallelTrainer

    names = {p.relative_to(REPO / "configs").with_suffix("").as_posix().replace("/", "_")
             for p in (REPO / "configs").rglob("*.toml")}
    assert names == set(config_registry.recipe_tables()) and "llama3_8b_upipe_1m" in dir(config_registry)
    config = ConfigManager().parse_args(["--module", "titan_upipe.torchtitan_0_3", "--config", "llama3_8b_upipe_1m",
                                         "--training.steps", "7", "--parallelism.context_parallel_degree", "4"])
    assert isinstance(config, ContextParallelTrainer.Config) and config.recipe is not None
    assert (config.training.steps, config.parallelism.context_parallel_degree, config.parallelism.spmd_backend) == \
        (7, 4, "partial_dtensor")
    from_file = job_spec(load_recipe(["--job.config_file", "configs/llama3_8b/upipe_1m.toml"]))
    assert job_spec(config.recipe) == from_file
    with pytest.raises(AttributeError, match="has no config function 'llama3_8b_upipe_9m': valid names"):
        config_registry.llama3_8b_upipe_9m  # noqa: B018
