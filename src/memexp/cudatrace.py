"""CUDA estimates from CUDA's own ops, on a machine without a GPU.

`memexp estimate --target cuda` traces the run with a CUDA build of torch when one is
installed (`make cuda-estimator` puts it in .venv-cuda, or name its python in
MEMEXP_CUDA_PYTHON). The trace runs in a process of that venv (memexp.cuda_trace_process),
under FakeTensorMode, on the fake device of memexp.fakecuda: torch then takes its CUDA code
paths as it would on the GPU named by `--gpu` (CUDA autocast's op lists, the SDPA kernel its
selector picks for that compute capability, cuDNN batch norm, fused optimizers, the
GradScaler's amp ops), while no kernel runs and nothing is allocated.

Beyond the traced tensors, a CUDA run holds memory that no trace shows. What is modelled is
added as its own line (memexp.estimate.describe): the cuBLAS workspaces (CublasWorkspaces,
inside torch's allocator), the CUDA context and, for a rank of several, NCCL's buffers
(memexp.gpus, outside it).

A parallel option's rank is traced in that process too, on a fake process group of its own
(memexp.estimate_parallel): fully_shard's and DistributedDataParallel's streams and events are
the fake device's, and their pinned host memory is PinnedHostMemory's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import memexp
from memexp import fakecuda
from memexp.gpus import Gpu
from memexp.memory.allocator import CachingAllocatorModel

_ops = torch.ops.aten
_HOST = torch.device("cpu")
# The ops torch runs through cuBLAS (ATen/cuda/Blas.cpp); convolutions go to cuDNN instead.
CUBLAS_OPS = {_ops.mm, _ops.addmm, _ops.bmm, _ops.baddbmm, _ops.addbmm, _ops.mv, _ops.addmv,
              _ops.dot, _ops.vdot, _ops._addmm_activation, _ops._scaled_mm, _ops._int_mm}
# addmm with a bias vector (nn.Linear) takes cublasLt's fused bias epilogue, which has a
# workspace of its own.
CUBLASLT_OPS = {_ops.addmm, _ops._addmm_activation}
class CublasWorkspaces(TorchDispatchMode):
    """The cuBLAS workspaces a CUDA run allocates through the caching allocator, fed to its
    model as they are allocated, of the sizes memexp.gpus gives the GPU. torch keeps one cuBLAS
    handle per thread, and gives each (handle, stream) a workspace on its first cuBLAS call
    (and a cuBLASLt one on its first cuBLASLt call), kept for the life of the process.
    A training step calls cuBLAS from two threads: the caller's (forward, evaluation, the
    optimizer) and autograd's device thread (backward, recomputation included)."""

    def __init__(self, allocator: CachingAllocatorModel, gpu: Gpu):
        super().__init__()
        self.allocator, self.gpu = allocator, gpu
        self.phase: Callable[[], str] = lambda: "other"
        self.allocated: dict[tuple[str, str], int] = {}

    @property
    def total(self) -> int:
        return sum(self.allocated.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet in CUBLAS_OPS:
            thread = "autograd" if self.phase() == "backward" else "caller"
            cublas = self.gpu.cublas_workspace.nbytes
            self._allocate(("cublas", thread), cublas)
            if packet in CUBLASLT_OPS:
                # torch caps cuBLASLt's at cuBLAS's (getCUDABlasLtWorkspaceSize)
                self._allocate(("cublaslt", thread),
                               min(self.gpu.cublaslt_workspace.nbytes, cublas))
        return func(*args, **(kwargs or {}))

    def _allocate(self, key: tuple[str, str], nbytes: int) -> None:
        if key not in self.allocated:  # negative keys: never a storage's id()
            self.allocated[key] = self.allocator.malloc(-1 - len(self.allocated), nbytes)


# The convolutions torch hands to cuDNN on a CUDA device where cuDNN is enabled
# (ATen/native/Convolution.cpp), forward and backward.
CONVOLUTION_OPS = {_ops.convolution, _ops.convolution_backward}


class ConvolutionWorkspaces(TorchDispatchMode):
    """A size for cuDNN's convolution workspaces, which no trace shows: cuDNN picks each
    convolution's algorithm at run time from its heuristics, and torch allocates that
    algorithm's workspace through the caching allocator for the one call, skipping a plan whose
    workspace does not fit. No rule bounds every algorithm's workspace; the explicit-GEMM
    algorithm's is the convolution's own im2col matrix (input channels x kernel positions, by
    batch x output positions), which the implicit-GEMM and Winograd ones stay below. `largest`
    is that matrix for the largest convolution the run makes, forward or backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.shape = ""  # the largest convolution's, for the estimate's line

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet is _ops.convolution:
            # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
            self._note(args[0], args[1], out, args[6], args[8])
        elif packet is _ops.convolution_backward:
            # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
            #  output_padding, groups, output_mask): the output's positions are grad_output's
            self._note(args[1], args[2], args[0], args[7], args[9])
        return out

    def _note(self, input, weight, output, transposed: bool, groups: int) -> None:
        # a transposed convolution's weight is (in, out / groups, kernel...), and its matrix
        # spans the input's positions
        rows = weight.shape[1] * groups * math.prod(weight.shape[2:])
        positions = math.prod((input if transposed else output).shape[2:])
        nbytes = rows * input.shape[0] * positions * input.element_size()
        if nbytes > self.largest:
            self.largest = nbytes
            self.shape = (f"{'transposed ' if transposed else ''}{tuple(weight.shape[2:])} "
                          f"kernel, {tuple(input.shape)} -> {tuple(output.shape)}")


class PinnedHostMemory(TorchDispatchMode):
    """Page-locked host memory for fake tensors, which have none: `pin_memory()` of a fake
    host tensor is its copy (as pinning copies into memory the CUDA driver locked), and every
    tensor on that copy's storage answers is_pinned() with True. fully_shard's CPU offload keeps
    its sharded parameters and gradients so on a GPU; the copies are host memory, like the
    tensors they pin.

    A host tensor made pinned (a factory's pin_memory=True) is made for real, in pageable
    memory: DistributedDataParallel's reducer copies its map of used parameters (one int per
    parameter) through one on every backward, and checks that its data pointer differs from the
    map's (reducer.cpp, all_reduce_local_used_map), which a fake tensor's (0) never does.

    Pinning belongs to the memory, not to one tensor object: torch asks the CUDA host allocator
    about the data pointer. fully_shard pins each shard as it shards, and at its first forward
    asks again of a narrowed view of it (FSDPParam.reset_sharded_param); answered for the one
    tensor object, it pinned a second copy then, made outside the offload's host_resident()
    and so counted nowhere.

    `tensor.record_stream(stream)` is dropped: it tells the caching allocator that a side
    stream uses the tensor's block, which a fake tensor has none of (torch's kernel reached the
    real allocator). torchao's CPUOffloadOptimizer calls it on each gradient it copies to the
    host on its stream (optim.offload_gradients)."""

    def __init__(self):
        super().__init__()
        self.pinned = WeakIdKeyDictionary()  # the pinned storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ops.record_stream.default:
            return None
        if func is _ops._pin_memory.default:
            pinned = args[0].clone()
            self.pinned[pinned.untyped_storage()] = True
            return pinned
        if kwargs and kwargs.get("pin_memory") and (kwargs.get("device") or _HOST).type == "cpu":
            with unset_fake_temporarily():
                made = func(*args, **{**kwargs, "pin_memory": False})
            self.pinned[made.untyped_storage()] = True
            return made
        if func is _ops.is_pinned.default:
            return args[0].untyped_storage() in self.pinned
        return func(*args, **(kwargs or {}))


def cuda_python() -> Path | None:
    """The python of the venv with a CUDA build of torch: MEMEXP_CUDA_PYTHON, else the
    checkout's .venv-cuda (made by `make cuda-estimator`), else None (also for
    MEMEXP_CUDA_PYTHON=none, which asks for the CPU stand-in)."""
    named = os.environ.get("MEMEXP_CUDA_PYTHON")
    if named == "none":
        return None
    if named:
        if not Path(named).is_file():
            raise ValueError(f"MEMEXP_CUDA_PYTHON={named}: no such file")
        return Path(named)
    checkout = Path(memexp.__file__).resolve().parents[2]  # src/memexp/__init__.py
    python = checkout / ".venv-cuda" / "bin" / "python"
    return python if python.is_file() else None


def run(config: dict, gpu: Gpu, python: Path, world_size: int = 1) -> dict:
    """Trace the composed run `config` in a process of `python`'s venv on the fake `gpu`: its
    one process, or (for a parallel option) its rank with the largest peak of `world_size`,
    on a fake process group of the trace process's own (memexp.estimate.on_ranks). Returns
    the Estimate's fields, with the fake device's call counts and the driver library the
    process loaded under "device"."""
    libraries = fakecuda.build(python.parent.parent / "memexp-fakecuda")
    source = str(Path(memexp.__file__).resolve().parents[1])  # this memexp, not an older copy
    with tempfile.TemporaryDirectory(prefix="memexp-cudatrace-") as folder:
        result_file, log = Path(folder) / "estimate.json", Path(folder) / "calls.log"
        env = {**os.environ, **fakecuda.environment(gpu, libraries, log),
               "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
        process = subprocess.run(
            [str(python), "-m", "memexp.cuda_trace_process", str(result_file)],
            input=json.dumps({"config": config, "gpu": gpu.key, "world_size": world_size}),
            text=True, capture_output=True, env=env)
        if process.returncode != 0:
            raise RuntimeError(f"the CUDA trace ({python}) failed with exit code "
                               f"{process.returncode}:\n{process.stderr[-4000:]}")
        result = json.loads(result_file.read_text())
        if "error" in result:  # bad input, found by the trace process
            raise ValueError(result["error"])
        result["device"]["runtime_calls"] = fakecuda.read_log(log)
    return result
