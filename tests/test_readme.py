"""The figures README.md and docs/ quote are what a fresh run gives (scripts/readme_figures.py
writes them).

One quoted job is rerun: the quick sweep's baseline (`make run`'s job 0), its 30 steps. Memory is
deterministic here, so its figures must match to the printed digit; accuracy to 3 decimals,
where torch runs the same CPU kernels as the README's run did. The README's single-run summary
is the defaults' (200 steps), whose memory is that of any of their steps from the second on: its
memory lines must be those of a 3-step run of the same config, in this process.
Then the pages name every config group and option there is (memexp.registry).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from memexp import registry
from memexp.result import summary

from conftest import REPO, job

BASELINE = ["experiment=quick"]  # the sweep's job 0: checkpointing=none bn_mode=train seed 0
# The README's figures were made with 2 intra-op threads (torch's default on 2 cores); another
# count sums in another order, and some steps later the accuracy differs in the 2nd decimal.
# A thread that waits for the other sleeps (OMP_WAIT_POLICY=PASSIVE) rather than spins: the same
# kernels and sums (the same losses), but beside other busy processes (make test's second
# worker) spinning cost 5 times the CPU time. At load 28 this run took 15 s of CPU and 4 minutes
# passive; with the default policy it had taken 77 s of CPU and 11 minutes by its 26th step.
README_THREADS = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
MEMORY_LINES = ("  peak memory", "    at peak", "    by phase")
QUOTED = "bn_mode=train checkpointing=none trainer.seed=0"  # the job's row in the quick table


def figures(name: str) -> str:
    """What the markers of `name` hold, in README.md or a page of docs/."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [re.search(rf"<!-- figures:{name} -->(.*?)<!-- /figures:{name} -->", page.read_text(),
                       re.S) for page in pages]
    found = [match.group(1) for match in found if match]
    assert len(found) == 1, f"figures:{name} markers in {len(found)} pages of README.md and docs/"
    return found[0]


def quoted_row(config: str) -> dict[str, str]:
    rows = [line for line in figures("quick").splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    row = next(r for r in rows if f"| {config} |" in r)
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("readme") / "run"
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *BASELINE,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=900, cwd=run_dir.parent, env=README_THREADS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.slow
def test_the_quick_sweeps_quoted_baseline_memory_is_a_fresh_runs(baseline):
    result = baseline
    quoted = quoted_row(QUOTED)
    memory = result["memory"]
    breakdown = memory["breakdown_at_peak"]
    assert quoted["peak MiB"] == f"{memory['peak_bytes'] / 2**20:.1f}"
    for category in ("params", "grads", "optimizer", "activations", "other"):
        assert quoted[category] == f"{breakdown[category] / 2**20:.1f}", category


@pytest.mark.slow
def test_the_quick_sweeps_quoted_accuracy_is_a_fresh_runs_on_the_same_kernels(baseline):
    """Accuracy after the quick sweep's steps moves with the order of the float sums, which the
    CPU kernels torch picks (AVX512, AVX2) set: it is compared where they are those of the
    README's run."""
    quoted_kernels = re.search(r"(\w+) kernels", figures("quick-time")).group(1)
    here = torch.backends.cpu.get_cpu_capability()
    if here != quoted_kernels:
        pytest.skip(f"the README's figures come from torch's {quoted_kernels} kernels, this "
                    f"machine runs its {here} ones, which sum in another order")
    quoted = quoted_row(QUOTED)
    assert quoted["eval acc"] == f"{baseline['metrics']['eval_accuracy']:.3f}"


def test_the_quoted_single_run_summary_has_a_fresh_runs_memory(tmp_path):
    record = job(tmp_path / "run", "trainer.max_steps=3", "data.num_eval=128")
    printed = summary(record, tmp_path / "run").splitlines()
    quoted = figures("run").splitlines()
    for start in MEMORY_LINES:
        line = next(line for line in quoted if line.startswith(start))
        assert line in printed, f"README: {line!r}; a fresh run printed: {printed}"


def anchors(page: Path) -> Iterator[str]:
    """The anchors GitHub gives the headings of `page` (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


@pytest.mark.parametrize("page", ["README.md", "BENCHMARKS.md",
                                  *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_every_link_between_the_pages_leads_to_a_page_and_heading(page):
    path = REPO / page
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page}: {target}: no such file"
        if anchor:
            assert anchor in set(anchors(linked)), f"{page}: {target}: no such heading"


def section(text: str, heading: str) -> str:
    """The part of a page under its `## <heading>` line, up to the next `## `."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"no '## {heading}' section"
    return found.group(1)


def test_the_docs_name_every_group_and_every_option_in_conf():
    """docs/running.md's table has a row for each config group with every option it has in
    conf/, and docs/techniques.md a section for each technique group naming each of its
    options: a new option is in the docs or this fails, naming it (memexp.registry reads
    conf/)."""
    running = (REPO / "docs" / "running.md").read_text().splitlines()
    techniques = (REPO / "docs" / "techniques.md").read_text()
    missing = []
    for group in registry.groups():
        row = next((line for line in running if line.startswith(f"| `{group}` |")), "")
        missing += [f"docs/running.md: {group}={option}" for option in registry.options(group)
                    if f"`{option}`" not in row]
    for group in registry.techniques():
        text = section(techniques, group)
        missing += [f"docs/techniques.md: {group}={option}"
                    for option in registry.options(group) if f"`{option}`" not in text]
    assert not missing, f"options the docs do not name: {', '.join(missing)}"
