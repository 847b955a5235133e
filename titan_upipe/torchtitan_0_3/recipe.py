"""Our TOML recipes on TorchTitan 0.3, which reads no TOML: a recipe and its ``--section.key value``
flags become a 0.3 ``Trainer.Config`` and the plugin's sections.

The file is read by ``spec.recipe_file`` (the same reader and messages as on 0.2,
``[context_parallel]`` included). Every key of a recipe is one of:

=============================== ====================================================================
kind                            keys
=============================== ====================================================================
a ``Trainer.Config`` field      ``STOCK_KEYS`` (0.2 name -> 0.3 path: ``training.dataset`` is
                                ``dataloader.dataset``, ``job.dump_folder`` is ``dump_folder``, ...)
read here                       ``model.name/flavor/converters`` (0.3 fixes the model in Python:
                                ``flavors.model_spec``), ``optimizer.name/lr`` (an AdamW param group,
                                0.2's defaults), ``activation_checkpoint.mode/selective_ac_option``
                                (0.3's AC policy classes), ``[validation]`` (0.3's validator with
                                the plugin's sizes and loader: ``validation.LayoutValidator``)
a plugin section or field       ``spec.sections`` (``[upipe]``, ``[tsp]``, ``[transforms]``,
                                ``[local_data]``; the plugin fields of ``[activation_checkpoint]``,
                                ``[optimizer]``, ``[training]``, ``[metrics]``): validated by the
                                same classes, with the same messages
0.2's registration              ``job.custom_config_module``, ``experimental.custom_import``,
                                ``job.description``: nothing to register on 0.3 (``REGISTRATION_KEYS``)
=============================== ====================================================================

Any other key is refused by name, with the closest one this reader knows: no setting of a recipe is
dropped without a word (``docs/torchtitan_versions.md`` lists what 0.3 does not host yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import typing
from dataclasses import dataclass
from typing import Any

from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.trainer import Trainer

from titan_upipe.data.synthetic import VALIDATION_SEED
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec import sections
from titan_upipe.spec.recipe_file import (
    SECTION_ALIASES,
    describe_values,
    internal_sections,
    load_toml,
    value_problem,
)
from titan_upipe.torchtitan_0_3.data import GlobalBatchDataLoader
from titan_upipe.torchtitan_0_3.flavors import model_spec
from titan_upipe.torchtitan_0_3.validation import LayoutValidator

CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")

STOCK_KEYS = {
    "job.dump_folder": "dump_folder", "model.hf_assets_path": "hf_assets_path",
    "metrics.log_freq": "metrics.log_freq", "metrics.enable_tensorboard": "metrics.enable_tensorboard",
    "metrics.save_tb_folder": "metrics.save_tb_folder",
    "optimizer.implementation": "optimizer.implementation", "lr_scheduler.warmup_steps": "lr_scheduler.warmup_steps",
    "training.local_batch_size": "training.local_batch_size", "training.seq_len": "training.seq_len",
    "training.steps": "training.steps", "training.max_norm": "training.max_norm",
    "training.mixed_precision_param": "training.mixed_precision_param",
    "training.mixed_precision_reduce": "training.mixed_precision_reduce", "training.dataset": "dataloader.dataset",
    "parallelism.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "parallelism.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "parallelism.context_parallel_degree": "parallelism.context_parallel_degree",
    "checkpoint.enable": "checkpoint.enable", "checkpoint.folder": "checkpoint.folder",
    "checkpoint.interval": "checkpoint.interval", "checkpoint.async_mode": "checkpoint.async_mode",
    "checkpoint.keep_latest_k": "checkpoint.keep_latest_k",
    "checkpoint.last_save_model_only": "checkpoint.last_save_model_only",
    "checkpoint.initial_load_in_hf": "checkpoint.initial_load_in_hf",
    "checkpoint.initial_load_path": "checkpoint.initial_load_path", "checkpoint.load_only": "checkpoint.load_only",
    "checkpoint.create_seed_checkpoint": "checkpoint.create_seed_checkpoint",
    "checkpoint.load_step": "checkpoint.load_step", "training.global_batch_size": "training.global_batch_size",
    "comm.init_timeout_seconds": "comm.init_timeout_seconds", "comm.train_timeout_seconds": "comm.train_timeout_seconds",
    "debug.seed": "debug.seed",
}
"""A recipe's key (TorchTitan 0.2's name) -> the ``Trainer.Config`` attribute path it sets on 0.3."""

VALIDATION_TYPES = {"validation.enable": bool, "validation.freq": int, "validation.steps": int,
                    "validation.dataset": str, "validation.dataset_path": str, "validation.seq_len": int,
                    "validation.local_batch_size": int}
VALIDATION_DEFAULTS = {"validation.enable": False, "validation.freq": 10, "validation.steps": -1,
                       "validation.dataset": "c4_validation", "validation.dataset_path": None,
                       "validation.seq_len": 2048, "validation.local_batch_size": 8}
"""``[validation]`` (0.2's section, its defaults): 0.3's ``validator`` with the plugin's sizes and loader."""
READ_HERE = ("model.name", "model.flavor", "model.converters", "optimizer.name", "optimizer.lr",
             "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option", *VALIDATION_TYPES)
"""Keys whose 0.3 form is not one field: the model, the AdamW param group, the AC policy class."""

REGISTRATION_KEYS = {
    "job.custom_config_module": "0.2 merges the plugin's sections from this module; on 0.3 this reader reads them",
    "experimental.custom_import": "0.2 registers the plugin by importing this module; 0.3 imports nothing by name "
                                  "(the plugin's entry points run it)",
    "job.description": "a note for the reader of the file",
}
"""Keys of 0.2's that have nothing to set on 0.3, and why (read, checked to be strings, not refused)."""

PLUGIN_SECTIONS = {"upipe": sections.UPipe, "tsp": sections.TSP, "transforms": sections.Transforms,
                   "local_data": sections.LocalData}
PLUGIN_FIELDS = {"activation_checkpoint": sections.ActivationCheckpointOffload,
                 "optimizer": sections.OptimizerHostState, "training": sections.TrainingHealth,
                 "metrics": sections.MetricsConsole}
"""The plugin's sections, and its fields in stock sections (``spec.sections``)."""

AC_MODES = ("none", "full", "selective")
DEFAULTS = {"model.converters": [], "optimizer.name": "AdamW", "optimizer.lr": 8e-4,
            "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"}
"""The keys read here when a recipe leaves them out: 0.2's optimizer defaults, and 0.3's own AC
default (per-op selective; 0.2's was every second block, which 0.3 has not)."""

READ_HERE_TYPES = {"model.name": str, "model.flavor": str, "model.converters": list[str], "optimizer.name": str,
                   "optimizer.lr": float, "activation_checkpoint.mode": str,
                   "activation_checkpoint.selective_ac_option": str, **VALIDATION_TYPES}
NONE_DEFAULT_TYPES = {"debug.seed": int, "checkpoint.initial_load_path": str}
"""Stock keys whose 0.3 default is None, and the type a recipe gives them (0.2's annotation)."""


@dataclass
class Recipe:
    """A recipe on TorchTitan 0.3: its ``Trainer.Config`` and what 0.3 has no field for."""

    path: str
    trainer: Any
    """``Trainer.Config`` with the recipe's stock keys, the model's ``ModelSpec`` and AdamW set."""
    model_name: str
    flavor: str
    converters: tuple[str, ...]
    ac_mode: str
    selective_ac_option: str
    plugin: dict[str, Any]
    """Section name -> the validated ``spec.sections`` object (``activation_checkpoint`` etc.: its
    plugin fields)."""


def known_keys() -> list[str]:
    """Every ``section.key`` a recipe may hold on TorchTitan 0.3."""
    plugin = [f"{name}.{f.name}" for table in (PLUGIN_SECTIONS, PLUGIN_FIELDS) for name, cls in table.items()
              for f in dataclasses.fields(cls)]
    return sorted({*STOCK_KEYS, *READ_HERE, *REGISTRATION_KEYS, *plugin})


def key_annotation(key: str) -> object:
    """The type a recipe's ``key`` takes (as TorchTitan 0.2's schema annotates it): a stock key's 0.3
    default's type, a plugin field's annotation (``spec.sections``), the keys read here their own."""
    if key in READ_HERE_TYPES:
        return READ_HERE_TYPES[key]
    if key in REGISTRATION_KEYS:
        return str
    if key in STOCK_KEYS:
        default = _get(_default_trainer(), STOCK_KEYS[key])
        if default is None:
            return NONE_DEFAULT_TYPES[key]
        return list[str] if isinstance(default, list) else type(default)
    section, _, name = key.partition(".")
    cls = PLUGIN_SECTIONS.get(section) or PLUGIN_FIELDS[section]
    return next(f.type for f in dataclasses.fields(cls) if f.name == name)


@functools.cache
def _default_trainer():
    """One default ``Trainer.Config``, built on first use (its defaults are the stock keys' types)."""
    return Trainer.Config()


def _flag_key(flag: str) -> tuple[str, bool]:
    """``(section.key, negated)`` of ``--section.key`` or a true/false field's ``--section.no-key``
    (dashes read as underscores, ``[context_parallel]`` as ``upipe``), as TorchTitan 0.2's parser reads flags."""
    section, _, leaf = flag[2:].replace("-", "_").partition(".")
    section = SECTION_ALIASES.get(section, section)
    if leaf.startswith("no_") and f"{section}.{leaf[3:]}" in known_keys() and \
            key_annotation(f"{section}.{leaf[3:]}") is bool:
        return f"{section}.{leaf[3:]}", True
    return f"{section}.{leaf}", False


def _flag_value(flag: str, key: str, negated: bool, words: list[str]) -> object:
    """A flag's value, as 0.2's parser (tyro) takes it: a true/false field takes no value (``--key``
    true, ``--no-key`` false), a list the words up to the next flag, anything else one word."""
    annotation = key_annotation(key)
    section, _, name = key.partition(".")
    if annotation is bool:
        if words:
            raise ConfigError(f"{flag} is a true/false flag and takes no value ({words[0]!r}): pass --{section}.{name} "
                              f"alone for true, --{section}.no-{name} for false")
        return not negated
    if typing.get_origin(annotation) is list:
        return list(words)
    if len(words) != 1:
        raise ConfigError(f"{flag} takes one value, got {len(words)}: {' '.join(words) or 'none'}")
    kind = annotation if annotation in (int, float) else str
    try:
        return kind(words[0])
    except ValueError:
        raise ConfigError(f"invalid {flag} {words[0]!r}: valid values are {describe_values(annotation)}") from None


def _flags(argv: list[str]) -> tuple[str, dict[str, object]]:
    """(the config file, ``{section.key: value}``) of ``argv`` (``_flag_value``); an unknown flag is
    refused with the closest known key."""
    path, values, i = None, {}, 0
    while i < len(argv):
        flag, has_value, value = argv[i].partition("=")
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument {argv[i]!r}: give --job.config_file X.toml and --section.key value "
                              "flags")
        words = [value] if has_value else []
        while not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            words.append(argv[i + 1])
            i += 1
        i += 1
        if flag in CONFIG_FILE_FLAGS:
            path = words[0] if words else None
            continue
        key, negated = _flag_key(flag)
        _require_known(key, "the flags")
        values[key] = _flag_value(flag, key, negated, words)
    if not path:
        raise ConfigError("no recipe: give --job.config_file X.toml (e.g. configs/llama3_8b/upipe_1m.toml)")
    return path, values


def _require_known(key: str, where: str) -> None:
    known = known_keys()
    if key not in known:
        raise ConfigError(with_suggestion(f"{key} (in {where}) is not read on TorchTitan 0.3 yet: valid keys are "
                                          "listed in docs/torchtitan_versions.md; drop it or run on TorchTitan 0.2.2",
                                          key, known))


def _settings(argv: list[str]) -> tuple[str, dict[str, object]]:
    """(the file, ``{section.key: value}``): the file's values, each of its field's type, then the flags
    over them; an unknown key is refused with the closest known one."""
    path, flags = _flags(argv)
    return path, {**_table_values(path, load_toml(path)), **flags}


def _table_values(path: str, tables: dict) -> dict[str, object]:
    """``{section.key: value}`` of a recipe's sections, each checked against its field's type."""
    values = {f"{section}.{key}": value for section, table in internal_sections(tables).items()
              for key, value in table.items()}
    for key, value in values.items():
        _require_known(key, path)
        if problem := value_problem(key, value, key_annotation(key)):
            raise ConfigError(f"{path}: {problem}")
    return values


def _get(config: object, path: str) -> object:
    for name in path.split("."):
        config = getattr(config, name)
    return config


def _set(config: object, path: str, value: object) -> None:
    *parents, name = path.split(".")
    setattr(_get(config, ".".join(parents)) if parents else config, name, value)


def _ac_config(mode: str, option: str):
    """0.3's AC policy for 0.2's ``mode`` / ``selective_ac_option``: full, per-op selective or none."""
    if mode not in AC_MODES:
        raise ConfigError(with_suggestion(f"invalid activation_checkpoint.mode = {mode!r}: valid values are "
                                          f"{', '.join(AC_MODES)}", mode, AC_MODES))
    if mode == "selective" and option != "op":
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {option!r} (per-block selective AC: one block "
                          f"in {option} checkpointed) is not in TorchTitan 0.3, whose selective AC is per op: valid "
                          "values on 0.3 are \"op\", or set activation_checkpoint.mode = \"full\" (every recipe of "
                          "configs/ does)")
    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[mode]


def _validator_config(values: dict[str, object]):
    """``[validation]`` as the plugin's 0.3 validator: its loader draws held-out samples (``VALIDATION_SEED``)
    or reads ``dataset_path``; a run of every validation sample (``steps = -1``) never ends on the plugin's
    datasets, which repeat, and is refused."""
    if values["validation.enable"] and values["validation.steps"] == -1:
        raise ConfigError("validation.steps = -1 (every sample) never ends on the plugin's datasets, which repeat: "
                          "valid values are a positive number of steps")
    path = values["validation.dataset_path"]
    loader = GlobalBatchDataLoader.Config(dataset=values["validation.dataset"], seed=VALIDATION_SEED,
                                          paths=[path] if path else [])
    return LayoutValidator.Config(enable=values["validation.enable"], freq=values["validation.freq"],
                                  steps=values["validation.steps"], validation_seq_len=values["validation.seq_len"],
                                  validation_local_batch_size=values["validation.local_batch_size"],
                                  dataloader=loader)


@contextlib.contextmanager
def _warnings_muted(quiet: bool):
    """TorchTitan 0.3 logs a warning for its own defaults (``CheckpointManager.Config``: "initial_load_model_only
    ... has no effect") each time a ``Trainer.Config`` is built: held back for the tools, as on 0.2."""
    root = logging.getLogger()
    level = root.level
    if quiet:
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def load_recipe(argv: list[str], quiet: bool = True) -> Recipe:
    """The recipe of ``argv`` (``--job.config_file X.toml [--section.key value ...]``) on TorchTitan 0.3.
    Raises ConfigError: the file, an unknown key, a bad value, a model or flavor 0.3 has not.
    ``quiet``: without TorchTitan's warnings about its own defaults."""
    with _warnings_muted(quiet):
        return _load_recipe(argv)


def recipe_of_tables(path: str, tables: dict) -> Recipe:
    """The recipe of ``tables`` (a TOML file's sections, as ``resources/recipes.json`` holds them; ``path``
    names it in messages), read as :func:`load_recipe` reads the file."""
    with _warnings_muted(True):
        return _recipe_of(path, _table_values(path, tables))


def _load_recipe(argv: list[str]) -> Recipe:
    return _recipe_of(*_settings(argv))


def _recipe_of(path: str, values: dict[str, object]) -> Recipe:
    read = {key: values.get(key, DEFAULTS.get(key)) for key in READ_HERE}
    if read["model.name"] is None or read["model.flavor"] is None:
        raise ConfigError(f"{path} names no model: set [model] name and flavor (e.g. upipe_llama3 and 8B)")
    if read["optimizer.name"] != "AdamW":
        raise ConfigError(f"optimizer.name = {read['optimizer.name']!r} is not run by titan_upipe on TorchTitan 0.3: "
                          "valid values are \"AdamW\"")
    trainer = Trainer.Config(model_spec=model_spec(read["model.name"], read["model.flavor"]),
                             optimizer=default_adamw(lr=float(read["optimizer.lr"])))
    for key, attribute in STOCK_KEYS.items():
        if key in values:
            _set(trainer, attribute, values[key])
    trainer.validator = _validator_config({key: values.get(key, VALIDATION_DEFAULTS[key]) for key in VALIDATION_TYPES})
    trainer.activation_checkpoint = _ac_config(read["activation_checkpoint.mode"],
                                               str(read["activation_checkpoint.selective_ac_option"]).strip())
    plugin = {}
    for name, cls in {**PLUGIN_SECTIONS, **PLUGIN_FIELDS}.items():
        given = {f.name: values[f"{name}.{f.name}"] for f in dataclasses.fields(cls) if f"{name}.{f.name}" in values}
        plugin[name] = cls(**given)  # each section checks its own values (spec.sections)
    for key in REGISTRATION_KEYS:
        if key in values and not isinstance(values[key], str):
            raise ConfigError(f"invalid {key} = {values[key]!r}: valid values are strings")
    return Recipe(path, trainer, read["model.name"], read["model.flavor"], tuple(read["model.converters"]),
                  read["activation_checkpoint.mode"], str(read["activation_checkpoint.selective_ac_option"]).strip(),
                  plugin)
