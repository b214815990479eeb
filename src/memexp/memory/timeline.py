"""memory.snapshot on CPU: live bytes by category over the run, as a table and a PNG plot.

The tracker records one point after every op. Params and optimizer state are counted whenever a
phase starts (they change only in the optimizer phase); between those points the rest is split
into activations, gradients and everything else. A long run stays bounded: when `max_entries`
points are held, every second one is dropped and from then on only every second op is recorded.
"""

from __future__ import annotations

import csv
from pathlib import Path

from memexp.result import category_color

COLUMNS = ("op", "phase", "params_and_optimizer", "grads", "activations", "other", "offloaded")


class Timeline:
    def __init__(self, max_entries: int):
        if max_entries < 2:
            raise ValueError(f"memory.snapshot_max_entries={max_entries}: must be >= 2")
        self.max_entries = max_entries
        self.points: list[tuple] = []
        self._ops = 0
        self._stride = 1
        self._states = 0

    def set_states(self, nbytes: int) -> None:
        self._states = nbytes

    def record(self, phase: str, total: int, activations: int, grads: int, host: int) -> None:
        self._ops += 1
        if self._ops % self._stride:
            return
        states = min(self._states, total)
        grads = min(grads, total - states)
        activations = min(activations, total - states - grads)
        other = total - states - grads - activations
        self.points.append((self._ops, phase, states, grads, activations, other, host))
        if len(self.points) >= self.max_entries:
            self.points = self.points[::2]
            self._stride *= 2

    def write(self, folder: Path) -> list[Path]:
        """`memory_timeline.csv` and `memory_timeline.png` in `folder`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder.mkdir(parents=True, exist_ok=True)
        table, plot = folder / "memory_timeline.csv", folder / "memory_timeline.png"
        with table.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(self.points)
        figure, axes = plt.subplots(figsize=(10, 4))
        if self.points:
            ops = [p[0] for p in self.points]
            stacks = [[p[i] / 2**20 for p in self.points] for i in range(2, 6)]
            # each category in the colour the sweep's breakdown plot gives it (parameters and
            # optimizer state together in the parameters')
            colors = [category_color(c) for c in ("params", "grads", "activations", "other")]
            axes.stackplot(ops, *stacks, labels=COLUMNS[2:6], colors=colors, step="post")
            axes.plot(ops, [p[6] / 2**20 for p in self.points], color="black", lw=0.8,
                      ls="--", label="offloaded (host)")
        axes.set_xlabel("op (the run's tensor operations, in order)")
        axes.set_ylabel("live tensor memory (MiB)")
        axes.set_title("Live tensor memory by category over the run (memory.snapshot)")
        # outside the data, on the right: inside it covered the first peak
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
        figure.savefig(plot, dpi=110, bbox_inches="tight")
        plt.close(figure)
        return [table, plot]
