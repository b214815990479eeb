"""CUDA estimates without a GPU: the fake device (memexp.fakecuda), the trace in the CUDA build
of torch (memexp.cudatrace), and the CPU stand-in where that build is absent.

The fake device is C, built with gcc and tested here on any machine. The tests marked
`cudabuild` need the CUDA build of torch (`make cuda-estimator`) and are skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memexp import cli, cudatrace, fakecuda
from memexp.estimate import (
    Estimate,
    compose_config,
    describe,
    estimate,
    optimizer_kernels,
    with_storage,
)
from memexp.gpus import GPUS, gpu
from memexp.result import mib

from conftest import CPU_SMALL, CUDA_PYTHON, needs_cuda_build

MIB = 2**20
TINY_GPT = ("model=transformer", "model.n_layers=1", "model.d_model=64", "data.seq_len=32",
            "data.batch_size=4", "data.num_train=16", "data.num_eval=8")

# Offsets in struct cudaDeviceProp as CUDA 13's driver_types.h lays it out (read with offsetof
# against the header); torch reads the same struct in test_torch_reads_the_table_s_device.
STRUCT = {"size": 1008, "memory": 288, "major": 360, "minor": 364, "sms": 384}
# A C program's view of the fake device, through ctypes: argv is the library, the offsets, and
# optionally a call that must never be answered.
QUERIES = """
import ctypes, json, sys
runtime, at = ctypes.CDLL(sys.argv[1]), json.loads(sys.argv[2])
count, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
assert runtime.cudaGetDeviceCount(ctypes.byref(count)) == 0
assert runtime.cudaDeviceGetAttribute(ctypes.byref(major), 75, 0) == 0  # capability major
assert runtime.cudaDeviceGetAttribute(ctypes.byref(minor), 76, 0) == 0  # capability minor
props = ctypes.create_string_buffer(b"\\xab" * (at["size"] + 64))
assert runtime.cudaGetDeviceProperties(props, 0) == 0
raw = props.raw
field = lambda name, size: int.from_bytes(raw[at[name]:at[name] + size], "little")
print(json.dumps({
    "count": count.value, "attribute_capability": [major.value, minor.value],
    "name": raw[:256].split(b"\\0")[0].decode(), "memory": field("memory", 8),
    "capability": [field("major", 4), field("minor", 4)], "sms": field("sms", 4),
    "beyond_the_struct": raw[at["size"]:].count(b"\\xab")}))
if len(sys.argv) > 3:
    getattr(runtime, sys.argv[3])()
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> Path:
    return fakecuda.build(tmp_path_factory.mktemp("fakecuda"))


def query(libraries: Path, device, log: Path, *refused: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **fakecuda.environment(device, libraries, log)}
    del env["LD_PRELOAD"]  # loaded by ctypes here, not into the interpreter
    return subprocess.run([sys.executable, "-c", QUERIES, str(libraries / fakecuda.RUNTIME),
                           json.dumps(STRUCT), *refused], capture_output=True, text=True,
                          env=env, timeout=60)


# -- the fake device, on any machine ------------------------------------------------------------
@pytest.mark.parametrize("key", ["h100", "v100-16gb", "t4"])
def test_the_fake_device_compiles_and_answers_as_the_chosen_gpu(libraries, tmp_path, key):
    device = gpu(key)
    done = query(libraries, device, tmp_path / "calls.log")
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert answers == {"count": 1, "attribute_capability": list(device.capability),
                       "name": device.name, "memory": device.memory,
                       "capability": list(device.capability), "sms": device.sms,
                       "beyond_the_struct": 64}  # nothing written past the CUDA 13 struct
    # every answered call is counted, in the log written when the process exits
    assert fakecuda.read_log(tmp_path / "calls.log") == {
        "cudaGetDeviceCount": 1, "cudaDeviceGetAttribute": 2, "cudaGetDeviceProperties": 1}


@pytest.mark.parametrize("call", ["cudaMalloc", "cudaLaunchKernel", "cudaMemcpyAsync"])
def test_the_fake_device_aborts_on_anything_that_would_run(libraries, tmp_path, call):
    done = query(libraries, gpu("h100"), tmp_path / "calls.log", call)
    assert done.returncode == -6  # SIGABRT: loud, and no result can be mistaken for a trace
    assert f"memexp fakecuda: {call} was called" in done.stderr


def test_the_stand_in_driver_answers_queries_and_refuses_work(libraries):
    script = ("import ctypes, sys\n"
              "driver = ctypes.CDLL(sys.argv[1])\n"
              "flags, active = ctypes.c_uint(7), ctypes.c_int(7)\n"
              "assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags),"
              " ctypes.byref(active)) == 0\n"
              "print(flags.value, active.value, flush=True)\n"
              "driver.cuLaunchKernel()\n")
    env = {**os.environ, **fakecuda.environment(gpu("h100"), libraries)}
    del env["LD_PRELOAD"]
    done = subprocess.run([sys.executable, "-c", script, str(libraries / fakecuda.DRIVER)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.split() == ["0", "0"]  # no context was ever made
    assert done.returncode == -6 and "the driver call cuLaunchKernel" in done.stderr


def test_an_unchanged_source_is_not_rebuilt(libraries):
    built = (libraries / fakecuda.RUNTIME).stat().st_mtime_ns
    assert fakecuda.build(libraries.parent) == libraries
    assert (libraries / fakecuda.RUNTIME).stat().st_mtime_ns == built


# -- the model of an estimate: built on meta, given fake storage ---------------------------------
def test_pinned_host_memory_is_pinned_in_every_view_of_it():
    """fully_shard asks is_pinned() of a narrowed view of the shard it pinned
    (FSDPParam.reset_sharded_param); a False pinned a second copy, counted nowhere."""
    with FakeTensorMode(), cudatrace.PinnedHostMemory():
        host = torch.empty(8)
        pinned = host.pin_memory()
        assert not host.is_pinned() and pinned.is_pinned()
        assert pinned.narrow(0, 0, 4).is_pinned() and pinned.view(2, 4).is_pinned()


def test_an_estimate_s_model_keeps_its_tied_weights():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100, bias=False))
        model[1].weight = model[0].weight  # tied, as GPT-2's output head is to its embedding
        model.register_buffer("scale", torch.ones(3))
    with FakeTensorMode():
        model = with_storage(model)
    assert model[1].weight is model[0].weight
    assert sum(p.numel() for p in model.parameters()) == 800  # counted once
    assert all(isinstance(t, FakeTensor) and t.device.type == "cpu"
               for t in [*model.parameters(), *model.buffers()])


# -- the CPU stand-in (no CUDA build) -------------------------------------------------------------
def test_without_the_cuda_build_the_estimate_says_it_used_the_cpu_stand_in(monkeypatch, capsys):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")  # as on a machine without .venv-cuda
    overrides = [*TINY_GPT, *CPU_SMALL, "precision=amp"]
    assert cli.main(["estimate", *overrides, "--target", "cuda", "--gpu", "a100-40gb"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA A100-SXM4-40GB (a100-40gb, sm_80)" in text
    assert "trace        CPU stand-in" in text and "make cuda-estimator" in text
    assert "attention    aten._scaled_dot_product_flash_attention_for_cpu" in text
    assert "convolution workspaces" not in text  # no convolution, no size for one
    assert cli.main(["estimate", *overrides, "--target", "cuda", "--gpu", "a100-40gb",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["trace"], result["gpu"]) == ("cpu stand-in", "a100-40gb")
    memory = result["memory"]
    # sm_80: 2 x (4 MiB x 2 + 16 KiB x 8) for the caller's and autograd's threads, + 1 MiB
    # cublasLt for the caller's addmm (nn.Linear with a bias)
    assert memory["cublas_workspace_bytes"] == 2 * (8 * MIB + 128 * 1024) + MIB
    assert memory["allocated_peak_bytes"] == memory["peak_bytes"] + memory[
        "cublas_workspace_bytes"]
    context = gpu("a100-40gb").context.nbytes
    assert memory["context_bytes"] == context
    assert memory["device_peak_bytes"] == memory["reserved_peak_bytes"] + context
    # the workspaces live in the allocator's segments: a 20 MiB one holds both (< 10 MiB each)
    assert memory["reserved_peak_bytes"] >= memory["allocated_peak_bytes"]


def test_every_gpu_s_context_and_workspaces_say_where_they_come_from(monkeypatch, capsys):
    for device in GPUS.values():
        for figure in (device.context, device.cublas_workspace, device.cublaslt_workspace):
            assert figure.nbytes > 0
            assert figure.source.startswith(("measured: ", "published: ", "not measured: "))
    # what an H100 measured on 2026-11-26, with its stack
    h100 = gpu("h100").context
    assert h100.nbytes == 527 * MIB
    assert "torch 2.11.0+cu130" in h100.source and "driver 580.159.04" in h100.source
    # the context line of an estimate says where its figure comes from
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    assert cli.main(["estimate", *TINY_GPT, *CPU_SMALL, "--target", "cuda", "--gpu", "h100"]) == 0
    context = next(line for line in capsys.readouterr().out.splitlines()
                   if line.startswith("  + context"))
    assert context.split()[2:4] == ["527.0", "MiB"] and h100.source in context


def test_a_cuda_estimate_gives_cudnn_s_convolution_workspaces_a_size(monkeypatch):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    cfg = compose_config(["model=resnet", "model.blocks_per_stage=[1,1,1,1]", "data.batch_size=4",
                          "data.image_size=16", "data.num_eval=8", *CPU_SMALL])
    result = estimate(cfg, target="cuda", gpu_key="t4")
    # the largest im2col matrix: a 3x3 convolution of the first stage's 16 channels, by
    # batch 4 x 16 x 16 output positions, fp32
    bound = 16 * 9 * 4 * 16 * 16 * 4
    assert result.memory["cudnn_workspace_bound_bytes"] == bound
    assert (f"cuDNN's convolution workspaces, each allocated for one call: up to {mib(bound)} "
            "if cuDNN's algorithm needs no more than explicit GEMM's (the im2col matrix of the "
            "largest convolution, (3, 3) kernel, (4, 16, 16, 16) -> (4, 16, 16, 16))"
            ) in describe(cfg, result)


def test_gpu_flags_are_checked(capsys):
    assert cli.main(["estimate", "model=mlp", "--gpu", "h100"]) == 2
    assert "--gpu h100 is for --target cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["estimate", "model=mlp", "--target", "cuda", "--gpu", "h1000"])
    assert "invalid choice: 'h1000'" in capsys.readouterr().err
    assert set(GPUS) >= {"h100", "a100-40gb", "a100-80gb", "v100-16gb", "t4"}


def test_a_cuda_plan_fits_the_gpu_less_its_context(monkeypatch, capsys):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    arguments = ["model=mlp", *CPU_SMALL, "data.batch_size=8", "precision=fp32", "optim=sgd",
                 "checkpointing=none", "optim.accumulate=1"]
    assert cli.main(["plan", *arguments, "--target", "cuda", "--gpu", "t4"]) == 0
    t4 = gpu("t4")
    assert f"fit in {(t4.memory - t4.context.nbytes) // MIB}MiB (cuda estimate)" in (
        capsys.readouterr().out)


def test_a_cuda_plan_for_ranks_fits_the_gpu_less_its_context_and_nccl_s_buffers(monkeypatch,
                                                                                   capsys):
    monkeypatch.setenv("MEMEXP_CUDA_PYTHON", "none")
    arguments = ["model=mlp", *CPU_SMALL, "data.batch_size=8", "precision=fp32", "optim=sgd",
                 "checkpointing=none", "optim.accumulate=1", "parallel=fsdp"]
    assert cli.main(["plan", *arguments, "--target", "cuda", "--gpu", "t4",
                     "--world-size", "2"]) == 0
    t4 = gpu("t4")
    outside = t4.context.nbytes + t4.nccl_buffers.nbytes
    assert f"fit in {(t4.memory - outside) // MIB}MiB per rank, on 2 ranks" in (
        capsys.readouterr().out)


# -- the trace in the CUDA build, on the fake device --------------------------------------------
@pytest.mark.cudabuild
@needs_cuda_build
def test_torch_reads_the_table_s_device_and_a_real_allocation_aborts(libraries):
    """torch's own view of the fake device (the struct's layout), then a CUDA tensor made
    outside FakeTensorMode: the device refuses to allocate it."""
    script = ("import json, torch\n"
              "p = torch.cuda.get_device_properties(0)\n"
              "print(json.dumps([p.name, p.major, p.minor, p.total_memory, "
              "p.multi_processor_count, p.L2_cache_size, p.shared_memory_per_block_optin, "
              "p.max_threads_per_multi_processor]), flush=True)\n"
              "torch.zeros(1, device='cuda')\n")
    device = gpu("a100-80gb")
    done = subprocess.run([str(CUDA_PYTHON), "-c", script], capture_output=True, text=True,
                          env={**os.environ, **fakecuda.environment(device, libraries)},
                          timeout=300)
    arch = device.architecture
    assert json.loads(done.stdout) == [device.name, *device.capability, device.memory,
                                       device.sms, device.l2_bytes, arch.smem_per_block_optin,
                                       arch.threads_per_sm]
    assert done.returncode == -6 and "memexp fakecuda: cudaMalloc was called" in done.stderr


@pytest.fixture(scope="module")
def h100_amp_trace() -> dict:
    """A 2-step transformer trace with amp and fused AdamW, in the CUDA build on a fake H100."""
    cfg = compose_config([*TINY_GPT, *CPU_SMALL, "precision=amp", "optim.fused=true"])
    return cudatrace.run(OmegaConf.to_container(cfg, resolve=True), gpu("h100"), CUDA_PYTHON)


@pytest.mark.cudabuild
@needs_cuda_build
def test_the_cuda_trace_finishes_without_a_real_driver(h100_amp_trace):
    result = h100_amp_trace
    assert result["trace"] == "cuda" and "+cu" in result["torch"]
    device = result["device"]
    assert device["name"] == gpu("h100").name and device["capability"] == [9, 0]
    # the only driver library in the trace process is the stand-in, which aborts on any work;
    # the trace finished, so nothing ran
    assert [Path(p).name for p in device["driver_libraries"]] == [fakecuda.DRIVER]
    assert "memexp-fakecuda" in device["driver_libraries"][0]
    assert device["runtime_calls"]["cudaGetDeviceCount"] >= 1
    assert result["memory"]["cublas_workspace_bytes"] == 2 * 32 * MIB + MIB  # sm_90


@pytest.mark.cudabuild
@needs_cuda_build
def test_the_cuda_trace_sees_cuda_s_own_ops(h100_amp_trace):
    forward, backward = h100_amp_trace["ops"]["forward"], h100_amp_trace["ops"]["backward"]
    optimizer = h100_amp_trace["ops"]["optimizer"]
    # torch's SDPA selector on sm_90 with fp16: cuDNN attention, which keeps a logsumexp
    assert "aten._scaled_dot_product_cudnn_attention" in forward
    assert "aten._scaled_dot_product_cudnn_attention_backward" in backward
    assert "aten._scaled_dot_product_attention_math" not in forward
    # CUDA autocast: linear (addmm) in half; layer_norm and the loss's log_softmax in fp32
    assert forward["aten.addmm"] == ["float16"]
    assert forward["aten.native_layer_norm"] == ["float32"]
    assert forward["aten._log_softmax"] == ["float32"]
    # fused AdamW, behind the GradScaler's unscale and scale update
    assert {"aten._fused_adamw_", "aten._amp_foreach_non_finite_check_and_unscale_",
            "aten._amp_update_scale_"} <= set(optimizer)


# torch's own choice on CUDA, where neither optim.foreach nor optim.fused is given: the foreach
# kernels for Adam(W) and SGD, its loop for Adafactor; optim.foreach=false asks for the loop.
@pytest.mark.cudabuild
@needs_cuda_build
@pytest.mark.parametrize("overrides, kernels", [
    (["optim=adamw"], "foreach kernels"), (["optim=sgd_momentum"], "foreach kernels"),
    (["optim=adafactor"], "loop over parameters"),
    (["optim=adamw", "optim.foreach=false"], "loop over parameters"),
], ids=["adamw", "sgd_momentum", "adafactor", "adamw foreach=false"])
def test_the_cuda_trace_runs_the_optimizer_torch_picks_on_cuda(overrides, kernels):
    cfg = compose_config([*TINY_GPT, *CPU_SMALL, *overrides])
    result = Estimate(**cudatrace.run(OmegaConf.to_container(cfg, resolve=True), gpu("h100"),
                                      CUDA_PYTHON))
    assert optimizer_kernels(result) == kernels
    if overrides == ["optim=adamw"]:
        # foreach AdamW's sqrt(exp_avg_sq) of every parameter at once: a list of their size
        step = result.memory["phases"]["optimizer"]["breakdown"]
        assert step["other"] >= step["params"]


@pytest.mark.cudabuild
@needs_cuda_build
def test_the_gpu_decides_the_attention_kernel():
    """No flash or cuDNN attention before sm_80: a V100 gets the memory-efficient kernel."""
    cfg = compose_config([*TINY_GPT, *CPU_SMALL, "precision=amp"])
    result = cudatrace.run(OmegaConf.to_container(cfg, resolve=True), gpu("v100-16gb"),
                           CUDA_PYTHON)
    assert result["device"]["capability"] == [7, 0]
    attention = {op for op in result["ops"]["forward"] if "attention" in op}
    assert attention == {"aten._scaled_dot_product_efficient_attention"}
    assert result["memory"]["cublas_workspace_bytes"] == 2 * (8 * MIB + 128 * 1024) + MIB


@needs_cuda_build
def test_torchvision_built_for_the_cuda_build_imports_beside_memexp_s_entry_point():
    """The CUDA build's venv has the torchvision made for its torch (timm's extra), whose ops
    load from `_C_stable` (torchvision 0.29 on): memexp's entry point, run at `import torch`,
    must leave them to it. Declaring them as well aborted the process as torchvision registered
    its own (a duplicate definition), and with it every CUDA estimate of a model=hf run."""
    done = subprocess.run(
        [str(CUDA_PYTHON), "-c", "import torch, torchvision; "
         "print(torchvision.extension._has_ops())"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
