"""Bad input told in a few lines, with the valid choices (memexp.errors), on the real configs'
real composition errors; HYDRA_FULL_ERROR=1 still gets the whole exception."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import pytest
import torch
from hydra.errors import HydraException
from omegaconf import OmegaConf

from memexp import errors
from memexp.result import error_message
from memexp.trainer import validate

from conftest import REPO, compose_train, fill, run_train_py, small_filesystem


def composition_error(*overrides: str) -> HydraException:
    with pytest.raises(HydraException) as raised:
        compose_train(*overrides)
    return raised.value


@pytest.mark.parametrize(("override", "told"), [
    ("model.widht=3", "model.widht: model has no key 'widht'\n  valid keys of model: _target_, "
                      "num_classes, in_channels, width, blocks_per_stage, inplace"),
    ("trainer.device=tpu", "trainer.device=tpu: Invalid value 'tpu', expected one of "
                           "[auto, cpu, cuda]"),
    ("experiment=nope", "experiment=nope: there is no such option\n  valid choices for "
                        "experiment: amp_bert, amp_models, bn_accumulation, "),
    ("data.root=~/datasets", "data.root=~/datasets: not a valid override. Quote values with "
                             "characters such as ~"),
])
def test_composition_errors_are_the_message_and_the_valid_choices(override, told):
    message = errors.describe(composition_error(override))
    assert message.startswith(told) and len(message.splitlines()) <= 2


@pytest.mark.parametrize(("overrides", "told"), [
    (("model=custom", "model._target_=torch.nn.Linear", "model.in_features=8"),
     "model.in_features: model has no key 'in_features'\n  valid keys of model: _target_\n"
     "  torch.nn.Linear takes in_features, which this config does not list: to give it, add "
     "the key: +model.in_features=8"),
    (("model=mlp", "model.width=8"), "model.width: model has no key 'width'\n  valid keys of "
     "model: _target_, num_classes, in_channels, image_size, hidden, depth, inplace"),
    (("data=dataset", "model=custom", "model._target_=torch.nn.Linear",
      "data.eval._target_=mypkg.Eval"),
     "data.eval._target_: data.eval has no keys to set: it is null or empty in this config. "
     "To give it '_target_', add the key: +data.eval._target_=mypkg.Eval"),
], ids=["custom: add it", "mlp: a typo", "null node"])
def test_a_missing_key_suggests_adding_it_where_the_target_takes_it(overrides, told):
    """`+key=value` where the option's target takes the key (model=custom passes exactly the
    keys given), never an empty list of valid keys."""
    assert errors.describe(composition_error(*overrides)) == told


def test_train_py_outside_its_environment_says_to_activate_it(tmp_path):
    """A python without memexp's packages (here the venv's, without its site-packages)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", str(REPO / "train.py"), "model=mlp"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"memexp: {sys.executable} cannot import hydra_plugins: "
                                  "train.py runs in memexp's virtual environment. Create it "
                                  "once with `make install`, then `source .venv/bin/activate`")


def test_main_tells_bad_input_in_its_own_words_unless_hydra_full_error(monkeypatch):
    def bad_main():
        compose_train("precision=bogus")

    monkeypatch.delenv(errors.FULL_ERROR, raising=False)
    with pytest.raises(SystemExit) as exited:
        errors.main(bad_main)
    assert str(exited.value).startswith("memexp: precision=bogus: there is no such option")
    assert errors.FULL_ERROR not in os.environ  # borrowed, and given back
    monkeypatch.setenv(errors.FULL_ERROR, "1")
    with pytest.raises(HydraException):  # the user's HYDRA_FULL_ERROR=1: Hydra's own report
        errors.main(bad_main)
    with pytest.raises(ValueError), errors.summarized_bad_input():
        raise ValueError("kept whole for the traceback")


def test_after_its_summary_a_run_that_stopped_on_bad_input_just_exits(monkeypatch):
    monkeypatch.delenv(errors.FULL_ERROR, raising=False)
    with pytest.raises(SystemExit) as exited, errors.summarized_bad_input():
        raise ValueError("optim.lr=-1.0: the learning rate must be positive")
    assert exited.value.code == 1
    with pytest.raises(RuntimeError), errors.summarized_bad_input():  # a crash keeps its traceback
        raise RuntimeError("a bug")


def test_a_runs_summary_shows_the_whole_message_of_its_error_not_its_last_line():
    try:
        raise FileNotFoundError("data.root=x: nothing there. Put these files in x:\n  a\n  b\n  c\n"
                                "  d\nor point data.root at the folder that holds them.")
    except FileNotFoundError as error:
        formatted = "".join(traceback.format_exception(error))
    assert error_message(formatted) == [
        "FileNotFoundError: data.root=x: nothing there. Put these files in x:", "  a",
        "... (3 more lines)", "or point data.root at the folder that holds them."]
    assert error_message("rank 1 was killed (exit code -9)") == ["rank 1 was killed (exit code -9)"]


@pytest.mark.parametrize("seed", [-2**63, 2**64 - 1])
def test_trainer_seed_is_refused_where_torch_manual_seed_refuses_it(seed):
    validate(compose_train(f"trainer.seed={seed}").trainer)
    torch.Generator().manual_seed(seed)
    beyond = seed - 1 if seed < 0 else seed + 1
    with pytest.raises(ValueError, match=rf"^trainer.seed={beyond}: must be an integer from "
                                         r"-2\*\*63 to 2\*\*64 - 1$"):
        validate(compose_train(f"trainer.seed={beyond}").trainer)
    with pytest.raises((OverflowError, RuntimeError, ValueError)):
        torch.Generator().manual_seed(beyond)


def test_a_number_longer_than_python_reads_is_one_line_not_hydras_traceback(tmp_path,
                                                                            monkeypatch):
    seed = "trainer.seed=" + "9" * 5000
    told = ("memexp: trainer.seed=99999999999999999999... (5000 digits): a number longer than "
            "Python reads (4300 digits), and than any key takes\n")
    ran = run_train_py(tmp_path, "model=mlp", seed)
    assert (ran.returncode, ran.stderr, ran.stdout) == (1, told, "")
    monkeypatch.setattr(sys, "argv", ["train.py", seed])
    monkeypatch.setenv(errors.FULL_ERROR, "1")  # Hydra's own parser gets it, traceback and all
    hydra_ran = []
    errors.main(lambda: hydra_ran.append(True))
    assert hydra_ran


def test_a_full_disk_at_the_start_names_the_run_folder_and_the_key(tmp_path):
    with small_filesystem(tmp_path / "run") as run:
        fill(run)
        ran = run_train_py(tmp_path, "model=mlp")
        assert (ran.returncode, ran.stderr, ran.stdout) == (1, (
            f"memexp: {run}: no space left on device, the disk is full. Free some space there, "
            "or point hydra.run.dir at a folder on another disk\n"), "")
        # A sweep's folder, where Hydra's sweeper first writes multirun.yaml: its error names
        # no file either.
        errors.RunFolder().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": run}}}))
        fd = os.open(run / "multirun.yaml", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(SystemExit, match=rf"^memexp: {run}: no space left on device, the "
                                             "disk is full.*point hydra.sweep.dir at"):
            try:
                os.write(fd, b"x" * 8192)
            except OSError as error:
                errors.exit_if_disk_full(error)
            finally:
                os.close(fd)
