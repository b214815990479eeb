"""compile: whether the model runs through torch.compile (TorchDynamo and Inductor).

`apply(model)` puts a `Compiled` wrapper in the model's place; the first forward pass compiles.
It goes after precision and checkpointing, which change the modules dynamo traces (their wrappers
and autocast are traced into the graph), and inside the parallel wrapper: DDP's gradient hooks
then stay eager, around a compiled model, as torch's DDP supports. FSDP2 is refused: its
per-unit hooks would cut the whole-model graph at every block, and a compiled FSDP model is built
block by block (torchtitan compiles each block before fully_shard), which memexp does not do yet.

Inductor's generated code allocates its buffers outside the aten ops that memexp's live-storage
tracker sees, and dynamo runs nothing compiled while a TorchDispatchMode is active: the meter
measures a compiled run by the allocator's own accounting instead (memexp.memory.meter). An
estimate traces aten ops on fake tensors, not Inductor's buffers: it refuses compiled runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memexp.models.blocks import Wrapper
from memexp.techniques import Technique

# torch.compile's modes memexp offers: reduce-overhead adds CUDA graphs on CUDA, and is the same
# code as default on a CPU (Inductor makes none there). (A str, not an Enum: OmegaConf reads an
# Enum by its member names, and "reduce-overhead" is none.)
MODES = ("default", "reduce-overhead")


def cpp_compiler() -> str:
    """The C++ compiler Inductor builds its kernels with (its own lookup: torch._inductor's
    `cpp.cxx`, CXX at import, else g++), or ValueError saying none was found."""
    from torch._inductor import config, exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        searched = ", ".join(str(c) for c in config.cpp.cxx if c is not None)
        raise ValueError(
            f"compile: no C++ compiler found (searched {searched}, from CXX or g++ on PATH): "
            "Inductor compiles the model's kernels with one, on CPU and GPU alike. Install "
            "g++ or point CXX at a compiler, or use compile=none") from error


class Compiled(Wrapper):
    """Runs `inner` through torch.compile. The compiled callable is not a submodule: the
    parameters keep their names under `inner`, once."""

    def __init__(self, inner: nn.Module, mode: str):
        super().__init__(inner)
        object.__setattr__(self, "_compiled", torch.compile(inner, mode=mode))

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)


@dataclass
class NoCompile(Technique):
    """Eager PyTorch: the baseline."""

    baseline = True
    planned = ({},)
    compiles = False
    changes_math = None  # see memexp.techniques

    def apply(self, model: nn.Module) -> nn.Module:
        return model


@dataclass
class Compile(Technique):
    """torch.compile with Inductor, in `mode`. Fused kernels keep fewer intermediates, and
    AOTAutograd's partitioner chooses what the forward saves for backward (checkpointing=budget
    sets how much). Not planned: `memexp plan` estimates, and an estimate cannot trace
    Inductor's buffers."""

    mode: str = "default"
    compiles = True
    estimable = False
    # Fused kernels round differently (fp32 sums in another order): within a step, like
    # recomputation.
    changes_math = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"compile.mode={self.mode}: valid choices are {', '.join(MODES)}")
        self.compiler = cpp_compiler()

    def apply(self, model: nn.Module) -> nn.Module:
        # Dynamo keys what it compiled by the code object it traced (the model class's forward),
        # not by the model, nor by the functorch settings the graph was partitioned under: a
        # second model of the class in this process (a bench's next row, an in-process job)
        # would run the first one's graph, at the first one's checkpointing.budget. Whatever
        # else this process compiled compiles again when next called (under its own settings).
        torch.compiler.reset()
        return Compiled(model, self.mode)
