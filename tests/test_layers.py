"""The package's shape (docs/architecture.md): three layers, imports pointing down, no cycle,
no import-time side effect, small modules and functions.

The import graph is read from the source (``ast``), function-level imports included, so an
import hidden inside a function cannot close a cycle unnoticed. Each rule is also run on a
sabotaged copy of the package, to show it can fail.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "titan_upipe"

LAYERS = {
    "core": ("errors", "resources", "spec", "plan", "parallel", "attention", "transforms", "tsp", "optim", "costs",
             "contracts"),
    "glue": ("torchtitan_0_2", "torchtitan_0_3", "torchtitan_common", "adapter", "data", "plugin", "config"),
    "tools": ("toolkit", "tools", "emulate", "train", "validate", "check", "gpu_suite"),
}
"""Folders (and the root's few modules) by layer: ``errors`` is the error type; ``plugin`` and
``config`` are TorchTitan's entry points (``custom_import``, ``custom_config_module``); ``train``,
``validate``, ``check`` and ``gpu_suite`` are ``-m`` shims over the glue and the tools."""
ROOT_MODULES = ("__init__", "errors", "adapter", "plugin", "config", "train", "validate", "check", "gpu_suite")
MAX_ROOT_MODULES = 12
ORDER = {"core": 0, "glue": 1, "tools": 2}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
PURE_FOLDERS = ("spec", "costs", "plan")
"""Folders of arithmetic alone: they import neither torch nor TorchTitan (the planner reads them)."""
ADAPTERS = ("torchtitan_0_2", "torchtitan_0_3")
"""One folder per TorchTitan version (``titan_upipe.adapter`` chooses by the installed one): the only
folders that import TorchTitan, and none imports another."""
COMMON_ADAPTER = "torchtitan_common"
"""Code that speaks an API every supported TorchTitan shares (its device globals): both adapters may
import it, it imports neither."""
TORCHTITAN_FOLDERS = (*ADAPTERS, COMMON_ADAPTER)
TORCHTITAN_OUTSIDE_ADAPTER: set[str] = set()
"""Modules outside the adapter allowed to import TorchTitan: none (issue 43 moved the last behind it).
A module on it that no longer imports TorchTitan is reported, so the set cannot go stale."""
LAYOUT_BUILDERS = {
    "titan_upipe.spec.cp_layout": "the search over candidate layouts (layout_problem: a degree to suggest)",
    "titan_upipe.plan.job": "the planner's layout of a PlanInput (it plans jobs that have no JobSpec: --model)",
    "titan_upipe.torchtitan_0_2.checks.parallelism": "cp_layout: the job checks' layout of a JobConfig, the one "
                                                     "the adapter's JobSpec carries (torchtitan_0_2.job_spec)",
    "titan_upipe.torchtitan_0_3.job_spec": "recipe_layout: the layout of a TorchTitan 0.3 recipe, built once for "
                                           "its JobSpec",
}
"""The only modules that construct a ``CPLayout``, and why: everything else reads one it was given."""
ENTRY_MODULE = "__main__"
COMMAND_SHIMS = ("titan_upipe.train", "titan_upipe.validate", "titan_upipe.check", "titan_upipe.gpu_suite")
"""The root's ``-m`` shims: like ``__main__`` modules, they import their command after
``adapter.require_command`` (a command the installed TorchTitan's adapter does not run is one line)."""
"""``-m`` entry modules may defer their command's import to after ``--help`` (a function-level import;
the graph still counts it, so it cannot hide a cycle)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module name, inside a function?) for every import statement."""
    top_level = {id(node) for node in tree.body}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            names = [node.args[0].value]  # importlib.import_module("torch"), __import__("torchtitan.x")
        else:
            continue
        found += [(name, id(node) not in top_level) for name in names]
    return found


def package_graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, list[str]], dict[str, ast.Module]]:
    """(internal import graph, third-party imports, parsed trees) of every module under ``root``."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    trees = {name: ast.parse(path.read_text()) for name, path in files.items()}
    graph: dict[str, set[str]] = {name: set() for name in files}
    external: dict[str, list[str]] = {name: [] for name in files}
    for name, tree in trees.items():
        for target, _ in _imports(tree, name, files[name].name == "__init__.py"):
            if not target.startswith(root.name):
                external[name].append(target)
                continue
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph, external, trees


def layer_of(module: str) -> str | None:
    if module.endswith(f".{ENTRY_MODULE}"):
        return "tools"  # a ``-m`` entry module: a command, wherever its folder sits
    first = module.split(".")[1] if "." in module else ""
    return next((layer for layer, names in LAYERS.items() if first in names), None)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def loaded_by(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The package's modules an import of ``module`` runs: its imports, theirs, and so on, each with
    its parent packages (importing ``a.b.c`` runs ``a/b/__init__.py`` first)."""
    seen: set[str] = set()
    stack = [module]
    while stack:
        name = stack.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        parts = name.split(".")
        stack += [".".join(parts[:i]) for i in range(2, len(parts))] + sorted(graph[name])
    return seen


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's folders (and root modules): ``a -> b`` where a module
    of ``a`` imports one of ``b``."""
    def folder(module: str) -> str:
        if module.endswith(f".{ENTRY_MODULE}"):
            return module  # a ``-m`` command sits above every folder, its own among them
        return module.split(".")[1] if "." in module else module

    folders: dict[str, set[str]] = {folder(m): set() for m in graph}
    for module, targets in graph.items():
        folders[folder(module)] |= {folder(t) for t in targets if folder(t) != folder(module)}
    return folders


def layer_violations(root: Path = PACKAGE) -> list[str]:
    """Every broken rule, one line each (empty: the package has the shape the docs describe)."""
    graph, external, trees = package_graph(root)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            if module != root.name:
                problems.append(f"{module}: in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        problems += [f"{module} ({layer}) imports {t} ({layer_of(t)}): imports must point down"
                     for t in sorted(targets) if layer_of(t) and ORDER[layer_of(t)] > ORDER[layer]]
    problems += [f"folder import cycle: {' <-> '.join(c)}" for c in cycles(folder_graph(graph))]
    for module in sorted(graph):
        folder = module.split(".")[1] if "." in module else ""
        if folder in PURE_FOLDERS and not module.endswith(ENTRY_MODULE):
            problems += [f"{module} ({folder}: arithmetic) imports {t}" + (f" (through {m})" if m != module else "")
                         for m in sorted(loaded_by(module, graph)) for t in external[m]
                         if t.split(".")[0] in ("torch", "torchtitan")]
    for module, targets in sorted(external.items()):
        folder = module.split(".")[1] if "." in module else ""
        if module in TORCHTITAN_OUTSIDE_ADAPTER and not any(t.split(".")[0] == "torchtitan" for t in targets):
            problems.append(f"{module} imports no TorchTitan any more: take it off TORCHTITAN_OUTSIDE_ADAPTER")
        if folder not in TORCHTITAN_FOLDERS and module not in TORCHTITAN_OUTSIDE_ADAPTER:
            problems += [f"{module} imports {t}: TorchTitan is imported in the adapter folders "
                         f"({', '.join(a + '/' for a in TORCHTITAN_FOLDERS)}) only" for t in targets
                         if t.split(".")[0] == "torchtitan"]
    for module, targets in sorted(graph.items()):
        folder = module.split(".")[1] if "." in module else ""
        if folder in TORCHTITAN_FOLDERS:
            problems += [f"{module} imports {t}: an adapter speaks one TorchTitan version and imports no other adapter"
                         for t in sorted(targets) if len(t.split(".")) > 1 and t.split(".")[1] in ADAPTERS
                         and t.split(".")[1] != folder]
    for module, tree in sorted(trees.items()):
        if module not in LAYOUT_BUILDERS:
            names = {"CPLayout"} | {alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                                    for alias in node.names if alias.name == "CPLayout" and alias.asname}
            problems += [f"{module}:{node.lineno} constructs a CPLayout: read the job's (JobSpec.layout) instead"
                         for node in ast.walk(tree) if isinstance(node, ast.Call)
                         and getattr(node.func, "id", getattr(node.func, "attr", None)) in names]
            # dataclasses.replace(layout, ...) builds one too (a layout is found by its name: *layout)
            problems += [f"{module}:{node.lineno} copies a CPLayout with replace(): read the job's instead"
                         for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
                         and getattr(node.func, "id", getattr(node.func, "attr", None)) == "replace"
                         and str(getattr(node.args[0], "id", getattr(node.args[0], "attr", ""))).endswith("layout")]
        problems += [f"{module}: imports {t} inside a function" for t, lazy in _imports(tree, module, False)
                     if lazy and t.startswith(root.name) and not module.endswith(ENTRY_MODULE)
                     and module not in COMMAND_SHIMS]
        path = root.parent.joinpath(*module.split("."))
        source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
        if (n := len(source.read_text().splitlines())) > MAX_MODULE_LINES:
            problems.append(f"{module}: {n} lines > {MAX_MODULE_LINES}")
        problems += [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines > {MAX_FUNCTION_LINES}"
                     for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    return problems


def test_the_package_has_three_layers_no_cycle_and_small_units():
    assert layer_violations() == []


def test_the_root_holds_only_entry_points_and_folders_are_layers():
    """Every other module lives in a folder that belongs to one layer (``LAYERS``)."""
    root_modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert root_modules == sorted(ROOT_MODULES) and len(root_modules) <= MAX_ROOT_MODULES
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    listed = [name for names in LAYERS.values() for name in names]
    assert set(folders) <= set(listed), sorted(set(folders) - set(listed))
    assert len(listed) == len(set(listed))  # one layer each
    # the three names TorchTitan users mix up are never in one folder
    for folder in [PACKAGE, *(PACKAGE / f for f in folders)]:
        stems = {p.stem for p in folder.glob("*.py")}
        assert len(stems & {"validate", "validation", "validator"}) <= 1, (folder, stems)


def _sabotaged_copy(tmp_path: Path, module: str, code: str) -> Path:
    root = tmp_path / PACKAGE.name
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    target = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    target.write_text(target.read_text() + code)
    return root


@pytest.mark.parametrize(
    "module, code, expected",
    [
        # a lazy import closing a cycle (what the package had before issue 14)
        ("titan_upipe.torchtitan_0_2.flavors", "\n\ndef _late():\n    from titan_upipe.torchtitan_0_2 import checks\n",
         "import cycle"),
        ("titan_upipe.attention.ring", "\nfrom titan_upipe import config\n", "imports must point down"),
        ("titan_upipe.transforms.tiling", "\nimport torchtitan.models.llama3\n", "imported in the adapter folders"),
        ("titan_upipe.plugin", "\n\ndef _late():\n    import titan_upipe.tools.parity\n", "inside a function"),
        ("titan_upipe.errors", "\n\ndef _long():\n" + "    x = 1\n" * 80, "lines > 80"),
        # a folder-level circle without a module cycle (what attention <-> parallel was before issue 43)
        ("titan_upipe.spec.document_deal", "\nfrom titan_upipe.attention.collectives import all_to_all\n",
         "folder import cycle"),
        ("titan_upipe.spec.units", "\nimport torch\n", "(spec: arithmetic) imports torch"),
        ("titan_upipe.costs.attention_comm", "\nimport torch\n", "(costs: arithmetic) imports torch"),
        ("titan_upipe.plan.search", "\nimport torchtitan.tools.logging\n", "imported in the adapter folders"),
        ("titan_upipe.data.packing", "\nimport torchtitan\n", "imported in the adapter folders"),
        ("titan_upipe.torchtitan_0_2.converters", "\n\ndef _own():\n    return CPLayout(None)\n", "constructs a CPLayout"),
        ("titan_upipe.torchtitan_0_2.converters",
         "\nfrom titan_upipe.spec.cp_layout import CPLayout as Layout\n\n\ndef _own():\n    return Layout(None)\n",
         "constructs a CPLayout"),
        ("titan_upipe.torchtitan_0_2.converters",
         "\n\ndef _copy(self):\n    return dataclasses.replace(self.layout, cp_degree=2)\n", "copies a CPLayout"),
        # torch reached through another module: costs -> parallel (its __init__ imports torch)
        ("titan_upipe.costs.attention_comm", "\nfrom titan_upipe.parallel import layout\n",
         "(costs: arithmetic) imports torch"),
        ("titan_upipe.attention.ring", "\n\ndef _late():\n    importlib.import_module('torchtitan.models')\n",
         "imported in the adapter folders"),
        ("titan_upipe.spec.units", "\n\ndef _late():\n    return __import__('torch')\n", "(spec: arithmetic) imports torch"),
        ("titan_upipe.torchtitan_0_3.flavors", "\nfrom titan_upipe.torchtitan_0_2 import flavors as old\n",
         "imports no other adapter"),
        ("titan_upipe.torchtitan_common.cpu_runtime", "\nfrom titan_upipe.torchtitan_0_3 import flavors\n",
         "imports no other adapter"),
        # a deferred import of the package: refused in a module, allowed in a -m entry module only
        ("titan_upipe.tools.plan_cli", "\n\ndef _late():\n    import titan_upipe.tools.parity\n", "inside a function"),
    ],
)
def test_each_rule_catches_its_breakage(tmp_path, module, code, expected):
    problems = layer_violations(_sabotaged_copy(tmp_path, module, code))
    assert any(expected in p for p in problems), problems


IMPORT_EVERYTHING = """
import importlib, pkgutil, sys
import titan_upipe
from titan_upipe.adapter import ADAPTERS, adapter_package
others = tuple(p for p in ADAPTERS.values() if p != adapter_package())  # another TorchTitan's API: not installed
names = [m.name for m in pkgutil.walk_packages(titan_upipe.__path__, "titan_upipe.")
         if m.name != "titan_upipe.plugin" and not m.name.endswith("__main__") and not m.name.startswith(others)]
for name in names:
    importlib.import_module(name)
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.checks import check_job
check_job(parse_config(["--job.config_file", "configs/debug/llama3_upipe_transforms.toml"]), 2)  # needs no registry
from torchtitan.protocols import model_converter
from torchtitan.protocols.train_spec import get_train_spec
import torchtitan.tools.utils as titan_utils
from torchtitan.hf_datasets.text_datasets import DATASETS
registered = {name for name in ("upipe", "ulysses", "tiled_mlp")
              if name in model_converter._registry_model_converter_cls}
registered |= {name for name in ("synthetic_copy",) if name in DATASETS}
for spec in ("upipe_llama3", "upipe_qwen3"):
    try:
        get_train_spec(spec)
        registered.add(spec)
    except ValueError:
        pass
print("before:", sorted(registered), titan_utils.device_type)
import titan_upipe.plugin  # noqa: F401
get_train_spec("upipe_llama3"), get_train_spec("upipe_qwen3")
assert "upipe" in model_converter._registry_model_converter_cls and "synthetic_copy" in DATASETS
print("after: registered", titan_utils.device_type)
"""


def test_importing_any_module_registers_nothing_until_the_plugin_entry_point():
    env = {"PATH": "/usr/bin:/bin", "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, env=env,
                         cwd=PACKAGE.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = out.stdout.strip().splitlines()[-2:]
    assert before.startswith("before: []"), before  # no module registered anything on import
    assert not before.endswith(" cpu"), before  # nor switched TorchTitan to the CPU runtime
    assert after == "after: registered cpu", after


def test_the_data_the_package_reads_is_installed_with_it(tmp_path):
    """A wheel of the package (what a non-editable install puts in site-packages) carries every file
    the code reads through ``titan_upipe.resources``; nothing reads the repository's ``docs/``."""
    import zipfile

    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(PACKAGE.parent)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("titan_upipe-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(p.name for p in (PACKAGE / "resources").iterdir() if p.suffix in (".csv", ".json", ".txt", ".md"))
    assert data and all(f"titan_upipe/resources/{name}" in members for name in data), data
    readers = [p for p in PACKAGE.rglob("*.py") if '"docs"' in p.read_text() and "parents[" in p.read_text()]
    assert readers == [], readers
