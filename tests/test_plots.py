"""The sweep plots stand alone: labels are overrides, failed jobs are marked, axes have units.
(What the PNGs look like was checked by eye; these tests check what is drawn, not pixels.)"""

from __future__ import annotations

import itertools

import pytest
from test_report import result, rows_of
from test_timing import result as timed

from memexp.memory.timeline import Timeline
from memexp.plots import overlap, place_labels, write_plots
from memexp.report import markdown_table

MIB = 2**20


def oom(overrides: list[str], peak_mib: float) -> dict:
    """A job that ran out of memory in its forward pass at step 2, having reached `peak_mib`."""
    record = result(overrides, 0, 0, 0, status="oom")
    record["memory"] = {"peak_bytes": int(peak_mib * MIB), "oom": {"phase": "forward", "step": 2},
                        "breakdown_at_peak": {"params": 2 * MIB, "activations": 30 * MIB}}
    return record


def test_a_sweep_with_an_oom_and_a_killed_job_gets_every_plot_labelled_by_overrides(tmp_path):
    rows = rows_of(
        result(["checkpointing=none", "optim=sgd"], 0.08, 0.2, 0.71),
        result(["checkpointing=full", "optim=sgd"], 0.05, 0.3, 0.71, checkpointing="full"),
        result(["checkpointing=none", "optim=adamw"], 0.09, 0.25, 0.75, optim="adamw"),
        oom(["checkpointing=none", "optim=adam"], 40),
        result(["checkpointing=full", "optim=adam"], 0, 0, 0, status="killed"),
    )
    charts = {chart.path.name: chart for chart in write_plots(rows, tmp_path)}
    assert sorted(charts) == ["memory_breakdown.png", "memory_vs_accuracy.png",
                              "memory_vs_throughput.png"]
    for chart in charts.values():
        assert chart.path.stat().st_size > 10_000
        assert "MiB" in chart.axes[0] and chart.title
        assert not any(label.isdigit() for label in chart.labels)
    bars = charts["memory_breakdown.png"]
    # the OOM job is a bar (its peak is known); the killed job, with none, is in the note
    assert "checkpointing=none\noptim=adam" in bars.labels and len(bars.labels) == 4
    assert any("job 4 (checkpointing=full optim=adam): killed" in n for n in bars.notes)
    speed = charts["memory_vs_throughput.png"]
    assert speed.labels == ["checkpointing=none\noptim=sgd", "checkpointing=full\noptim=sgd",
                            "checkpointing=none\noptim=adamw"]
    assert speed.axes[1] == "throughput (samples/s)"  # 3.3 to 5 samples/s: linear
    assert "accuracy" in charts["memory_vs_accuracy.png"].axes[1]


def test_throughput_spanning_more_than_10x_is_on_a_log_axis_accuracy_never(tmp_path):
    rows = rows_of(result(["model=mlp"], 1.0, 0.01, 0.05), result(["model=resnet"], 2.0, 0.5, 0.8))
    charts = {chart.path.name: chart for chart in write_plots(rows, tmp_path)}
    assert charts["memory_vs_throughput.png"].axes[1] == "throughput (samples/s), log scale"
    assert charts["memory_vs_accuracy.png"].axes[1] == "eval accuracy (fraction correct)"


def test_labels_of_points_at_one_spot_do_not_overlap_nor_cover_a_point():
    anchors = [(200.0, 150.0)] * 4 + [(205.0, 152.0), (260.0, 150.0)]
    sizes = [(90.0, 24.0)] * len(anchors)
    boxes = place_labels(anchors, sizes, (0.0, 0.0, 600.0, 400.0))
    assert boxes == place_labels(anchors, sizes, (0.0, 0.0, 600.0, 400.0))  # deterministic
    for a, b in itertools.combinations(boxes, 2):
        assert overlap(a, b) == 0
    for box, (x, y) in itertools.product(boxes, anchors):
        assert overlap(box, (x - 5, y - 5, x + 5, y + 5)) == 0
    assert all(0 <= box[0] and box[2] <= 600 and 0 <= box[1] and box[3] <= 400 for box in boxes)


def test_the_timeline_and_the_breakdown_give_each_category_one_colour(tmp_path, monkeypatch):
    """A run's memory timeline (memory.snapshot) and its sweep's breakdown plot: activations,
    gradients and the rest are drawn in the same colour in both."""
    import matplotlib
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda figure, *a, **k: (saved.append(figure), real_savefig(figure, *a,
                                                                                      **k)))
    matplotlib.use("Agg")
    timeline = Timeline(100)
    timeline.set_states(2 * 2**20)
    for total, activations, grads in [(4, 1, 0), (6, 2, 1), (5, 1, 1)]:
        timeline.record("forward", total * 2**20, activations * 2**20, grads * 2**20, 0)
    timeline.write(tmp_path / "run")
    write_plots(rows_of(result(["checkpointing=none"], 0.08, 0.2, 0.71)), tmp_path)
    stacked = {c.get_label(): to_rgb(c.get_facecolor()[0]) for c in saved[0].axes[0].collections}
    breakdown = next(f for f in saved if "at the peak" in f.axes[0].get_title())
    legend = {text.get_text(): to_rgb(handle.get_facecolor()) for text, handle in
              zip(breakdown.axes[0].get_legend().get_texts(),
                  breakdown.axes[0].get_legend().legend_handles, strict=True)}
    for category in ("grads", "activations", "other"):
        assert stacked[category] == legend[category], category
    assert stacked["params_and_optimizer"] == legend["params"]


def test_the_plots_show_the_tables_figures_with_their_spread_and_keep_its_uncertain_marks(
        tmp_path):
    """The throughput chart plots the table's throughput column (the base's over the step
    time x base), each point with its ratio's spread; a time the table marks `?` keeps the mark
    and stays off the Pareto front, however good it looks (x0.09, two runs' medians on a busy
    machine); the accuracy axis starts at 0."""
    rows = rows_of(
        timed(["checkpointing=none"], 1.0, peak=100),
        # its own steps, alone, took 1.5 s; beside its baseline, 1.3x the baseline's
        timed(["checkpointing=full"], 1.5, peak=60, paired=1.3, checkpointing="full"),
        timed(["checkpointing=offload"], 0.09, peak=50, busy=True, checkpointing="offload"),
    )
    for row, accuracy in zip(rows, (0.52, 0.51, 0.505), strict=True):
        row.result["metrics"]["eval_accuracy"] = accuracy
    charts = {chart.path.name: chart for chart in write_plots(rows, tmp_path)}
    speed = charts["memory_vs_throughput.png"]
    table = markdown_table(rows).splitlines()
    throughputs = [float(line.split(" | ")[14].split()[0].rstrip("?")) for line in table[2:]]
    assert [round(y, 1) for _, y in speed.points] == throughputs == [64.0, 49.2, 711.1]
    assert speed.spreads[1] == pytest.approx((64 / 1.32, 64 / 1.28))
    assert speed.labels == ["checkpointing=none", "checkpointing=full",
                            "checkpointing=offload ?"]
    assert speed.front == ["checkpointing=full", "checkpointing=none"]
    # the table marks the same row, in its time ratio and its throughput
    assert "0.09?" in table[-1] and "711.1? samples/s" in table[-1]
    assert "?" not in table[-2]
    accuracy = charts["memory_vs_accuracy.png"]
    assert accuracy.y_limits[0] == 0 and accuracy.labels[2] == "checkpointing=offload"


def test_on_a_busy_machine_ratios_timed_beside_their_baseline_still_make_a_front(tmp_path):
    """Every job's steps shared the machine: the throughputs, all taken from the base's own
    busy steps, are marked, but the paired ratios are not, and the front is drawn from them."""
    rows = rows_of(
        timed(["checkpointing=none"], 1.0, peak=100, busy=True),
        timed(["checkpointing=full"], 1.5, peak=60, paired=1.3, busy=True, checkpointing="full"),
        timed(["checkpointing=offload"], 1.2, peak=50, paired=1.1, busy=True,
              checkpointing="offload"))
    assert [row.time_doubt for row in rows] == [None, None, None]
    speed = {c.path.name: c for c in write_plots(rows, tmp_path)}["memory_vs_throughput.png"]
    assert speed.front == ["checkpointing=offload ?", "checkpointing=none ?"]
    assert all("?" in line.split(" | ")[14] for line in markdown_table(rows).splitlines()[2:])


def test_repeats_are_one_point_with_their_seeds_range_and_compared_seed_by_seed(tmp_path):
    """Two seeds of three configs: checkpointing keeps each seed's accuracy (the same math) on
    less memory, so the baseline is off the front though its seeds' range overlaps; frozen
    BatchNorm loses accuracy at each seed."""
    accuracies = {("none", "train"): (0.94, 0.85), ("full", "train"): (0.94, 0.85),
                  ("none", "eval"): (0.53, 0.34)}
    records = []
    for (checkpointing, bn), seeds in accuracies.items():
        for seed, accuracy in enumerate(seeds):
            record = timed([f"checkpointing={checkpointing}", f"bn_mode={bn}",
                            f"trainer.seed={seed}"], 1.0, peak=100 if checkpointing == "none"
                           and bn == "train" else 60, paired=None if checkpointing == "none"
                           and bn == "train" else 1.2, checkpointing=checkpointing, bn_mode=bn)
            record["metrics"]["eval_accuracy"] = accuracy
            records.append(record)
    rows = rows_of(*records)
    assert [row.memory_base.job for row in rows] == ["0", "1", "0", "1", "0", "1"]
    chart = {c.path.name: c for c in write_plots(rows, tmp_path)}["memory_vs_accuracy.png"]
    assert chart.labels == ["bn_mode=train\ncheckpointing=none\n(2 seeds)",
                            "bn_mode=train\ncheckpointing=full\n(2 seeds)",
                            "bn_mode=eval\ncheckpointing=none\n(2 seeds)"]
    assert chart.spreads == [(0.85, 0.94), (0.85, 0.94), (0.34, 0.53)]
    assert chart.front == ["bn_mode=train\ncheckpointing=full\n(2 seeds)"]
