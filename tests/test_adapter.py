"""The adapter is chosen by the installed TorchTitan's version (``titan_upipe.adapter``), nowhere else."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from titan_upipe import adapter
from titan_upipe.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "titan_upipe"


@pytest.mark.parametrize("version,package", [
    ("0.2.2", "titan_upipe.torchtitan_0_2"), ("0.2.0", "titan_upipe.torchtitan_0_2"),
    ("0.3.0", "titan_upipe.torchtitan_0_3"), ("0.3.1.dev20261201", "titan_upipe.torchtitan_0_3"),
])
def test_each_release_has_its_adapter(version, package):
    assert adapter.adapter_package(version) == package


def test_this_environment_runs_the_0_2_adapter():
    assert adapter.installed_torchtitan_version() == "0.2.2"
    assert adapter.adapter_package() == "titan_upipe.torchtitan_0_2"


@pytest.mark.parametrize("version", ["0.1.0", "0.4.0", "1.0.0"])
def test_a_release_without_an_adapter_is_refused_with_the_supported_ones(version):
    with pytest.raises(ConfigError, match=rf"torchtitan {version} is not supported by titan_upipe: valid versions are "
                                          r"0\.2\.x, 0\.3\.x; pip install torchtitan==0\.2\.2"):
        adapter.adapter_package(version)


def test_no_torchtitan_installed_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(adapter, "installed_torchtitan_version", lambda: None)
    with pytest.raises(ConfigError, match=r"TorchTitan is not installed: pip install torchtitan==0\.2\.2"):
        adapter.adapter_package()


def test_choosing_imports_no_torchtitan():
    code = "import sys, titan_upipe.adapter as a; a.adapter_package(); print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('torchtitan', 'torch')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def torchtitan_version_readers(root: Path) -> set[str]:
    """Modules under ``root`` that read TorchTitan's version: ``version("torchtitan")`` (importlib.metadata)
    or ``torchtitan.__version__``."""
    readers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            reads_metadata = (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
                              == "version" and node.args and getattr(node.args[0], "value", None) == "torchtitan")
            reads_attribute = (isinstance(node, ast.Attribute) and node.attr == "__version__"
                               and getattr(node.value, "id", None) == "torchtitan")
            if reads_metadata or reads_attribute:
                readers.add(path.relative_to(root).as_posix())
    return readers


def test_no_module_outside_the_chooser_reads_the_torchtitan_version(tmp_path):
    assert torchtitan_version_readers(PACKAGE) == {"adapter.py"}
    (tmp_path / "trainer.py").write_text("import torchtitan\nOLD = torchtitan.__version__.startswith('0.2')\n")
    (tmp_path / "checks.py").write_text("from importlib import metadata\nV = metadata.version('torchtitan')\n")
    assert torchtitan_version_readers(tmp_path) == {"trainer.py", "checks.py"}


DOOR = ("spec_of_recipe", "flavor_model_dims")
"""What the version-neutral tools call on ``adapter_module("load_job")`` (``tools/plan_cli.py``)."""


def door_functions(path: Path) -> set[str]:
    """Names ``path`` defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_every_adapter_opens_the_same_door():
    for folder in ("torchtitan_0_2", "torchtitan_0_3"):
        assert set(DOOR) <= door_functions(PACKAGE / folder / "load_job.py"), folder
    from titan_upipe.torchtitan_0_2 import load_job

    assert adapter.adapter_module("load_job") is load_job


def test_the_planner_reaches_the_adapter_through_the_chooser_alone():
    """``plan`` names no adapter: the installed TorchTitan's is chosen at run time."""
    text = (PACKAGE / "tools" / "plan_cli.py").read_text()
    assert "torchtitan_0_2" not in text and "torchtitan_0_3" not in text and "adapter_module(" in text


def test_every_command_the_0_2_adapter_runs_is_a_module_and_runs_here():
    from titan_upipe.torchtitan_0_2 import COMMANDS

    for command, entry in COMMANDS.items():
        relative = command.removeprefix("titan_upipe.").replace(".", "/")
        assert (PACKAGE / f"{relative}.py").is_file() or (PACKAGE / relative / "__main__.py").is_file(), command
        assert adapter.require_command(command) == entry  # hosted: where it runs
        module, function = entry.split(":")
        assert callable(getattr(importlib.import_module(module), function)), entry


def test_a_command_the_adapter_does_not_run_is_one_line(monkeypatch, capsys):
    import titan_upipe.torchtitan_0_2 as adapter_0_2

    monkeypatch.setattr(adapter_0_2, "COMMANDS", {"titan_upipe.plan": "titan_upipe.tools.plan_cli:main"})
    with pytest.raises(SystemExit) as stopped:
        adapter.require_command("titan_upipe.validate")
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("titan_upipe.validate: error: titan_upipe.validate does not run on "
                                                      "torchtitan 0.2.2 yet: its adapter runs titan_upipe.plan; run "
                                                      "titan_upipe.validate on torchtitan 0.2.2")
