"""Results you can trust: no stale or mixed measurement is recorded as ok, and every fault ends
in a clear status. Each fault happens for real here: a rerun in a used folder, a real SIGTERM
and SIGINT, two live processes, a full tmpfs, a crafted pickle."""

from __future__ import annotations

import csv
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.callbacks import Callbacks

from memexp import checkpoint, cli
from memexp.app import Terminated, interrupted_once, run_config, sigterm_raises
from memexp.checkpoint import ResumeRefused
from memexp.config import config_dir
from memexp.data import cifar10, mnist
from memexp.report import describe_rows, markdown_table
from memexp.result import summary
from memexp.rows import Row

from conftest import (
    CPU_SMALL,
    TRAIN_PY_ENV,
    compose_train,
    fill,
    job,
    run_train_py,
    small_filesystem,
    start_train_py,
    train,
    train_py,
    write_idx,
    write_tiny_cifar10,
    write_tiny_mnist,
)

TINY = ("model=mlp", "model.hidden=16", "model.depth=1", "data.batch_size=8",
        "data.num_train=64", "data.num_eval=32", "trainer.log_every=1")
RESUMABLE = (*TINY, "trainer.max_steps=6", "trainer.checkpoint_every=2")
CHAOS = ("model=custom", "model._target_=chaos.Chaos", "data.batch_size=8", "data.num_eval=32")
ENDLESS = (*TINY, "trainer.max_steps=1000000", "trainer.device=cpu", "trainer.progress=false")


@pytest.fixture(autouse=True)
def chaos_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def attempt(run_dir: Path, *overrides: str) -> dict:
    """job(), raised or not; the result.json it left."""
    try:
        job(run_dir, *overrides)
    except BaseException:
        pass
    return json.loads((run_dir / "result.json").read_text())


def error_shown(result: dict) -> str:
    """The error line of the summary a user sees at the end of a run."""
    return next(line for line in summary(result, "run").splitlines()
                if line.startswith("  error"))


def wait_for_steps(run_dir: Path, process: subprocess.Popen, steps: int = 2) -> None:
    """Until the run has logged `steps` training steps: it is training, whatever the load."""
    rows = run_dir / "metrics.csv"
    while not rows.is_file() or len(rows.read_text().splitlines()) <= steps:
        assert process.poll() is None, "the run ended before it was signalled"
        time.sleep(0.2)


def sweep_config(sweep_dir: Path):
    """The sweep's config, with Hydra's own keys (its callbacks among them)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=[*CPU_SMALL, f"hydra.sweep.dir={sweep_dir}"],
                       return_hydra_config=True)


# -- 1: data.batch_size=auto ----------------------------------------------------------------------
@pytest.mark.slow
def test_auto_batch_size_works_through_train_py(tmp_path):
    """train.py resolves the config before the search (eval_batch_size: ${.batch_size})."""
    done = run_train_py(tmp_path, "model=mlp", "model.hidden=16", "data.num_train=32",
                        "data.num_eval=16", "trainer.max_steps=2", "memory.budget=1MiB",
                        "data.batch_size=auto", "trainer.device=cpu", "trainer.progress=false")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    found = result["batch_search"]["batch_size"]
    assert result["status"] == "ok" and len(result["batch_search"]["probes"]) > 1
    assert result["config"]["data"]["batch_size"] == found
    assert result["config"]["data"]["eval_batch_size"] == found


# -- 2 and 3: reruns in a used folder -------------------------------------------------------------
def test_a_finished_run_is_kept_not_measured_again(tmp_path):
    run = tmp_path / "run"
    first = job(run, *RESUMABLE)
    assert first["status"] == "ok" and first["metrics"]["steps"] == 6
    kept = (run / "result.json").read_bytes()
    # The same run again: nothing to train, and its record stays as it is.
    assert job(run, *RESUMABLE)["finished_at"] == first["finished_at"]
    assert (run / "result.json").read_bytes() == kept
    # Another optimizer over it: refused before anything is written, naming what differs.
    with pytest.raises(ResumeRefused) as refused:
        job(run, *RESUMABLE, "optim=adam")
    assert "optim._target_: checkpoint 'memexp.techniques.optim.SGD'" in str(refused.value)
    assert "trainer.resume=never" in str(refused.value)
    # Fewer steps than it ran: a resumed run would train nothing.
    with pytest.raises(ResumeRefused, match="would train nothing"):
        job(run, *TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    assert (run / "result.json").read_bytes() == kept
    # More steps: it goes on from where it ended.
    assert job(run, *TINY, "trainer.max_steps=8")["metrics"]["resumed_from"] == [6]


@pytest.mark.slow
def test_a_refused_rerun_in_a_sweep_folder_is_not_reported_as_ok(tmp_path):
    """The refused job leaves the earlier record; Hydra's .hydra/overrides.yaml names the job
    that was launched, and the report does not pass the old record off as it."""
    settings = (*RESUMABLE, *CPU_SMALL)
    job(tmp_path / "run", *settings)  # the earlier run, in this process: train.py's own record
    refused = run_train_py(tmp_path, *settings, "optim=adam")
    assert refused.returncode == 1 and "was written by another config" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert cli.main(["report", str(tmp_path)]) == 1
    report = (tmp_path / "report.md").read_text()
    assert "the job last launched here" in report and "optim=adam) did not run" in report


@pytest.mark.parametrize(("changed", "named"), [
    (("optim=sgd_momentum", "optim.lr=0.3"), ("optim.lr", "optim.momentum")),
    (("optim=adamw",), ("optim._target_", "optim.betas")),
], ids=["sgd_momentum", "adamw"])
def test_resume_refuses_a_checkpoint_of_another_config(tmp_path, changed, named):
    run = tmp_path / "run"
    job(run, *TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    longer = (*TINY, *changed, "trainer.max_steps=6", "trainer.checkpoint_every=2")
    with pytest.raises(ResumeRefused) as refused:
        job(run, *longer)
    for key in named:
        assert f"\n  {key}: checkpoint" in str(refused.value)
    # Started over, the run trains what it records: every step with the new settings.
    fresh = job(run, *longer, "trainer.resume=never")
    _, straight = train(*TINY, *changed, "memory.track=false", steps=6)
    assert fresh["metrics"]["resumed_from"] == []
    assert fresh["metrics"]["losses"] == straight.losses


def test_an_auto_batch_size_run_resumes_with_the_size_it_found(tmp_path):
    run = tmp_path / "run"
    auto = (*TINY, "data.batch_size=auto", "memory.budget=1MiB", "data.num_train=8",
            "trainer.checkpoint_every=1")
    first = job(run, *auto, "trainer.max_steps=2")
    assert first["status"] == "ok"
    assert job(run, *auto, "trainer.max_steps=2")["finished_at"] == first["finished_at"]
    resumed = job(run, *auto, "trainer.max_steps=3")
    assert resumed["metrics"]["resumed_from"] == [2]
    assert resumed["config"]["data"]["batch_size"] == first["config"]["data"]["batch_size"]


# -- 4: one process per folder --------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_process_is_refused_a_run_folder_in_use(tmp_path):
    first = start_train_py(tmp_path, *ENDLESS)
    try:
        wait_for_steps(tmp_path / "run", first)
        second = run_train_py(tmp_path, *ENDLESS)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert (f"memexp: {tmp_path / 'run'} is in use by another run (pid {first.pid}"
                in second.stderr)
        result = json.loads((tmp_path / "run" / "result.json").read_text())
        assert result["status"] == "running"  # the first run's record, untouched
        with open(tmp_path / "run" / "metrics.csv") as f:
            steps = [int(row["step"]) for row in csv.DictReader(f)]
        assert steps == list(range(1, len(steps) + 1))  # one writer
    finally:
        first.kill()  # SIGKILL: the OS releases its lock
        first.wait()
    # No stale lock is left behind.
    assert job(tmp_path / "run", *TINY, "trainer.max_steps=2")["status"] == "ok"


def test_a_second_sweep_is_refused_a_sweep_folder_in_use(tmp_path):
    sweep_dir = tmp_path / "sweep"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path\n"
         "from memexp import run_folder\n"
         "with run_folder.hold(Path(sys.argv[1]), 'sweep'):\n"
         "    print('held', flush=True); time.sleep(600)", str(sweep_dir)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        config = sweep_config(sweep_dir)
        with pytest.raises(SystemExit, match=f"{sweep_dir} is in use by another sweep"):
            Callbacks(config).on_multirun_start(config=config)
    finally:
        holder.kill()
        holder.wait()


# -- 5: the end-of-sweep report -------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_record(tmp_path_factory) -> str:
    """A real run's result.json, as text."""
    run = tmp_path_factory.mktemp("good") / "run"
    job(run, *TINY, "trainer.max_steps=2")
    return (run / "result.json").read_text()


def test_an_unreadable_result_fails_the_sweep(tmp_path, good_record):
    sweep_dir = tmp_path / "sweep"
    for number, text in (("0", good_record), ("1", "null")):
        (sweep_dir / number).mkdir(parents=True)
        (sweep_dir / number / "result.json").write_text(text)
    config = sweep_config(sweep_dir)
    callbacks = Callbacks(config)  # Hydra's: it turns a callback's exceptions into warnings
    callbacks.on_multirun_start(config=config)
    with pytest.raises(SystemExit, match="2 jobs did not succeed: 1 result.json unusable"):
        callbacks.on_multirun_end(config=config)
    assert str(sweep_dir / "1" / "result.json") in (sweep_dir / "report.md").read_text()


def test_a_report_the_disk_cannot_hold_fails_the_sweep(tmp_path, good_record):
    sweep_dir = tmp_path / "sweep"
    with small_filesystem(sweep_dir):
        (sweep_dir / "0").mkdir()
        (sweep_dir / "0" / "result.json").write_text(good_record)
        config = sweep_config(sweep_dir)
        callbacks = Callbacks(config)
        callbacks.on_multirun_start(config=config)
        fill(sweep_dir)
        with pytest.raises(SystemExit, match="report could not be written.*No space left"):
            callbacks.on_multirun_end(config=config)
        assert not (sweep_dir / "report.md").exists()


# -- 6: signals -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, "terminated"),
                                                (signal.SIGINT, "interrupted")],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signalled_run_records_how_it_ended(tmp_path, signum, status):
    process = start_train_py(tmp_path, *ENDLESS)
    try:
        wait_for_steps(tmp_path / "run", process)
        process.send_signal(signum)
        process.wait(timeout=300)
    finally:
        process.kill()
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == status and result["finished_at"]
    assert result["metrics"]["steps"] >= 2  # what it did before the signal, measured
    assert process.returncode == (128 + signal.SIGTERM if signum == signal.SIGTERM
                                  else -signal.SIGINT)


@pytest.mark.parametrize(("signum", "raised", "arms"), [
    (signal.SIGINT, KeyboardInterrupt, interrupted_once),
    (signal.SIGTERM, Terminated, sigterm_raises)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run(signum, raised, arms):
    """Its handler runs inside a weakref callback (the memory tracker frees every storage in
    one), where Python prints what it raises and goes on: the run must stop all the same."""
    ours = signal.signal(signum, {signal.SIGINT: signal.default_int_handler,
                                  signal.SIGTERM: signal.SIG_DFL}[signum])  # a run's own start
    lost = []

    class Storage:
        pass

    def freed(ref) -> None:
        lost.append(signum)
        signal.raise_signal(signum)  # its handler runs here, inside the callback

    try:
        with pytest.raises(raised), arms():
            storage = Storage()
            ref = weakref.ref(storage, freed)
            del storage
            assert lost == [signum] and ref() is None
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # where the signal's exception can stop the run
                time.sleep(0.001)
    finally:
        signal.signal(signum, ours)


def test_a_sigterm_handler_someone_else_installed_is_left_alone(tmp_path):
    """submitit's, in sweep jobs: it logs SIGTERM and leaves the job to its own timeout signal,
    which checkpoints and requeues. A run in such a job must not take SIGTERM over."""
    seen = []
    theirs = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        overrides = [*CHAOS, "+model.mode=term", "trainer.max_steps=2"]
        result = run_config(compose_train(*overrides), tmp_path, {}, overrides, "test")
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # still theirs
    finally:
        signal.signal(signal.SIGTERM, theirs)
    assert result["status"] == "ok" and seen == [signal.SIGTERM] * 2


# -- 7 and 8: checkpoints and metrics.csv across reruns --------------------------------------------
def test_a_fresh_run_keeps_its_own_checkpoints_not_an_older_runs(tmp_path):
    run = tmp_path / "run"
    job(run, *RESUMABLE)  # leaves steps 4 and 6
    newer = (*TINY, "optim.lr=0.01", "trainer.checkpoint_every=2")
    job(run, *newer, "trainer.max_steps=4", "trainer.resume=never")
    kept = checkpoint.checkpoints(run / "checkpoints")
    assert [checkpoint.step_of(p) for p in kept] == [4, 2]
    assert torch.load(kept[0], weights_only=True)["config"]["optim.lr"] == 0.01
    assert job(run, *newer, "trainer.max_steps=6")["metrics"]["resumed_from"] == [4]


def test_a_resumed_run_keeps_the_rows_before_it_and_logs_each_step_once(tmp_path):
    run = tmp_path / "run"
    job(run, *TINY, "trainer.max_steps=7", "trainer.checkpoint_every=3")
    # Cut short after logging step 7 and before its checkpoint: the rerun does step 7 again.
    (run / "checkpoints" / "step_00000007.pt").unlink()
    result = job(run, *TINY, "trainer.max_steps=10", "trainer.checkpoint_every=3")
    assert result["metrics"]["resumed_from"] == [6]
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == list(range(1, 11))
    assert [float(row["loss"]) for row in rows] == result["metrics"]["losses"]


# -- 9: a logger that cannot write ----------------------------------------------------------------
def test_a_logger_on_a_full_disk_never_fails_the_run(tmp_path):
    run = tmp_path / "run"
    with small_filesystem(run / "logs") as logs:
        fill(logs)
        result = job(run, *TINY, "trainer.max_steps=3", "logger.filename=logs/metrics.csv")
    assert result["status"] == "ok" and result["metrics"]["steps"] == 3
    recorded = json.loads((run / "result.json").read_text())
    assert "No space left on device" in recorded["logger"]["error"]


# -- 10: memexp report and show on bad records ----------------------------------------------------
BAD_RECORDS = {"empty": "", "null": "null", "a list": "[]", "missing keys": '{"status": "ok"}'}


def test_report_and_show_skip_a_bad_result_and_name_it(tmp_path, good_record, capsys):
    zero_peak = json.loads(good_record)
    zero_peak["memory"]["peak_bytes"] = 0
    bad = [*BAD_RECORDS.values(), json.dumps(zero_peak)]
    sweep_dir = tmp_path / "sweep"
    for number, text in enumerate([good_record, *bad]):
        (sweep_dir / str(number)).mkdir(parents=True)
        (sweep_dir / str(number) / "result.json").write_text(text)
    assert cli.main(["report", str(sweep_dir)]) == 1  # written, without the bad ones
    report = (sweep_dir / "report.md").read_text()
    assert "| 0 |" in report
    for number in range(1, len(bad) + 1):
        path = sweep_dir / str(number) / "result.json"
        assert f"{path}: " in report
        assert cli.main(["show", str(path.parent)]) == 2
        assert f"memexp show: {path}: " in capsys.readouterr().err
    assert cli.main(["show", str(sweep_dir / "0")]) == 0


# -- 11 and 12: data files, and the errors a user sees --------------------------------------------
def test_data_files_that_do_not_line_up_are_refused_when_read(tmp_path):
    root = write_tiny_cifar10(tmp_path / "cifar")
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    entry = pickle.loads(batch.read_bytes())
    batch.write_bytes(pickle.dumps({**entry, b"labels": entry[b"labels"][:14]}))
    with pytest.raises(ValueError, match="data_batch_1: 20 images but 14 labels"):
        cifar10(root=str(root))
    batch.write_bytes(pickle.dumps({**entry, b"labels": [-1] + entry[b"labels"][1:]}))
    with pytest.raises(ValueError, match="data_batch_1: label -1 at index 0"):
        cifar10(root=str(root))
    folder = write_tiny_mnist(tmp_path / "mnist", count=40)
    write_idx(folder / "train-labels-idx1-ubyte", np.zeros(30, dtype=np.uint8))
    with pytest.raises(ValueError, match="40 images but 30 labels"):
        mnist(root=str(folder))


def broken_data(tmp_path: Path, case: str) -> tuple[str, ...]:
    """Overrides for a data folder with one broken file."""
    if case == "truncated cifar":
        root = write_tiny_cifar10(tmp_path / "cifar")
        batch = root / "cifar-10-batches-py" / "data_batch_2"
        batch.write_bytes(batch.read_bytes()[:100])
        return "data=cifar10", f"data.root={root}"
    root = write_tiny_mnist(tmp_path / "mnist", gz=case == "bad gz")
    if case == "bad gz":
        (root / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    else:
        (root / "train-labels-idx1-ubyte").write_bytes(b"")
    return "data=mnist", f"data.root={root}"


@pytest.mark.parametrize(("case", "says"), [
    ("truncated cifar", ["data_batch_2: not a CIFAR-10", "truncated"]),
    ("bad gz", ["train-images-idx3-ubyte.gz: not a readable IDX file", "Not a gzipped file"]),
    ("empty mnist", ["train-labels-idx1-ubyte is not an IDX file: it is empty"]),
])
def test_a_broken_data_file_is_named_with_its_cause(tmp_path, case, says):
    result = attempt(tmp_path / "run", *broken_data(tmp_path, case), "model=mlp",
                     "trainer.max_steps=1")
    shown = error_shown(result)
    assert result["status"] == "failed" and all(fragment in shown for fragment in says), shown


@pytest.mark.parametrize(("overrides", "says", "not_says"), [
    (("model=transformer", "data=tokens", "model.n_heads=0"),
     "Transformer: raised ZeroDivisionError: integer modulo by zero", "For your own model"),
    (("model=custom", "model._target_=mypkg.Net", "+model.hidden=3"),
     "mypkg.Net: cannot be imported (ModuleNotFoundError: No module named 'mypkg')",
     "could not be built with the keys"),
    (("model=custom", "model._target_=os.system", "+model.command=true"),
     "os.system: Target 'os.system' is blocklisted", "For your own model"),
], ids=["constructor raises", "no such module", "blocklisted"])
def test_a_model_that_cannot_be_built_says_why(tmp_path, overrides, says, not_says):
    shown = error_shown(attempt(tmp_path / "run", *overrides, "trainer.max_steps=1"))
    assert says in shown and not_says not in shown, shown


def test_your_own_module_imports_from_the_directory_train_py_runs_in(tmp_path):
    """`python /path/to/train.py` puts train.py's folder on sys.path, not the user's; memexp
    adds the working directory. Where the module is not there, the error gives the line that
    makes it importable, not the command the user just typed."""
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Sequential):\n    def __init__(self):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))\n")
    done = run_train_py(tmp_path, "model=custom", "model._target_=mynet.Net", "debug=fast",
                        "data.image_size=8", "data.num_eval=64", "logger=none")
    assert done.returncode == 0, done.stderr[-3000:]
    error = attempt(tmp_path / "run2", "model=custom", "model._target_=nothere.Net",
                    "trainer.max_steps=1")["error"]
    assert f"memexp imports your modules from the directory it runs in ({os.getcwd()})" in error
    assert "export PYTHONPATH=/folder/holding/nothere:$PYTHONPATH" in error


# -- 13: smaller points ---------------------------------------------------------------------------
def test_result_json_is_strict_json_with_null_and_a_reason_for_nan(tmp_path):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    attempt(tmp_path / "run", *CHAOS, "+model.mode=diverge", "trainer.max_steps=5")
    result = json.loads((tmp_path / "run" / "result.json").read_text(), parse_constant=refuse)
    assert result["status"] == "nan"
    assert result["metrics"]["final_loss"] is None and result["metrics"]["losses"] == [None] * 3
    assert result["non_finite"]["metrics.final_loss"] == "nan"
    assert result["non_finite"]["metrics.losses.2"] == "nan"


def test_a_pipe_in_an_override_stays_in_its_table_cell():
    rows = [Row(str(i), {"status": "ok", "overrides": [f"+model.act={act}"], "techniques": {}})
            for i, act in enumerate(["relu", "a|b"])]
    describe_rows(rows)
    lines = markdown_table(rows).splitlines()
    cells = [len(line.replace("\\|", "").split("|")) for line in lines]
    assert len(set(cells)) == 1 and "a\\|b" in lines[-1]


def test_records_and_checkpoints_are_readable_by_the_team(tmp_path):
    previous = os.umask(0o022)
    try:
        job(tmp_path / "run", *TINY, "trainer.max_steps=2", "trainer.checkpoint_every=2")
    finally:
        os.umask(previous)
    for path in (tmp_path / "run" / "result.json",
                 tmp_path / "run" / "checkpoints" / "step_00000002.pt"):
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_a_full_disk_while_checkpointing_is_named(tmp_path):
    run = tmp_path / "run"
    with small_filesystem(run / "checkpoints") as folder:
        fill(folder)
        result = attempt(run, *TINY, "trainer.max_steps=2", "trainer.checkpoint_every=1")
    shown = error_shown(result)
    assert result["status"] == "failed"
    assert "step_00000001.pt could not be written: No space left on device" in shown, shown


def test_warm_up_steps_are_never_timed():
    trainer, _ = train(*TINY, "trainer.warmup_steps=3", steps=2)
    metrics = trainer.summary_metrics()
    assert metrics["step_time_s"] is None and metrics["throughput"] is None
    assert metrics["timing"]["timed_steps"] == []


# -- 17: a crafted CIFAR file ---------------------------------------------------------------------
class RunsACommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_crafted_cifar_file_runs_nothing(tmp_path):
    root = write_tiny_cifar10(tmp_path / "data")
    folder = root / "cifar-10-batches-py"
    # The real files' pickles: protocol 2, numpy 1's module names (the reader admits these).
    entry = pickle.loads((folder / "data_batch_3").read_bytes())
    real = pickle.dumps(entry, protocol=2).replace(b"numpy._core.", b"numpy.core.")
    (folder / "data_batch_3").write_bytes(real)
    assert len(cifar10(root=str(root)).train) == 100
    marker = tmp_path / "it ran"
    (folder / "data_batch_1").write_bytes(
        pickle.dumps({b"data": RunsACommand(f"touch '{marker}'"), b"labels": []}))
    with pytest.raises(ValueError, match="data_batch_1: not a CIFAR-10.*names posix.system"):
        cifar10(root=str(root))
    assert not marker.exists()



# -- 18: a run is ok only if its loss reached the weights and left them finite ------------------
CLASSIFIER = ("data=dataset", "data.train._target_=user_models.Features", "data.batch_size=8",
              "model=custom", "model._target_=user_models.Classifier", "trainer.log_every=1")


def final_weights(run: Path) -> list[torch.Tensor]:
    newest = checkpoint.checkpoints(run / "checkpoints")[0]
    return list(torch.load(newest, weights_only=True)["model"].values())


@pytest.mark.parametrize("options", [(), ("precision=bf16_pure", "precision.master_weights=true"),
                                     ("optim.in_backward=true",)],
                         ids=["fp32", "bf16 master weights", "in backward"])
def test_nan_gradients_of_a_finite_loss_never_reach_the_weights(tmp_path, options):
    """sqrt's gradient at 0 is infinite, times 0: NaN gradients, while the loss is finite."""
    run = tmp_path / "run"
    result = job(run, *CLASSIFIER, *options, "+model.output=nan_gradient", "+model.nan_forwards=1",
                 "trainer.max_steps=3", "trainer.checkpoint_every=3")
    # The first step is skipped; its gradients are gone by the next (master weights keep the
    # model's own apart), which trains.
    assert result["status"] == "ok" and result["metrics"]["bad_steps"] == 1
    assert all(torch.isfinite(torch.tensor(result["metrics"]["losses"])))
    assert all(torch.isfinite(weight).all() for weight in final_weights(run))
    assert ("non-finite   1 steps had a NaN or infinite loss or gradients; none reached the "
            "weights") in summary(result, run)
    # Every step such a step, one more than trainer.max_bad_steps allows: the run is not ok.
    failed = attempt(tmp_path / "every step", *CLASSIFIER, *options, "+model.output=nan_gradient",
                     "trainer.max_steps=3")
    assert failed["status"] == "nan"
    assert "3 steps with a non-finite loss or gradients" in error_shown(failed)


def test_weights_an_update_made_infinite_end_the_run_as_nan(tmp_path):
    """Adam's eps of 1e-8 is 0 in fp16: the first update divides by zero."""
    result = attempt(tmp_path / "run", *CLASSIFIER, "precision=fp16_pure", "optim=adamw",
                     "trainer.max_steps=1")
    assert result["status"] == "nan"
    assert "the final weights are not finite: NaN or infinite values in linear.weight" in (
        error_shown(result))


@pytest.mark.parametrize(("overrides", "says"), [
    (("loss=custom", "loss._target_=user_models.leaf_loss"),
     "loss._target_=user_models.leaf_loss: the loss is a tensor of its own"),
    (("loss=custom", "loss._target_=user_models.own_weight_loss"),
     "loss._target_=user_models.own_weight_loss: backward gave none of the model's 2 trainable "
     "parameters a gradient"),
    (("+model.frozen=[weight,bias]",), "model: none of the model's parameters requires a "
                                       "gradient (all are frozen)"),
], ids=["a leaf", "a tensor of its own", "all frozen"])
def test_a_loss_that_reaches_no_parameter_is_refused_at_the_first_step(tmp_path, overrides, says):
    """Refused with no step taken: at the first step, or before it (all frozen: as the trainer
    is built, before the optimizer over no parameter)."""
    result = attempt(tmp_path / "run", *CLASSIFIER, *overrides, "trainer.max_steps=2")
    assert result["status"] == "failed" and (result["metrics"] or {"steps": 0})["steps"] == 0
    assert f"ValueError: {says}" in error_shown(result), error_shown(result)


def test_a_partly_frozen_model_trains_what_is_not_frozen(tmp_path):
    result = job(tmp_path / "run", *CLASSIFIER, "+model.frozen=[bias]", "trainer.max_steps=2")
    assert result["status"] == "ok" and result["memory"]["grads_peak_bytes"] == 8 * 10 * 4


def test_eval_targets_outside_the_models_classes_are_refused_not_counted_as_misses(tmp_path):
    result = attempt(tmp_path / "run", *CLASSIFIER, "+data.eval._target_=user_models.Features",
                     "+data.eval.classes=50", "trainer.max_steps=1")
    assert result["status"] == "failed"
    assert ("ValueError: data: 22 of the eval set's targets name no class of the model: valid "
            "targets are 0 to 9, and -100 (not counted)") in error_shown(result)


# -- 19: user mistakes, each told in one line that names what to fix ----------------------------
@pytest.mark.parametrize(("overrides", "says"), [
    (("+data.train.classes=50",),
     "loss=cross_entropy: the batch's targets include 7 outside the model's 10 classes (from 10 "
     "to 31; logits (8, 10)): valid targets are 0 to 9, and -100 (not counted)"),
    (("+model.output=none",), "model._target_: the model's forward returned NoneType"),
    (("+model.output=scalar",),
     "loss=cross_entropy: the model's logits () do not fit the batch's targets (8,)"),
    (("loss=custom", "loss._target_=user_models.unreduced_loss"),
     "loss._target_=user_models.unreduced_loss: the loss is a tensor of shape (8,), not one "
     "number"),
    (("loss=custom", "loss._target_=user_models.count_loss"),
     "loss._target_=user_models.count_loss: the loss is a torch.int64 tensor"),
    (("loss=custom", "loss._target_=user_models.no_loss"),
     "loss._target_=user_models.no_loss: the loss is NoneType, not a tensor"),
    (("+data.train.labels=false",),
     "loss=cross_entropy needs targets, and the batch has none: its keys are ['x']"),
], ids=["train labels outside the classes", "forward returns None", "scalar logits",
        "a vector loss", "an integer loss", "no loss", "no labels"])
def test_a_user_mistake_at_the_first_step_names_what_to_fix(tmp_path, overrides, says):
    result = attempt(tmp_path / "run", *CLASSIFIER, *overrides, "trainer.max_steps=2")
    assert result["status"] == "failed" and result["metrics"]["steps"] == 0
    assert error_shown(result).startswith(f"  error        ValueError: {says}"), (
        error_shown(result))


@pytest.mark.slow
def test_a_user_mistake_ends_train_py_with_its_summary_and_no_traceback(tmp_path):
    overrides = (*CLASSIFIER, "loss=custom", "loss._target_=user_models.unreduced_loss",
                 "trainer.max_steps=2")
    # tests/ on the path, and what was there (the sources under test, if not installed)
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(train_py(tmp_path, overrides), capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env={**TRAIN_PY_ENV, "PYTHONPATH": path})
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output
    errors = [line for line in output.splitlines() if "error  " in line]
    assert len(errors) == 1 and "the loss is a tensor of shape (8,), not one number" in errors[0]
