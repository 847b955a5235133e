"""The one error type of a setting that cannot run exactly (core: no torch, no TorchTitan)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A setting that cannot run exactly; the message names it and the valid choices."""


def closest(word: object, choices: Iterable[object]) -> str | None:
    """The choice closest to ``word`` (difflib's ratio), or None when none is close enough to be a
    likely typo of it."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1)
    return close[0] if close else None


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """``'did you mean "x"?'`` for the choice closest to ``word``, or ``''``."""
    match = closest(word, choices)
    return f'did you mean "{match}"?' if match else ""


def with_suggestion(message: str, word: object, choices: Iterable[object]) -> str:
    """``message`` followed by ``; did you mean "x"?`` when one of ``choices`` is close to ``word``."""
    hint = did_you_mean(word, choices)
    return f"{message}; {hint}" if hint else message
