"""Records read defensively (memexp.result.load_record): whatever a sweep folder's result.json
is, `memexp report`, the end-of-sweep report and `memexp show` name it in one line and go on;
and a logger's file is never one of memexp's own."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.callbacks import Callbacks
from omegaconf import OmegaConf

from memexp import cli
from memexp.app import Job, run_job
from memexp.config import config_dir
from memexp.loggers import CsvLogger
from memexp.result import record_killed

from conftest import CPU_SMALL, compose_train

TINY = ("model=mlp", "model.hidden=16", "model.depth=1", "data.batch_size=8",
        "data.num_train=64", "data.num_eval=32", "trainer.max_steps=2")
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m"  # a window title, a cleared screen, a C1 CSI
# The jobs of the sweep below, and what the report says of each that is not a record.
BAD = {
    "1": "nested deeper than 100 levels",
    "2": "not readable as JSON (an integer of 5000 digits, more than a record's 100)",
    "3": "not a regular file, so not a record",  # a FIFO: no writer ever comes
    "4": "not a regular file, so not a record",  # a link to /dev/zero: endless
    "5": "`status` is 'finished', not one of ok, failed, oom, nan, terminated, interrupted, "
         "killed, timeout, running",
    "7": "an incomplete record (TypeError: string indices must be integers, not 'str')",
}


def job(run_dir: Path, *overrides: str) -> dict:
    """One run as train.py runs it, in this process."""
    config = OmegaConf.to_container(compose_train(*overrides), resolve=True, enum_to_str=True)
    return run_job(Job(config, run_dir, {}, list(overrides), run_dir.name))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder: job 0 a real run's record, job 6 the same failed with terminal escapes
    in its error, and jobs 1-5 and 7 files that are no records (BAD)."""
    sweep_dir = tmp_path_factory.mktemp("reading") / "sweep"
    job(sweep_dir / "0", *TINY)
    text = (sweep_dir / "0" / "result.json").read_text()
    record = json.loads(text)
    files = {
        "1": "[" * 100_000 + "]" * 100_000,
        "2": text.replace('"status": "ok"', '"status": "ok", "seed": ' + "7" * 5000),
        "5": json.dumps({**record, "status": "finished"}),
        "6": json.dumps({**record, "status": "failed",
                         "error": f"ValueError: boom {ESCAPES} cleared\n"}),
        "7": json.dumps({**record, "metrics": {**record["metrics"], "step_time_s": 0.1,
                                               "timing": "fast"}}),
    }
    for number, content in files.items():
        (sweep_dir / number).mkdir()
        (sweep_dir / number / "result.json").write_text(content)
    (sweep_dir / "3").mkdir()
    os.mkfifo(sweep_dir / "3" / "result.json")
    (sweep_dir / "4").mkdir()
    (sweep_dir / "4" / "result.json").symlink_to("/dev/zero")
    return sweep_dir


def at_most_4gib() -> None:
    """A report that read /dev/zero whole would take the machine's memory: not past 4 GiB."""
    resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))


def test_the_report_names_each_file_that_is_no_record_and_goes_on(sweep):
    report = sweep
    done = subprocess.run([sys.executable, "-m", "memexp.cli", "report", str(report)],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=at_most_4gib)  # a FIFO read would hang: the timeout
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "\x1b" not in done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("skipped ")]
    assert skipped == [f"skipped {report / n / 'result.json'}: {why}" for n, why in BAD.items()]
    assert re.search(r"^\| 0 \| .* \| ok \|", done.stdout, re.M)
    assert re.search(r"^\| 6 \| .* \| failed \|", done.stdout, re.M)
    written = (report / "report.md").read_text()
    assert "\x1b" not in written and "ValueError: boom ]0;pwned[2J31m cleared" in written
    assert all(str(report / n / "result.json") in written for n in BAD)


def test_the_end_of_sweep_report_names_each_file_that_is_no_record(sweep, tmp_path):
    report = tmp_path / "sweep"
    for number in ("0", "1", "2", "5", "6"):  # no FIFO: an unguarded reader would hang here
        shutil.copytree(sweep / number, report / number)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        config = compose("train", overrides=[*CPU_SMALL, f"hydra.sweep.dir={report}"],
                         return_hydra_config=True)
    callbacks = Callbacks(config)  # Hydra's: it turns a callback's exceptions into warnings
    callbacks.on_multirun_start(config=config)
    with pytest.raises(SystemExit, match=r"^memexp: 4 of 5 jobs did not succeed: job 6 failed, "
                                         r"3 result.json unusable"):
        callbacks.on_multirun_end(config=config)
    written = (report / "report.md").read_text()
    assert all(f"{report / n / 'result.json'}: {BAD[n]}" in written for n in ("1", "2", "5"))


@pytest.mark.parametrize("number", [*BAD, "6"])
def test_show_names_the_file_in_one_line(sweep, number, capsys):
    code = cli.main(["show", str(sweep / number)])
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err
    if number == "6":  # a record, its escapes taken out
        assert code == 1 and "  error        ValueError: boom ]0;pwned[2J31m cleared" in out
    else:
        assert code == 2 and not out
        assert err == f"memexp show: {sweep / number / 'result.json'}: {BAD[number]}\n"


def test_a_killed_job_whose_record_is_unusable_gets_a_record(sweep, tmp_path):
    path = tmp_path / "result.json"
    shutil.copy(sweep / "1" / "result.json", path)  # too deep to read
    record_killed(path, ["precision=bf16"], "killed by SIGKILL")
    record = json.loads(path.read_text())
    assert record["status"] == "killed" and record["techniques"]["precision"] == "bf16"


def test_the_known_statuses_are_the_documented_ones():
    from memexp.result import STATUSES

    schema = (Path(__file__).parents[1] / "docs" / "result-json.md").read_text()
    line = re.search(r"^status: (.*)$", schema, re.M).group(1)
    assert line.split(" | ") == list(STATUSES)


@pytest.mark.parametrize(("filename", "taken"), [
    ("Result.json", "result.json"), (".memexp.lock", ".memexp.lock"),
    ("checkpoints/metrics.csv", "checkpoints"), ("./ranks", "ranks"),
])
def test_a_logger_file_is_never_one_of_memexps_own(filename, taken):
    with pytest.raises(ValueError, match=f"^logger.filename='{re.escape(filename)}': "
                                         f"{re.escape(taken)} is memexp's own in the run folder"):
        CsvLogger(filename)


def test_a_run_whose_metrics_would_overwrite_its_record_is_refused(tmp_path):
    with pytest.raises(ValueError, match="logger.filename='result.json': result.json is "
                                         "memexp's own"):
        job(tmp_path / "run", *TINY, "logger.filename=result.json")
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["status"] == "failed" and record["metrics"] is None
    assert "logger.filename='result.json'" in record["error"]
