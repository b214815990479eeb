"""Measuring memory: the live-storage tracker (CPU, fake tensors) and the per-run meter."""

from memexp.memory.meter import MemoryMeter, SwapsParameters
from memexp.memory.tracker import (
                                   CATEGORIES,
                                   LiveStorageTracker,
                                   LossBoundary,
                                   computing_loss,
                                   host_resident,
                                   recomputing,
)

__all__ = ["CATEGORIES", "LiveStorageTracker", "LossBoundary", "MemoryMeter", "SwapsParameters",
           "computing_loss", "host_resident", "recomputing"]
