"""The GPUs a CUDA estimate can be for (`memexp estimate --target cuda --gpu h100`).

A GPU sets three things:
- what the fake CUDA device reports to torch (memexp.fakecuda): the compute capability decides
  kernels (flash attention needs sm_80; sm_90 gets a 32 MiB cuBLAS workspace), and the shared
  memory per block limits which attention kernels fit a head size;
- the capacity `memexp plan` fits plans into;
- the CUDA context added to the estimate: memory the driver holds for the process (kernels,
  the context's own state), outside torch's allocator, so `nvidia-smi` shows it and
  `torch.cuda.max_memory_allocated()` does not.

Memory sizes are what `nvidia-smi` reports as the total for each board.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20

# The CUDA context of a training process on a current stack (CUDA 11.7+ loads kernels lazily;
# torch sets CUDA_MODULE_LOADING=LAZY since 1.13, PyTorch PR #86509). The one measurement with
# its stack stated: 426 MiB in nvidia-smi once torch 2.10.0+cu130 made its context on an RTX
# 6000 Ada (unsloth-zoo PR #1053). PR #86509 measured 274 MiB lazy against 636 MiB eager on
# CUDA 11.7. Kernels that load later (cuBLAS, cuDNN) add to it by an amount nobody has
# published per GPU, so this is a floor. Before lazy loading, contexts of 0.6-1 GB were the rule
# (Titan X to Tesla T4, transformers issue #6222; 1008 MiB on a Titan V, PyTorch issue #28394).
LAZY_CONTEXT = 426 * MIB


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
    context: int = LAZY_CONTEXT  # bytes the CUDA context holds (see LAZY_CONTEXT)

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.capability]

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


GPUS = {gpu.key: gpu for gpu in (
    Gpu("h100", "NVIDIA H100 80GB HBM3", (9, 0), 81559 * MIB, 132, 50 * MIB, 5120),
    Gpu("h200", "NVIDIA H200", (9, 0), 143771 * MIB, 132, 50 * MIB, 6144),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 81920 * MIB, 108, 40 * MIB, 5120),
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 40960 * MIB, 108, 40 * MIB, 5120),
    Gpu("l40s", "NVIDIA L40S", (8, 9), 46068 * MIB, 142, 96 * MIB, 384),
    Gpu("l4", "NVIDIA L4", (8, 9), 23034 * MIB, 58, 48 * MIB, 192),
    Gpu("a10g", "NVIDIA A10G", (8, 6), 23028 * MIB, 80, 6 * MIB, 384),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 24564 * MIB, 128, 72 * MIB, 384),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 24576 * MIB, 82, 6 * MIB, 384),
    Gpu("v100-16gb", "Tesla V100-SXM2-16GB", (7, 0), 16384 * MIB, 80, 6 * MIB, 4096),
    Gpu("v100-32gb", "Tesla V100-SXM2-32GB", (7, 0), 32768 * MIB, 80, 6 * MIB, 4096),
    Gpu("t4", "Tesla T4", (7, 5), 15360 * MIB, 40, 4 * MIB, 256),
)}


def gpu(key: str) -> Gpu:
    """The GPU `key` names, or a ValueError that lists the known ones."""
    if key not in GPUS:
        raise ValueError(f"--gpu {key}: unknown GPU; choose one of {', '.join(GPUS)}")
    return GPUS[key]
