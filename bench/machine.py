"""The machine a benchmark ran on, as every bench script prints it first: timing figures, half
precision's above all, hold for that CPU only (a CPU with AMX or avx512_bf16 runs bf16 matmuls
natively; one without emulates them, many times slower)."""

from __future__ import annotations

import os
import platform

import torch

# The instruction sets that decide how fast CPU matmuls run in each precision.
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of FLAGS it has (Linux's /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, [flag for flag in FLAGS if flag in flags]


def describe_machine() -> str:
    model, flags = cpu_info()
    gpu = f"; GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"machine: {model}, {os.cpu_count()} cores, with {' '.join(flags) or 'none'} "
            f"(of {', '.join(FLAGS)}); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads{gpu}")
