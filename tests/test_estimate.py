"""memexp estimate and plan: predictions under fake tensors, checked against real CPU runs."""

from __future__ import annotations

import itertools
import platform
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memexp import cli, registry
from memexp import estimate as estimate_module
from memexp.build import build
from memexp.config import config_dir
from memexp.estimate import compose_config, estimate
from memexp.gpus import GPUS
from memexp.loggers import NoLogger
from memexp.memory.allocator import CachingAllocatorModel
from memexp.plan import covered, describe, group_choices, plan, search_space
from memexp.prechecks import IntegerValues
from memexp.techniques.bn_mode import EfficientEvalBN, TrainBN
from memexp.trainer import Trainer

from conftest import CPU_SMALL, HF_BERT, HF_GPT2, compose_train

MIB = 2**20
SMALL_RESNET = ("model.width=8", "model.blocks_per_stage=[1,1,1,1]", "data.image_size=16",
                "data.batch_size=8", "data.num_train=64", "data.num_eval=16")
SMALL_GPT = ("model=transformer", "model.n_layers=2", "data.batch_size=8", "data.num_train=64",
             "data.num_eval=16")
HF_SMALL_DATA = ("data.batch_size=4", "data.num_train=32", "data.num_eval=8")
LLAMA = ("model=hf", "model.arch=llama", "model.task=causal_lm", "+model.config.hidden_size=64",
         "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=4",
         "+model.config.intermediate_size=128", "+model.config.vocab_size=256", "data.seq_len=64",
         *HF_SMALL_DATA)
DEBERTA = ("model=hf", "model.arch=deberta-v2", "model.task=sequence_classification",
           "+model.config.hidden_size=32", "+model.config.num_hidden_layers=2",
           "+model.config.num_attention_heads=2", "+model.config.intermediate_size=64",
           "+model.config.vocab_size=64", "data.seq_len=32", *HF_SMALL_DATA)

# Each built-in model, and every option of each technique group at least once.
CASES = {
    "resnet fp32 sgd": SMALL_RESNET,
    "resnet amp efficient_eval": (*SMALL_RESNET, "precision=amp", "bn_mode=efficient_eval"),
    "resnet full checkpointing adam": (*SMALL_RESNET, "checkpointing=full", "optim=adam"),
    "resnet bf16_pure sequential": (*SMALL_RESNET, "precision=bf16_pure",
                                    "checkpointing=sequential", "bn_mode=eval"),
    "resnet group_norm modules": (*SMALL_RESNET, "bn_mode=group_norm", "checkpointing=modules",
                                  "checkpointing.modules=[blocks.1]"),
    "gpt adamw": SMALL_GPT,
    "gpt bf16 offload": (*SMALL_GPT, "precision=bf16", "checkpointing=offload"),
    "gpt fp16_pure master adafactor": (*SMALL_GPT, "precision=fp16_pure",
                                       "precision.master_weights=true", "optim=adafactor"),
    "gpt selective in_backward": (*SMALL_GPT, "checkpointing=selective", "optim.in_backward=true"),
    "gpt adamw_8bit accumulate": (*SMALL_GPT, "optim=adamw_8bit", "optim.accumulate=2"),
    "mlp sgd_momentum accumulate": ("model=mlp", "optim=sgd_momentum", "optim.accumulate=2"),
    # Hugging Face models, with their own loss and mapping batches
    "hf gpt2 full bf16": (*HF_GPT2, "checkpointing=full", "precision=bf16"),
    "hf bert adamw": HF_BERT,
    # the output head applied by the loss, a chunk of tokens at a time (GPT-2's tied to its
    # embedding): on the three language models
    "hf gpt2 chunked_ce": (*HF_GPT2, "loss=chunked_ce", "loss.chunk_tokens=16"),
    "llama chunked_ce bf16": (*LLAMA, "loss=chunked_ce", "loss.chunk_tokens=64",
                              "precision=bf16"),
    "gpt chunked_ce": (*SMALL_GPT, "loss=chunked_ce"),
    # per-op selective checkpointing's policy runs under FakeTensorMode too: GPT-2's addmm and
    # bmm, Llama's mm and CPU attention kernel
    "hf gpt2 selective_ops": (*HF_GPT2, "checkpointing=selective_ops"),
    "llama selective_ops": (*LLAMA, "checkpointing=selective_ops"),
}


def measured(cfg) -> dict:
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    return trainer.meter.report()


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_estimate_is_within_3_percent_of_the_measured_cpu_peak(overrides):
    cfg = compose_train("trainer.max_steps=2", *overrides)
    predicted, real = estimate(cfg).memory, measured(cfg)
    assert predicted["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.03)
    assert predicted["peak_phase"] == real["peak_phase"]
    # the breakdown too: each category within 3% of the peak
    for category, nbytes in real["breakdown_at_peak"].items():
        assert abs(predicted["breakdown_at_peak"][category] - nbytes) <= 0.03 * real["peak_bytes"]



# The batches are real under the trace, so what their values decide goes as in the real run:
# Llama's unpadded mask is all ones, which Hugging Face skips (SDPA's is_causal, no 4D mask)
# only where it can read the mask; DeBERTa-v2's loss picks its labelled rows with nonzero.
@pytest.mark.parametrize("overrides", [(*LLAMA, "data.padding=0"), DEBERTA],
                         ids=["llama unpadded", "deberta-v2 classification"])
def test_what_the_batch_s_values_decide_is_estimated_to_the_byte(overrides):
    cfg = compose_train("trainer.max_steps=2", *overrides)
    predicted, real = estimate(cfg).memory, measured(cfg)
    assert (predicted["peak_bytes"], predicted["peak_phase"]) == (real["peak_bytes"],
                                                                  real["peak_phase"])
    assert predicted["breakdown_at_peak"] == real["breakdown_at_peak"]


def test_a_data_set_read_through_a_dataloader_is_estimated_to_the_byte():
    """data=dataset: a map-style data set of the user's, read through a torch DataLoader,
    which draws its base seed from torch's generator as its iterator starts
    (`random_().item()`). The estimate made that draw on a fake tensor and refused it as a
    branch on chance; it is made for real, as the batches are, and the estimate equals the
    measured run."""
    cfg = compose_train("trainer.max_steps=2", "data=dataset", "data.batch_size=8",
                        "data.train._target_=user_models.Features", "model=custom",
                        "model._target_=user_models.Classifier", "loss=cross_entropy")
    predicted, real = estimate(cfg).memory, measured(cfg)
    assert predicted["peak_bytes"] == real["peak_bytes"]
    assert predicted["breakdown_at_peak"] == real["breakdown_at_peak"]


# optim.foreach=true on CPU: torch's foreach kernels, whose temporaries are lists the size of the
# parameters (AdamW's sqrt(exp_avg_sq), Adafactor's squared gradients; SGD's momentum is updated
# in place). With a batch of one and checkpointing, AdamW's and Adafactor's runs peak in the step.
@pytest.mark.parametrize("optim, peak_phase", [("adamw", "optimizer"), ("adafactor", "optimizer"),
                                               ("sgd_momentum", "backward")])
def test_a_foreach_optimizer_step_is_estimated_to_the_byte(optim, peak_phase):
    cfg = compose_train("trainer.max_steps=2", *HF_BERT, "data.batch_size=1", "checkpointing=full",
                        f"optim={optim}", "optim.foreach=true")
    predicted, real = estimate(cfg).memory, measured(cfg)
    assert real["peak_phase"] == peak_phase
    assert (predicted["peak_bytes"], predicted["peak_phase"]) == (real["peak_bytes"],
                                                                  real["peak_phase"])
    assert predicted["phases"]["optimizer"] == real["phases"]["optimizer"]


@pytest.mark.parametrize("model, refusal", [
    ("user_models.Routed", "aten.nonzero.default in Routed.forward ("),
    ("user_models.ReadsValues +model.op=unique_consecutive",
     "aten.unique_consecutive.default in ReadsValues.forward ("),
    ("user_models.ReadsValues +model.op=equal", "aten.equal.default in ReadsValues.forward ("),
], ids=["nonzero", "unique_consecutive", "equal"])
def test_an_op_whose_output_depends_on_the_model_s_values_is_refused_where_it_runs(
        model, refusal, capsys):
    target, *options = model.split()
    assert cli.main(["estimate", "model=custom", f"model._target_={target}", *options,
                     "data=tokens", "data.seq_len=16", *HF_SMALL_DATA, *CPU_SMALL]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"memexp estimate: {refusal}")
    assert "user_models.py, line " in err and " depends on values the estimate does not" in err
    if target == "user_models.Routed":
        assert ": routed[first] = self.layers[0](x[first])): the size of its output" in err

def test_the_checks_before_tracing_compute_integers_for_real_and_floats_on_the_meta_device():
    """The dry run before a trace (memexp.prechecks.IntegerValues) computes integers and
    booleans from real values on the CPU, as embedding lookups are checked against them; a
    float made from them (attention's additive mask from a boolean one, 2 x 8192 x 8192 floats
    at seq 8192) is made on the meta device, not computed (it was, for every block)."""
    with IntegerValues():
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        additive = torch.where(causal, 0.0, float("-inf"))
        positions = torch.arange(4) + 1
    assert not causal.is_meta and not positions.is_meta
    assert positions.tolist() == [1, 2, 3, 4] and int(causal.sum()) == 10
    assert additive.is_meta and additive.shape == (4, 4) and additive.dtype == torch.float32


def test_the_trace_s_quicker_cache_keys_tell_apart_what_torch_s_do():
    """memexp's fake mode keys a fake tensor by its metadata in one tuple (the trace's cache is
    torch's): the same ops on tensors of one shape that differ in one field each where the
    outputs differ by it (strides, storage offset, a conjugate or a negative view), each after
    the first is cached, give the outputs plain FakeTensorMode gives, field by field. Any of
    those four left out of the key gives the first one's cached output for another (tried)."""
    assert _fake_outputs(estimate_module._FakeMode()) == _fake_outputs(FakeTensorMode())


def test_the_trace_takes_unsafe_view_from_the_cache_as_torch_makes_it():
    """memexp's fake mode dispatches `_unsafe_view` (a linear layer's matmul on a 3-D input
    ends with one) as `view`, which torch's cache knows how to give: outputs as plain
    FakeTensorMode makes them, field by field, sharing their input's storage; autograd still
    takes them as no view; and where no view can be made (a transposed input), the same error.
    Given a storage of its own, an output would count its bytes twice (tried: a cached clone).
    torch's own mode bypasses its cache for each (FakeTensorMode.cache_bypasses); memexp's
    for none."""
    def outputs(mode) -> list:
        made = []
        with mode:
            base = torch.empty(6, 8, 4, requires_grad=True)
            for tensor in (base, base[1:], base.detach()[:, 2:]):
                out = torch.ops.aten._unsafe_view.default(tensor, [tensor.shape[0], -1])
                made.append((out.shape, out.stride(), out.storage_offset(), out._is_view(),
                             out.untyped_storage()._cdata == tensor.untyped_storage()._cdata))
            try:
                torch.ops.aten._unsafe_view.default(base.transpose(0, 2), [-1])
            except (RuntimeError, ValueError) as error:
                made.append((type(error), str(error)))
            weight = torch.empty(3, 4, requires_grad=True)
            torch.nn.functional.linear(base, weight).sum().backward()
            made.append((weight.grad.shape, base.grad.shape))
        return made

    def bypassed(mode) -> tuple[list, int]:
        before = FakeTensorMode.cache_bypasses.get("unsafe view", 0)
        made = outputs(mode)
        return made, FakeTensorMode.cache_bypasses.get("unsafe view", 0) - before

    (ours, uncached), (torchs, bypasses) = (bypassed(mode) for mode in (
        estimate_module._FakeMode(), FakeTensorMode()))
    assert ours == torchs
    assert uncached == 0 and bypasses >= 4


FREED_AND_MADE_AGAIN = """
import resource, torch
from memexp.estimate import keep_freed_memory

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.ones(2**24)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
keep_freed_memory()
print(default, faults())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_an_estimating_process_keeps_the_blocks_it_frees_for_its_next():
    """keep_freed_memory (memexp estimate and plan): a 64 MiB tensor made and freed
    eight times faults its 16,384 pages in once or twice (seen: 16,373 or 32,757); by glibc's
    default each is mapped afresh and faulted in again (131,127: a trace's 134 MB attention
    masks cost a fifth of its CPU so, as system time)."""
    done = subprocess.run([sys.executable, "-c", FREED_AND_MADE_AGAIN], capture_output=True,
                          text=True, check=True)
    default, kept = map(int, done.stdout.split()[-2:])
    pages = 2**26 // 4096
    assert default >= 6 * pages
    assert kept <= 2.1 * pages  # once, or twice where another block lies above the first


def _fake_outputs(mode) -> list[tuple]:
    made = []
    with mode:
        base = torch.empty(8, 12, dtype=torch.complex64)
        longer = torch.empty(9, 12, dtype=torch.complex64)
        inputs = [base, base.t().contiguous().t(), longer[1:], longer[:-1], base.conj(),
                  torch._neg_view(base)]
        for tensor in inputs:
            for out in (tensor.clone(), tensor.reshape(-1), tensor.resolve_conj(),
                        tensor.resolve_neg()):
                made.append((out.shape, out.stride(), out.storage_offset(), out.dtype,
                             out.untyped_storage().nbytes(), out.is_conj(), out.is_neg()))
    return made


def test_a_billion_parameter_model_is_estimated_without_allocating_it():
    result = estimate(compose_config(["experiment=gpt_1b", "precision=bf16"]))
    assert result.parameters > 1e9
    # params (fp32) + AdamW's two states at least: far more than this machine could hold
    assert result.memory["peak_bytes"] > 12 * result.parameters
    assert result.flops["backward"] > result.flops["forward"] > 0


def test_the_cli_prints_the_breakdown_and_refuses_bad_input(capsys):
    assert cli.main(["estimate", "model=mlp", *CPU_SMALL]) == 0
    out = capsys.readouterr().out
    assert "peak" in out and "backward" in out and "activations" in out
    # torch's choice on CPU, and where the step's temporaries are
    assert "optimizer step: loop over parameters, its temporaries in the optimizer row's" in out
    assert cli.main(["estimate", "precision=bogus"]) == 2
    err = capsys.readouterr().err
    assert "precision=bogus: there is no such option" in err and "bf16_pure" in err
    assert cli.main(["estimate", "model=mlp", "--world-size", "2"]) == 2
    assert "--world-size 2 with parallel=none" in capsys.readouterr().err


# -- the CUDA caching allocator model -------------------------------------------------------
def test_allocator_model_rounds_and_splits_like_the_caching_allocator():
    allocator = CachingAllocatorModel()
    assert allocator.malloc(1, 100) == 512  # at least one 512-byte block
    assert allocator.reserved == 2 * MIB  # a small request opens a 2 MiB segment
    assert allocator.malloc(2, 1000) == 1024  # rounded up to 512 bytes, from the same segment
    assert allocator.reserved == 2 * MIB
    assert allocator.malloc(3, 3 * MIB) == 3 * MIB  # large pool: a 20 MiB segment, split
    assert allocator.reserved == 22 * MIB
    assert allocator.malloc(4, 11 * MIB) == 11 * MIB  # best fit: the segment's free 17 MiB
    assert allocator.reserved == 22 * MIB
    # 11 MiB more opens a 12 MiB segment (10 MiB and up: rounded to 2 MiB); the 1 MiB rest is
    # too small to split off (large blocks split only when more than 1 MiB remains), so the
    # whole 12 MiB counts as allocated
    assert allocator.malloc(5, 11 * MIB) == 12 * MIB
    assert allocator.reserved == 34 * MIB


def test_allocator_model_reuses_freed_blocks_and_merges_neighbours():
    allocator = CachingAllocatorModel()
    for key in range(4):
        allocator.malloc(key, 4 * MIB)  # 16 of one 20 MiB segment
    for key in (1, 2):
        allocator.free(key)
    assert allocator.allocated == 8 * MIB and allocator.reserved == 20 * MIB
    assert allocator.malloc(9, 8 * MIB) == 8 * MIB  # fits the merged 8 MiB hole: no new segment
    assert allocator.reserved == 20 * MIB
    assert allocator.reserved_peak == 20 * MIB and allocator.allocated_peak == 16 * MIB


@pytest.mark.slow
def test_a_cuda_estimate_s_reserved_memory_is_that_of_the_steps_after_it(monkeypatch):
    """Reserved memory can grow at step 3, the first to start from the blocks that a step with
    optimizer state alive left behind; later steps repeat its layout. This 6-layer BERT grows
    by 120 MiB there, as the 12-layer one does (BERT-large's reserved then holds to step 8)."""
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")  # the same trace wherever it runs
    cfg = compose_config(["model=hf", "model.arch=bert", "model.task=sequence_classification",
                          "+model.config.hidden_size=1024", "+model.config.num_hidden_layers=6",
                          "+model.config.num_attention_heads=16", "data.seq_len=512",
                          "data.batch_size=4", "data.num_eval=8", "optim=adamw", *CPU_SMALL])
    estimated = estimate(cfg, target="cuda", gpu_key="h100").memory
    reserved = {}
    for steps in (2, 4):
        monkeypatch.setattr(estimate_module, "RESERVED_STEPS", steps)
        reserved[steps] = estimate(cfg, target="cuda", gpu_key="h100").memory
    assert reserved[2]["reserved_peak_bytes"] < estimated["reserved_peak_bytes"]  # it grew
    assert estimated["reserved_peak_bytes"] == reserved[4]["reserved_peak_bytes"]
    assert estimated["allocated_peak_bytes"] == reserved[4]["allocated_peak_bytes"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("model", "cudnn"), [("resnet", False), ("transformer", True),
                                              ("mlp", True)])
def test_cuda_estimate_is_within_5_percent_of_max_memory_allocated(model, cudnn):
    cfg = compose_config([f"model={model}", "trainer.device=cuda", "trainer.max_steps=3",
                          "trainer.progress=false"])
    # the table's GPU of this device's compute capability (its cuBLAS workspace size)
    key = next(k for k, g in GPUS.items() if g.capability == torch.cuda.get_device_capability())
    predicted = estimate(cfg, target="cuda", gpu_key=key).memory["allocated_peak_bytes"]
    # The estimate does not count cuDNN's convolution workspaces (it says so): cuDNN sizes them
    # at run time. The ResNet is compared with ATen's own convolutions, and is higher with
    # cuDNN's. The device's counters include cuBLAS's workspaces, as the estimate does.
    with torch.backends.cudnn.flags(enabled=cudnn):
        real = measured(cfg)["peak_bytes"]
    assert predicted == pytest.approx(real, rel=0.05)
    if not cudnn:
        assert measured(cfg)["peak_bytes"] > real


# -- plan ---------------------------------------------------------------------------------
LIGHTER = ["adafactor", "adamw_8bit", "adamw_4bit", "adamw_fp8", "muon"]


# AdamW's class plans its options with bf16 moments and with the step on the host
@pytest.mark.parametrize("optim, tried", [("adamw", ["adamw", "adamw_bf16", "adamw_offload",
                                                     *LIGHTER]),
                                          ("adam", ["adam", *LIGHTER]),
                                          ("adamw_8bit", ["adamw_8bit"]), ("sgd", ["sgd"])])
def test_plan_also_tries_the_lighter_optimizers_the_configured_ones_class_names(optim, tried):
    cfg = compose_config([f"optim={optim}"])
    choices = group_choices([f"optim={optim}"])
    assert search_space(cfg, choices, {}).space["optim"] == tried
    # the user's choice
    assert search_space(cfg, choices, {"optim": ["sgd"]}).space["optim"] == ["sgd"]


def test_plan_says_which_options_of_every_group_it_tried_and_why_it_left_out_the_others():
    """Every group is searched or held at the run's own option; every option of a searched
    group is tried or left out with its reason, read from its class (a new option's class
    sets `planned`, and the plan tries it)."""
    cfg, choices = compose_config(["model=mlp"]), group_choices(["model=mlp"])
    search = search_space(cfg, choices, {"precision": ["fp32", "bf16"]})
    assert set(search.space) | set(search.fixed) == {*registry.groups(), "optim.accumulate"}
    for group, tried in search.space.items():
        if group != "optim.accumulate":
            assert set(tried) | set(search.left_out[group]) == set(registry.options(group))
    assert search.fixed == {"data": "images", "model": "mlp", "logger": "csv"}
    assert search.space["checkpointing"] == ["none", "full", "full_offload", "offload",
                                             "selective_ops"]
    assert search.left_out["checkpointing"] == {
        "budget": "MemoryBudget plans none", "modules": "CheckpointModules plans none",
        "selective": "CheckpointBlocks plans only every=1",
        "sequential": "CheckpointSequential plans none"}
    # the loss: chunked_ce is planned, but the MLP has no output head for it to take
    assert search.space["loss"] == ["cross_entropy"]
    assert search.left_out["loss"] == {
        "chunked_ce": "does not compute loss=cross_entropy on this model",
        "custom": "the user names its loss._target_", "model": "ModelLoss plans none",
        "mse": "MSE plans none"}
    lines = covered(search).splitlines()
    assert lines[0] == "search space covered:"
    line = {line.split(":")[0].strip(): line for line in lines[1:]}
    assert line["precision"] == ("  precision: tried fp32, bf16; left out amp, bf16_pure, "
                                 "float8, fp16_pure, tf32 (not in the command line's list)")
    assert line["bn_mode"] == ("  bn_mode: tried train; left out efficient_eval, eval, "
                               "group_norm, sync (the model has no BatchNorm)")
    assert line["parallel"] == ("  parallel: tried none; left out ddp, fsdp, zero1 (one "
                                "process: --world-size N searches them)")
    assert lines[-1] == ("  not searched, the run's own (their classes plan no other): "
                         "data=images, model=mlp, logger=csv")


def test_a_group_whose_classes_plan_options_is_searched_from_the_run_s_own(monkeypatch):
    """A group beyond precision ... parallel joins the search once a class of it plans: the
    run's own option first, then the planned ones."""
    monkeypatch.setattr(NoLogger, "planned", ({},), raising=False)
    search = search_space(compose_config(["model=mlp"]), group_choices(["model=mlp"]), {})
    assert search.space["logger"] == ["csv", "none"]
    assert search.left_out["logger"] == {"wandb": "WandbLogger plans none"}
    assert "logger" not in search.fixed


def test_each_option_says_whether_it_changes_what_is_learned():
    """Stated once, on the option classes (memexp.techniques): what the plan marks."""
    groups = {group: sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
              for group in ("precision", "optim", "bn_mode", "checkpointing")}
    changing = {}
    for picks in itertools.zip_longest(*groups.values()):  # one option of each group a compose
        chosen = {group: option for group, option in zip(groups, picks, strict=True) if option}
        overrides = [f"{group}={option}" for group, option in chosen.items()]
        if chosen.get("checkpointing") == "modules":  # the one key without a default
            overrides.append("checkpointing.modules=[fc]")
        cfg = compose_config(overrides)
        for group, option in chosen.items():
            if build(cfg[group]).changes_math:
                changing.setdefault(group, []).append(option)
    assert changing == {"precision": ["bf16_pure", "fp16_pure"],
                        "optim": ["adafactor", "adamw_4bit", "adamw_8bit", "adamw_bf16",
                                  "adamw_fp8", "muon"],
                        "bn_mode": ["efficient_eval", "eval", "group_norm"]}
    # pure half precision keeps the math with fp32 master weights, as amp does
    master = compose_config(["precision=fp16_pure", "precision.master_weights=true"])
    assert build(master.precision).changes_math is None


def test_plan_ranks_what_changes_what_is_learned_after_what_keeps_it(capsys):
    """A CNN from scratch. Frozen BatchNorm statistics (bn_mode=efficient_eval) take less memory
    but learn something else: the plan lists them after bn_mode=train, apart, saying why. Where
    bn_mode=train needs less memory, full checkpointing keeps the math, accumulation (BatchNorm
    over half-batches) does not: the plan ranks checkpointing first, and --allow-changes the
    cheaper accumulation, saying what it changes."""
    fixed = [*SMALL_RESNET, *CPU_SMALL, "precision=fp32", "optim=sgd"]
    arguments = [*fixed, "bn_mode=train,efficient_eval", "checkpointing=none",
                 "optim.accumulate=1"]
    plans = plan(arguments, "1GiB")
    keeps, frozen = plans
    assert "bn_mode=train" in keeps.overrides and keeps.changes == []
    assert "bn_mode=efficient_eval" in frozen.overrides
    assert frozen.peak_bytes < keeps.peak_bytes  # what ranked it first
    assert frozen.changes == [f"bn_mode=efficient_eval: {EfficientEvalBN.changes_math}"]
    shown = describe(arguments, "1GiB", plans).splitlines()
    assert shown[1].startswith("1 of them change what is learned, after every one")
    assert shown[-4:-2] == ["", "  fit, but change what is learned:"]
    assert shown[-2].startswith("   2 ") and "bn_mode=efficient_eval" in shown[-2]
    assert shown[-1] == f"      changes what is learned: {frozen.changes[0]}"
    # a budget that bn_mode=train fits with full checkpointing (or accumulation), not without
    full = estimate(compose_config([*fixed, "checkpointing=full"]))
    budget = str(full.memory["peak_bytes"])
    arguments = [*fixed, "bn_mode=train", "checkpointing=none,full", "optim.accumulate=1,2"]
    checkpointed, *accumulated = plan(arguments, budget)  # every way that fits
    assert checkpointed.fits and checkpointed.changes == []
    assert "checkpointing=full" in checkpointed.overrides and checkpointed.accumulate == 1
    assert accumulated and all(p.fits and p.accumulate == 2 and p.changes for p in accumulated)
    assert cli.main(["plan", f"budget={budget}", *arguments, "--allow-changes"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[1] == (f"{len(accumulated)} of them change what is learned, ranked with the "
                        "rest (--allow-changes)")
    assert "checkpointing=none optim.accumulate=2" in shown[4]
    assert shown[5] == ("      changes what is learned: optim.accumulate=2: "
                        f"{TrainBN.accumulation_changes_math}")
    # ... and ends with the space it covered
    block = shown[shown.index("search space covered:"):]
    assert ("  checkpointing: tried none, full; left out budget, full_offload, modules, offload, "
            "selective, selective_ops, sequential (not in the command line's list)") in block
    assert block[-1].startswith("  not searched, the run's own")


def test_plan_lists_what_fits_cheapest_first_and_its_commands_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --verify runs into ./outputs/plans
    arguments = ["model=mlp", "data.batch_size=512", *CPU_SMALL, "precision=fp32,bf16", "optim=sgd",
                 "checkpointing=none", "optim.accumulate=1,2,4"]
    everything = plan(arguments, "1GiB")
    assert all(p.fits for p in everything)  # all fit, each way
    assert len(everything) == 6 and [p.accumulate for p in everything[:2]] == [1, 1]
    by_precision = {p.precision: p for p in everything if p.accumulate == 1}
    # a budget between fp32's accumulate=1 and accumulate=4 peaks
    fp32 = by_precision["fp32"].estimate.memory["peak_bytes"]
    tight = plan(arguments, f"{int(fp32 * 0.9)}")
    fitting = [p for p in tight if p.fits]
    assert fitting and all(p.peak_bytes <= fp32 * 0.9 for p in fitting)
    assert [p.cost() for p in fitting] == sorted(p.cost() for p in fitting)
    assert any(p.accumulate > 1 for p in fitting)  # accumulation is what made fp32 fit
    # the plan's command is a real run that fits the budget, as estimated
    assert cli.main(["plan", f"budget={int(fp32 * 0.9)}", *arguments, "--verify", "1",
                     "--verify-steps", "3"]) == 0
    out, err = capsys.readouterr()
    # each candidate as it was settled: fp32 over budget, but for accumulation
    tried = err.splitlines()
    assert tried[0].startswith("memexp plan: settling 6 candidates")
    fp32_tried = [line for line in tried if "precision=fp32 " in line]
    assert any(" fits " in line for line in fp32_tried)
    assert all(" over " in line for line in fp32_tried if "optim.accumulate=1 " in line)
    assert "python train.py" in out and "verified in" in out
    ratio = float(out.split("verified in")[1].splitlines()[2].split()[5])
    assert ratio == pytest.approx(1.0, abs=0.03)
