"""A fake CUDA device for tracing a CUDA build of torch on a machine without a GPU.

Two small C libraries, built here with gcc from this folder's sources:
- `libfakecudart.so` (fakecudart.c), loaded with LD_PRELOAD: it answers the CUDA runtime calls
  torch makes about the device (count, properties, attributes, stream-capture state) as one
  device described by a `memexp.gpus.Gpu`;
- `libcuda.so.1` (libcuda.c), a stand-in for the driver library, found through
  LD_LIBRARY_PATH: torch's NVRTC stub links it, and autograd asks it whether a context exists.

Both abort, naming the call, on anything that would allocate, copy or launch on a device, so a
trace that finishes ran nothing. Only the trace process gets them (`environment()`): the
libraries are never loaded into the process that asked for the estimate.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from memexp.gpus import Gpu

SOURCES = Path(__file__).resolve().parent
RUNTIME, DRIVER = "libfakecudart.so", "libcuda.so.1"


def build(folder: Path) -> Path:
    """Compile both libraries into a subfolder of `folder` named by the sources' hash (a
    rebuilt source gets a new folder; an existing one is reused). Returns that subfolder."""
    runtime_c, driver_c = SOURCES / "fakecudart.c", SOURCES / "libcuda.c"
    digest = hashlib.sha256(runtime_c.read_bytes() + driver_c.read_bytes()).hexdigest()[:12]
    target = folder / digest
    if (target / RUNTIME).is_file() and (target / DRIVER).is_file():
        return target
    compiler = shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the fake CUDA device is built with gcc, and gcc is not on PATH")
    target.mkdir(parents=True, exist_ok=True)
    flags = ["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
    for source, output, extra in ((runtime_c, RUNTIME, ["-ldl"]),
                                  (driver_c, DRIVER, [f"-Wl,-soname,{DRIVER}"])):
        partial = target / f"{output}.partial"  # never a half-written library under its name
        subprocess.run([compiler, *flags, "-o", str(partial), str(source), *extra], check=True,
                       capture_output=True, text=True)
        partial.replace(target / output)
    return target


def environment(gpu: Gpu, libraries: Path, log: Path | None = None) -> dict[str, str]:
    """The variables that make a process see `gpu` (add them to its environment).
    `log`: a file the runtime library appends its call counts to when the process exits."""
    arch = gpu.architecture
    return {
        "LD_PRELOAD": str(libraries / RUNTIME),
        "LD_LIBRARY_PATH": str(libraries),
        "MEMEXP_FAKECUDA_NAME": gpu.name,
        "MEMEXP_FAKECUDA_MAJOR": str(gpu.capability[0]),
        "MEMEXP_FAKECUDA_MINOR": str(gpu.capability[1]),
        "MEMEXP_FAKECUDA_MEMORY": str(gpu.memory),
        "MEMEXP_FAKECUDA_SMS": str(gpu.sms),
        "MEMEXP_FAKECUDA_L2": str(gpu.l2_bytes),
        "MEMEXP_FAKECUDA_SMEM_OPTIN": str(arch.smem_per_block_optin),
        "MEMEXP_FAKECUDA_SMEM_PER_SM": str(arch.smem_per_sm),
        "MEMEXP_FAKECUDA_THREADS_PER_SM": str(arch.threads_per_sm),
        "MEMEXP_FAKECUDA_BUS_WIDTH": str(gpu.bus_width),
        # The driver version reported: CUDA 13.0's (13000), which the CUDA 13 build requires.
        "MEMEXP_FAKECUDA_DRIVER": "13000",
        "MEMEXP_FAKECUDA_LOG": str(log) if log is not None else "",
    }


def read_log(log: Path) -> dict[str, int]:
    """The call counts a traced process wrote (`environment(log=...)`)."""
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        name, count = line.split()
        counts[name] = counts.get(name, 0) + int(count)
    return counts
