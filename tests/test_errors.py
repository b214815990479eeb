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
from memexp.build import build, build_model
from memexp.estimate import estimate
from memexp.loss import as_loss
from memexp.prechecks import dry_run
from memexp.result import error_message
from memexp.trainer import Trainer, validate

from conftest import REPO, compose_train, fill, run_train_py, small_filesystem, train


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


# -- a model's ids, lengths and masks against the data: refused up front, naming the key ----------
def hf_config_keys(**keys) -> tuple[str, ...]:
    return tuple(f"+model.config.{key}={value}" for key, value in keys.items())


# Whisper as issue 38 built it: small, its vocabulary cut to 1,000, its pad and decoder start ids
# set within it, and its bos and eos ids left at the published 50256.
WHISPER_1000 = ("model=hf", "model.arch=whisper", "model.task=speech_seq2seq", *hf_config_keys(
    d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
    max_source_positions=16, max_target_positions=16, vocab_size=1000, pad_token_id=0,
    decoder_start_token_id=1), "data.batch_size=2", "data.num_train=4", "data.num_eval=2",
    "data.seq_len=8", "trainer.max_steps=1")
WAV2VEC2 = ("model=hf", "model.arch=wav2vec2", "model.task=ctc", *hf_config_keys(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    conv_dim="[8,8]", conv_kernel="[5,3]", conv_stride="[4,2]", num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2, vocab_size=32, layerdrop=0), "data.batch_size=2",
    "data.num_train=4", "data.num_eval=2")
GPT2 = ("model=hf", "model.arch=gpt2", "model.task=causal_lm", *hf_config_keys(
    n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=64), "data.batch_size=2",
    "data.num_train=8", "data.num_eval=2")


def test_an_id_the_synthetic_data_writes_past_the_vocabulary_is_refused_naming_its_key():
    """Whisper's transcripts end in its eos_token_id, 50256, past a vocabulary of 1,000: the
    decoder's lookup failed, blamed on "a position table" (issue 38, item 7)."""
    cfg = compose_train(*WHISPER_1000)
    says = (r"^data.task=speech_seq2seq: the synthetic batches hold WhisperConfig's "
            r"eos_token_id=50256 \(ending each transcript\), past its vocabulary of 1000 \(ids 0 "
            r"to 999\), and the model looks it up: set \+model.config.eos_token_id=\.\.\. within "
            r"it, or a larger vocab_size$")
    with pytest.raises(ValueError, match=says):
        estimate(cfg)
    with pytest.raises(ValueError, match=says):
        Trainer(cfg)


def test_a_lookup_out_of_range_says_where_its_index_came_from_only_where_that_is_known():
    """Whisper's decoder looks up its labels shifted right after decoder_start_token_id: an id
    the labels hold, or the start id itself, is neither the batch's own ids nor positions, and
    both were blamed on a position table (`dry_run`: the checks of `memexp estimate`)."""
    cfg = compose_train(*WHISPER_1000, "+model.config.eos_token_id=2",
                        "+model.config.bos_token_id=2")
    with torch.device("meta"):
        model = build_model(cfg.model)
    loss = as_loss(build(cfg.loss), model)
    labels = torch.tensor([[5, 6, 1500, 2], [7, 8, 2, -100]])
    batch = {"input_features": torch.randn(2, 8, 32), "labels": labels}
    with pytest.raises(ValueError, match=r"^model.decoder.embed_tokens \(nn.Embedding with 1000 "
                                         r"rows\) is looked up at index 1500, out of range: an id "
                                         r"that the batch's 'labels' holds, from which the model "
                                         r"makes this lookup's indices"):
        dry_run(model, batch, loss)
    model.config.decoder_start_token_id = 1200
    with pytest.raises(ValueError, match=r"at index 1200, out of range: made by the model itself: "
                                         r"no tensor of the batch holds it, and it is not one of a "
                                         r"run of positions$"):
        dry_run(model, {**batch, "labels": labels.clamp(max=999)}, loss)


def test_clips_shorter_than_specaugments_span_are_refused_naming_both_keys():
    """wav2vec2's SpecAugment masks spans of mask_time_length=10 frames: at data.seq_len=4 the
    run ended in transformers' "`mask_length` has to be smaller than `sequence_length`"."""
    with pytest.raises(ValueError, match=r"^data.seq_len=4: Wav2Vec2Config's SpecAugment masks "
                                         r"spans of mask_time_length=10 frames in training "
                                         r"\(mask_time_prob=0.05\), and the synthetic clips are 4 "
                                         r"frames long \(data.seq_len\): set data.seq_len=10 or "
                                         r"more, \+model.config.mask_time_length=4 or less, or "
                                         r"\+model.config.mask_time_prob=0 \(no masking\)$"):
        train(*WAV2VEC2, "data.seq_len=4")
    shorter = train(*WAV2VEC2, "data.seq_len=4", "+model.config.mask_time_length=4")[1]
    assert len(shorter.losses) == 1


def test_a_causal_lm_with_nothing_to_predict_is_refused_before_it_trains():
    """A sequence of one token gives a causal LM no target: its loss was nan (0 / 0), and the run
    ended `nan` after trainer.max_bad_steps=3 steps."""
    says = (r"^data.seq_len=1: a causal LM predicts each token from the ones before it, and the "
            r"shortest sequence here is 1 token long \(up to data.padding=0.25 of data.seq_len "
            r"is padding\), with nothing to predict.*a larger data.seq_len, or a smaller "
            r"data.padding$")
    with pytest.raises(ValueError, match=says):
        train(*GPT2, "data.seq_len=1", steps=3)
    with pytest.raises(ValueError, match=says):
        estimate(compose_train(*GPT2, "data.seq_len=1"))
    with pytest.raises(ValueError, match=r"^data.seq_len=2: .* the shortest sequence here is 1 "
                                         r"token long \(up to data.padding=0.5 "):
        build(compose_train(*GPT2, "data.seq_len=2", "data.padding=0.5").data)
    build(compose_train(*GPT2, "data.seq_len=2").data)  # no padding at 2 x 0.25: both predicted


def test_an_extra_this_python_lacks_is_named_with_the_interpreter(monkeypatch):
    """A CUDA estimate traces in a venv of its own: the message says which Python lacks peft,
    and how to install it there."""
    import importlib.util

    from memexp.techniques.adapter import peft_or_refuse

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "peft" else found(name, *args))
    with pytest.raises(ValueError) as refused:
        peft_or_refuse("lora")
    assert str(refused.value) == (
        f"adapter=lora needs peft, which is not installed in {sys.executable}: "
        f"{sys.executable} -m pip install 'memexp[lora]'")
