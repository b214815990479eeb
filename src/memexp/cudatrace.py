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
inside torch's allocator) and the CUDA context (memexp.gpus, outside it).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memexp
from memexp import fakecuda
from memexp.gpus import Gpu
from memexp.memory.allocator import CachingAllocatorModel

_ops = torch.ops.aten
# The ops torch runs through cuBLAS (ATen/cuda/Blas.cpp); convolutions go to cuDNN instead.
CUBLAS_OPS = {_ops.mm, _ops.addmm, _ops.bmm, _ops.baddbmm, _ops.addbmm, _ops.mv, _ops.addmv,
              _ops.dot, _ops.vdot, _ops._addmm_activation, _ops._scaled_mm, _ops._int_mm}
# addmm with a bias vector (nn.Linear) takes cublasLt's fused bias epilogue, which has a
# workspace of its own.
CUBLASLT_OPS = {_ops.addmm, _ops._addmm_activation}
MIB = 2**20
# cublasLt's workspace: CUBLASLT_WORKSPACE_SIZE, 1024 KiB by default, kept apart from cuBLAS's
# (torch's CublasHandlePool.cpp, getCUDABlasLtWorkspaceSize and getCUDABlasLtWorkspace).
CUBLASLT_WORKSPACE = 1 * MIB


def cublas_workspace(gpu: Gpu) -> int:
    """The cuBLAS workspace torch gives each (handle, stream): 32 MiB on sm_90, else
    ":4096:2:16:8" = 2 x 4 MiB + 8 x 16 KiB (CublasHandlePool.cpp, parseChosenWorkspaceSize;
    CUBLAS_WORKSPACE_CONFIG changes it)."""
    return 32 * MIB if gpu.capability == (9, 0) else 2 * 4 * MIB + 8 * 16 * 1024


class CublasWorkspaces(TorchDispatchMode):
    """The cuBLAS workspaces a CUDA run allocates through the caching allocator, fed to its
    model as they are allocated. torch keeps one cuBLAS handle per thread, and gives each
    (handle, stream) a workspace on its first cuBLAS call, kept for the life of the process.
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
            self._allocate(("cublas", thread), cublas_workspace(self.gpu))
            if packet in CUBLASLT_OPS:
                self._allocate(("cublaslt", thread),
                               min(CUBLASLT_WORKSPACE, cublas_workspace(self.gpu)))
        return func(*args, **(kwargs or {}))

    def _allocate(self, key: tuple[str, str], nbytes: int) -> None:
        if key not in self.allocated:  # negative keys: never a storage's id()
            self.allocated[key] = self.allocator.malloc(-1 - len(self.allocated), nbytes)


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


def run(config: dict, gpu: Gpu, python: Path) -> dict:
    """Trace the composed run `config` in a process of `python`'s venv on the fake `gpu`.
    Returns the Estimate's fields, with the fake device's call counts and the driver library
    the process loaded under "device"."""
    libraries = fakecuda.build(python.parent.parent / "memexp-fakecuda")
    source = str(Path(memexp.__file__).resolve().parents[1])  # this memexp, not an older copy
    with tempfile.TemporaryDirectory(prefix="memexp-cudatrace-") as folder:
        result_file, log = Path(folder) / "estimate.json", Path(folder) / "calls.log"
        env = {**os.environ, **fakecuda.environment(gpu, libraries, log),
               "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
        process = subprocess.run(
            [str(python), "-m", "memexp.cuda_trace_process", str(result_file)],
            input=json.dumps({"config": config, "gpu": gpu.key}), text=True,
            capture_output=True, env=env)
        if process.returncode != 0:
            raise RuntimeError(f"the CUDA trace ({python}) failed with exit code "
                               f"{process.returncode}:\n{process.stderr[-4000:]}")
        result = json.loads(result_file.read_text())
        if "error" in result:  # bad input, found by the trace process
            raise ValueError(result["error"])
        result["device"]["runtime_calls"] = fakecuda.read_log(log)
    return result
