"""Records read defensively (memexp.result.load_record): whatever a sweep folder's result.json
is, `memexp report`, the end-of-sweep report and `memexp show` name it in one line and go on; a
record whose figures disagree is one of them, and wandb's summary leaves its figures out; and a
logger's file is never one of memexp's own."""

from __future__ import annotations

import json
import math
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
from memexp.loggers import CsvLogger, summary_of
from memexp.result import BadRecord, load_record, record_killed

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
    # a real record edited on disk: figures that no run writes, or that contradict each other
    # (the figures in braces are the real record's: why())
    "8": "`memory.breakdown_at_peak` adds up to {total} B on the device, not the {peak} B of "
         "`memory.peak_bytes`: the storage tracker's peak is its categories' sum",
    "9": "`memory.breakdown_at_peak.frozen` is -5000, not a whole number from 0 to 2^63-1",
    "10": "`metrics.eval_accuracy` is 7.5, not a fraction in [0, 1] or null",
    "11": "`metrics.eval_accuracy` is -3, not a fraction in [0, 1] or null",
    "12": "`memory.peak_bytes` is 0.5, not a whole number from 1 to 2^63-1",
    "13": "`memory.peak_bytes` is 1e+300, not a whole number from 1 to 2^63-1",
    "14": "`status` is 'ok', but `metrics` is null: a run that ends ok records its memory and its "
          "metrics",
}
ACTIVATIONS = 10**12  # job 8's, in a peak of some 0.5 MiB
# section, key and value of each record in BAD edited from the real one
EDITS = {"8": ("breakdown_at_peak", "activations", ACTIVATIONS),
         "9": ("breakdown_at_peak", "frozen", -5000), "10": ("metrics", "eval_accuracy", 7.5),
         "11": ("metrics", "eval_accuracy", -3), "12": ("memory", "peak_bytes", 0.5),
         "13": ("memory", "peak_bytes", 1e300), "14": (None, "metrics", None)}
# Real records of other kinds, which every reader reads as they are: host bytes (`offloaded`,
# outside the device's peak), and a peak not measured (null).
REAL = {"15": ("checkpointing=offload",), "16": ("memory.track=false",)}


def job(run_dir: Path, *overrides: str) -> dict:
    """One run as train.py runs it, in this process."""
    config = OmegaConf.to_container(compose_train(*overrides), resolve=True, enum_to_str=True)
    return run_job(Job(config, run_dir, {}, list(overrides), run_dir.name))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder: job 0 a real run's record, job 6 the same failed with terminal escapes
    in its error, jobs 1-5 and 7 files that are no records, 8-14 the real record edited on
    disk (BAD); and jobs of the other kinds of real record (REAL)."""
    sweep_dir = tmp_path_factory.mktemp("reading") / "sweep"
    job(sweep_dir / "0", *TINY)
    for number, overrides in REAL.items():
        job(sweep_dir / number, *TINY, *overrides)
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
        **{number: json.dumps(edited(record, *edit)) for number, edit in EDITS.items()},
    }
    for number, content in files.items():
        (sweep_dir / number).mkdir()
        (sweep_dir / number / "result.json").write_text(content)
    (sweep_dir / "3").mkdir()
    os.mkfifo(sweep_dir / "3" / "result.json")
    (sweep_dir / "4").mkdir()
    (sweep_dir / "4" / "result.json").symlink_to("/dev/zero")
    return sweep_dir


def edited(record: dict, section: str | None, key: str, value) -> dict:
    """A copy of `record` with `key` of its `section` (memory.breakdown_at_peak, memory, metrics;
    None: the record itself) set to `value`."""
    copy = json.loads(json.dumps(record))
    where = {"breakdown_at_peak": copy["memory"]["breakdown_at_peak"], "memory": copy["memory"],
             "metrics": copy["metrics"], None: copy}[section]
    where[key] = value
    return copy


def why(sweep: Path, number: str) -> str:
    """What the readers say of job `number`'s file: BAD's, with the real record's figures."""
    memory = json.loads((sweep / "0" / "result.json").read_text())["memory"]
    peak, activations = memory["peak_bytes"], memory["breakdown_at_peak"]["activations"]
    return BAD[number].format(peak=f"{peak:,}", total=f"{peak - activations + ACTIVATIONS:,}")


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
    assert skipped == [f"skipped {report / n / 'result.json'}: {why(report, n)}" for n in BAD]
    assert re.findall(r"^\| (\d+) \|", done.stdout, re.M) == ["0", "6", *REAL]  # the rest: skipped
    assert re.search(r"^\| 0 \| .* \| ok \|", done.stdout, re.M)
    assert re.search(r"^\| 6 \| .* \| failed \|", done.stdout, re.M)
    written = (report / "report.md").read_text()
    assert "\x1b" not in written and "ValueError: boom ]0;pwned[2J31m cleared" in written
    assert all(str(report / n / "result.json") in written for n in BAD)


def test_the_end_of_sweep_report_names_each_file_that_is_no_record(sweep, tmp_path):
    report = tmp_path / "sweep"
    copied = ("0", "1", "2", "5", "6", *EDITS, *REAL)  # no FIFO: an unguarded reader would hang
    for number in copied:
        shutil.copytree(sweep / number, report / number)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        config = compose("train", overrides=[*CPU_SMALL, f"hydra.sweep.dir={report}"],
                         return_hydra_config=True)
    callbacks = Callbacks(config)  # Hydra's: it turns a callback's exceptions into warnings
    callbacks.on_multirun_start(config=config)
    with pytest.raises(SystemExit, match=r"^memexp: 11 of 14 jobs did not succeed: job 6 "
                                         r"failed, 10 result.json unusable"):
        callbacks.on_multirun_end(config=config)
    written = (report / "report.md").read_text()
    assert all(f"{report / n / 'result.json'}: {why(report, n)}" in written
               for n in copied if n in BAD)
    assert re.findall(r"^\| (\d+) \|", written, re.M) == ["0", "6", *REAL]


@pytest.mark.parametrize("number", [*BAD, "6"])
def test_show_names_the_file_in_one_line(sweep, number, capsys):
    code = cli.main(["show", str(sweep / number)])
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err
    if number == "6":  # a record, its escapes taken out
        assert code == 1 and "  error        ValueError: boom ]0;pwned[2J31m cleared" in out
    else:
        assert code == 2 and not out
        assert err == f"memexp show: {sweep / number / 'result.json'}: {why(sweep, number)}\n"


@pytest.mark.parametrize("number", EDITS)
def test_wandbs_summary_leaves_out_the_figures_of_a_record_that_disagrees(sweep, number):
    """The summary WandbLogger.finish gives the run (the end-of-sweep table is of the report's
    rows, which are load_record's)."""
    record = json.loads((sweep / number / "result.json").read_text())
    assert summary_of(record) == {"status": "ok", "record_problem": why(sweep, number)}


@pytest.mark.parametrize("number", ["0", *REAL])
def test_real_records_are_read_as_they_are(sweep, number, capsys):
    record = json.loads((sweep / number / "result.json").read_text())
    assert cli.main(["show", str(sweep / number)]) == 0
    assert "  peak memory  " in capsys.readouterr().out
    summary = summary_of(record)  # all its figures: peak_bytes where it was measured
    assert "record_problem" not in summary and summary["final_loss"] > 0
    assert summary.get("peak_bytes") == record["memory"]["peak_bytes"]
    if number == "15":  # a record with host bytes at its peak, of a run that offloaded
        assert record["memory"]["breakdown_at_peak"]["offloaded"] > 0


def ranks(memory: dict) -> None:
    """`memory` as a two-rank run's: both ranks' the same, rank 0's on top; then rank 1's
    forward phase a byte above its peak."""
    memory.update(rank=0, per_rank=[json.loads(json.dumps(memory)) for _ in range(2)])
    memory["per_rank"][1]["phases"]["forward"]["breakdown"]["params"] += 1


@pytest.mark.parametrize(("number", "edit", "says"), [
    ("0", lambda memory: memory.update(peak_phase="eval"),  # a phase below the peak
     "`memory.peak_phase` is 'eval', not a phase whose peak is `memory.peak_bytes`"),
    ("0", lambda memory: memory["breakdown_at_peak"].update(  # the same sum, params as other
        params=0, other=sum(memory["breakdown_at_peak"][c] for c in ("params", "other"))),
     "`memory.breakdown_at_peak` is not `memory.phases.{peak_phase}.breakdown`, the breakdown of "
     "the phase of the peak"),
    ("0", lambda memory: memory["breakdown_at_peak"].update(weights=0),
     "`memory.breakdown_at_peak` has 'weights', not one of the categories params, frozen, grads, "
     "optimizer, activations, loss, other, offloaded"),
    ("15", lambda memory: memory["breakdown_at_peak"].update(offloaded=2**40),
     "`memory.breakdown_at_peak.offloaded` is 1,099,511,627,776 B, more than the {offloaded} B of "
     "`memory.offloaded_peak_bytes`, the host's highest"),
    ("0", ranks, "`memory.per_rank.1.phases.forward.breakdown` adds up to {forward} B on the "
                 "device, not the {forward_peak} B of `memory.per_rank.1.phases.forward."
                 "peak_bytes`: the storage tracker's peak is its categories' sum"),
], ids=["peak phase", "breakdown at peak", "category", "offloaded", "ranks"])
def test_each_section_agrees_with_the_others(sweep, tmp_path, number, edit, says):
    """Beside the cases above: the peak is its phase's, a breakdown is of the categories, the
    host's bytes are within their own peak, and each rank's section holds on its own."""
    record = json.loads((sweep / number / "result.json").read_text())
    memory = record["memory"]
    forward = memory["phases"]["forward"]["peak_bytes"]
    figures = {"offloaded": f"{memory['offloaded_peak_bytes']:,}", "forward": f"{forward + 1:,}",
               "forward_peak": f"{forward:,}", "peak_phase": memory["peak_phase"]}
    assert load_record(sweep / number / "result.json")  # before the edit
    edit(memory)
    path = tmp_path / "result.json"
    path.write_text(json.dumps(record))
    with pytest.raises(BadRecord) as refused:
        load_record(path)
    assert str(refused.value) == f"{path}: {says.format(**figures)}"


def test_a_cuda_records_breakdown_is_within_its_peak(sweep, tmp_path):
    """No GPU here: job 0's record in a CUDA run's shape (memexp.memory.meter.CudaCounters).
    The counters' peaks hold more than the tracker's storages (each allocation rounded up to
    its block, cuBLAS's workspace), and reserved memory more than allocated: read as it is.
    A breakdown above its phase's peak is not."""
    record = json.loads((sweep / "0" / "result.json").read_text())
    memory = record["memory"]
    memory.update(device="cuda:0", source="cuda-counters", num_alloc_retries=0, num_ooms=0)
    for phase in memory["phases"].values():
        phase["peak_bytes"] += 8 * 2**20  # a workspace
    memory["peak_bytes"] = memory["phases"][memory["peak_phase"]]["peak_bytes"]
    memory.update(active_peak_bytes=memory["peak_bytes"], reserved_peak_bytes=2 * 2**30)
    path = tmp_path / "result.json"
    path.write_text(json.dumps(record))
    assert load_record(path)["memory"]["source"] == "cuda-counters"
    forward = memory["phases"]["forward"]
    forward["breakdown"]["activations"] += forward["peak_bytes"]
    path.write_text(json.dumps(record))
    with pytest.raises(BadRecord, match=r"`memory.phases.forward.breakdown` adds up to [\d,]+ B "
                                        r"on the device, more than the [\d,]+ B of "
                                        r"`memory.phases.forward.peak_bytes`$"):
        load_record(path)


def test_wandbs_summary_checks_a_record_as_it_is_written(sweep):
    """A run that ended nan, in its process: result.json writes its NaN loss as null."""
    record = json.loads((sweep / "0" / "result.json").read_text())
    diverged = {**record, "status": "nan", "metrics": {**record["metrics"],
                                                       "final_loss": float("nan")}}
    summary = summary_of(diverged)
    assert summary["peak_bytes"] == record["memory"]["peak_bytes"]
    assert math.isnan(summary["final_loss"])


def test_a_killed_job_whose_record_is_unusable_gets_a_record(sweep, tmp_path):
    path = tmp_path / "result.json"
    shutil.copy(sweep / "1" / "result.json", path)  # too deep to read
    record_killed(path, ["precision=bf16"], "killed by SIGKILL")
    record = load_record(path)
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
    record = load_record(tmp_path / "run" / "result.json")
    assert record["status"] == "failed" and record["metrics"] is None
    assert "logger.filename='result.json'" in record["error"]
