"""The sweep report's plots, made to be read without report.md.

- `memory_breakdown.png`: each job's memory at its peak, by category. Jobs that ran out of memory,
  failed or were killed are hatched bars with their status where their peak is known; a note
  under the chart names the jobs whose peak is not known.
- `memory_vs_throughput.png`, `memory_vs_accuracy.png`: one point per config that succeeded,
  labelled with the overrides that vary across the sweep; a config's repeats (rows that differ
  only in their seeds, memexp.rows.REPEAT_KEYS) are one point at their mean. They plot the
  report table's figures: its throughput column (where the sweep has one unit; else the speed
  its step time x base column gives), and its eval accuracy, each with a bar: the step time x
  base's range, and the seeds' range. A throughput the table marks uncertain (`?`) keeps the
  mark and is drawn hollow. The Pareto front is of what is certain (memexp.rows.pareto_front):
  a config leaves it only where another certainly beats it, seed by seed, across their bars;
  ratios that may be off whatever their range (two runs' medians on a busy machine) stay off
  the throughput chart's front. The throughput axis is logarithmic when its values span more
  than 10x; the accuracy axis starts at 0, so that a small gap looks small.

Every chart has a title and units, and its legend and notes outside the data. Labels are placed
by `place_labels`, a small deterministic search that keeps them apart.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from textwrap import shorten

from memexp.result import DEVICE_CATEGORIES, category_color, error_message
from memexp.rows import MIB, UNCERTAIN, Row, pareto_front, repeats, speed_doubt, speed_range

DPI = 110  # the figure's own, and the saved file's: label offsets are in its pixels
LOG_SPAN = 10  # a value axis whose largest value is more than this times its smallest is log
Box = tuple[float, float, float, float]  # left, bottom, right, top, in pixels


@dataclass
class Chart:
    """A written plot: its file and the words on it (title, axis labels, data labels, notes)."""

    path: Path
    title: str
    axes: tuple[str, str]  # x, y
    labels: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a scatter's points (x, y) in the order of `labels`, the labels on its Pareto front, and
    # the value axis's limits
    points: list[tuple[float, float]] = field(default_factory=list)
    spreads: list[tuple[float, float]] = field(default_factory=list)  # each point's bar
    front: list[str] = field(default_factory=list)
    y_limits: tuple[float, float] | None = None


# -- label placement ----------------------------------------------------------------------------
# Where a label may go, nearest first: rings around its point, and on each ring eight
# directions (up-right first, the usual spot).
RADII = (8, 16, 28, 44, 64, 90, 120)
DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


def overlap(a: Box, b: Box) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return width * height if width > 0 and height > 0 else 0.0


def candidate(anchor: tuple[float, float], size: tuple[float, float], radius: float,
              direction: tuple[int, int]) -> Box:
    """The box of `size` whose side facing `anchor` is `radius` pixels from it."""
    (x, y), (width, height), (dx, dy) = anchor, size, direction
    left = x + dx * radius - (width if dx < 0 else width / 2 if dx == 0 else 0)
    bottom = y + dy * radius - (height if dy < 0 else height / 2 if dy == 0 else 0)
    return left, bottom, left + width, bottom + height


def place_labels(anchors: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]],
                 bounds: Box, marker: float = 5.0) -> list[Box]:
    """A box for each label near its anchor, all in pixels. Labels are placed in order; each
    takes the nearest spot that overlaps no label placed before it, covers no point (a square
    of `marker` pixels each way) and stays within `bounds`; where no spot is free, the one that
    overlaps least. The same input always gives the same boxes."""
    points = [(x - marker, y - marker, x + marker, y + marker) for x, y in anchors]
    placed: list[Box] = []
    for anchor, size in zip(anchors, sizes, strict=True):
        best: tuple[float, Box] | None = None
        for radius in RADII:
            for direction in DIRECTIONS:
                box = candidate(anchor, size, radius, direction)
                area = (box[2] - box[0]) * (box[3] - box[1])
                cost = (sum(overlap(box, other) for other in (*placed, *points))
                        + 10 * (area - overlap(box, bounds)))  # leaving the axes is worse
                if best is None or cost < best[0]:
                    best = (cost, box)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        placed.append(best[1])
    return placed


# -- labels -------------------------------------------------------------------------------------
def labels_of(rows: Sequence[Row]) -> list[str]:
    """What tells each job apart: its varying overrides, one per line (all its overrides where
    nothing varies); the job number only where two jobs share the same overrides."""
    texts = [row.label.replace(" ", "\n") if row.label != "-"
             else " ".join(row.result.get("overrides") or ["defaults"]) for row in rows]
    counts = Counter(texts)
    return [f"{text} (job {row.job})" if counts[text] > 1 else text
            for text, row in zip(texts, rows, strict=True)]


def status_of(row: Row) -> str:
    """What became of a job that did not succeed, in a few words."""
    oom = row.memory.get("oom")
    if oom:
        return f"out of memory in {oom['phase'] or 'an unknown phase'} at step {oom['step']}"
    if row.status == "nan":
        return "nan: the loss was not finite"
    error = error_message(row.result.get("error") or "")
    return f"{row.status}: {shorten(error[0], 60)}" if error and error[0] else row.status


# -- the charts -------------------------------------------------------------------------------
def write_plots(rows: list[Row], sweep_dir: Path) -> list[Chart]:
    """The charts there is data for, written into `sweep_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    charts = []
    if any(row.peak is not None for row in rows):
        charts.append(breakdown_chart(rows, sweep_dir / "memory_breakdown.png"))
    units = {row.metrics.get("throughput_unit") for row in rows if row.ok}
    unit = next(iter(units)) if len(units) == 1 else None

    def accuracy(row: Row) -> tuple[float, float, float] | None:
        value = row.metrics.get("eval_accuracy")
        return None if value is None else (value, value, value)

    scatters = (  # file, y axis, what it shows, its (low, value, high), whether it is a speed
        ("memory_vs_throughput.png", f"throughput ({unit})" if unit else
         "speed against its workload's base (1 / step time x base)",
         "throughput" if unit else "speed", lambda row: speed_range(row, rows), True),
        ("memory_vs_accuracy.png", "eval accuracy (fraction correct)", "accuracy", accuracy,
         False),
    )
    for name, axis, what, value, timed in scatters:
        if any(row.ok and value(row) is not None for row in rows):
            charts.append(scatter_chart(rows, sweep_dir / name, axis, what, value, timed))
    return charts


def breakdown_chart(rows: list[Row], path: Path) -> Chart:
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    drawn = [row for row in rows if row.peak is not None]
    unknown = [row for row in rows if row.peak is None]
    labels = labels_of(drawn)
    figure, axes = plt.subplots(figsize=(9, 0.5 * len(drawn) + 1.6), dpi=DPI)
    positions = range(len(drawn))
    left = [0.0] * len(drawn)
    for category in DEVICE_CATEGORIES:
        values = [(row.memory.get("breakdown_at_peak") or {}).get(category, 0) / MIB
                  for row in drawn]
        faded = [to_rgba(category_color(category), 1.0 if row.status == "ok" else 0.35)
                 for row in drawn]
        axes.barh(positions, values, left=left, height=0.7, color=faded)
        left = [a + b for a, b in zip(left, values, strict=True)]
    # Each bar's outline is its peak. Jobs that did not succeed are faded and hatched, with
    # their status at the end of the bar.
    widest = max(row.peak / MIB for row in drawn)
    for position, row in zip(positions, drawn, strict=True):
        failed = row.status != "ok"
        axes.barh(position, row.peak / MIB, height=0.7, fill=False, hatch="//" if failed else "",
                  edgecolor="black", linewidth=1.2 if failed else 0.6)
        if failed:
            axes.text(row.peak / MIB + 0.01 * widest, position, status_of(row), va="center",
                      fontsize=8, color="tab:red")
    axes.set_yticks(list(positions), labels=labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, widest * (1.45 if any(row.status != "ok" for row in drawn) else 1.05))
    axes.set_xlabel("memory at the job's peak (MiB)")
    axes.set_title(f"Memory at the peak, by category: sweep {path.parent.name}")
    categories = [Patch(color=category_color(category), label=category)  # unfaded
                  for category in DEVICE_CATEGORIES]
    axes.legend(handles=categories, loc="upper left", bbox_to_anchor=(1.01, 1),
                fontsize="small", title="category", title_fontsize="small")
    return save(figure, axes, path, labels, breakdown_notes(drawn, unknown))


def breakdown_notes(drawn: list[Row], unknown: list[Row]) -> list[str]:
    notes = []
    if any(row.status != "ok" for row in drawn):
        notes.append("Faded and hatched: the job did not succeed; the bar is what it reached.")
    if unknown:
        notes.append("No peak known, not drawn: " + "; ".join(
            f"job {row.job} ({label.replace(chr(10), ' ')}): {row.status}"
            for row, label in zip(unknown, labels_of(unknown), strict=True)))
    return notes


@dataclass
class Point:
    """One config on a scatter: its repeats (memexp.rows.repeats) as one point, at their mean,
    with a bar over their values' range (each value's own range included)."""

    rows: list[Row]
    values: dict[tuple, tuple[float, float, float]]  # (low, value, high) by repeat
    uncertain: bool  # a time the table marks `?`: hollow
    ranked: bool  # on or against the Pareto front

    @property
    def x(self) -> float:
        return statistics.fmean(row.peak / MIB for row in self.rows)

    @property
    def y(self) -> float:
        return statistics.fmean(middle for _, middle, _ in self.values.values())

    @property
    def low(self) -> float:
        return min(low for low, _, _ in self.values.values())

    @property
    def high(self) -> float:
        return max(high for _, _, high in self.values.values())


def scatter_points(shown: list[Row], value: Callable[[Row], tuple | None],
                   timed: bool) -> list[Point]:
    return [Point(group, {row.repeat: value(row) for row in group},
                  uncertain=timed and any(speed_doubt(row) for row in group),
                  # a ratio of two runs' medians from a busy machine may be far off (x0.09),
                  # however narrow its range: it would push the certain points off the front.
                  # A spread one (unsettled, or about 1.0) is ranked by its range.
                  ranked=not timed or not any(row.time_biased for row in group))
            for group in repeats(shown).values()]


def point_labels(points: list[Point]) -> list[str]:
    """labels_of, for a point of several repeats its config's overrides and how many."""
    texts = [labels_of(point.rows)[0] if len(point.rows) == 1
             else point.rows[0].repeat_label.replace(" ", "\n") + f"\n({len(point.rows)} seeds)"
             for point in points]
    counts = Counter(texts)
    return [f"{text} (job {point.rows[0].job})" if counts[text] > 1 else text
            for text, point in zip(texts, points, strict=True)]


def scatter_chart(rows: list[Row], path: Path, axis: str, what: str,
                  value: Callable[[Row], tuple | None], timed: bool) -> Chart:
    """`value`: a row's (low, value, high). `timed`: the value is a speed (uncertain where the
    table's throughput is, log scale when wide); else an accuracy (an axis from 0)."""
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row.ok and value(row) is not None]
    points = scatter_points(shown, value, timed)
    labels = [label + f" {UNCERTAIN}" * point.uncertain
              for label, point in zip(point_labels(points), points, strict=True)]
    xy = [(point.x, point.y) for point in points]
    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=DPI)
    figure.subplots_adjust(left=0.12, right=0.97, top=0.9, bottom=0.12)
    logarithmic = timed and min(p.low for p in points) > 0 and \
        max(p.high for p in points) > LOG_SPAN * min(p.low for p in points)
    if logarithmic:
        axes.set_yscale("log")
    spread = ("its step time x base's spread" if timed else "") + \
        (" and " if timed and any(len(p.rows) > 1 for p in points) else "") + \
        ("its seeds' range" if any(len(p.rows) > 1 for p in points) else "")
    for doubt in (False, True):
        mine = [p for p in points if p.uncertain == doubt]
        if mine:
            axes.errorbar([p.x for p in mine], [p.y for p in mine],
                          yerr=[[p.y - p.low for p in mine], [p.high - p.y for p in mine]],
                          fmt="o", zorder=3, color="tab:blue", ecolor="tab:blue", capsize=3,
                          markerfacecolor="none" if doubt else "tab:blue",
                          label=(f"{UNCERTAIN} {what} uncertain (the report's table says why)"
                                 if doubt else f"a config; its bar: {spread}" if spread else None))
    ranked = [i for i, point in enumerate(points) if point.ranked]
    front = [ranked[i] for i in pareto_front([
        (points[i].x, {repeat: (low, high) for repeat, (low, _, high) in points[i].values.items()})
        for i in ranked])]
    left_off = (" (ratios of two runs on a busy machine are left off it)"
                if len(ranked) < len(points) else "")
    axes.plot([points[i].x for i in front], [points[i].y for i in front], "o-",
              color="tab:red", markerfacecolor="none", markersize=11, zorder=2,
              label=f"Pareto front: no other config certainly has both less memory and more "
                    f"{what}{' (at each seed, across its bar)' if spread else ''}{left_off}")
    axes.margins(x=0.25, y=0.2)
    if not timed:
        axes.set_ylim(bottom=0)
    axes.set_xlabel("peak memory (MiB)")
    axes.set_ylabel(axis + (", log scale" if logarithmic else ""))
    axes.set_title(f"Peak memory vs {what}: sweep {path.parent.name}")
    annotate(figure, axes, xy, labels)
    axes.legend(loc="upper left", bbox_to_anchor=(0, -0.1), fontsize="small")
    left_out = [row for row in rows if row not in shown]
    notes = ["Not shown: " + "; ".join(
        f"{label.replace(chr(10), ' ')} ({row.status if row.status != 'ok' else f'no {what}'})"
        for row, label in zip(left_out, labels_of(left_out), strict=True))] if left_out else []
    y_limits = axes.get_ylim()
    chart = save(figure, axes, path, labels, notes, notes_below=80)
    chart.points, chart.front, chart.y_limits = xy, [labels[i] for i in front], y_limits
    chart.spreads = [(point.low, point.high) for point in points]
    return chart


def annotate(figure, axes, points: list[tuple[float, float]], labels: list[str]) -> None:
    """Each point's label, where `place_labels` puts it; a thin line to its point when it had
    to move away."""
    texts = [axes.annotate(label, xy=point, xytext=(0, 0), textcoords="offset pixels",
                           fontsize=8, ha="left", va="bottom", zorder=4)
             for point, label in zip(points, labels, strict=True)]
    figure.draw_without_rendering()  # the axes' final limits, and the texts' sizes
    renderer = figure.canvas.get_renderer()
    sizes = [tuple(text.get_window_extent(renderer).size) for text in texts]
    anchors = [tuple(p) for p in axes.transData.transform(points)]
    boxes = place_labels(anchors, sizes, tuple(axes.get_window_extent(renderer).extents))
    for text, point, (x, y), box in zip(texts, points, anchors, boxes, strict=True):
        text.set_position((box[0] - x, box[1] - y))
        # the label's nearest edge, from the point
        edge = (min(max(x, box[0]), box[2]) - x, min(max(y, box[1]), box[3]) - y)
        if max(map(abs, edge)) > RADII[1]:
            axes.annotate("", xy=point, xytext=edge, textcoords="offset pixels", zorder=1,
                          arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6,
                                      "shrinkA": 1, "shrinkB": 5})


def save(figure, axes, path: Path, labels: list[str], notes: list[str],
         notes_below: float = 40) -> Chart:
    """Write the figure, with `notes` under the axes (`notes_below` points down)."""
    import matplotlib.pyplot as plt

    if notes:
        axes.annotate("\n".join(notes), xy=(0, 0), xycoords="axes fraction",
                      xytext=(0, -notes_below), textcoords="offset points", va="top",
                      fontsize=8, wrap=True)
    # bbox_inches="tight" widens the image to the legend and notes outside the axes
    figure.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(figure)
    return Chart(path, axes.get_title(), (axes.get_xlabel(), axes.get_ylabel()), labels, notes)
