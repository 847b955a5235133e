"""The TorchTitan 0.3 pass of ``make test``: these tests run only where TorchTitan 0.3 is the installed
one (``make test`` puts the ``.tt03`` environment first on ``PYTHONPATH``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from titan_upipe.adapter import installed_torchtitan_version


def pytest_configure(config):
    version = installed_torchtitan_version()
    if version is None or not version.startswith("0.3."):
        pytest.exit(f"tests_tt03 runs on TorchTitan 0.3, found {version}: run `make test` (it builds .tt03 with "
                    "`make install`), or PYTHONPATH=.tt03 .venv/bin/python -m pytest tests_tt03", returncode=2)


# The main suite's launch helpers (forked ranks, TensorBoard readers) serve this pass too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


@pytest.fixture(scope="session")
def on_0_2(tmp_path_factory) -> dict:
    """TorchTitan 0.2.2's side of the comparisons, from one process (``on_0_2.run_on_0_2``)."""
    from on_0_2 import run_on_0_2
    from test_recipes import PLAN_RECIPES, RECIPES

    return run_on_0_2(RECIPES, PLAN_RECIPES, tmp_path_factory.mktemp("on_0_2"))
