"""The user docs cannot silently fall behind the code.

Checks that every config key (with its default), converter, train spec and dashboard tag the
plugin defines is documented, that ``scripts/plot_dashboard.py`` renders a PNG from an event
file, and that every relative link (and its ``#anchor``) in README.md and docs/ resolves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CONFIG_DOC = DOCS / "config.md"
DASHBOARD_DOC = DOCS / "dashboard.md"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _sections():
    from titan_upipe.torchtitan_0_2.config import (
        ActivationCheckpointOffload,
        LocalData,
        MetricsConsole,
        OptimizerHostState,
        Transforms,
        UPipe,
    )

    return [("upipe", UPipe), ("transforms", Transforms), ("activation_checkpoint", ActivationCheckpointOffload),
            ("local_data", LocalData), ("optimizer", OptimizerHostState), ("metrics", MetricsConsole)]


def _section_text(doc: str, section: str) -> str:
    """The part of config.md under the heading that names ``[section]``, up to the next heading
    of the same or a higher level."""
    match = re.search(rf"^(#+) .*`\[{section}\]`.*$", doc, re.M)
    assert match, f"docs/config.md has no heading naming `[{section}]`"
    level = len(match.group(1))
    rest = doc[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


@pytest.mark.parametrize("section", ["upipe", "transforms", "activation_checkpoint", "local_data", "optimizer",
                                     "metrics"])
def test_every_config_key_is_documented_with_its_default(section):
    doc = CONFIG_DOC.read_text()
    cls = dict(_sections())[section]
    text = _section_text(doc, section)
    for field in dataclasses.fields(cls):
        rows = [line for line in text.splitlines() if line.startswith(f"| `{field.name}`")]
        assert rows or f"`{section}.{field.name}`" in doc, f"{section}.{field.name} is not in docs/config.md"
        if rows:  # | key | type | default | valid values | meaning |
            value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            default = _toml(value)
            cell = rows[0].split("|")[3].strip()
            assert cell == f"`{default}`", f"{section}.{field.name}: documented default {cell}, the code's is {default}"


def test_choice_keys_list_every_valid_value():
    from titan_upipe.torchtitan_0_2.config import ATTENTION_BACKENDS, KERNEL_BACKENDS

    doc = CONFIG_DOC.read_text()
    for section, key, choices in (("upipe", "attention_backend", ATTENTION_BACKENDS),
                                  ("transforms", "ce_backend", KERNEL_BACKENDS)):
        row = next(line for line in _section_text(doc, section).splitlines() if line.startswith(f"| `{key}`"))
        missing = [c for c in choices if f"`{c}`" not in row and f'`"{c}"`' not in row]
        assert not missing, f"{section}.{key}: valid values {missing} not documented"


def test_every_converter_and_train_spec_is_documented():
    from titan_upipe.torchtitan_0_2 import converters, flavors

    doc = CONFIG_DOC.read_text()
    names = [*converters.CP_CONVERTERS, *converters.TRANSFORM_CONVERTERS]
    missing = [name for name in names if f"`{name}`" not in doc]
    assert not missing, f"converters missing from docs/config.md: {missing}"
    debug_flavors = [*flavors.LLAMA3_DEBUG_FLAVORS, *flavors.QWEN3_DEBUG_FLAVORS]
    for name in (flavors.LLAMA3_SPEC, flavors.QWEN3_SPEC, *debug_flavors):
        assert f"`{name}`" in doc, f"{name} missing from docs/config.md"


def _layout_tags() -> list[str]:
    from titan_upipe.torchtitan_0_2.metrics import CUSTOM_SCALARS_LAYOUT

    return [tag for group in CUSTOM_SCALARS_LAYOUT.values() for _, tags in group.values() for tag in tags]


def test_every_dashboard_tag_is_documented():
    doc = DASHBOARD_DOC.read_text()
    missing = [tag for tag in _layout_tags() if f"`{tag}`" not in doc]
    assert not missing, f"tags missing from docs/dashboard.md: {missing}"


def _plot_dashboard():
    spec = importlib.util.spec_from_file_location("plot_dashboard", REPO / "scripts" / "plot_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("with_layout", [True, False], ids=["recorded-layout", "plugin-layout"])
def test_plot_dashboard_renders_a_png(tmp_path, with_layout):
    from torch.utils.tensorboard import SummaryWriter

    from titan_upipe.torchtitan_0_2.metrics import CUSTOM_SCALARS_LAYOUT

    run = tmp_path / "tb" / "20260101-0000"  # the trainer's <dump_folder>/tb/<timestamp> layout
    writer = SummaryWriter(str(run))
    if with_layout:
        writer.add_custom_scalars(CUSTOM_SCALARS_LAYOUT)
    for step in range(1, 5):
        for i, tag in enumerate(_layout_tags()):
            writer.add_scalar(tag, 1.0 / step + i, step)
    writer.close()

    out = tmp_path / "img" / "dash.png"
    assert _plot_dashboard().main([str(tmp_path), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    slugs: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", markdown), re.M):
        slug, n = _slug(heading), 1
        while slug in slugs:
            slug, n = f"{_slug(heading)}-{n}", n + 1
        slugs.add(slug)
    return slugs


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    text = page.read_text()
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    broken = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page}: broken links {broken}"


# ---------------------------------------------------------------------------- launch commands

TORCHRUN = re.compile(r"--nproc[_-]per[_-]node[ =](\d+) -m titan_upipe\.train --job\.config_file (configs/debug/\w+\.toml)"
                      r"((?: --[\w.-]+(?: [^\s`#-][^\s`]*)?)*)")
RUN_TRAIN = re.compile(r"NGPU=(\d+) CONFIG=(configs/debug/\w+\.toml) scripts/run_train\.sh((?: --[\w.-]+(?: [^\s`#-]\S*)?)*)")
MAKE_RUN = re.compile(r"make run RUN_CONFIG=(configs/debug/\w+\.toml) NPROC=(\d+)(?: RUN_ARGS=\"([^\"]*)\")?")


def _cpu_launch_commands() -> set[tuple[str, int, tuple[str, ...]]]:
    """(config, ranks, overrides) of every CPU training command the docs and scripts show: torchrun,
    ``scripts/run_train.sh`` (its header too) and ``make run`` with a ``configs/debug`` file."""
    commands = set()
    for page in [*_markdown_files(), REPO / "scripts" / "run_train.sh"]:
        text = re.sub(r"\s*\\\n\s*", " ", page.read_text())  # join continued shell lines
        for ranks, config, rest in TORCHRUN.findall(text):
            commands.add((config, int(ranks), tuple(rest.split())))
        for ranks, config, rest in RUN_TRAIN.findall(text):
            commands.add((config, int(ranks), tuple(rest.split())))
        for config, ranks, rest in MAKE_RUN.findall(text):
            commands.add((config, int(ranks), tuple(rest.split())))
    return commands


def test_documented_cpu_launch_commands_can_run():
    """Each command's config, rank count and overrides pass every check the trainer makes before
    starting (``validate --no-assets``): e.g. run_train.sh's header once showed a CP = 4 config
    on 2 ranks."""
    from titan_upipe.tools.preflight import find_problems
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    commands = _cpu_launch_commands()
    problems = {command: find_problems(parse_config(["--job.config_file", str(REPO / command[0]), *command[2]]),
                                       command[1]) for command in sorted(commands)}
    assert not any(problems.values()), {command: found for command, found in problems.items() if found}
    assert len(commands) >= 6, commands  # the patterns still find the commands
