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
  outside it too;
- its speeds, which price a step (memexp.steptime): dense peak FLOP/s by dtype, the share of
  them a matmul, a convolution and an attention kernel achieve, memory bandwidth and the share
  of it a streaming kernel achieves, the host link, the links to other ranks, and what the
  host spends dispatching each op.

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
class Rate:
    """A speed (FLOP/s, bytes/s), a share of one, or a time, and where it comes from."""

    value: float
    source: str


def published(value: float, where: str) -> Rate:
    return Rate(value, f"published: {where}")


def rate_modelled_as(rate: Rate, why: str) -> Rate:
    """A speed that stands in for one nobody has published or measured, saying so."""
    return Rate(rate.value, f"not measured: modelled as {rate.value:g}, {why} ({rate.source})")


# What the host spends on each op it dispatches to the GPU (Python, the dispatcher, autograd's
# bookkeeping, the kernel's launch), on average over a training step's ops, views included:
# the median step of experiment=checkpointing_transformer (memexp's 8-layer, 128-wide GPT, AdamW,
# fp32) on the H100, 16.79 ms at batch 16 and 15.83 ms at batch 64 (bench-gpu.log,
# ../shared/gpu/h100-2026-11-26: the same time at 4x the batch, so the host's), over the ops a
# trace of that step dispatches: 862 on the device and 211 on host tensors alone
# (`python bench/step_time.py --calibration`). Its host: 16 cores of an Intel Xeon with AMX,
# torch 2.11.0+cu130. Another host, or torch, dispatches at another speed.
HOST_OP = Rate(17.8e-6, "measured: 16.31 ms, the median step of memexp's 8-layer GPT on the "
               "H100 at batch 16 and 64 (bench-gpu.log, 2026-11-26; host-bound: 4x the batch "
               "took as long), less its 211 ops on host tensors, over the 862 ops on the device "
               "that its trace dispatches; a 16-core Xeon, torch 2.11.0+cu130")
# An op on host tensors alone launches nothing (an optimizer's `step.item()` per parameter)
HOST_TENSOR_OP = published(4.5e-6, "eager PyTorch's `x + 1` on a one-element CPU tensor, "
                           "4.5 us on an i9-11900K (J. Ansel, 'Micro-optimizations for the most "
                           "micro of benchmarks', dev-discuss.pytorch.org)")
# The share of the dense peak that the best-shaped matmul reached, by brute-force search over
# shapes (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison table", bf16,
# mean of 100 iterations). Taken for every dtype: no fp32 or TF32 figure is published beside it.
MAMF_H100 = published(794.5 / 989, "794.5 of 989 TFLOPS, the best bf16 matmul measured on an "
                      "H100 SXM, torch 2.7.0+cu126, 'H200 is the same' (Bekman, ml-engineering, "
                      "Maximum Achievable Matmul FLOPS)")
MAMF_A100 = published(271.2 / 312, "271.2 of 312 TFLOPS, the best bf16 matmul measured on an "
                      "A100 SXM, torch 2.6.0+cu126 (Bekman, ml-engineering, Maximum Achievable "
                      "Matmul FLOPS)")
NO_MAMF = rate_modelled_as(MAMF_H100, "the H100's, the lowest published for an NVIDIA GPU: none "
                           "is published for this one")
# Attention kernels reach less of the peak than a matmul: softmax between two matmuls
FA2_H100 = published(0.35, "FlashAttention-2's utilisation of an H100 (Shah et al. 2024, "
                     "FlashAttention-3, arXiv 2407.08608)")
FA2_A100 = published(0.50, "the low end of FlashAttention-2's forward, 50-73% of an A100's peak "
                     "(Dao 2023, arXiv 2307.08691); backward and masks run slower")
NO_FA2 = rate_modelled_as(FA2_A100, "the A100's: none is published for this GPU")
# The share of the data sheet's memory bandwidth that a kernel streaming through memory
# reaches: the best kernels measured stay near 90% of it.
STREAM_H100 = published(3000 / 3350, "3000 of 3350 GB/s: DeepSeek's FlashMLA, a memory-bound "
                        "kernel, 'up to 3000 GB/s in memory-bound configuration' on an H800 SXM5 "
                        "(FlashMLA README; the H800 SXM5 has the H100 SXM's 3.35 TB/s HBM3, as "
                        "FlashMLA's deep-dive note gives it)")
STREAM_A100 = published(1.80 / 2.039, "1.80 of 2.04 TB/s, a read kernel on an A100 80GB SXM, "
                        "88% by Nsight Compute too, 'around 90%' the best of any kernel in an "
                        "NVIDIA GTC talk (NVIDIA developer forums, 'Trouble to Reach Peak "
                        "Bandwidth of A100')")
STREAM_AS_H100 = rate_modelled_as(STREAM_H100, "the H100's, whose HBM3 this HBM3e follows")
STREAM_AS_A100 = rate_modelled_as(STREAM_A100, "the A100 80GB's: none is published for this "
                                  "GPU")
# cuDNN's convolutions reach much less of the peak than a matmul of their FLOPs, for reasons a
# step's time does not separate (the algorithms cuDNN picks, layout conversions of NCHW tensors).
# Derived from published ResNet-50 v1.5 training throughput on one GPU (NVIDIA's, for the A100
# and the V100: DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance", pytorch-21.03 container, batch sizes from its configs.yml; Lambda's,
# with NVIDIA's same code, for the H100: bench/step_time.py names the file): the step's time
# less memexp's own price of everything in it but the convolutions (Hugging Face's ResNet-50,
# the same v1.5 network, `python bench/step_time.py --convolutions`) is the convolutions' time,
# and their FLOPs over it a rate. The published run's data loading and cuDNN's choice of
# algorithms are in it, unmodelled.
CONV_A100 = Rate(0.237, "derived: NVIDIA's 938 images/s of ResNet-50 v1.5 training in TF32 on "
                 "one A100 80GB at batch 256 (DeepLearningExamples), less memexp's price of its "
                 "other kernels (bench/step_time.py --convolutions)")
CONV_V100 = Rate(0.86, "derived: NVIDIA's 367 images/s of ResNet-50 v1.5 training in fp32 on "
                 "one V100 16GB at batch 112 (DeepLearningExamples), less memexp's price of its "
                 "other kernels (bench/step_time.py --convolutions)")
CONV_H100 = Rate(0.173, "derived: Lambda's 1,898 images/s of ResNet-50 v1.5 training in TF32 on "
                 "one H100 80GB SXM5 at batch 640, NVIDIA's ConvNets code, synthetic data, 2024 "
                 "(github.com/lambdal/deeplearning-benchmark), less memexp's price of its other "
                 "kernels (bench/step_time.py --convolutions)")
CONV_AS_A100 = rate_modelled_as(CONV_A100, "the A100's: none is derived for this GPU")
CONV_AS_H100 = rate_modelled_as(CONV_H100, "the H100's, the same chip")
CONV_AS_V100 = rate_modelled_as(CONV_V100, "the V100's, the other GPU without TF32 or bf16")
# Between nodes, per GPU each way: DGX H100 and H200 have eight 400 Gb/s ConnectX-7 ports for
# eight GPUs (DGX H100 datasheet), DGX A100 eight 200 Gb/s HDR ports (DGX A100 datasheet)
NDR_PER_GPU = published(50e9, "400 Gb/s per GPU, DGX H100's eight ConnectX-7 (DGX H100 "
                        "datasheet)")
HDR_PER_GPU = published(25e9, "200 Gb/s per GPU, DGX A100's eight ConnectX-6 (DGX A100 "
                        "datasheet)")
NO_FABRIC = rate_modelled_as(HDR_PER_GPU, "one 200 Gb/s NIC per GPU, as on a DGX A100: no "
                             "multi-node system is published for this PCIe card")
PCIE3, PCIE4, PCIE5 = 16e9, 32e9, 64e9  # bytes/s each way of x16 (64, 128 GB/s both ways: Gen4, 5)


@dataclass(frozen=True)
class Speeds:
    """What prices a step (memexp.steptime). FLOP/s are dense (no 2:4 sparsity, which
    datasheets since Ampere double), with fp32 accumulation; links are bytes/s each way."""

    fp32: Rate  # without tensor cores
    tf32: Rate  # tensor cores (fp32's rate where there are none)
    bf16: Rate  # fp32's rate where the tensor cores have no bf16 (before Ampere)
    fp16: Rate
    memory: Rate  # device memory's bandwidth
    memory_share: Rate  # of it, that a kernel streaming through memory achieves
    host_link: Rate  # host to device and back (PCIe)
    peer_link: Rate  # to the other GPUs of a node (NVLink; else PCIe)
    network: Rate  # between nodes, per GPU
    matmul_share: Rate  # of the peak, that a matmul achieves
    convolution_share: Rate  # of the peak, that cuDNN's convolutions achieve
    attention_share: Rate  # of the peak, that an attention kernel achieves
    gpus_per_node: int = 8
    host_op: Rate = HOST_OP
    host_tensor_op: Rate = HOST_TENSOR_OP

    def link(self, ranks: int) -> Rate:
        """The link a ring of `ranks` ranks is as slow as: within a node, or between nodes."""
        return self.peer_link if ranks <= self.gpus_per_node else self.network


def _datasheet(name: str, fp32: float, tf32: float, half: float, memory: float,
               host_link: float, peer_link: float | None, network: Rate, matmul_share: Rate,
               attention_share: Rate, bf16: float | None = None, tf32_note: str = "",
               bf16_note: str = "", memory_share: Rate = STREAM_AS_A100,
               convolution_share: Rate = CONV_AS_A100) -> Speeds:
    """A GPU's speeds from its data sheet `name` (TFLOPS, GB/s as printed there; links each
    way), with the shares and the network that no data sheet gives."""
    sheet = f"NVIDIA {name}"
    half_rate = published(half * 1e12, f"{half} TFLOPS dense, {sheet}")
    return Speeds(
        fp32=published(fp32 * 1e12, f"{fp32} TFLOPS, {sheet}"),
        tf32=published(tf32 * 1e12, f"{tf32} TFLOPS dense, {sheet}{tf32_note}"),
        bf16=half_rate if bf16 is None else published(bf16 * 1e12, f"{bf16} TFLOPS, {sheet}"
                                                       f"{bf16_note}"),
        fp16=half_rate,
        memory=published(memory * 1e9, f"{memory} GB/s, {sheet}"), memory_share=memory_share,
        host_link=published(host_link, f"PCIe x16, {host_link / 1e9:g} GB/s each way, {sheet}"),
        peer_link=(published(peer_link, f"NVLink, {peer_link / 1e9:g} GB/s each way, {sheet}")
                   if peer_link else published(host_link, f"no NVLink: peers over PCIe x16, "
                                                          f"{host_link / 1e9:g} GB/s each way, "
                                                          f"{sheet}")),
        network=network, matmul_share=matmul_share, convolution_share=convolution_share,
        attention_share=attention_share)


HOPPER_SXM = dict(fp32=67, tf32=494.7, half=989.4, host_link=PCIE5, peer_link=450e9,
                  network=NDR_PER_GPU, matmul_share=MAMF_H100, attention_share=FA2_H100)
NO_TF32 = " (no TF32 before Ampere: fp32's rate)"
NO_BF16 = " (no bf16 tensor cores before Ampere: fp32's rate)"


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
    speeds: Speeds  # what prices a step (memexp.steptime)
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
        H100_CONTEXT, CUBLAS_SM90,
        _datasheet("H100 Tensor Core GPU datasheet, H100 SXM", memory=3350,
                   memory_share=STREAM_H100, convolution_share=CONV_H100, **HOPPER_SXM)),
    Gpu("h200", "NVIDIA H200", (9, 0), 143771 * MIB, 132, 50 * MIB, 6144,
        SAME_CHIP_AS_H100, CUBLAS_SM90,
        _datasheet("H200 Tensor Core GPU datasheet, H200 SXM", memory=4800,
                   memory_share=STREAM_AS_H100, convolution_share=CONV_AS_H100,
                   **HOPPER_SXM)),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 81920 * MIB, 108, 40 * MIB, 5120,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("A100 Tensor Core GPU datasheet, A100 80GB SXM", 19.5, 156, 312, 2039, PCIE4,
                   300e9, HDR_PER_GPU, MAMF_A100, FA2_A100, memory_share=STREAM_A100,
                   convolution_share=CONV_A100)),
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 40960 * MIB, 108, 40 * MIB, 5120,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("A100 Tensor Core GPU datasheet, A100 40GB SXM", 19.5, 156, 312, 1555, PCIE4,
                   300e9, HDR_PER_GPU, MAMF_A100, FA2_A100, convolution_share=CONV_A100)),
    Gpu("l40s", "NVIDIA L40S", (8, 9), 46068 * MIB, 142, 96 * MIB, 384,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT,
        _datasheet("L40S datasheet", 91.6, 183, 362, 864, PCIE4, None, NO_FABRIC, NO_MAMF,
                   NO_FA2)),
    Gpu("l4", "NVIDIA L4", (8, 9), 23034 * MIB, 58, 48 * MIB, 192,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT,
        _datasheet("L4 Tensor Core GPU datasheet", 30.3, 60, 121, 300, PCIE4, None, NO_FABRIC,
                   NO_MAMF, NO_FA2)),
    Gpu("a10g", "NVIDIA A10G", (8, 6), 23028 * MIB, 80, 6 * MIB, 384,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("A10 Tensor Core GPU datasheet (the A10G, AWS's GA102 part, has none of "
                   "its own: modelled as the A10)", 31.2, 62.5, 125, 600, PCIE4, None,
                   NO_FABRIC, NO_MAMF, NO_FA2)),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 24564 * MIB, 128, 72 * MIB, 384,
        SAME_ARCH_AS_ADA, CUBLAS_DEFAULT,
        _datasheet("Ada GPU Architecture whitepaper, appendix A, GeForce RTX 4090 (fp16 and "
                   "bf16 with fp32 accumulation)", 82.6, 82.6, 165.2, 1008, PCIE4, None,
                   NO_FABRIC, NO_MAMF, NO_FA2)),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 24576 * MIB, 82, 6 * MIB, 384,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090 (fp16 and bf16 "
                   "with fp32 accumulation; its NVLink bridge, where fitted, not modelled)",
                   35.6, 35.6, 71, 936, PCIE4, None, NO_FABRIC, NO_MAMF, NO_FA2)),
    Gpu("v100-16gb", "Tesla V100-SXM2-16GB", (7, 0), 16384 * MIB, 80, 6 * MIB, 4096,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("V100 Tensor Core GPU datasheet, V100 SXM2", 15.7, 15.7, 125, 900, PCIE3,
                   150e9, NO_FABRIC, NO_MAMF, NO_FA2, bf16=15.7, tf32_note=NO_TF32,
                   bf16_note=NO_BF16, convolution_share=CONV_V100)),
    Gpu("v100-32gb", "Tesla V100-SXM2-32GB", (7, 0), 32768 * MIB, 80, 6 * MIB, 4096,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("V100 Tensor Core GPU datasheet, V100 SXM2", 15.7, 15.7, 125, 900, PCIE3,
                   150e9, NO_FABRIC, NO_MAMF, NO_FA2, bf16=15.7, tf32_note=NO_TF32,
                   bf16_note=NO_BF16, convolution_share=CONV_V100)),
    Gpu("t4", "Tesla T4", (7, 5), 15360 * MIB, 40, 4 * MIB, 256,
        OLDER_ARCH, CUBLAS_DEFAULT,
        _datasheet("T4 Tensor Core GPU datasheet", 8.1, 8.1, 65, 320, PCIE3, None, NO_FABRIC,
                   NO_MAMF, NO_FA2, bf16=8.1, tf32_note=NO_TF32, bf16_note=NO_BF16,
                   convolution_share=CONV_AS_V100)),
)}


def gpu(key: str) -> Gpu:
    """The GPU `key` names, or a ValueError that lists the known ones."""
    if key not in GPUS:
        raise ValueError(f"--gpu {key}: unknown GPU; choose one of {', '.join(GPUS)}")
    return GPUS[key]
