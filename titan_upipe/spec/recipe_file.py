"""A job's TOML file (a recipe), read as TorchTitan reads it, or refused in one line naming the file.

Every adapter reads recipes through this module: TorchTitan 0.2.2 also reads the file itself, and
0.3 reads no TOML at all (``torchtitan_0_3.recipe`` maps the values onto its ``Trainer.Config``).
TorchTitan 0.2.2 opens the file with ``tomllib`` and lets every failure through as a traceback
without the file's name: a byte that is not UTF-8 (``UnicodeDecodeError``), a binary file, an
unreadable one (``PermissionError``). A UTF-8 byte-order mark reads as "Invalid statement (line 1,
column 1)", and an empty file parses as no settings at all, so the job silently trains
TorchTitan's defaults. Each of these is a :class:`~titan_upipe.errors.ConfigError` here.

The context-parallel section is ``[context_parallel]`` in the docs and ``[upipe]`` inside: the
JobConfig field, the ``--upipe.X`` flags and the checks' messages keep the older name, which TOML
files may still use. :func:`internal_sections` maps the one to the other; a file with both is refused.
"""

from __future__ import annotations

import errno
import os
import tomllib
import types
import typing
from pathlib import Path

from titan_upipe.errors import ConfigError, with_suggestion

__all__ = ["SECTION_ALIASES", "accepts", "describe_values", "internal_sections", "load_toml", "toml_text", "value_problem"]

SECTION_ALIASES = {"context_parallel": "upipe"}
"""A TOML section's documented name -> the JobConfig section that holds it. ``[context_parallel]``
holds the settings of every context-parallel mode; its field keeps the plugin's name, ``upipe``,
as do the ``--upipe.X`` flags and the messages of the checks (``upipe.ulysses_degree``)."""

_BYTE_ORDER_MARKS = {
    b"\xef\xbb\xbf": "starts with a UTF-8 byte-order mark (BOM), which tomllib (TorchTitan's reader) refuses: save it "
                     "as UTF-8 without a BOM",
    b"\xff\xfe": "is UTF-16 text (it starts with a UTF-16 byte-order mark): save it as UTF-8",
    b"\xfe\xff": "is UTF-16 text (it starts with a UTF-16 byte-order mark): save it as UTF-8",
}
"""What a config file that starts with a byte-order mark is (``tomllib`` reads UTF-8 without one)."""


def _missing(path: str, file: Path) -> ConfigError:
    if file.is_dir():
        tomls = sorted(str(p) for p in file.glob("*.toml"))
        return ConfigError(f"config file {path} is a directory: name one TOML file in it"
                           + (f", one of {', '.join(tomls)}" if tomls else " (it has none)"))
    siblings = sorted(str(p) for p in file.parent.glob("*.toml")) if file.parent.is_dir() else []
    where = f"{file.parent}/ has no such file" if file.parent.is_dir() else f"{file.parent}/ does not exist"
    return ConfigError(with_suggestion(f"config file {path} not found ({where})", path, siblings))


def _read_bytes(path: str) -> bytes:
    file = Path(path)
    if not file.is_file():
        raise _missing(path, file)
    try:
        return file.read_bytes()
    except OSError as err:
        reason = "permission denied" if err.errno in (errno.EACCES, errno.EPERM) else os.strerror(err.errno or 0)
        raise ConfigError(f"config file {path} cannot be read ({reason}): make it readable by the user running "
                          "the job (chmod a+r)") from None


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def toml_text(path: str, data: bytes) -> str:
    """``data``, the bytes of the config file ``path``, as text; raises ConfigError for a file that is
    not UTF-8 TOML text (a byte-order mark, a NUL byte, a byte sequence that is not UTF-8)."""
    for mark, problem in _BYTE_ORDER_MARKS.items():
        if data.startswith(mark):
            raise ConfigError(f"config file {path} {problem}")
    if b"\x00" in data:
        line, column = _line_and_column(data, data.index(b"\x00"))
        raise ConfigError(f"config file {path} is a binary file, not TOML text (a NUL byte at line {line}, column "
                          f"{column}): name the job's .toml file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = _line_and_column(data, err.start)
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at line {line}, "
                          f"column {column}): save it as UTF-8") from None


def load_toml(path: str) -> dict:
    """The settings of the TOML file at ``path``; a file that is missing, unreadable, not UTF-8 TOML
    text, malformed or without any setting is a ConfigError naming the file and the fix."""
    text = toml_text(path, _read_bytes(path))
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    if not values:
        what = "is empty" if not text.strip() else "holds no settings (only comments)"
        raise ConfigError(f"config file {path} {what}: TorchTitan would train its defaults; name a config with "
                          "[model] and [training], e.g. configs/debug/llama3_upipe.toml")
    _check_one_name_per_section(path, values)
    return values


def _check_one_name_per_section(path: str, values: dict) -> None:
    """A section under its documented name and its internal one at once is refused: which of the two
    a key would come from is the reader's guess."""
    for name, internal in SECTION_ALIASES.items():
        if name in values and internal in values:
            raise ConfigError(f"config file {path} has both [{name}] and [{internal}], the same section under its "
                              f"two names ([{internal}] is the older one): move the keys of [{internal}] into "
                              f"[{name}] and delete [{internal}]")


def internal_sections(values: dict) -> dict:
    """The TOML ``values`` with each section under its JobConfig name (``[context_parallel]`` read as
    ``upipe``), in the file's order; ``values`` itself when no section is aliased."""
    if not SECTION_ALIASES.keys() & values.keys():
        return values
    return {SECTION_ALIASES.get(name, name): value for name, value in values.items()}


# ---------------------------------------------------------------------------- values


def accepts(value: object, annotation: object) -> bool:
    """Whether a TOML ``value`` fits the field's annotation; annotations this does not model accept."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(value, arm) for arm in args)
    if origin is typing.Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and (not args or all(accepts(item, args[0]) for item in value))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is type(None):
        return False  # TOML has no null
    return True


def describe_values(annotation: object) -> str:
    """The values an annotation accepts, in words (``integers``, ``bfloat16, float32``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_values(arm) for arm in args if arm is not type(None))
    if origin is typing.Literal:
        return ", ".join(str(arg) for arg in args)
    if origin is list:
        return f"lists of {describe_values(args[0])}" if args else "lists"
    names = {bool: "true, false", int: "integers", float: "numbers", str: "strings (in quotes)"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def value_problem(key: str, value: object, annotation: object) -> str | None:
    """``invalid key = value (type): valid values are ...`` for a value its field's annotation refuses
    (with the closest choice of a ``Literal``); None when it fits. Every adapter's recipe reader says it so."""
    if accepts(value, annotation):
        return None
    message = f"invalid {key} = {value!r} ({type(value).__name__}): valid values are {describe_values(annotation)}"
    if typing.get_origin(annotation) is typing.Literal:
        message = with_suggestion(message, value, typing.get_args(annotation))
    return message
