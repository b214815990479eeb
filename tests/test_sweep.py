"""Real sweeps through submitit_local, as a user runs them: results, the report, wandb, failures."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from memexp import cli
from memexp.result import GROUPS, mib

from conftest import (
    CPU_SMALL,
    REPO,
    TRAIN_PY_ENV,
    Background,
    Ran,
    Together,
    default_sigint,
    early,
)
from conftest import job as run_in_process
from wandb_records import summary as wandb_summary

pytestmark = pytest.mark.slow

TINY_DATA = ["debug=fast", "data.batch_size=8", "data.num_eval=64"]
TINY = [*TINY_DATA, "model.width=4"]
TESTS = Path(__file__).resolve().parent


def sweep(sweep_dir: Path, *overrides: str, env: dict | None = None,
          timeout: float = 400) -> subprocess.CompletedProcess:
    """`python train.py -m ...` in a subprocess; tests/ is importable (for chaos.Chaos)."""
    return subprocess.run(sweep_command(sweep_dir, overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=sweep_dir.parent, env=sweep_env(env))


def started_sweep(folder: Path, name: str, *overrides: str,
                  env: dict | None = None) -> Background:
    """sweep(), started in the background (an `early` fixture's), its folder folder/name."""
    return Background(sweep_command(folder / name, overrides), folder, sweep_env(env))


def ended_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The sweep's line for each job as it ended (not those as it started, or its heartbeats)."""
    return [line for line in (done.stdout + done.stderr).splitlines()
            if re.search(r"\[\d+/\d+\] job #", line) and not line.endswith(": started")
            and ": running, " not in line]


def sweep_command(sweep_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}",
            *overrides]


def sweep_env(env: dict | None) -> dict:
    # tests/ before the caller's own PYTHONPATH (a checkout's src/ ahead of an installed memexp)
    path = os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))
    environment = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    environment.pop("WANDB_MODE", None)  # the developer's own setting must not leak in
    environment.update(env or {})
    return environment


def results(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text())
            for p in sorted(sweep_dir.glob("*/result.json"))}


def assert_serial(records: list[dict]) -> None:
    """Jobs ran one at a time: each started after the previous one finished."""
    spans = sorted((r["started_at"], r["finished_at"]) for r in records if r.get("started_at"))
    for (_, finished), (started, _) in zip(spans, spans[1:], strict=False):
        assert started >= finished


def read(folder: Path, name: str, *overrides: str, env: dict | None = None) -> Ran:
    return Ran(folder / name, started_sweep(folder, name, *overrides, env=env))


@early()
def four_jobs(folder: Path) -> Ran:
    return read(folder, "four", *TINY, "logger=wandb", "precision=fp32,bf16",
                "checkpointing=none,full")


def test_a_four_job_sweep_writes_every_result_and_the_report(four_jobs):
    sweep_dir, done = four_jobs
    assert done.returncode == 0, done.stderr[-3000:]
    found = results(sweep_dir)
    assert sorted(found) == ["0", "1", "2", "3"]
    assert all(r["status"] == "ok" for r in found.values())
    assert {(r["techniques"]["precision"], r["techniques"]["checkpointing"])
            for r in found.values()} == {("fp32", "none"), ("fp32", "full"), ("bf16", "none"),
                                         ("bf16", "full")}
    for name in ("report.md", "report.csv", "memory_breakdown.png", "memory_vs_throughput.png",
                 "memory_vs_accuracy.png"):
        assert (sweep_dir / name).stat().st_size > 0
    assert "| job | config | status | base | peak MiB" in done.stderr + done.stdout  # at the end


def test_report_rows_match_the_results(four_jobs):
    sweep_dir, done = four_jobs
    found = results(sweep_dir)
    with open(sweep_dir / "report.csv") as f:
        rows = {row["job"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == sorted(found)
    for job, result in found.items():
        row = rows[job]
        assert row["status"] == result["status"]
        assert row["precision"] == result["techniques"]["precision"]
        assert float(row["peak_mib"]) == pytest.approx(result["memory"]["peak_bytes"] / 2**20)
        assert float(row["eval_accuracy"]) == pytest.approx(result["metrics"]["eval_accuracy"])
    baseline = next(r for r in rows.values()
                    if r["precision"] == "fp32" and r["checkpointing"] == "none")
    assert float(baseline["memory_x_base"]) == 1.0
    full = next(r for r in rows.values()
                if r["precision"] == "fp32" and r["checkpointing"] == "full")
    assert float(full["memory_x_base"]) < 1.0
    # each other job timed its baseline (fp32, none: the base's config) beside its steps 3-5
    # (debug=fast), and that is its ratio in the report
    for job, row in rows.items():
        paired = found[job]["metrics"]["timing"]["paired"]
        if row is baseline:
            assert paired == {"skipped": "the run is its own baseline"}
            assert row["step_time_x_base_paired"] == ""
        else:
            assert paired["steps"] == [[3, 5]] and row["step_time_x_base_paired"] == "True"
            assert float(row["step_time_x_base"]) == pytest.approx(paired["ratio"])
        # the line the job printed as it ended gives the table's ratio and base
        ratio = float(row["step_time_x_base"])
        assert any(f"job #{job} " in line and f"step time x base {ratio:.2f}" in line
                   and f"(base: job {row['step_time_base']})" in line
                   for line in (done.stderr + done.stdout).splitlines()
                   if ": ok, peak " in line), job


def test_jobs_run_one_at_a_time_by_default(four_jobs):
    assert_serial(list(results(four_jobs[0]).values()))


def test_each_job_is_an_offline_wandb_run_in_the_sweeps_group(four_jobs):
    sweep_dir, _ = four_jobs
    for job, result in results(sweep_dir).items():
        assert result["logger"]["wandb"]["mode"] == "offline"
        run_file = next((sweep_dir / job / "wandb").glob("offline-run-*/run-*.wandb"))
        recorded = wandb_summary(run_file)
        assert recorded["group"] == sweep_dir.name
        assert recorded["job_type"] == "/".join(str(result["techniques"][g]) for g in GROUPS)
        assert "precision=" + result["techniques"]["precision"] in recorded["tags"]
        assert recorded["config"]["trainer"] == result["config"]["trainer"]
        assert any("memory_bytes" in step and "loss" in step for step in recorded["history"])
        assert recorded["exit_code"] == 0
    # The comparison table, logged at the end of the sweep in a run of its own.
    report_run = next((sweep_dir / "wandb").glob("offline-run-*"))
    recorded = wandb_summary(next(report_run.glob("run-*.wandb")))
    assert recorded["group"] == sweep_dir.name and recorded["job_type"] == "report"
    table = json.loads(next(report_run.glob("files/media/table/*.table.json")).read_text())
    assert len(table["data"]) == 4 and "peak_mib" in table["columns"]
    # its summary gives each job the table's ratio, against the table's base
    with open(sweep_dir / "report.csv") as f:
        for row in csv.DictReader(f):
            assert recorded["summary"][f"job/{row['job']}/step_time_x_base"] == pytest.approx(
                float(row["step_time_x_base"]))
            assert recorded["summary"][f"job/{row['job']}/step_time_base"] == \
                row["step_time_base"]


def test_report_command_works_on_a_partial_sweep(four_jobs, tmp_path, capsys):
    """In this process; `python -m memexp.cli report` as a command: tests/test_reading_records."""
    sweep_dir, _ = four_jobs
    partial = tmp_path / "partial"
    for job in ("0", "2"):
        shutil.copytree(sweep_dir / job, partial / job)
    running = json.loads((sweep_dir / "1" / "result.json").read_text())
    running.update(status="running", memory=None, metrics=None, finished_at=None)
    (partial / "1").mkdir()
    (partial / "1" / "result.json").write_text(json.dumps(running))
    assert cli.main(["report", str(partial), "--budget", "64MiB"]) == 0
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "running" in printed
    assert "fastest that fits" in printed
    with open(partial / "report.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["ok", "running", "ok"]


@early()
def chaos_sweep(folder: Path) -> Ran:
    return read(folder, "chaos", *TINY_DATA, "logger=wandb", "model=custom",
                "model._target_=chaos.Chaos", "+model.mode=ok,raise,oom,diverge,kill,ok",
                "hydra.launcher.heartbeat_s=0.2")


def test_a_chaos_sweep_records_every_job_truthfully_and_goes_on(chaos_sweep):
    """Jobs that raise, run out of memory, diverge, are SIGKILLed, or succeed, in one sweep."""
    sweep_dir, done = chaos_sweep
    assert done.returncode != 0  # the sweep says that some jobs failed
    assert ("4 of 6 jobs did not succeed: job 1 failed, job 2 oom, job 3 nan, job 4 killed"
            in done.stderr)
    found = results(sweep_dir)
    statuses = ["ok", "failed", "oom", "nan", "killed", "ok"]
    assert [found[str(j)]["status"] for j in range(6)] == statuses
    assert "chaos: this job raises" in found["1"]["error"]
    assert found["2"]["memory"]["oom"]["phase"] == "forward"
    assert found["3"]["metrics"]["bad_steps"] == 3
    assert found["4"]["error"] and found["4"]["finished_at"]
    for job in "05":  # no finished result is lost
        assert found[job]["metrics"]["eval_accuracy"] is not None
    assert_serial(list(found.values()))
    # In the sweep's own output, one line per job as it started, a heartbeat while it runs
    # (hydra.launcher.heartbeat_s), and one as it ended, with its place in the sweep.
    lines = [line for line in (done.stdout + done.stderr).splitlines()
             if re.search(r"\[\d+/6\] job #", line)]
    for job in range(6):
        mine = [line.split(": ", 1)[1] for line in lines if f"/6] job #{job} " in line]
        assert mine[0] == "started" and mine[1].startswith("running, "), mine
    ended = ended_lines(done)
    assert len(ended) == 6
    for job, (line, status) in enumerate(zip(ended, statuses, strict=True)):
        peak = found[str(job)]["memory"] and found[str(job)]["memory"]["peak_bytes"]
        assert re.search(rf"\[{job + 1}/6\] job #{job} .*\+model\.mode=\w+: {status}, "
                         rf"peak {mib(peak)}, (step time x base [\d.]+\?? \(base: job \d\), )?"
                         rf"(\d+ min )?\d+ s$", line), line
    report = (sweep_dir / "report.md").read_text()
    for job, status in enumerate(statuses):
        assert f"| {job} | +model.mode=" in report and f"| {status} |" in report
    for plot in ("memory_breakdown.png", "memory_vs_throughput.png", "memory_vs_accuracy.png"):
        assert f"]({plot})" in report and (sweep_dir / plot).stat().st_size > 0
    # The failed job's wandb run ends with a non-zero exit code.
    failed_run = next((sweep_dir / "1" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert wandb_summary(failed_run)["exit_code"] == 1


def test_ctrl_c_on_a_sweep_records_its_running_job_as_interrupted(tmp_path):
    """A terminal's Ctrl-C: SIGINT to the sweep's whole process group. The running job gets it
    more than once (from the terminal; passed on by the launcher, and with preload by the
    job's client), when they come: here, to be sure one comes while the job writes its record,
    the test passes one on every millisecond until the job ends. And a loaded machine may not
    run the job for seconds: here it is stopped (SIGSTOP) when the Ctrl-C comes, for 2 s.
    submitit's controller SIGKILLs its task 1 s after passing a Ctrl-C on; the job must still
    record `interrupted`, with its figures. Both ways a local job runs, as two sweeps side by
    side, each interrupted once its job has logged a step."""
    sweeps = {}
    try:
        for preload in ("true", "false"):
            sweep_dir = tmp_path / f"preload_{preload}"
            sweep_dir.mkdir()
            with open(sweep_dir / "out", "w") as out:  # its own session: a terminal's group
                sweeps[sweep_dir] = subprocess.Popen(
                    [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}",
                     f"hydra.launcher.preload={preload}", "model=mlp", "data.batch_size=8",
                     "trainer.max_steps=1000000", "trainer.log_every=1", "optim=sgd"],
                    stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=TRAIN_PY_ENV,
                    preexec_fn=default_sigint, start_new_session=True)
        jobs = {}
        for sweep_dir, process in sweeps.items():
            metrics = sweep_dir / "0" / "metrics.csv"  # its header, then a row a step: training
            while not (metrics.exists() and len(metrics.read_text().splitlines()) > 1):
                assert process.poll() is None, (sweep_dir / "out").read_text()[-3000:]
                time.sleep(0.05)
            # the job's process, which holds its run folder (a pidfd: never another's pid)
            holder = (sweep_dir / "0" / ".memexp.lock").read_text()
            jobs[sweep_dir] = os.pidfd_open(int(re.fullmatch(r"pid (\d+) on .*", holder)[1]))
            signal.pidfd_send_signal(jobs[sweep_dir], signal.SIGSTOP)
            os.killpg(process.pid, signal.SIGINT)
        time.sleep(2)  # the jobs stay stopped, with their Ctrl-C pending
        for job in jobs.values():
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile: the test fails
                signal.pidfd_send_signal(job, signal.SIGCONT)
        for job in jobs.values():
            with contextlib.suppress(ProcessLookupError):  # reaped already
                while not select.select([job], [], [], 0.001)[0]:  # readable once it ended
                    signal.pidfd_send_signal(job, signal.SIGINT)
            os.close(job)
        for sweep_dir, process in sweeps.items():
            assert process.wait(timeout=300) != 0
            record = results(sweep_dir)["0"]
            assert record["status"] == "interrupted", (sweep_dir / "out").read_text()[-3000:]
            assert "KeyboardInterrupt" in record["error"] and record["metrics"]["steps"] >= 1
            assert record["memory"]["peak_bytes"] > 0
    finally:
        for process in sweeps.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@early()
def cuda_sweep(folder: Path) -> Ran:
    return read(folder, "nocuda", *TINY, "trainer.device=cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_job_asking_for_cuda_without_a_gpu_fails_loudly(cuda_sweep):
    sweep_dir, done = cuda_sweep
    assert done.returncode != 0
    result = results(sweep_dir)["0"]
    assert result["status"] == "failed"
    assert "trainer.device=cuda, but this process sees no CUDA device" in result["error"]


class SilentServer:
    """A loopback socket that accepts connections and never answers."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.port = self.socket.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.socket.accept()[0])
            except OSError:
                return


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class UnreachableWandb(Together):
    """A one-job sweep for each way a wandb server is unreachable, started together:
    {how: (its folder, its CompletedProcess, the SilentServer or None)}."""

    def __init__(self, folder: Path):
        self.silent = {"refuses": None, "never answers": SilentServer()}
        started = {}
        for how, silent in self.silent.items():
            port = silent.port if silent else closed_port()
            env = {"WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40,
                   "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
            (folder / how).mkdir()
            started[how] = read(folder / how, "wandb", *TINY, "logger=wandb", env=env)
        super().__init__(started)

    def result(self) -> dict[str, tuple[Path, subprocess.CompletedProcess, SilentServer | None]]:
        return {how: (*ran, self.silent[how]) for how, ran in super().result().items()}


@early()
def unreachable_wandb(folder: Path) -> UnreachableWandb:
    return UnreachableWandb(folder)


@pytest.mark.parametrize("server", ["refuses", "never answers"])
def test_an_unreachable_wandb_server_never_fails_the_job(unreachable_wandb, server):
    sweep_dir, done, silent = unreachable_wandb[server]
    assert done.returncode == 0, done.stderr[-3000:]
    result = results(sweep_dir)["0"]
    assert result["status"] == "ok"
    assert result["logger"]["wandb"]["mode"] == "offline"
    assert "unreachable" in result["logger"]["wandb"]["why"]
    if silent:
        # Each process that logs (the job, the sweep's report run) asks once, with memexp's
        # short probe; once it went unanswered nothing else waits on the server: not wandb's
        # init (90 s), nor its analytics at exit (10 s).
        assert len(silent.held) == 2


@early()
def bad_budget_sweep(folder: Path) -> Ran:
    return read(folder, "budget", *TINY, "report.budget=lots", "checkpointing=none,full")


def test_a_bad_budget_stops_the_sweep_before_any_job_runs(bad_budget_sweep):
    sweep_dir, done = bad_budget_sweep
    assert done.returncode != 0
    assert "report.budget=lots: expected a positive size such as 12GiB" in done.stderr
    assert not list(sweep_dir.glob("*/result.json"))


def test_each_jobs_config_is_composed_once_for_the_sweepers_check_and_the_launcher(monkeypatch):
    """Hydra's sweeper composes every job's config to check its batch, then the launcher needs
    them: ComposedOnce (around Hydra's own loader) hands the launcher the check's."""
    import cloudpickle
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    from memexp.config import config_dir

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(config_dir())))
    master = loader.load_configuration("train", overrides=["checkpointing=none,full"],
                                       run_mode=RunMode.MULTIRUN)
    # after Hydra's plugin scan, which imports the launcher's module anew
    from hydra_plugins.memexp_launcher.launcher import ComposedOnce

    composed, compose = [], loader.load_sweep_config
    monkeypatch.setattr(loader, "load_sweep_config",
                        lambda config, overrides: composed.append(overrides) or
                        compose(config, overrides))
    once = ComposedOnce(loader)
    checked = once.load_sweep_config(master, ["checkpointing=full"])  # the sweeper's check
    taken = once.take(master, ["checkpointing=full"])  # the launcher's
    assert taken is checked and composed == [["checkpointing=full"]]
    assert taken.checkpointing._target_ == "memexp.techniques.checkpointing.CheckpointBlocks"
    # what the launcher took is its own to change: asked again, the loader composes anew
    assert once.take(master, ["checkpointing=full"]) is not taken and len(composed) == 2
    # it travels to each job inside the launcher, which submitit pickles with cloudpickle
    assert cloudpickle.loads(cloudpickle.dumps(once)).get_search_path() is not None


def test_a_sweeps_composes_read_each_config_once_and_give_what_hydra_alone_gives(
        tmp_path, monkeypatch):
    """ComposedOnce's composes share one SharedRepository, which reads each config once for the
    sweep: they equal a plain loader's. A compose that sets hydra.searchpath reads its own
    search path, which the next compose does not see."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.errors import MissingConfigException
    from hydra.types import RunMode

    from memexp.config import config_dir

    def loader_and_master():
        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(config_dir())))
        return loader, loader.load_configuration("train", overrides=["optim=sgd,adamw"],
                                                 run_mode=RunMode.MULTIRUN)

    from hydra_plugins.memexp_launcher.launcher import ComposedOnce  # after the plugin scan

    (plain, plain_master), (loader, master) = loader_and_master(), loader_and_master()
    once = ComposedOnce(loader)
    hydras, loads = loader.repository._repository, Counter()  # Hydra's own reads, by path
    read = hydras.load_config
    monkeypatch.setattr(hydras, "load_config", lambda path: loads.update([path]) or read(path))
    jobs = [["optim=adamw", "checkpointing=full", "memory.budget=6MiB"], ["model=transformer"],
            ["optim=sgd", "precision=bf16", "memory.budget=64MiB"], ["optim=adamw", "optim.lr=0.5"]]
    taken = [once.take(master, overrides) for overrides in jobs]  # all, then compared
    for config, overrides in zip(taken, jobs, strict=True):
        assert (OmegaConf.to_yaml(config)
                == OmegaConf.to_yaml(plain.load_sweep_config(plain_master, overrides)))
    assert [c.memory.budget for c in taken] == ["6MiB", None, "64MiB", None]
    assert "optim/adamw" in loads and set(loads.values()) == {1}  # each read once
    monkeypatch.undo()  # a copy of the counting repository would read its old search path
    extra = tmp_path / "extra"
    (extra / "optim").mkdir(parents=True)
    (extra / "optim" / "mine.yaml").write_text(
        (config_dir() / "optim" / "sgd.yaml").read_text().replace("lr: 0.05", "lr: 0.5"))
    mine = once.take(master, [f"hydra.searchpath=[file://{extra}]", "optim=mine"])
    assert mine.optim.lr == 0.5
    with pytest.raises(MissingConfigException, match="mine"):
        once.take(master, ["optim=mine"])
    # the job's pickle carries none of the configs read
    import cloudpickle

    assert cloudpickle.loads(cloudpickle.dumps(loader.repository))._cache == {}


def test_a_sweep_job_refused_before_it_ran_is_not_shown_as_its_earlier_record(tmp_path):
    """The rerun's job is refused (another optimizer over the job folder's checkpoint) and
    writes nothing: the folder's ok record is the earlier run's, and the sweep's line for the
    job must say that, not `ok`."""
    sweep_dir = tmp_path / "sweep"
    settings = (*TINY, "trainer.max_steps=1", "trainer.checkpoint_every=1", "logger=none",
                *CPU_SMALL)
    run_in_process(sweep_dir / "0", *settings, "optim=sgd")  # the earlier run: its record
    done = sweep(sweep_dir, *settings, "optim=adam")
    assert done.returncode != 0
    line = next(line for line in ended_lines(done) if "[1/1] job #0" in line)
    assert "refused before it ran" in line and "an earlier run's record (ok)" in line, line
