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
        TrainingHealth,
        Transforms,
        UPipe,
    )

    return [("upipe", UPipe), ("transforms", Transforms), ("activation_checkpoint", ActivationCheckpointOffload),
            ("local_data", LocalData), ("optimizer", OptimizerHostState), ("metrics", MetricsConsole),
            ("training", TrainingHealth)]


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
                                     "metrics", "training"])
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
    from titan_upipe.torchtitan_0_2.config import ATTENTION_BACKENDS, KERNEL_BACKENDS, NONFINITE_ACTIONS

    doc = CONFIG_DOC.read_text()
    for section, key, choices in (("upipe", "attention_backend", ATTENTION_BACKENDS),
                                  ("transforms", "ce_backend", KERNEL_BACKENDS),
                                  ("training", "on_nonfinite", NONFINITE_ACTIONS)):
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
    from titan_upipe.torchtitan_common.dashboard import CUSTOM_SCALARS_LAYOUT

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

    from titan_upipe.torchtitan_common.dashboard import CUSTOM_SCALARS_LAYOUT

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


# ---------------------------------------------------------------------------- longest fit (issue 34)

PLANNER_DOC = DOCS / "planner.md"


def _longest_fit_script():
    spec = importlib.util.spec_from_file_location("longest_fit_table", REPO / "scripts" / "longest_fit_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def longest_fit_tables() -> list[str]:
    """The script's three markdown tables (cluster shapes, what ran, the one-node recipes)."""
    return _longest_fit_script().markdown().strip("\n").split("\n\n")


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table.splitlines()[2:]]


def _tokens(cell: str) -> int:
    """``7.66M (8,033,440)`` -> 8033440, after checking the M figure is the same number."""
    figure, count = re.fullmatch(r"([\d.]+)M \(([\d,]+)\)", cell).groups()
    n = int(count.replace(",", ""))
    assert f"{n / 2**20:.2f}" == figure, cell
    return n


def test_planner_doc_holds_the_longest_fit_tables(longest_fit_tables):
    """docs/planner.md holds ``scripts/longest_fit_table.py``'s tables as they are (so they cannot
    drift from the planner), and each cluster row is right by plans made here, without the search:
    the length fits with the levers it names and the next multiple does not (for the reason the row
    gives), the "as configured" length the same with no lever, and no lever it names is idle."""
    from dataclasses import replace

    from titan_upipe import plan as P

    doc = PLANNER_DOC.read_text()
    for table in longest_fit_tables:
        assert table in doc, table.splitlines()[0]
    cluster = _rows(longest_fit_tables[0])
    assert len(cluster) == 2 * 2 * 2 * 2
    models = {"Llama3-8B": "llama3_8b", "Qwen3-32B": "qwen3_32b"}
    fields = {"`state_on_host`": ("optimizer_state_on_host", True),
              "`prefetch_after_attention`": ("prefetch_after_attention", True)}
    for name, gpus, gpu_gib, host_gib, longest, levers, configured, over in cluster:
        gpu, host = int(gpu_gib) * P.GIB, int(host_gib.replace(",", "")) * P.GIB
        base = P.PlanInput(P.KNOWN_MODELS[models[name]], seq_len=2**20, cp=int(gpus.split()[0]), ulysses=8, mode="upipe")
        named = dict(fields[x] if x in fields else ("resident_blocks", int(x.strip("`").split(" = ")[1]))
                     for x in levers.split(", ") if x != "none")
        unit = base.seq_unit

        def at(n: int, base=base, host=host, **settings):
            return P.plan(replace(base, seq_len=n, **settings), host)

        n = _tokens(longest)
        assert at(n, **named).fits(gpu, host) and not at(n + unit, **named).fits(gpu, host), (name, gpus, gpu_gib, host_gib)
        after = at(n + unit, **named)
        broken = {"GPU": after.peak_gpu_bytes + base.reserve > gpu, "host": after.host_bytes > host}
        assert over == " and ".join(k for k, v in broken.items() if v)
        for key in named:  # each lever named lengthens the fit
            fewer = {k: v for k, v in named.items() if k != key}
            assert not at(n, **fewer).fits(gpu, host), (name, gpus, gpu_gib, host_gib, key)
        c = _tokens(configured)
        assert at(c).fits(gpu, host) and not at(c + unit).fits(gpu, host) and c <= n
    # the reading below the tables
    doc_cells = {(r[0], r[1].split()[0], r[2], r[3]): r for r in cluster}
    reading = " ".join(doc[doc.index("Reading: where the paper ran"):doc.index("### Qwen3-32B on one 8-GPU node")].split())
    assert "6.94M against 5M" in reading and doc_cells["Llama3-8B", "8", "80", "1,900"][6].startswith("6.94M")
    assert "5.60M against 4M" in reading and doc_cells["Qwen3-32B", "16", "80", "1,900"][6].startswith("5.60M")
    host_bound = [r for r in cluster if r[3] == "1,000" or r[2] == "141"]
    assert host_bound and all(r[7] == "host" for r in host_bound)
    assert all(r[5] == "none" or "resident_blocks" in r[5] for r in host_bound)
    differ = {(m, g) for m, g, _, h in doc_cells if h == "1,000"
              and doc_cells[m, g, "80", h][4] != doc_cells[m, g, "141", h][4]}
    assert differ == {("Qwen3-32B", "8")} and "same length except Qwen3-32B on 8 GPUs" in reading


def test_planner_doc_measured_rows_are_the_papers(longest_fit_tables):
    """The paper's rows against ``paper_tables.csv`` read cell by cell (Table 4): the longest length
    with a number, its GiB, and the next length's cell (OOM, empty, or past the table)."""
    from titan_upipe.resources.paper_tables import LENGTH_COLUMNS, paper_value

    rows = [r for r in _rows(longest_fit_tables[1]) if r[0].startswith("paper Table 4")]
    assert len(rows) == 8
    methods = {"UPipe": "upipe", "FPDT": "fpdt", "Ulysses": "ulysses", "Ring": "ring"}
    models = {"Llama3-8B": "llama3_8b", "Qwen3-32B": "qwen3_32b"}
    for source, model, gpus, ran, following in rows:
        method, model = methods[source.split(", ")[1]], models[model]
        length, gib = re.fullmatch(r"(\S+) \(([\d.]+)\)", ran).groups()
        assert paper_value("4", model, method, "peak_memory", length) == pytest.approx(float(gib))
        assert gpus == ("8 x H100" if model == "llama3_8b" else "16 x H100")
        later = LENGTH_COLUMNS[LENGTH_COLUMNS.index(length) + 1:]
        assert all(paper_value("4", model, method, "peak_memory", x) is None for x in later)
        if later:
            assert following.startswith(later[0])
            # paper_value: None for OOM and for an empty cell alike; the CSV tells them apart
            from titan_upipe.resources.paper_tables import paper_rows

            cell = next(r[later[0]] for r in paper_rows()
                        if (r["table"], r["model"], r["method"]) == ("4", model, method))
            assert following.endswith("out of memory" if cell == "OOM" else "empty in the table")


def test_one_node_qwen3_32b_prose_is_the_planners():
    """The figures docs/planner.md's "Qwen3-32B on one 8-GPU node" section states in its prose,
    recomputed from the planner and ``validate``'s host count."""
    from dataclasses import replace

    from titan_upipe import plan as P
    from titan_upipe.tools.preflight import host_memory_needed
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    doc = PLANNER_DOC.read_text()
    start = doc.index("## Longest fit per cluster shape")
    section = " ".join(doc[start: doc.index("## Limits", start)].split())  # as read, not as wrapped
    gpu, host, gib = 80 * P.GIB, 1900 * P.GIB, P.GIB
    job = P.PlanInput(P.KNOWN_MODELS["qwen3_32b"], seq_len=2**20, cp=8, ulysses=8, mode="upipe")
    assert f"{P.max_seq_len(job, gpu, host):,} tokens" in section
    peak = P.plan(job, host).breakdown
    state = [peak["parameters (fp32, FSDP shard)"], peak["AdamW exp_avg + exp_avg_sq (fp32 shards)"],
             peak["gradients (fp32 shards reduced so far)"]]
    assert "holds {:.1f} GiB of fp32 parameters, {:.1f} of moments and up to {:.1f} of gradients".format(
        *(x / gib for x in state)) in section
    assert f"holds {round(sum(state) / gib)} GiB of fp32 parameters, moments and gradients" in section
    on_host = replace(job, optimizer_state_on_host=True)
    moved = P.plan(on_host, host)
    assert f"{moved.host_optimizer_bytes_per_rank / gib:.0f} GiB per rank pinned, " \
           f"{8 * moved.host_optimizer_bytes_per_rank / gib:.0f} GiB per node" in section
    assert f"take {8 * moved.host_optimizer_bytes_per_rank / gib:.0f} GiB of the node" in section
    assert f"falls by {(P.plan(job, host).peak_gpu_bytes - moved.peak_gpu_bytes) / gib:.1f} GiB" in section
    assert f"({P.max_seq_len(on_host, gpu, host):,}) with every input offloaded" in section
    staging = {}
    for model, name in (("llama3_8b", "Llama3-8B"), ("qwen3_32b", "Qwen3-32B")):
        staging[model] = 12 * P.KNOWN_MODELS[model].total_params / gib
        assert f"{staging[model]:.0f} GiB for {name}" in section
    two_m = parse_config(["--job.config_file", str(REPO / "configs/qwen3_32b/upipe_8gpu_2m.toml"),
                          "--checkpoint.async_mode", "async"])
    assert f"2M makes {host_memory_needed(two_m, 8)[0] / gib:,.0f} GiB" in section
    assert f"stages the rank's state shard ({staging['qwen3_32b']:.0f} GiB per node)" in section
    at = replace(on_host, seq_len=2_621_440, attention_backend="flash_attn4", pin_memory=False)
    every, resident = P.plan(at, host), P.plan(replace(at, resident_blocks=2), host)
    assert f"({every.host_bytes / gib:,.0f} GiB with every input offloaded)" in section
    assert (f"leaves the host {(host - resident.host_bytes) / gib:.0f} GiB instead of "
            f"{(host - every.host_bytes) / gib:.0f}") in section
    loss_peaks = [max(m.total for m in p.moments if m.phase == "loss") / gib for p in (every, resident)]
    assert f"rises from {loss_peaks[0]:.2f} to {loss_peaks[1]:.2f} GiB" in section
    flush = next(m.total for m in resident.moments if m.where == "block 1 backward: attention backward (K/V flush)")
    assert resident.peak.where == "block 1 backward: MLP backward"
    assert f"K/V flush is {(resident.peak_gpu_bytes - flush) / gib:.2f} GiB under" in section
    us = [P.recommended_heads_per_stage(replace(on_host, seq_len=n, attention_backend="flash_attn4"), gpu, host)[0]
          for n in (2**20, 2 * 2**20, 2_621_440)]
    assert us[1] == us[2] and f"says {us[0]} at 1M, {us[1]} at 2M and 2.5M" in section


def test_planner_doc_past_3m_table_is_the_planners():
    """The "Past 3M on one node" table: each row's GPU peak, host per rank, offloaded inputs and the
    moments (pinned and exact) are the planner's, recomputed here (Qwen3-32B, CP 8, AdamW moments on
    the host, the last two inputs on the device)."""
    from titan_upipe import plan as P
    from titan_upipe.plan.sizes import StepSizes
    from titan_upipe.plan.state import optimizer_host_bytes

    doc = PLANNER_DOC.read_text()
    section = doc[doc.index("### Past 3M on one node"):doc.index("\n## Limits")]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    rows = _rows(table)
    assert [r[0] for r in rows] == ["2.5M", "2.75M", "3M", "3.25M"]
    model = P.KNOWN_MODELS["qwen3_32b"]
    for length, gpu, host, inputs, moments in rows:
        job = P.PlanInput(model, seq_len=P.parse_length(length), cp=8, ulysses=8, optimizer_state_on_host=True,
                          resident_blocks=2)
        result, sizes = P.plan(job, 1900 * P.GIB), StepSizes.of(job)
        pinned, exact = optimizer_host_bytes(sizes, True), optimizer_host_bytes(sizes, False)
        assert gpu == f"{result.peak_gpu_bytes / P.GIB:.2f}", length
        assert host == f"{result.host_bytes_per_rank / P.GIB:.1f}", length
        assert inputs == f"{(model.n_layers - 2) * sizes.hidden / P.GIB:.1f}", length
        assert moments == f"{pinned / P.GIB:.1f} / {exact / P.GIB:.1f}", length
        assert (result.host_bytes_per_rank * 8 <= 1900 * P.GIB) == (length == "2.5M")  # host-bound past 2.5M
        assert result.peak_gpu_bytes + job.reserve < 80 * P.GIB  # the GPU is not what binds


def test_tsp_memory_table_is_the_scripts(capsys):
    """docs/tsp.md's per-rank memory table (TSP, Ulysses, UPipe at 128K-1M, D = 8) is what
    ``python scripts/tsp_compare.py --memory`` prints with this checkout's planner."""
    spec = importlib.util.spec_from_file_location("tsp_compare", REPO / "scripts" / "tsp_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.memory_table()
    printed = capsys.readouterr().out.strip()
    assert printed and printed in (DOCS / "tsp.md").read_text()
    assert printed.count("| TSP, ") == 2 * 3 * 2  # two models, three lengths, with and without offload
