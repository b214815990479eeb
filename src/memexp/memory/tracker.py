"""A tracker of live tensor storage, for devices whose allocator we cannot read (CPU, fake tensors).

Every aten op goes through `__torch_dispatch__`; each output's storage is recorded once (views
share their base's storage, so they are never counted twice) with a weak reference whose callback
fires when the storage is really freed. Storage objects keep their Python object alive while C++
(autograd's saved tensors, for example) still holds them, so the callback marks the true free.

Storages that existed before tracking started (parameters, buffers) must be registered with
`track()`, otherwise they would be counted the first time an op viewed them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from memexp.memory.allocator import CachingAllocatorModel
from memexp.memory.timeline import Timeline

# Live storages are grouped into these categories when a peak is recorded.
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
# Storages created while `host_resident()` is active (offloaded activations, CPU-offloaded
# parameters) are host memory: reported in their own category and kept out of the device peak.
OFFLOADED = "offloaded"
# The phase between named phases (batch fetch, loss.item()): only allocations made in it count
# towards its peak, not what the previous phase left alive.
IDLE = "other"
# Tensors the forward pass created, or that activation checkpointing recomputes in backward, and
# that are still alive are what autograd keeps for backward (plus the logits and the loss): the
# "activations" category.
RECOMPUTE = "recompute"
ACTIVATION_PHASES = frozenset({"forward", RECOMPUTE})

_host_depth = 0
_recompute_depth = 0


@contextmanager
def host_resident():
    """Declare that tensors allocated inside live in host memory, not on the training device.

    On CUDA this is literally where they are; on a CPU run it keeps the device/host split that
    a GPU run would have, so offloading techniques can be measured on any machine.
    """
    global _host_depth
    _host_depth += 1
    try:
        yield
    finally:
        _host_depth -= 1


@contextmanager
def recomputing():
    """Declare that tensors allocated inside belong to a forward pass recomputed during backward
    (activation checkpointing): they are activations, not backward temporaries."""
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


@dataclass(slots=True)
class _Storage:
    ref: weakref.ref | None
    nbytes: int
    phase: str
    host: bool
    grad: bool = False
    # the storage's own size; `nbytes` is what the device holds for it (with `allocator`, the
    # caching allocator's rounded block)
    requested: int = 0


@dataclass
class PhasePeak:
    peak_bytes: int = 0
    # Live storages at the peak: (weakref, nbytes, creating phase, host, role known at the peak).
    # Roles unknown at the peak are looked up again when the phase ends, because some tensors get
    # their role after they are allocated (SGD stores a new momentum buffer after using it).
    snapshot: list[tuple[weakref.ref, int, str, bool, str | None]] | None = None
    breakdown: dict[str, int] | None = None


def tensor_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind a tensor; wrapper subclasses (DTensor) are opened up."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        # DTensor (torch >= 2.10) also names its device mesh, which holds no storage.
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in tensor_storages(t)]
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return []


class LiveStorageTracker(TorchDispatchMode):
    """Counts live device bytes after every op and records each phase's peak with its breakdown.

    `roles` maps id(storage) to a category for storages whose role is known from the outside
    (parameters, gradients, optimizer state); everything else is classified by the phase that
    created it (see ACTIVATION_PHASES). With `device_type` set, tensors on other devices are not
    device memory and are skipped (a CUDA run's batch before it is copied over), unless they are
    declared host-resident (`host_resident()`).
    """

    def __init__(self, roles: Callable[[], dict[int, str]] = dict, budget: int | None = None,
                 timeline: Timeline | None = None,
                 allocator: CachingAllocatorModel | None = None, device_type: str | None = None):
        super().__init__()
        self._roles = roles
        self.device_type = device_type
        # estimates for CUDA: count each storage as the caching allocator's block for it
        self.allocator = allocator
        # memory.budget: the size of the device this run pretends to have
        self.budget = budget
        # memory.snapshot: live bytes by category after every op
        self.timeline = timeline
        # Weakref callbacks may fire from autograd's threads: single dict operations only, and
        # iteration over a copy.
        self._live: dict[int, _Storage] = {}
        self.phase = IDLE
        self.current = 0
        self.host_current = self.host_peak = 0
        # Live activations (by creating phase) and gradients (marked by `mark_grad`) are followed
        # op by op, so their own peaks are known whatever the moment of the overall peak.
        self.activations_current = self.activations_peak = 0
        self.grads_current = self.grads_peak = 0
        # Device activations alive when a forward pass ends: what autograd keeps for backward.
        self.saved_activations = 0
        self.peaks: dict[str, PhasePeak] = {}

    # -- recording ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        if self.timeline is not None:
            self.timeline.record(self.phase, self.current, self.activations_current,
                                 self.grads_current, self.host_current)
        return out

    def track(self, *tensors: torch.Tensor) -> None:
        """Record the storages of `tensors` (safe to call on tensors already tracked)."""
        grew = False
        for tensor in tensors:
            # A fake tensor's storage is on "meta": the tensor knows where it lives.
            if (self.device_type is not None and tensor.device.type != self.device_type
                    and _host_depth == 0):
                continue
            for storage in tensor_storages(tensor):
                grew |= self._record(storage)
        if grew:
            self._maybe_peak()

    def _record(self, storage: torch.UntypedStorage) -> bool:
        key = id(storage)
        nbytes = storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            if known.requested == nbytes:
                return False
            change = nbytes - known.requested  # resized in place
            known.nbytes += change
            known.requested = nbytes
            self._add(known, change)
            if known.grad:
                self._add_grad(change)
            return change > 0 and not known.host
        phase = RECOMPUTE if _recompute_depth > 0 else self.phase
        record = _Storage(None, nbytes, phase, _host_depth > 0, requested=nbytes)
        if self.allocator is not None and not record.host:
            nbytes = record.nbytes = self.allocator.malloc(key, nbytes)
        if not record.host and self.budget is not None and self.current + nbytes > self.budget:
            self._out_of_budget(nbytes)
        record.ref = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._live[key] = record
        self._add(record, nbytes)
        return not record.host

    def _out_of_budget(self, nbytes: int) -> None:
        """Fail the way a device of `budget` bytes would: the allocation that does not fit raises
        torch.OutOfMemoryError (what CUDA raises) and is never counted, so the peak is what the
        device would have held. The tensor exists here, but the op's caller never gets it."""
        raise torch.OutOfMemoryError(
            f"memory.budget: tried to allocate {nbytes / 2**20:.2f} MiB in phase {self.phase} "
            f"with {self.current / 2**20:.2f} MiB of live tensors; the emulated device holds "
            f"{self.budget / 2**20:.2f} MiB")

    def _free(self, key: int) -> None:
        record = self._live.pop(key, None)
        if self.allocator is not None:
            self.allocator.free(key)
        if record is not None:
            self._add(record, -record.nbytes)
            if record.grad:
                self._add_grad(-record.nbytes)

    def mark_grad(self, grad: torch.Tensor) -> None:
        """Count `grad`'s storage as gradient memory until it is freed."""
        for storage in tensor_storages(grad):
            record = self._live.get(id(storage))
            if record is not None and not record.grad and not record.host:
                record.grad = True
                self._add_grad(record.nbytes)

    def _add_grad(self, nbytes: int) -> None:
        self.grads_current += nbytes
        self.grads_peak = max(self.grads_peak, self.grads_current)

    def _add(self, record: _Storage, nbytes: int) -> None:
        if record.host:
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
            return
        self.current += nbytes
        if record.phase in ACTIVATION_PHASES:
            self.activations_current += nbytes
            self.activations_peak = max(self.activations_peak, self.activations_current)

    # -- peaks -------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Start attributing allocations to `phase`; what is live on entry counts for it too
        (an SGD step allocates nothing, yet the optimizer phase holds params and grads)."""
        self._settle(self.peaks.get(self.phase))
        if self.phase == "forward":
            self.saved_activations = max(self.saved_activations, self.activations_current)
        self.phase = phase
        if phase != IDLE:
            self._maybe_peak()
        if self.timeline is not None:
            self.timeline.set_states(self._state_bytes())

    def _state_bytes(self) -> int:
        """Live device bytes of parameters and optimizer state (roles known from outside)."""
        roles = self._roles()
        return sum(r.nbytes for key, r in self._live.copy().items()
                   if not r.host and roles.get(key) in ("params", "optimizer"))

    def _maybe_peak(self) -> None:
        peak = self.peaks.setdefault(self.phase, PhasePeak())
        if self.current > peak.peak_bytes:
            roles = self._roles()
            peak.peak_bytes = self.current
            peak.snapshot = [
                (r.ref, r.nbytes, r.phase, r.host, roles.get(key))
                for key, r in self._live.copy().items()
            ]
            peak.breakdown = None

    def _settle(self, peak: PhasePeak | None) -> None:
        """Classify a phase's peak snapshot, resolving late roles from the tensors alive now."""
        if peak is None or peak.snapshot is None:
            return
        roles = self._roles()
        totals = dict.fromkeys((*CATEGORIES, OFFLOADED), 0)
        for ref, nbytes, phase, host, role in peak.snapshot:
            if role is None and (storage := ref()) is not None:
                role = roles.get(id(storage))
            if host:
                role = OFFLOADED
            elif role is None:
                role = "activations" if phase in ACTIVATION_PHASES else "other"
            totals[role] += nbytes
        peak.breakdown, peak.snapshot = totals, None

    def settled_peaks(self) -> dict[str, PhasePeak]:
        """Every phase's peak, with its breakdown by category."""
        for peak in self.peaks.values():
            self._settle(peak)
        return self.peaks
