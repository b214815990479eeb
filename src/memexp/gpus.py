"""The GPUs a CUDA estimate can be for (`memexp estimate --target cuda --gpu h100`).

A GPU sets four things:
- what the fake CUDA device reports to torch (memexp.fakecuda): the compute capability decides
  kernels (flash attention needs sm_80), and the shared memory per block limits which attention
  kernels fit a head size;
- the capacity `memexp plan` fits plans into;
- the cuBLAS and cuBLASLt workspaces torch gives each thread that calls cuBLAS, inside its
  caching allocator (memexp.cudatrace.CublasWorkspaces adds them where they are first used);
- the CUDA context added to the estimate: memory the driver holds for the process (kernels,
  the context's own state), outside torch's allocator, so `nvidia-smi` shows it and
  `torch.cuda.max_memory_allocated()` does not; and, for a rank of 2 or more, NCCL's buffers,
  outside it too.

Each of those figures carries its source: a measurement with its stack, a published figure with
its citation, or "not measured: modelled as ..." with what stands in for it.

Memory sizes are what `nvidia-smi` reports as the total for each board.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Figure:
    """A number of bytes and where it comes from."""

    nbytes: int
    source: str


# The CUDA context of a training process on a current stack: CUDA 11.7+ loads kernels lazily,
# and torch sets CUDA_MODULE_LOADING=LAZY since 1.13 (PyTorch PR #86509, which measured 274 MiB
# lazy against 636 MiB eager on CUDA 11.7). It depends on the GPU (it grows with the SM count:
# 107 MiB on an RTX 4060 Ti against 555 MiB on an RTX PRO 6000 Blackwell for a bare context,
# llama.cpp PR #23604), the driver and the CUDA version. Kernels that load later (cuBLAS,
# cuDNN) add to it. Before lazy loading, contexts of 0.6-1 GB were the rule (Titan X to
# Tesla T4, transformers issue #6222; 1008 MiB on a Titan V, PyTorch issue #28394).
H100_CONTEXT = Figure(527 * MIB, "measured: nvidia-smi after torch's CUDA init on an H100 80GB "
                      "HBM3, torch 2.11.0+cu130 (CUDA 13.0), driver 580.159.04 (2026-11-26)")
ADA_CONTEXT = Figure(426 * MIB, "published: nvidia-smi once torch 2.10.0+cu130 made its "
                     "context on an RTX 6000 Ada, sm_89 with 142 SMs (unsloth-zoo PR #1053)")


def modelled_as(figure: Figure, why: str) -> Figure:
    """A figure that stands in for a GPU nobody has measured, saying so."""
    return Figure(figure.nbytes, f"not measured: modelled as {figure.nbytes // MIB} MiB, {why} "
                  f"({figure.source})")


SAME_CHIP_AS_H100 = modelled_as(H100_CONTEXT, "the H100's, the same GH100 chip and SM count")
SAME_ARCH_AS_ADA = modelled_as(ADA_CONTEXT, "the RTX 6000 Ada's (the same architecture)")
OLDER_ARCH = modelled_as(ADA_CONTEXT, "the RTX 6000 Ada's, the only lazily loaded context "
                         "published with its stack; one with fewer SMs may be smaller")

# The workspaces torch allocates through its caching allocator, per (cuBLAS handle, stream):
# parseChosenWorkspaceSize and getCUDABlasLtWorkspaceSize in ATen/cuda/CublasHandlePool.cpp;
# CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE change them. On the H100 the GPU tests'
# MLP run allocated what the estimate predicted with these to the byte (77,430,784 bytes, once
# an earlier test's 9,815,040 bytes of uncollected garbage are taken out).
CUBLAS_DEFAULT = Figure(2 * 4 * MIB + 8 * 16 * 1024,
                        "published: torch's default, ':4096:2:16:8' = 2 x 4 MiB + 8 x 16 KiB "
                        "(CublasHandlePool.cpp, parseChosenWorkspaceSize)")
CUBLAS_SM90 = Figure(32 * MIB, "published: torch's default on sm_90, 4096 KiB x 8 "
                     "(CublasHandlePool.cpp, parseChosenWorkspaceSize); measured on the H100, "
                     "torch 2.11.0+cu130")
CUBLASLT = Figure(1 * MIB, "published: torch's default CUBLASLT_WORKSPACE_SIZE, 1024 KiB, kept "
                  "apart from cuBLAS's (CublasHandlePool.cpp, getCUDABlasLtWorkspaceSize)")

# NCCL's buffers for a communicator of 2 or more ranks: memory NCCL allocates itself (cuMem),
# outside torch's allocator, on its first collective. Each channel keeps its own buffers for
# every connection of a collective (sjeaugey in NVIDIA/nccl#1450), for each of NCCL's three
# protocols: Simple's is NCCL_BUFFSIZE, 4 MiB by default (NCCL's docs, env.html#nccl-buffsize),
# LL128's 4.69 MiB and LL's 0.5 MiB, 9.19 MiB rounded to cuMem's 2 MiB granularity: the
# 10,485,760-byte allocations NCCL_DEBUG_SUBSYS=ALLOC shows on 8 H100s (NVIDIA/nccl#1685). A
# ring receives from one peer per channel whatever the number of ranks ("Ring uses a limited
# amount of memory as it only has 2 connections regardless of the scale", sjeaugey in
# NVIDIA/nccl#986, who adds that memory is linear in the number of channels). Channels: the 16
# of NCCL's rings on 8-H100 nodes (the NCCL_DEBUG=INFO log in NVIDIA/nccl#1453). Trees, NVLS,
# all-to-all (+3.3 GB on 8 H100s, nccl#1685) and more channels add to it; NCCL_BUFFSIZE and
# NCCL_MAX_NCHANNELS shrink it.
NCCL_RING = Figure(16 * 10 * MIB, "not measured: modelled as one ring's receive buffers, 16 "
                   "channels x 10 MiB (NCCL_BUFFSIZE's 4 MiB for the Simple protocol, NCCL's "
                   "docs, + LL128's and LL's, in the 10 MiB allocations seen on 8 H100s, "
                   "NVIDIA/nccl#1685; 16 ring channels on H100 nodes, NVIDIA/nccl#1453); "
                   "trees, NVLS and all-to-all add more")


@dataclass(frozen=True)
class Architecture:
    """Per-SM limits of a compute capability (CUDA C Programming Guide, "Technical
    Specifications per Compute Capability")."""

    smem_per_block_optin: int  # bytes a kernel may ask for beyond the default 48 KiB
    smem_per_sm: int
    threads_per_sm: int


ARCHITECTURES = {
    (7, 0): Architecture(96 * 1024, 96 * 1024, 2048),  # Volta
    (7, 5): Architecture(64 * 1024, 64 * 1024, 1024),  # Turing
    (8, 0): Architecture(163 * 1024, 164 * 1024, 2048),  # Ampere (A100)
    (8, 6): Architecture(99 * 1024, 100 * 1024, 1536),  # Ampere (GA10x)
    (8, 9): Architecture(99 * 1024, 100 * 1024, 1536),  # Ada
    (9, 0): Architecture(227 * 1024, 228 * 1024, 2048),  # Hopper
}


@dataclass(frozen=True)
class Gpu:
    key: str  # what --gpu takes
    name: str  # the name torch reports
    capability: tuple[int, int]
    memory: int  # bytes
    sms: int
    l2_bytes: int
    bus_width: int  # bits
    context: Figure  # the CUDA context, outside torch's allocator
    cublas_workspace: Figure  # per (cuBLAS handle, stream), inside torch's allocator
    cublaslt_workspace: Figure = CUBLASLT
    # NCCL's buffers of one communicator of 2 or more ranks, outside torch's allocator
    nccl_buffers: Figure = NCCL_RING

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.capability]

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


GPUS = {gpu.key: gpu for gpu in (
    Gpu("h100", "NVIDIA H100 80GB HBM3", (9, 0), 81559 * MIB, 132, 50 * MIB, 5120,
        H100_CONTEXT, CUBLAS_SM90),
    Gpu("h200", "NVIDIA H200", (9, 0), 143771 * MIB, 132, 50 * MIB, 6144,
        SAME_CHIP_AS_H100, CUBLAS_SM90),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 81920 * MIB, 108, 40 * MIB, 5120,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 40960 * MIB, 108, 40 * MIB, 5120,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("l40s", "NVIDIA L40S", (8, 9), 46068 * MIB, 142, 96 * MIB, 384,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT),
    Gpu("l4", "NVIDIA L4", (8, 9), 23034 * MIB, 58, 48 * MIB, 192,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT),
    Gpu("a10g", "NVIDIA A10G", (8, 6), 23028 * MIB, 80, 6 * MIB, 384,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 24564 * MIB, 128, 72 * MIB, 384,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 24576 * MIB, 82, 6 * MIB, 384,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("v100-16gb", "Tesla V100-SXM2-16GB", (7, 0), 16384 * MIB, 80, 6 * MIB, 4096,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("v100-32gb", "Tesla V100-SXM2-32GB", (7, 0), 32768 * MIB, 80, 6 * MIB, 4096,
        OLDER_ARCH, CUBLAS_DEFAULT),
    Gpu("t4", "Tesla T4", (7, 5), 15360 * MIB, 40, 4 * MIB, 256,
        OLDER_ARCH, CUBLAS_DEFAULT),
)}


def gpu(key: str) -> Gpu:
    """The GPU `key` names, or a ValueError that lists the known ones."""
    if key not in GPUS:
        raise ValueError(f"--gpu {key}: unknown GPU; choose one of {', '.join(GPUS)}")
    return GPUS[key]
