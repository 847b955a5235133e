"""Data the package reads at run time, installed with it (package data; ``README.md`` here says
what each file holds and where it comes from)."""

from importlib.resources import files
from pathlib import Path


def resource(name: str) -> Path:
    """The file ``name`` of this folder, wherever the package is installed."""
    return Path(str(files(__name__) / name))
