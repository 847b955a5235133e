"""Parse a job's TOML and ``--section.key value`` flags into TorchTitan's ``JobConfig``; every
mistake is one :class:`~titan_upipe.errors.ConfigError` line.

TorchTitan 0.2.2's ``ConfigManager`` logs a traceback for a missing or malformed file, rejects an
unknown TOML key with ``ValueError("Invalid field names in <class> data: {...}")`` (the section's
class, no suggestion), does not type-check TOML values (``steps = "30"`` passes and fails much
later), and leaves bad flags to tyro, which draws a multi-line box on stderr and exits with
status 2: under torchrun, once per rank. :func:`parse_job_config` checks the file, the TOML keys
and value types and the flag names against the merged schema first, each with the closest valid
name, then runs ``ConfigManager`` with its console output held back, so what tyro still refuses
(a flag's value) also becomes one ConfigError.

``[context_parallel]`` and ``--context_parallel.X`` are read as the JobConfig's ``upipe`` section
(``spec.recipe_file.SECTION_ALIASES``): the file's keys and the flags are checked under the name written,
then TorchTitan and tyro get them under ``upipe``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import itertools
import logging
import os
import re
import sys

import tyro
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TorchTitanJobConfig
from torchtitan.config.manager import custom_registry

from titan_upipe.errors import ConfigError, closest
from titan_upipe.spec.recipe_file import SECTION_ALIASES, internal_sections, load_toml, value_problem

__all__ = ["CONFIG_FILE_FLAGS", "CONFIG_MODULE_FLAGS", "check_bool_flags", "check_flags", "check_one_value_per_flag",
           "check_toml",
           "config_schema", "console_error_line", "flag_value", "internal_flags", "load_toml", "parse_job_config",
           "parse_quietly", "with_section_aliases"]

Schema = dict[str, "Schema | object"]
"""Section name -> nested schema, key name -> its annotated type."""

CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
CONFIG_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")


# ---------------------------------------------------------------------------- the file (spec/recipe_file.py)


def flag_value(args: list[str], flags: tuple[str, ...]) -> str | None:
    """The value of the first of ``flags`` in ``args`` (``--flag v`` or ``--flag=v``)."""
    for i, arg in enumerate(args):
        key, has_value, value = arg.partition("=")
        if key in flags:
            return value if has_value else (args[i + 1] if i + 1 < len(args) else None)
    return None


# ---------------------------------------------------------------------------- the schema


def _dataclass_schema(cls: type) -> Schema:
    return {f.name: _dataclass_schema(f.type) if dataclasses.is_dataclass(f.type) else f.type
            for f in dataclasses.fields(cls)}


def _merge(base: Schema, extra: Schema) -> Schema:
    """``extra`` merged into ``base`` as TorchTitan merges config classes: sections present in both
    merge key by key, anything else from ``extra`` wins."""
    merged = dict(base)
    for name, node in extra.items():
        both_sections = isinstance(merged.get(name), dict) and isinstance(node, dict)
        merged[name] = _merge(merged[name], node) if both_sections else node
    return merged


def config_schema(custom_module: str | None) -> Schema:
    """Every section and key TorchTitan's JobConfig, merged with ``custom_module``'s, accepts."""
    schema = _dataclass_schema(TorchTitanJobConfig)
    if not custom_module:
        return schema
    try:
        custom = importlib.import_module(custom_module).JobConfig
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"job.custom_config_module = {custom_module!r} cannot be used ({err}): name a module "
                          "with a JobConfig dataclass, e.g. \"titan_upipe.config\"") from None
    return _merge(schema, _dataclass_schema(custom))


def with_section_aliases(schema: Schema) -> Schema:
    """``schema`` with each aliased section under its documented name too (``context_parallel``, the
    keys of ``upipe``), so that a file's keys and flags are checked, and suggested, as written."""
    aliases = {name: schema[internal] for name, internal in SECTION_ALIASES.items()
               if isinstance(schema.get(internal), dict) and name not in schema}
    return {**schema, **aliases}


def internal_flags(args: list[str]) -> list[str]:
    """``args`` with each flag of an aliased section under the JobConfig's name (tyro's):
    ``--context_parallel.ulysses_degree 2`` (or ``--context-parallel.…``) as ``--upipe.ulysses_degree 2``."""
    renamed = []
    for arg in args:
        for name, internal in SECTION_ALIASES.items():
            for spelling in {name, name.replace("_", "-")}:
                if arg.startswith(f"--{spelling}."):
                    arg = f"--{internal}.{arg[len(spelling) + 3:]}"
        renamed.append(arg)
    return renamed


def _leaf_names(schema: Schema, prefix: str = "") -> list[str]:
    """Every key as ``section.key`` (nested sections dotted further)."""
    names = []
    for name, node in schema.items():
        names += _leaf_names(node, f"{prefix}{name}.") if isinstance(node, dict) else [f"{prefix}{name}"]
    return names


# ---------------------------------------------------------------------------- TOML values


def _unknown_toml_key(name: str, schema: Schema, prefix: str) -> str:
    """``unknown key training.stesp: did you mean "training.steps"?``, from the keys of that section
    only (a top-level name is a section: ``unknown section [trainin]``)."""
    match = closest(name, schema)
    if not prefix:
        return f"unknown section [{name}]: " + (f"did you mean [{match}]?" if match else
                                                f"valid sections are {', '.join(schema)}")
    return f"unknown key {prefix}{name}: " + (f'did you mean "{prefix}{match}"?' if match else
                                             f"valid keys of [{prefix[:-1]}] are {', '.join(schema)}")


def check_toml(values: dict, schema: Schema, path: str, prefix: str = "") -> None:
    """Every key of the TOML ``values`` is in ``schema`` (else the closest key of that section) and
    every value has its field's type; raises ConfigError naming ``path``."""
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in schema:
            raise ConfigError(f"{path}: {_unknown_toml_key(name, schema, prefix)}")
        node = schema[name]
        if isinstance(node, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {key} is a section: write its keys under [{key}]")
            check_toml(value, node, path, f"{key}.")
        elif problem := value_problem(key, value, node):
            raise ConfigError(f"{path}: {problem}")


# ---------------------------------------------------------------------------- flags


def _flag_names(args: list[str]) -> list[tuple[str, str]]:
    """(flag as written, dotted key) for every ``--section.key`` in ``args``; dashes read as
    underscores, as tyro reads them."""
    names = []
    for arg in args:
        flag = arg.partition("=")[0]
        if flag.startswith("--") and "." in flag:
            names.append((flag, flag[2:].replace("-", "_")))
    return names


def _flag_resolves(key: str, schema: Schema) -> bool:
    """Whether ``section.key`` names a field (``no_`` before a bool key negates it, as tyro allows)."""
    *sections, leaf = key.split(".")
    node: object = schema
    for section in sections:
        node = node.get(section) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return False
    return leaf in node or (leaf.startswith("no_") and node.get(leaf[3:]) is bool)


def check_flags(args: list[str], schema: Schema) -> None:
    """Every ``--section.key`` flag names a field (otherwise a ConfigError with the closest one),
    and a true/false field's flag comes without a value (:func:`check_bool_flags`)."""
    for flag, key in _flag_names(args):
        if not _flag_resolves(key, schema):
            match = closest(key, _leaf_names(schema))
            fix = f"did you mean --{match}?" if match else "--help lists the valid ones"
            raise ConfigError(f"unknown option {flag}: {fix}")
    check_bool_flags(args, schema)
    check_one_value_per_flag(args)


def _field_type(key: str, schema: Schema) -> object:
    node: object = schema
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_bool_flags(args: list[str], schema: Schema) -> None:
    """A true/false field is a flag in TorchTitan 0.2.2's parser (tyro): ``--section.key`` sets it
    true, ``--section.no-key`` (or ``no_key``) false, and it takes no value; given one (``--key
    maybe``, ``--key false``, ``--key=true``), tyro says only "Unrecognized options: maybe"."""
    for i, arg in enumerate(args):
        flag, has_value, value = arg.partition("=")
        if not (flag.startswith("--") and "." in flag):
            continue
        section, _, leaf = flag[2:].replace("-", "_").rpartition(".")
        negated = leaf.startswith("no_") and _field_type(f"{section}.{leaf[3:]}", schema) is bool
        if not negated and _field_type(f"{section}.{leaf}", schema) is not bool:
            continue
        if not has_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, has_value = args[i + 1], True
        if has_value:
            key = leaf[3:] if negated else leaf
            raise ConfigError(f"{flag} is a true/false flag and takes no value ({value!r}): pass --{section}.{key} "
                              f"alone for true, --{section}.no-{key} for false")


def _quoted_pattern(values: list[str]) -> str:
    """The pattern the shell probably expanded into ``values``: their folder, ``*`` and their common
    extension (``'/data/*.jsonl'``)."""
    folders = {os.path.dirname(value) for value in values}
    extensions = {os.path.splitext(value)[1] for value in values}
    folder = folders.pop() if len(folders) == 1 else os.path.commonpath(values) if values else ""
    extension = extensions.pop() if len(extensions) == 1 else ""
    return f"'{os.path.join(folder, '*' + extension)}'"


def check_one_value_per_flag(args: list[str]) -> None:
    """A flag takes one value (a list is one comma-separated value). Two or more words after a flag
    are almost always a glob the shell expanded (``--local_data.paths /data/*.jsonl``, unquoted),
    for which tyro says only "Unrecognized options: /data/b.jsonl"."""
    for i, arg in enumerate(args):
        if not (arg.startswith("--") and "." in arg and "=" not in arg):
            continue
        values = list(itertools.takewhile(lambda word: not word.startswith("--"), args[i + 1:]))
        if len(values) > 1:
            shown = " ".join(values[:3]) + (f" … ({len(values)} words)" if len(values) > 3 else "")
            raise ConfigError(f"{arg} takes one value but got {shown}: an unquoted glob that the shell expanded? "
                              f"quote it so that it reaches the job as written, e.g. {arg} {_quoted_pattern(values)} "
                              "(a list is one comma-separated value)")


# ---------------------------------------------------------------------------- ConfigManager

_RULE = re.compile(r"^[\s\-─━│┃|╭╮╰╯+]*$")
"""A row of tyro's error box with no text: a border or a rule, in UTF-8 or ASCII drawing."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SECTION_PREFIX = re.compile(r"^Error parsing (?!--)\S+: ")
"""tyro's prefix before a section's own error (``Error parsing upipe: invalid upipe.x = ...``)."""


def console_error_line(text: str) -> str:
    """The message of tyro's error box as one line: the first paragraph after its title, without
    the help text below. tyro draws the box in UTF-8 or ASCII, depending on stdout's encoding."""
    rows = [row.strip().strip("│|").strip() for row in _ANSI.sub("", text).splitlines()]
    rows = [row for row in rows if row][1:]  # the title ("Value error") goes
    message: list[str] = []
    for row in rows:
        if _RULE.match(row):
            if message:
                break
            continue
        message.append(row)
    return _SECTION_PREFIX.sub("", " ".join(message)) or text.strip()


HELP_FLAGS = frozenset({"--help", "-h"})


class HelpOnDemandConfigManager(ConfigManager):
    """TorchTitan's ``ConfigManager`` whose parse reads the fields' help text only for ``--help``.

    tyro builds each field's help from the config classes' source (``inspect.getsource`` and an AST
    walk per class, its caches cleared after every call): ~0.4 s of a ~0.6 s parse, for text that
    only ``--help`` shows (811 parses made 470 s of ``make test``). The same steps as
    ``ConfigManager.parse_args`` (the TOML, the custom config module, the TOML as defaults, tyro over
    the flags, TorchTitan's own checks), tyro told to skip the help text (``HelptextFromCommentsOff``)."""

    def _maybe_load_toml(self, args: list[str]) -> dict | None:
        """The TOML file's values, each section under its JobConfig name (``[context_parallel]`` as
        ``upipe``); TorchTitan's own reader would refuse ``context_parallel`` as an invalid field."""
        path = flag_value(args, CONFIG_FILE_FLAGS)
        return internal_sections(load_toml(path)) if path else None

    def parse_args(self, args: list[str]):
        if HELP_FLAGS.intersection(args):
            return super().parse_args(args)
        toml_values = self._maybe_load_toml(args)
        config_cls = self._maybe_add_custom_config(args, toml_values)
        defaults = self._dict_to_dataclass(config_cls, toml_values) if toml_values else config_cls()
        self.config = tyro.cli(config_cls, args=args, default=defaults, registry=custom_registry,
                               config=(tyro.conf.HelptextFromCommentsOff,))
        self._validate_config()
        return self.config


def parse_quietly(args: list[str]):
    """``ConfigManager().parse_args(args)`` (``HelpOnDemandConfigManager``) with tyro's console output
    held back: an error exit becomes a ConfigError of its message; ``--help`` and warnings are passed
    on unchanged."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            job_config = HelpOnDemandConfigManager().parse_args(args)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise ConfigError(console_error_line(captured.getvalue())) from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())
    return job_config


def parse_job_config(args: list[str]):
    """The JobConfig of ``args`` (``--job.config_file X.toml`` and overrides); raises ConfigError."""
    path = flag_value(args, CONFIG_FILE_FLAGS)
    values = load_toml(path) if path else {}
    job = values.get("job")
    module = flag_value(args, CONFIG_MODULE_FLAGS) or (job.get("custom_config_module") if isinstance(job, dict) else None)
    schema = with_section_aliases(config_schema(module))
    check_toml(values, schema, path or "")
    check_flags(args, schema)
    return parse_quietly(internal_flags(args))


CONFIG_MODULE = "titan_upipe.config"
"""``job.custom_config_module``: the plugin's config sections (the root's re-export of
``torchtitan_0_2.config``, the name users' TOML files carry)."""


def with_plugin_config(args: list[str]) -> list[str]:
    """``args`` plus ``--job.custom_config_module titan_upipe.config`` unless already chosen.

    A TOML that names another module keeps it (that module must then extend ours).
    """
    if any(a.split("=", 1)[0] in CONFIG_MODULE_FLAGS for a in args):
        return args
    toml_path = flag_value(args, CONFIG_FILE_FLAGS)
    job = load_toml(toml_path).get("job") if toml_path else None
    if isinstance(job, dict) and job.get("custom_config_module"):
        return args
    return [*args, f"--job.custom_config_module={CONFIG_MODULE}"]


@contextlib.contextmanager
def torchtitan_warnings_muted():
    """TorchTitan's config manager logs its own guesses while parsing ("HF assets path ... does not
    exist!", for synthetic-data jobs too, which need no assets). The tools print their findings
    only, each once, so the root logger (TorchTitan's) passes errors alone meanwhile."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def parse_config(args: list[str], quiet: bool = False):
    """The JobConfig of ``args`` with the plugin's sections; every mistake raises ConfigError.
    ``quiet``: without TorchTitan's parse-time warnings (the tools; the trainer keeps them, its
    deprecation notices included)."""
    if not quiet:
        return parse_job_config(with_plugin_config(args))
    with torchtitan_warnings_muted():
        return parse_job_config(with_plugin_config(args))
