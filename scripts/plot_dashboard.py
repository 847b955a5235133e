"""Render a training run's TensorBoard dashboard (Loss, Throughput, Memory, Data, Progress) to a PNG.

    python scripts/plot_dashboard.py outputs/debug_llama3_upipe/tb --out dashboard.png

RUN is a TensorBoard run folder (the one holding ``events.out.tfevents.*``, or its ``rank_0``
with ``metrics.save_for_all_ranks``), the ``tb`` folder above it (the newest run inside is used)
or the job's dump folder. Panels follow the
custom-scalars layout the run recorded (``titan_upipe.torchtitan_0_2.metrics.CUSTOM_SCALARS_LAYOUT``, written
by every titan_upipe run); for a run without one, that layout is imported from the plugin.
One row per group, one panel per chart, one line per tag. Needs matplotlib
(``pip install -e ".[plots]"``); draws off-screen (Agg), so no display is required.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

EVENTS_GLOB = "events.out.tfevents.*"
LAYOUT_TAG = "custom_scalars__config__"
GROUPS = ("Loss", "Throughput", "Memory")

Layout = dict[str, dict[str, list[str]]]  # group -> chart title -> tags
Series = dict[str, tuple[list[int], list[float]]]  # tag -> (steps, values)


def _events_dir(folder: Path) -> Path | None:
    """``folder`` if it holds event files, else its ``rank_0`` (``metrics.save_for_all_ranks``)."""
    for candidate in (folder, folder / "rank_0"):
        if any(candidate.glob(EVENTS_GLOB)):
            return candidate
    return None


def find_run(path: Path) -> Path:
    """The folder whose event files hold the run: ``path`` itself, else its newest run."""
    direct = _events_dir(path)
    if direct is not None:
        return direct
    for base in (path, path / "tb"):
        runs = sorted(p for p in base.glob("*") if p.is_dir() and _events_dir(p) is not None)
        if runs:
            return _events_dir(runs[-1])  # run folders are timestamps (YYYYmmdd-HHMM): newest last
    raise FileNotFoundError(f"no TensorBoard event files ({EVENTS_GLOB}) in {path} or its run folders")


def load_run(run: Path) -> tuple[Series, Layout | None]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    series: Series = {}
    for tag in tags["scalars"]:
        events = acc.Scalars(tag)
        series[tag] = ([e.step for e in events], [e.value for e in events])
    layout = None
    if LAYOUT_TAG in tags.get("tensors", []):
        layout = _parse_layout(acc.Tensors(LAYOUT_TAG)[-1].tensor_proto.string_val[0])
    return series, layout


def _parse_layout(serialized: bytes) -> Layout:
    from tensorboard.plugins.custom_scalar import layout_pb2

    proto = layout_pb2.Layout()
    proto.ParseFromString(serialized)
    return {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in proto.category}


def plugin_layout() -> Layout:
    from titan_upipe.torchtitan_common.dashboard import CUSTOM_SCALARS_LAYOUT

    return {group: {title: list(tags) for title, (_, tags) in charts.items()}
            for group, charts in CUSTOM_SCALARS_LAYOUT.items()}


def _matching(series: Series, tag: str) -> list[str]:
    """TensorBoard treats a layout tag as a regular expression; an exact name matches itself."""
    if tag in series:
        return [tag]
    try:
        return sorted(t for t in series if re.fullmatch(tag, t))
    except re.error:
        return []


def render(series: Series, layout: Layout, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in GROUPS if g in layout] + [g for g in layout if g not in GROUPS]
    columns = max(len(layout[g]) for g in groups)
    fig, axes = plt.subplots(len(groups), columns, figsize=(4.2 * columns, 3.1 * len(groups)), squeeze=False)
    styles = ("-", "--", ":", "-.")
    for row, group in enumerate(groups):
        charts = list(layout[group].items())
        for col in range(columns):
            ax = axes[row][col]
            if col >= len(charts):
                ax.axis("off")
                continue
            chart, tags = charts[col]
            ax.set_title(f"{group}: {chart}", fontsize=10, loc="left")
            names = [name for tag in tags for name in _matching(series, tag)]
            for i, name in enumerate(names):
                steps, values = series[name]
                # Later lines thinner, so that identical series (e.g. two names of one loss) stay visible.
                ax.plot(steps, values, styles[i % len(styles)], linewidth=max(2.8 - 0.9 * i, 1.0),
                        marker="." if len(steps) < 60 else None, label=name)
            if not names:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            else:
                ax.legend(fontsize=7, loc="best")
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the title above the top row
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="TensorBoard run folder, its parent tb/ folder, or the dump folder")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"), help="PNG to write (default dashboard.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the run folder)")
    args = parser.parse_args(argv)

    run = find_run(args.run)
    series, layout = load_run(run)
    if not series:
        print(f"{run}: no scalars logged", file=sys.stderr)
        return 1
    layout = layout or plugin_layout()
    render(series, layout, args.out, args.title or f"titan_upipe run {run}")
    last = max(max(steps) for steps, _ in series.values())
    print(f"{run}: {len(series)} scalar tags, {last} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
