"""The CUDA trace's own process (memexp.cudatrace.run starts it in the CUDA build's venv, on the
fake device): the run's config and the GPU on stdin, its Estimate as JSON in the file argv[1]
names."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from memexp.estimate import estimate, keep_freed_memory
from memexp.gpus import gpu


def loaded_driver() -> list[str]:
    """The driver libraries (libcuda.so*) mapped into this process."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "/libcuda.so" in line})


def main() -> int:
    """The trace process: config JSON on stdin, the Estimate as JSON in the file named by
    argv[1]."""
    keep_freed_memory()
    request = json.loads(sys.stdin.read())
    output = Path(sys.argv[1])
    try:
        result = estimate(OmegaConf.create(request["config"]), "cuda", request["gpu"],
                          request["world_size"])
    except ValueError as error:
        output.write_text(json.dumps({"error": str(error)}))
        return 0
    fields = asdict(result)
    fields["device"] = {"name": torch.cuda.get_device_name(0),
                        "capability": list(torch.cuda.get_device_capability(0)),
                        "driver_libraries": loaded_driver(),
                        "gpu": gpu(request["gpu"]).name}
    output.write_text(json.dumps(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
