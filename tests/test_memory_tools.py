"""memory.budget, the max-batch finder, memory.snapshot and leak detection, on real runs."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from test_sweep import TESTS, results, sweep

from memexp import cli
from memexp.app import run_config
from memexp.find_batch import probe, with_batch_size
from memexp.loggers import NoLogger
from memexp.memory.sizes import parse_size
from memexp.out_of_memory import OutOfMemory
from memexp.plots import write_plots
from memexp.report import load_rows
from memexp.trainer import Trainer

from conftest import compose_train

MLP = ("model=mlp", "data.num_train=512", "data.num_eval=128", "logger=none")


def run(tmp_path, *overrides: str) -> dict:
    """run_config as train.py runs it; the result.json it left, whether or not it raised."""
    cfg = compose_train(*overrides)
    try:
        run_config(cfg, tmp_path, {}, list(overrides), "test")
    except Exception:
        pass
    return json.loads((tmp_path / "result.json").read_text())


# -- memory.budget -------------------------------------------------------------------------
def test_a_run_over_budget_ends_oom_with_the_peak_it_reached_and_the_phase(tmp_path):
    result = run(tmp_path, *MLP, "memory.budget=6MiB", "trainer.max_steps=3")
    assert result["status"] == "oom"
    assert "memory.budget: tried to allocate" in result["error"]
    memory = result["memory"]
    # the allocation that did not fit is not counted: the peak is what the device held
    assert 4 * 2**20 < memory["peak_bytes"] <= parse_size("6MiB", "memory.budget")
    assert memory["oom"] == {"phase": "backward", "step": 1}


def test_a_cpu_sweep_shows_which_configs_would_oom_and_goes_on(tmp_path):
    sweep_dir = tmp_path / "budget"
    done = sweep(sweep_dir, *MLP, "trainer.max_steps=3", "memory.budget=6MiB,64MiB")
    assert done.returncode != 0  # one job did not succeed
    found = results(sweep_dir)
    assert [found[j]["status"] for j in "01"] == ["oom", "ok"]
    assert found["1"]["memory"]["peak_bytes"] <= 64 * 2**20
    report = (sweep_dir / "report.md").read_text()
    assert "| oom |" in report and "| ok |" in report
    # The plots, drawn again from the real results: the OOM job is a marked bar, labelled
    # like every point with the override that tells it apart.
    charts = {chart.path.name: chart for chart in write_plots(load_rows(sweep_dir)[0], tmp_path)}
    bars = charts["memory_breakdown.png"]
    assert bars.labels == ["memory.budget=6MiB", "memory.budget=64MiB"]
    assert any("did not succeed" in note for note in bars.notes)
    # memory.budget on a CPU tracks every step, so there is no untracked step time to plot
    assert "memory_vs_throughput.png" not in charts
    assert charts["memory_vs_accuracy.png"].labels == ["memory.budget=64MiB"]
    assert all((sweep_dir / name).stat().st_size > 0 for name in charts)  # the sweep's own


# -- the max-batch finder ------------------------------------------------------------------
def test_auto_batch_size_is_the_largest_that_fits_checked_directly(tmp_path):
    budget = ("memory.budget=12MiB",)
    result = run(tmp_path, *MLP, *budget, "data.batch_size=auto", "trainer.max_steps=2")
    assert result["status"] == "ok"
    found = result["batch_search"]["batch_size"]
    assert result["config"]["data"]["batch_size"] == found == result["config"]["data"][
        "eval_batch_size"]
    probes = result["batch_search"]["probes"]
    assert [p["batch_size"] for p in probes][:4] == [1, 2, 4, 8]  # doubling first
    assert any(not p["fits"] for p in probes)
    # the direct check: a fresh run at the found size fits, one sample more does not
    cfg = compose_train(*MLP, *budget)
    cpu = torch.device("cpu")
    assert probe(with_batch_size(cfg, found), cpu) is not None
    assert probe(with_batch_size(cfg, found + 1), cpu) is None


def test_find_batch_shows_each_probe_as_it_ends(capsys):
    assert cli.main(["find-batch", *MLP, "model.hidden=16", "data.num_train=8", "data.num_eval=8",
                     "memory.budget=12MiB", "trainer.device=cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [
        f"  batch {size:>6}" for size in (1, 2, 4, 8)]  # doubling up to the 8 samples there are
    assert all(line.endswith(" MiB") for line in lines[:-1])
    assert lines[-1].startswith("memexp find-batch: data.batch_size=8 is the largest that fits")


# -- memory.snapshot -----------------------------------------------------------------------
def read_timeline(folder) -> list[dict]:
    with (folder / "memory" / "memory_timeline.csv").open() as f:
        return list(csv.DictReader(f))


def test_snapshot_writes_a_timeline_by_category_and_also_on_an_oom(tmp_path):
    ok = run(tmp_path / "ok", *MLP, "memory.snapshot=true", "trainer.max_steps=3")
    assert ok["status"] == "ok"
    points = read_timeline(tmp_path / "ok")
    assert (tmp_path / "ok" / "memory" / "memory_timeline.png").stat().st_size > 10_000
    assert {"forward", "backward", "optimizer", "eval"} <= {p["phase"] for p in points}
    assert max(int(p["grads"]) for p in points) > 0
    highest = max(sum(int(p[c]) for c in ("params_and_optimizer", "grads", "activations",
                                          "other")) for p in points)
    assert highest == ok["memory"]["peak_bytes"]
    oom = run(tmp_path / "oom", *MLP, "memory.snapshot=true", "memory.budget=6MiB")
    assert oom["status"] == "oom"
    assert read_timeline(tmp_path / "oom")[-1]["phase"] == "backward"  # up to the failure
    assert (tmp_path / "oom" / "memory" / "memory_timeline.png").exists()


def test_snapshot_is_bounded_by_max_entries(tmp_path):
    run(tmp_path, *MLP, "memory.snapshot=true", "memory.snapshot_max_entries=50",
        "trainer.max_steps=4")
    assert len(read_timeline(tmp_path)) < 50


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_is_the_allocator_history_pickle(tmp_path):
    import pickle

    run(tmp_path, *MLP, "trainer.device=cuda", "memory.snapshot=true", "trainer.max_steps=2")
    snapshot = pickle.loads((tmp_path / "memory" / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]


# -- leak detection ------------------------------------------------------------------------
def chaos(mode: str) -> dict:
    cfg = compose_train("model=custom", "model._target_=chaos.Chaos", f"+model.mode={mode}",
                        "data.batch_size=8", "data.num_eval=16", "trainer.max_steps=8",
                        "trainer.warmup_steps=2")
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    return trainer.meter.report()


def test_a_loop_that_keeps_each_steps_graph_is_reported_with_its_growth(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    leak = chaos("leak")["leak"]
    assert leak is not None and leak["from_step"] == 3 and leak["steps"] == 5
    # each step's kept graph holds that step's logits (8 samples x 10 classes, float32)
    assert leak["bytes_per_step"] >= 8 * 10 * 4
    assert chaos("ok")["leak"] is None


def test_a_budget_smaller_than_the_model_fails_while_building():
    with pytest.raises(torch.OutOfMemoryError, match="memory.budget"):
        Trainer(compose_train(*MLP, "memory.budget=1MiB"))


def test_out_of_memory_carries_the_phase_and_step():
    trainer = Trainer(compose_train(*MLP, "memory.budget=6MiB"))
    with pytest.raises(OutOfMemory) as raised:
        trainer.fit(NoLogger())
    assert (raised.value.phase, raised.value.step) == ("backward", 1)
