"""Measuring memory: the live-storage tracker (CPU, fake tensors) and the per-run meter."""

from memexp.memory.meter import MemoryMeter, SwapsParameters
from memexp.memory.tracker import CATEGORIES, LiveStorageTracker, host_resident, recomputing

__all__ = ["CATEGORIES", "LiveStorageTracker", "MemoryMeter", "SwapsParameters", "host_resident",
           "recomputing"]
