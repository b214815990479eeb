"""The predicted step time on a GPU (memexp.steptime): a deterministic reading of the trace.

The traced tests trace in this process, on the CPU stand-in (MEMEXP_CUDA_PYTHON=none), whose
ops are priced as the GPU's: what is priced is the trace, whichever kernels it holds. The CUDA
build's traces cross to this process as JSON (tests/test_cuda_trace.py's build Estimates from
them), as the round trip here does; bench/step_time.py prices them against a real H100.
The played tests give StepTimer real aten ops on meta tensors, in the order a step would run
them (the estimate's op walk does the same with fake ones): the host's and the GPU's timelines
where the answer is known by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import flop_registry

from memexp import cli, cudatrace
from memexp.estimate import Estimate, compose_config, estimate
from memexp.gpus import GPUS, Rate, Speeds, gpu
from memexp.steptime import PhaseTime, StepTime, StepTimer, duration, extrapolation_doubt

from conftest import CPU_SMALL, CUDA_PYTHON, needs_cuda_build

H100 = gpu("h100").speeds
HOST_OP = H100.host_op.value
# An MLP whose hidden matmuls are compute-bound on an H100 in fp32 and in bf16
MLP = ("model=mlp", "model.hidden=2048", "data.batch_size=512", "data.num_train=1024",
       "data.num_eval=512", *CPU_SMALL)
_aten = torch.ops.aten


_TRACED: dict = {}


def traced(*overrides: str, world_size: int | None = None) -> Estimate:
    """The CUDA estimate of MLP with `overrides`, on the CPU stand-in; each traced once."""
    key = (overrides, world_size)
    if key not in _TRACED:
        _TRACED[key] = estimate(compose_config([*MLP, *overrides]), target="cuda",
                                gpu_key="h100", world_size=world_size)
    assert _TRACED[key].trace == "cpu stand-in"
    return _TRACED[key]


def step_time(*overrides: str, world_size: int | None = None) -> StepTime:
    return traced(*overrides, world_size=world_size).step_time


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def matmul(size: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
    return _aten.mm.default, (meta(size, size, dtype=dtype), meta(size, size, dtype=dtype))


TINY = (_aten.add.Tensor, (meta(1), meta(1)))  # a kernel of 12 bytes
READ = (_aten._local_scalar_dense.default, (meta(()),))  # `.item()`: the host reads it


def played(ops: list[tuple]) -> StepTime:
    """StepTimer's price of `ops`, (op, args) or (phase, op, args), run on meta tensors in
    order as the estimate's op walk gives them (with torch's FLOPs): one step on the H100."""
    timer = StepTimer(gpu("h100"), device="meta")
    for op in ops:
        phase, func, args = op if len(op) == 3 else ("forward", *op)
        out = 0.0 if func is READ[0] else func(*args)  # (a meta tensor has no value to read)
        formula = flop_registry.get(func._overloadpacket)
        flops = 0 if formula is None else formula(*args, out_val=out)
        timer.record(func, args, {}, out, flops, phase)
    return timer.result()


def test_many_tiny_ops_are_the_host_s_time_and_one_large_matmul_the_gpu_s():
    """The host dispatches each op in turn; a kernel starts once launched and once the GPU is
    free. 300 tiny kernels each wait for their launch: the step is the host's. One matmul of
    8.8 TFLOP runs 11 ms after its launch: the step is the GPU's."""
    tiny = played([TINY] * 300)
    assert tiny.seconds == pytest.approx(300 * HOST_OP, rel=1e-6)
    assert tiny.parts["exposed_host_s"] == pytest.approx(tiny.seconds, rel=1e-6)
    large = played([matmul(16384)])
    arithmetic = 2 * 16384**3 / (H100.bf16.value * H100.matmul_share.value)
    assert large.seconds == pytest.approx(HOST_OP + arithmetic, rel=1e-12)
    assert large.parts["compute_s"] == pytest.approx(arithmetic, rel=1e-12)
    assert large.parts["exposed_host_s"] == pytest.approx(HOST_OP, rel=1e-9)  # its launch


def test_a_host_read_makes_the_host_wait_for_the_gpu_and_shows_the_host_s_time_after_it():
    """200 tiny ops after an 11 ms matmul hide under it; after a read of a device value
    (`.item()`) between them, the host first waits for the matmul, and its dispatch of the 200
    shows in full. Each read ends a segment."""
    hidden = played([matmul(16384), *[TINY] * 200])
    waited = played([matmul(16384), READ, *[TINY] * 200])
    assert waited.seconds - hidden.seconds == pytest.approx(200 * HOST_OP, rel=1e-6)
    assert (hidden.phases["forward"].host_reads, waited.phases["forward"].host_reads) == (0, 1)
    assert (len(hidden.segments), len(waited.segments)) == (1, 2)
    assert sum(segment.seconds for segment in waited.segments) == waited.seconds


def test_kernels_move_the_bytes_their_cuda_kernels_move():
    """A softmax over rows too long for registers or shared memory reads them three times
    (GPT-2's 50,257 classes), a short one once; layer norm's backward reads its gradient and
    input twice; the loss reads one class per target, not the whole row."""

    def moved(func, *args) -> int:
        return played([(func, args)]).phases["forward"].bytes

    for classes, reads in ((50257, 3), (8192, 1), (1000, 1)):  # in 4 KiB registers, smem, none
        logits = meta(4096, classes)
        assert moved(_aten._log_softmax.default, logits, -1, False) == (reads + 1) * 4 * 4096 * (
            classes), classes
    activations, weight = meta(8, 512, 1024), meta(1024)
    _, mean, rstd = _aten.native_layer_norm.default(activations, [1024], weight, weight, 1e-5)
    once = 3 * activations.nbytes + 2 * mean.nbytes + 4 * weight.nbytes  # inputs and outputs
    assert moved(_aten.native_layer_norm_backward.default, activations, activations, [1024], mean,
                 rstd, weight, weight, [True, True, True]) == once + 2 * activations.nbytes
    target = meta(4096, dtype=torch.long)
    assert moved(_aten.nll_loss_forward.default, meta(4096, 50257), target, None, 1,
                 -100) == target.nbytes + 4096 * 4 + 2 * 4  # the loss and its total weight


def blocks(depth: int, head: int) -> list[tuple]:
    """A step of `depth` blocks, each the host's: a 4096-wide bf16 matmul (0.17 ms on the GPU)
    among 30 ops in forward (0.53 ms of dispatch) and 40 in backward (0.71 ms); between them a
    `head`-wide matmul, GPU work that backward's host catches up with 0.54 ms a block."""
    forward = [("forward", *matmul(4096))] + [("forward", *TINY)] * 29
    backward = [("backward", *matmul(4096))] + [("backward", *TINY)] * 39
    return forward * depth + [("forward", *matmul(head))] + backward * depth


def test_copies_of_fewer_blocks_give_the_deep_model_s_step_time_or_say_why_not():
    """What memexp.depth relies on: every field of a phase, and each segment's time, grows by
    the same amount per block. Where the copies' critical path is the steepest, the line
    through 2, 3 and 4 blocks gives 12 blocks' step exactly; where a head's queued GPU work
    (4.3 ms) hides backward's host at 2 to 4 blocks and no longer at 12, extrapolation_doubt
    says so (and the line would miss by over 10%)."""
    for head, doubted in ((4096, False), (12000, True)):
        two, three, four, twelve = (played(blocks(depth, head)) for depth in (2, 3, 4, 12))
        line = four.seconds + 8 * (four.seconds - three.seconds)
        assert three.seconds - two.seconds == pytest.approx(four.seconds - three.seconds)
        doubt = extrapolation_doubt([two, three, four])
        if not doubted:
            assert doubt is None
            assert line == pytest.approx(twelve.seconds, rel=1e-9)
        else:
            assert "take turns differently" in doubt
            assert line < 0.9 * twelve.seconds


def test_bf16_autocast_prices_the_same_matmuls_far_below_fp32():
    fp32, bf16 = step_time("model.depth=2"), step_time("model.depth=2", "precision=bf16")
    for phase in ("forward", "backward"):
        assert fp32.phases[phase].flops == bf16.phases[phase].flops > 0
    # the hidden matmuls run at the bf16 tensor cores' peak, 14.8x fp32's; the small ones
    # (the head) are bound by their bytes either way
    assert bf16.parts["compute_s"] < fp32.parts["compute_s"] / 10
    gpu_time = [sum(p.gpu_s for p in step.phases.values()) for step in (fp32, bf16)]
    assert gpu_time[1] < gpu_time[0] / 3  # its casts and its fp32 loss are bytes
    # autocast's casts are ops of their own: on an H100 this step is the host's, and the
    # bf16 one, with more ops, is slower
    assert fp32.ops < bf16.ops and fp32.seconds < bf16.seconds


def test_full_checkpointing_adds_the_recomputed_forward_to_backward():
    plain, full = step_time("model.depth=2"), step_time("model.depth=2", "checkpointing=full")
    forward, kept = full.phases["forward"], plain.phases["forward"]
    assert (forward.flops, forward.kernels, forward.compute_s) == (
        kept.flops, kept.kernels, kept.compute_s)
    # the two hidden blocks' Linear(2048, 2048) run again, in fp32, compute-bound
    recomputed = 2 * 2 * 512 * 2048 * 2048
    backward, before = full.phases["backward"], plain.phases["backward"]
    assert backward.flops - before.flops == recomputed
    assert backward.compute_s - before.compute_s == pytest.approx(
        recomputed / (H100.fp32.value * H100.matmul_share.value))
    # and their ops, dispatched again from the host (the checkpoint's own ops beside them)
    assert backward.ops - before.ops >= 4  # addmm and relu, twice
    assert full.seconds > plain.seconds


def test_a_traced_step_s_parts_add_up_and_extrapolate_from_fewer_blocks():
    """The parts add up to the step, which lies between the slower of host and GPU and their
    sum; traced at 2, 3 and 4 hidden blocks, every sum grows alike per block and gives 6
    blocks' as traced; the step survives JSON (the trace process)."""
    steps = {depth: step_time(f"model.depth={depth}") for depth in (2, 3, 4, 6)}
    for step in steps.values():
        assert sum(step.parts.values()) == pytest.approx(step.seconds, rel=1e-12)
        gpu_time = sum(p.gpu_s for p in step.phases.values())
        assert max(step.host_s, gpu_time) <= step.seconds <= step.host_s + gpu_time
    assert extrapolation_doubt([steps[2], steps[3], steps[4]]) is None
    for phase in ("forward", "backward", "optimizer"):
        for name in (f.name for f in fields(PhaseTime)):
            a, b, c = (getattr(steps[depth].phases[phase], name) for depth in (3, 4, 6))
            assert c == pytest.approx(b + 2 * (b - a), rel=1e-9, abs=1e-15), (phase, name)
    assert steps[6].seconds == pytest.approx(
        steps[4].seconds + 2 * (steps[4].seconds - steps[3].seconds), rel=1e-9)
    shipped = Estimate(**json.loads(json.dumps(asdict(
        Estimate({}, 0, {}, 0.0, "cuda", step_time=steps[4]))))).step_time
    assert shipped == steps[4] and shipped.seconds == steps[4].seconds


def test_a_step_holds_every_micro_batch_of_its_accumulation():
    one, two = step_time("model.depth=2"), step_time("model.depth=2", "optim.accumulate=2")
    assert two.phases["forward"].flops == 2 * one.phases["forward"].flops
    assert two.phases["backward"].flops == 2 * one.phases["backward"].flops
    # one optimizer step either way (the trainer stacks one loss more)
    assert two.phases["optimizer"].bytes == pytest.approx(one.phases["optimizer"].bytes,
                                                          rel=1e-6)


@pytest.mark.parametrize("ranks", [2, 16])
def test_ddp_s_all_reduce_moves_the_gradients_as_a_ring_does(ranks):
    """2(n-1)/n of the gradients' bytes each way, at NVLink's speed within a node of 8 and at
    the network's beyond it; all in backward, where DDP's buckets reduce."""
    step = step_time("model.depth=2", "parallel=ddp", "data.batch_size=32", world_size=ranks)
    parameters = 3072 * 2048 + 2 * 2048 * 2048 + 2048 * 10 + 3 * 2048 + 10
    link = H100.peer_link if ranks <= H100.gpus_per_node else H100.network
    expected = 2 * (ranks - 1) / ranks * 4 * parameters / link.value
    assert step.phases["backward"].collective_s == pytest.approx(expected, rel=0.01)


def test_every_gpu_s_speeds_say_where_they_come_from():
    """Each figure that prices a step, on every GPU of the table: a measurement, a published
    figure, one derived from a published one, or one that says what stands in for it."""
    for key, device in GPUS.items():
        for spec in fields(Speeds):
            figure = getattr(device.speeds, spec.name)
            if isinstance(figure, Rate):
                assert figure.value > 0, (key, spec.name)
                assert figure.source.startswith(
                    ("measured: ", "published: ", "derived: ", "not measured: ")), (key, spec.name)
    assert gpu("h100").speeds.memory_share.source.startswith("published: ")
    assert "938 images/s" in gpu("a100-80gb").speeds.convolution_share.source


@pytest.mark.cudabuild
@needs_cuda_build
def test_in_the_cuda_build_the_host_waits_for_the_values_it_reads():
    """On CUDA's kernels the host reads the GradScaler's verdict and the trainer reads the loss
    and the non-finite check in one `.tolist()`: the host waits for the GPU there, and only
    there (the optimizer's step counters live on the host: reading them waits for nothing)."""
    cfg = compose_config(["model=transformer", "model.n_layers=1", "model.d_model=64",
                          "data.seq_len=32", "data.batch_size=4", "data.num_train=16",
                          "data.num_eval=8", *CPU_SMALL, "precision=amp"])
    step = Estimate(**cudatrace.run(OmegaConf.to_container(cfg, resolve=True), gpu("h100"),
                                    CUDA_PYTHON)).step_time
    optimizer = step.phases["optimizer"]
    assert optimizer.host_ops > 0  # the step counters' reads, on the host
    reads = sum(phase.host_reads for phase in step.phases.values())
    assert reads == optimizer.host_reads >= 2
    assert len(step.segments) == reads + 1
    assert sum(segment.seconds for segment in step.segments) == step.seconds


def test_memexp_estimate_prints_the_step_time_on_its_own_line_and_json_carries_it(
        monkeypatch, capsys):
    result = traced("model.depth=2")
    monkeypatch.setattr("memexp.estimate.estimate", lambda *args, **kwargs: result)
    args = ["estimate", *MLP, "model.depth=2", "--target", "cuda", "--gpu", "h100"]
    assert cli.main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["step_time"]
    step = result.step_time
    assert printed["seconds"] == step.seconds and printed["phases"]["forward"] == asdict(
        step.phases["forward"])
    assert cli.main(args) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("step time "))
    assert line.split()[2:4] == duration(step.seconds).split()
