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
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from memexp.memory.allocator import CachingAllocatorModel
from memexp.memory.timeline import Timeline

# Live storages are grouped into these categories when a peak is recorded.
CATEGORIES = ("params", "frozen", "grads", "optimizer", "activations", "loss", "other")
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
_device_stays_depth = 0  # of those, host_resident(device_stays=True)'s
_recompute_depth = 0
# Inside the loss (`computing_loss`, and its backward between the two `LossBoundary` marks):
# the vocabulary-sized logits' upcast, log-softmax and gradients, the "loss" category. Not a
# weight cast to another dtype there (_cast_of_weights).
_loss_depth = 0
_TO_COPY = torch.ops.aten._to_copy.default
# A fake tensor's device, asked of every mode (thousands of times a step, by autograd's engine
# and F.linear): no storage is made or read.
DEVICE_OF = torch.ops.prim.device.default
# What follows the counts from outside while they change (memexp.depth labels a trace's events by
# the block that made them): told of each op before it runs, each count that changes, each
# candidate for a phase's peak and each phase entered. None when nothing follows.
_follower = None


def device_of(args) -> torch.device:
    """DEVICE_OF's answer: a fake tensor's as FakeTensor itself gives it (the modes below, a
    Python call each, need not be asked), anything else's from the next mode."""
    tensor = args[0]
    if type(tensor) is FakeTensor:
        return torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
    return DEVICE_OF(*args)


@contextmanager
def host_resident(device_stays: bool = False):
    """Declare that tensors allocated inside live in host memory, not on the training device.

    On CUDA this is literally where they are; on a CPU run it keeps the device/host split that
    a GPU run would have, so offloading techniques can be measured on any machine. With
    `device_stays`, a tensor made inside on a CUDA run's device is still device memory: the
    optimizer stepped on the host (optim.offload=cpu) keeps its small parameters' state on the
    device, beside the rest on the host. (A CPU run, whose device is the host, has no such
    split to make: everything made inside is host memory.)
    """
    global _host_depth, _device_stays_depth
    _host_depth += 1
    _device_stays_depth += device_stays
    try:
        yield
    finally:
        _host_depth -= 1
        _device_stays_depth -= device_stays


class Follower:
    """What a follower of the trackers is told (see _follower); each does nothing here, and a
    follower states only what it watches."""

    def op(self, tracker, func, args, kwargs) -> None:
        """`func` is about to run on `args`."""

    def added(self, tracker, record, nbytes: int) -> None:
        """`record`'s storage grew by `nbytes` (a new one, or a negative count: freed)."""

    def added_grad(self, tracker, nbytes: int) -> None:
        """The gradients' count changed by `nbytes`."""

    def candidate(self, tracker) -> None:
        """A candidate for the phase's peak: the live bytes grew, or a phase began."""

    def entering(self, tracker, phase: str) -> None:
        """The tracker is about to enter `phase`."""


@contextmanager
def followed(follower: Follower):
    """Let `follower` see the counts of every tracker as they change (see _follower)."""
    global _follower
    outer, _follower = _follower, follower
    try:
        yield follower
    finally:
        _follower = outer


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


@contextmanager
def computing_loss():
    """Declare that tensors allocated inside are the loss's (category "loss"), not activations
    or temporaries: what a chunked loss saves (loss=chunked_ce) shows there."""
    global _loss_depth
    _loss_depth += 1
    try:
        yield
    finally:
        _loss_depth -= 1


class LossBoundary(torch.autograd.Function):
    """The identity, whose backward enters the loss (`entering`: on the loss) or leaves it (on
    its input, the logits): the gradients backward computes in between are the loss's too."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, entering: bool) -> torch.Tensor:
        ctx.entering = entering
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        global _loss_depth
        # Never below 0: a loss whose input needs no gradient is never left (the next
        # computing_loss starts from 0 again).
        _loss_depth = _loss_depth + 1 if ctx.entering else max(_loss_depth - 1, 0)
        return grad, None


def leave_loss() -> None:
    """Out of the loss, whatever its backward did (a phase begins)."""
    global _loss_depth
    _loss_depth = 0


# The copies the tracker weighs as transfers between the host and the device, with where each
# reads its source and its target: (position in args, position in args or None for the output).
_COPIES = {torch.ops.aten.copy_.default: (1, 0), torch.ops.aten._to_copy.default: (0, None)}

# Which role wins when a storage is named twice (a master copy is an optimizer tensor, but its
# gradient is a gradient): the order in which MemoryMeter's roles are assigned.
ROLE_RANK = {"params": 0, "frozen": 0, "grads": 1, "optimizer": 2}


class _Ref(weakref.ref):
    """A weak reference to a storage that knows the storage's key: its callback is then the
    tracker's own bound method, not a closure made for every allocation."""

    __slots__ = ("key",)


@dataclass(slots=True, eq=False)
class _Storage:
    ref: _Ref | None
    nbytes: int
    phase: str
    host: bool
    grad: bool = False
    # the storage's own size; `nbytes` is what the device holds for it (with `allocator`, the
    # caching allocator's rounded block)
    requested: int = 0
    # when it was recorded, on the tracker's clock (a peak's storages were born before it)
    born: int = 0
    # params, grads or optimizer: looked up when roles may have changed, and kept here
    role: str | None = None
    # allocated inside the loss (computing_loss): its category, unless it has a role
    loss: bool = False


@dataclass
class PhasePeak:
    peak_bytes: int = 0
    breakdown: dict[str, int] | None = None


# Whether each tensor type seen is a wrapper subclass: asked for every op's outputs.
_WRAPPER_TYPES: dict[type, bool] = {}


def _is_wrapper(kind: type) -> bool:
    wrapper = _WRAPPER_TYPES.get(kind)
    if wrapper is None:
        wrapper = _WRAPPER_TYPES[kind] = is_traceable_wrapper_subclass_type(kind)
    return wrapper


def tensor_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind a tensor; wrapper subclasses (DTensor) are opened up."""
    if _is_wrapper(type(tensor)):
        names, _ = tensor.__tensor_flatten__()
        storages = []
        for name in names:
            inner = getattr(tensor, name)
            # DTensor (torch >= 2.10) also names its device mesh, which holds no storage.
            if isinstance(inner, torch.Tensor):
                storages += tensor_storages(inner)
        return storages
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return []


# `UntypedStorage.resize_` dispatches no op, so no mode sees it; FSDP2 frees each block's
# gathered parameters with it after use and regrows them for the next gather
# (torch.distributed.fsdp._fully_shard._fsdp_param.free_storage). While a tracker is active the
# method reports to it; outside, it is torch's own.
_STORAGE_RESIZE = torch.UntypedStorage.resize_
_RESIZE_WATCHERS: list[LiveStorageTracker] = []


def _resize_reported(storage: torch.UntypedStorage, size: int):
    resized = _STORAGE_RESIZE(storage, size)
    for tracker in _RESIZE_WATCHERS:
        tracker.storage_resized(storage)
    return resized


class EagerMode(TorchDispatchMode):
    """A dispatch mode whose ops run eagerly: torch wraps a mode's __torch_dispatch__ in a
    dynamo guard, microseconds per op and mode. The meter and the estimate run everything
    under them eagerly (set_stance("force_eager")): nothing compiles."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class LiveStorageTracker(EagerMode):
    """Counts live device bytes after every op and records each phase's peak with its breakdown.

    `roles` maps id(storage) to a category for storages whose role is known from the outside
    (parameters, gradients, optimizer state); everything else is classified by the phase that
    created it (see ACTIVATION_PHASES). With `device_type` set, tensors on other devices are not
    device memory and are skipped (a CUDA run's batch before it is copied over), unless they are
    declared host-resident (`host_resident()`).

    Building that map walks every parameter and optimizer
    tensor, so it is not rebuilt at every new peak: each storage keeps its role, looked up at a
    phase's first new peak (roles given in the previous phase: optimizer state, gradients of
    another rank) and at the end of a phase that reached one (roles given after the peak: SGD
    stores its momentum buffer after using it). Roles given with a hook are named at once
    (`name`, `mark_grad`); `on_new_peak` can name others that change inside a phase.

    The peak's live set is not copied at every new peak either: storages alive at the peak are
    those born before it and still alive, plus those freed since (kept in a list), with the
    size and role they had then (kept when either changes after the peak). It is classified
    when the phase ends.
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
        # called before each new peak is recorded, to name roles given without a hook
        self.on_new_peak: Callable[[], None] | None = None
        # Weakref callbacks may fire from autograd's threads: single dict and list operations
        # only, and iteration over a copy.
        self._live: dict[int, _Storage] = {}
        self.phase = IDLE
        self.current = 0
        self.host_current = self.host_peak = 0
        # bytes copied from device storage into host-resident storage, and back: what offloading
        # moves (a copy between two host or two device storages is not a transfer)
        self.to_host = self.to_device = 0
        # Live activations (by creating phase) and gradients (marked by `mark_grad`) are followed
        # op by op, so their own peaks are known whatever the moment of the overall peak.
        self.activations_current = self.activations_peak = 0
        self.grads_current = self.grads_peak = 0
        # Device activations alive when a forward pass ends: what autograd keeps for backward.
        self.saved_activations = 0
        self.peaks: dict[str, PhasePeak] = {}
        self._on_free = self._free  # one bound method for every weak reference
        # roles may have changed since they were last looked up (a new phase began)
        self._stale = True
        # The current phase's newest peak, not classified yet: its time on the clock, the
        # storages alive then and freed since, and the (size, role) of those changed since.
        self._clock = 0
        self._pending: PhasePeak | None = None
        self._peak_at = 0
        self._freed: list[_Storage] = []
        self._changed: dict[_Storage, tuple[int, str | None]] = {}

    # -- recording ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_OF:
            return device_of(args)
        if _loss_depth and func is _TO_COPY and self._holds_weights(args[0]):
            return self._cast_of_weights(func, types, args, kwargs)
        if _follower is not None:
            _follower.op(self, func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if _WRAPPER_TYPES.get(type(out)) is False:  # most ops: one plain tensor, inlined
            if self.device_type is not None and not self._on_device(out):
                grew = False
            else:
                try:
                    storage = out.untyped_storage()
                except (NotImplementedError, RuntimeError):  # sparse and storage-less layouts
                    grew = False
                else:
                    grew = self._record(storage, _host_depth > 0 and self._off_device(out))
        elif isinstance(out, torch.Tensor):
            grew = self._track_tensor(out)
        elif out is None:
            grew = False
        else:
            grew = False
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    grew |= self._track_tensor(leaf)
        if grew:
            self._maybe_peak()
        if func in _COPIES:
            source, target = _COPIES[func]
            self._count_transfer(args[source], out if target is None else args[target])
        if self.timeline is not None:
            self.timeline.record(self.phase, self.current, self.activations_current,
                                 self.grads_current, self.host_current)
        return out

    def _count_transfer(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """A copy from one recorded storage to another: a transfer where one is host-resident
        and the other is not."""
        try:
            held = self._live.get(id(source.untyped_storage()))
            made = self._live.get(id(target.untyped_storage()))
        except (NotImplementedError, RuntimeError):  # wrapper subclasses, storage-less layouts
            return
        if held is None or made is None or held.host == made.host:
            return
        nbytes = target.numel() * target.element_size()
        if made.host:
            self.to_host += nbytes
        else:
            self.to_device += nbytes

    def _holds_weights(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of the model's parameters or buffers (by their role)."""
        try:
            record = self._live.get(id(tensor.untyped_storage()))
        except (NotImplementedError, RuntimeError):  # wrapper subclasses, storage-less layouts
            return False
        return record is not None and record.role in ("params", "frozen")

    def _cast_of_weights(self, func, types, args, kwargs):
        """A weight cast inside the loss: loss=chunked_ce's copy of the output head in the
        compute dtype (once for all chunks), autocast's of an adapted head's. It is the weight's
        copy, of the weight's size, filed by the phase as the same cast is in the model's own
        forward (activations, where the head's matmul keeps it for backward), not as the
        loss's: on an 8B Llama under bf16 it was 1.0 GiB of a 1.2 GiB "loss"."""
        global _loss_depth
        depth, _loss_depth = _loss_depth, 0
        try:
            return self.__torch_dispatch__(func, types, args, kwargs)
        finally:
            _loss_depth = depth

    def track(self, *tensors: torch.Tensor) -> None:
        """Record the storages of `tensors` (safe to call on tensors already tracked)."""
        grew = False
        for tensor in tensors:
            grew |= self._track_tensor(tensor)
        if grew:
            self._maybe_peak()

    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is memory of the device counted (with `device_type` set; a fake
        tensor's storage is on "meta", so the tensor says where it lives)."""
        return tensor.device.type == self.device_type or _host_depth > 0

    def _off_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, made inside host_resident(), is host memory: all of it is, but a
        CUDA run's device tensor inside host_resident(device_stays=True)."""
        return not (_device_stays_depth and self.device_type is not None
                    and tensor.device.type == self.device_type)

    def _track_tensor(self, tensor: torch.Tensor) -> bool:
        """Record `tensor`'s storages; True if device memory grew."""
        if self.device_type is not None and not self._on_device(tensor):
            return False
        if not _is_wrapper(type(tensor)):  # the common case, without building a list
            try:
                storage = tensor.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
                return False
            return self._record(storage, _host_depth > 0 and self._off_device(tensor))
        host = _host_depth > 0 and self._off_device(tensor)
        grew = False
        for storage in tensor_storages(tensor):
            grew |= self._record(storage, host)
        return grew

    def _record(self, storage: torch.UntypedStorage, host: bool) -> bool:
        key = id(storage)
        nbytes = storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            return known.requested != nbytes and self._resized(key, known, nbytes)
        phase = RECOMPUTE if _recompute_depth > 0 else self.phase
        self._clock += 1
        # positional: a third faster than keywords, on a path every allocation takes
        record = _Storage(None, nbytes, phase, host, False, nbytes, self._clock, None,
                          _loss_depth > 0)
        if self.allocator is not None and not record.host:
            nbytes = record.nbytes = self.allocator.malloc(key, nbytes)
        if not record.host and self.budget is not None and self.current + nbytes > self.budget:
            self._out_of_budget(nbytes)
        record.ref = _Ref(storage, self._on_free)
        record.ref.key = key
        self._live[key] = record
        self._add(record, nbytes)
        return not record.host

    def _resized(self, key: int, known: _Storage, nbytes: int) -> bool:
        """A storage resized in place: True if device memory grew. torch's caching allocator
        gives the old block back and hands out one of the new size (none for 0 bytes, which is
        how FSDP2 frees its gathered parameters between uses)."""
        self._keep_as_at_peak(known)
        held = nbytes
        if self.allocator is not None and not known.host:
            self.allocator.free(key)
            held = self.allocator.malloc(key, nbytes) if nbytes else 0
        change = held - known.nbytes
        known.nbytes, known.requested = held, nbytes
        self._add(known, change)
        if known.grad:
            self._add_grad(change)
        return change > 0 and not known.host

    def storage_resized(self, storage: torch.UntypedStorage) -> None:
        """`storage.resize_()` ran: no op is dispatched for it, so it is reported here (see
        watching_storage_resizes)."""
        known = self._live.get(id(storage))
        if known is None or known.requested == storage.nbytes():
            return
        if self._resized(id(storage), known, storage.nbytes()):
            self._maybe_peak()
        if self.timeline is not None:
            self.timeline.record(self.phase, self.current, self.activations_current,
                                 self.grads_current, self.host_current)

    def __enter__(self):
        _RESIZE_WATCHERS.append(self)
        if len(_RESIZE_WATCHERS) == 1:
            torch.UntypedStorage.resize_ = _resize_reported
        return super().__enter__()

    def __exit__(self, *exc):
        _RESIZE_WATCHERS.remove(self)
        if not _RESIZE_WATCHERS:
            torch.UntypedStorage.resize_ = _STORAGE_RESIZE
        return super().__exit__(*exc)

    def _out_of_budget(self, nbytes: int) -> None:
        """Fail the way a device of `budget` bytes would: the allocation that does not fit raises
        torch.OutOfMemoryError (what CUDA raises) and is never counted, so the peak is what the
        device would have held. The tensor exists here, but the op's caller never gets it."""
        raise torch.OutOfMemoryError(
            f"memory.budget: tried to allocate {nbytes / 2**20:.2f} MiB in phase {self.phase} "
            f"with {self.current / 2**20:.2f} MiB of live tensors; the emulated device holds "
            f"{self.budget / 2**20:.2f} MiB")

    def _free(self, ref: _Ref) -> None:
        key = ref.key
        record = self._live.pop(key, None)
        if self.allocator is not None:
            self.allocator.free(key)
        if record is not None:
            if record.born < self._peak_at:  # alive at the pending peak
                self._freed.append(record)
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
        self.name(grad, "grads")

    def _add_grad(self, nbytes: int) -> None:
        self.grads_current += nbytes
        self.grads_peak = max(self.grads_peak, self.grads_current)
        if _follower is not None:
            _follower.added_grad(self, nbytes)

    def _add(self, record: _Storage, nbytes: int) -> None:
        if record.host:
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
        else:
            self.current += nbytes
            if record.phase in ACTIVATION_PHASES:
                self.activations_current += nbytes
                self.activations_peak = max(self.activations_peak, self.activations_current)
        if _follower is not None:
            _follower.added(self, record, nbytes)

    # -- roles -------------------------------------------------------------------------------
    def name(self, tensor: torch.Tensor, role: str) -> None:
        """Give `tensor`'s storages `role` now (unless they hold a role that ranks before it)."""
        for storage in tensor_storages(tensor):
            record = self._live.get(id(storage))
            if record is not None and (record.role is None
                                       or ROLE_RANK[role] < ROLE_RANK[record.role]):
                self._set_role(record, role)

    def refresh_roles(self) -> None:
        """Look every live storage's role up again."""
        roles = self._roles()
        for key, record in self._live.copy().items():
            role = roles.get(key)
            if role != record.role:
                self._set_role(record, role)
        self._stale = False

    def _set_role(self, record: _Storage, role: str | None) -> None:
        self._keep_as_at_peak(record)
        record.role = role

    def _keep_as_at_peak(self, record: _Storage) -> None:
        """Before a storage's size or role changes: what it was at the pending peak."""
        if record.born < self._peak_at:
            self._changed.setdefault(record, (record.nbytes, record.role))

    # -- peaks -------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Start attributing allocations to `phase`; what is live on entry counts for it too
        (an SGD step allocates nothing, yet the optimizer phase holds params and grads)."""
        self._settle()
        leave_loss()
        if self.phase == "forward":
            self.saved_activations = max(self.saved_activations, self.activations_current)
        if _follower is not None:
            _follower.entering(self, phase)
        self.phase = phase
        self._stale = True
        if phase != IDLE:
            self._maybe_peak()
        if self.timeline is not None:
            self.timeline.set_states(self._state_bytes())

    def _state_bytes(self) -> int:
        """Live device bytes of parameters and optimizer state (roles known from outside)."""
        if self._stale:
            self.refresh_roles()
        return sum(r.nbytes for r in self._live.copy().values()
                   if not r.host and r.role in ("params", "optimizer"))

    def _maybe_peak(self) -> None:
        if _follower is not None:
            _follower.candidate(self)
        peak = self.peaks.get(self.phase)
        if peak is None:
            peak = self.peaks[self.phase] = PhasePeak()
        if self.current > peak.peak_bytes:
            if self._stale:
                self.refresh_roles()
            if self.on_new_peak is not None:
                self.on_new_peak()
            peak.peak_bytes = self.current
            peak.breakdown = None
            self._clock += 1
            self._pending, self._peak_at, self._freed, self._changed = peak, self._clock, [], {}

    def _settle(self) -> None:
        """Classify the pending peak's storages, with the sizes and roles they had at the peak;
        a role unknown then is looked up now if the storage is still alive."""
        peak, at = self._pending, self._peak_at
        if peak is None:
            return
        changed = self._changed
        held = [r for r in self._live.copy().values() if r.born < at] + self._freed
        at_peak = [(r, *changed.get(r, (r.nbytes, r.role))) for r in held]
        self._pending, self._peak_at, self._freed, self._changed = None, 0, [], {}
        if any(role is None and r.ref() is not None for r, _, role in at_peak):
            self.refresh_roles()
        totals = dict.fromkeys((*CATEGORIES, OFFLOADED), 0)
        for record, nbytes, role in at_peak:
            if role is None and record.ref() is not None:
                role = record.role
            if record.host:
                role = OFFLOADED
            elif role is None and record.loss:
                role = "loss"
            elif role is None:
                role = "activations" if record.phase in ACTIVATION_PHASES else "other"
            totals[role] += nbytes
        peak.breakdown = totals

    def settled_peaks(self) -> dict[str, PhasePeak]:
        """Every phase's peak, with its breakdown by category."""
        self._settle()
        return self.peaks
