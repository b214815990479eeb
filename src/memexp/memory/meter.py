"""The memory meter: peak memory of a run, by phase and by category.

Totals come from the device's own counters on CUDA and from the live-storage tracker elsewhere.
The category breakdown always comes from the tracker (the allocator knows sizes, not roles):

- params:      parameters and buffers of the model
- frozen:      parameters that do not train (adapter=lora's base weights): no grads, no state;
               with what a 4-bit weight keeps beside it (bitsandbytes' scales)
- grads:       `.grad` of those parameters
- optimizer:   optimizer state, and fp32 master copies the optimizer updates instead of the model
- activations: tensors created by the forward pass that are still alive (saved for backward)
- loss:        tensors the loss allocates, and backward between the loss and its input (the
               logits' upcast, log-softmax and gradients; memexp.memory.tracker.computing_loss),
               but not a weight it casts (chunked_ce's copy of the head: by phase, as in forward)
- other:       everything else: the batch, backward temporaries, optimizer-step temporaries
- offloaded:   host-resident copies (activation offload, CPU-offloaded params, the optimizer
               stepped on the host); not in the peak. `transfer_bytes_per_step` is what a
               measured step copied to the host and back.
"""

from __future__ import annotations

import gc
import itertools
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path

import torch
from torch import nn

from memexp.memory.allocator import CachingAllocatorModel
from memexp.memory.profiled import AllocatorPeaks, AllocatorProfile
from memexp.memory.timeline import Timeline
from memexp.memory.tracker import IDLE, LiveStorageTracker, tensor_storages

PHASES = ("forward", "backward", "optimizer", "eval", IDLE)
# The share of a device's memory a run and the baseline beside it may plan to fill: the rest is
# left to the caching allocator's rounding and fragmentation.
ROOM_SHARE = 0.9
_NOTHING = nullcontext()  # reusable: nullcontext keeps no state


def limit_cuda_memory(device: torch.device, budget: int) -> None:
    """Let this process allocate at most `budget` bytes of the device (memory.budget)."""
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise ValueError(f"memory.budget={budget / 2**30:.2f} GiB is more than the "
                         f"{total / 2**30:.2f} GiB of {torch.cuda.get_device_name(device)}")
    torch.cuda.set_per_process_memory_fraction(budget / total, device)


class CudaCounters:
    """Per-phase peaks from the caching allocator's own statistics. `stop()` leaves the steps
    after it uncounted until `resume()`: a baseline timed beside the run allocates meanwhile, in
    the same caching allocator. So the reserved and active peaks are those of the phases before
    the first stop (blocks the baseline split may stay reserved after it), and the allocator's
    retries and out-of-memory errors are the run's own: what happened while counted."""

    EVENTS = ("num_alloc_retries", "num_ooms")

    def __init__(self, device: torch.device):
        self.device = device
        # The counters see every block of the process. An earlier run's trainer in the same
        # process (a test, an in-process sweep job) is unreachable but in reference cycles (the
        # meter's gradient hooks on its parameters): its parameters and optimizer state stay on
        # the device until Python's collector runs, and were counted in every phase of the next
        # run (9,815,040 bytes, the default transformer's, in the H100's GPU tests). Collected
        # before the peaks start.
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
        self.peaks: dict[str, int] = {}
        self.reserved_peak = self.active_peak = 0
        self.stopped = self.ever_stopped = False
        self._events = dict.fromkeys(self.EVENTS, 0)  # counted so far, up to the last stop
        self._phase = IDLE
        self._start, self._events_at_start = self._now()

    def _now(self) -> tuple[int, dict[str, int]]:
        stats = torch.cuda.memory_stats(self.device)
        return (stats.get("allocated_bytes.all.current", 0),
                {name: stats.get(name, 0) for name in self.EVENTS})

    def switch(self, phase: str) -> None:
        """Close the current phase (its peak since the last switch) and start `phase`."""
        if self.stopped:
            return
        stats = torch.cuda.memory_stats(self.device)
        peak = stats.get("allocated_bytes.all.peak", 0)
        # Like the tracker: the idle phase counts only if something was allocated in it.
        if self._phase != IDLE or peak > self._start:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), peak)
        if not self.ever_stopped:
            self.reserved_peak = max(self.reserved_peak, stats.get("reserved_bytes.all.peak", 0))
            self.active_peak = max(self.active_peak, stats.get("active_bytes.all.peak", 0))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._phase = phase
        self._start = stats.get("allocated_bytes.all.current", 0)

    def events(self) -> dict[str, int]:
        """Allocation retries and out-of-memory errors while counted."""
        if self.stopped:
            return dict(self._events)
        _, now = self._now()
        return {name: self._events[name] + now[name] - self._events_at_start[name]
                for name in self.EVENTS}

    def stop(self) -> None:
        self.switch(IDLE)
        self._events = self.events()
        self.stopped = self.ever_stopped = True

    def resume(self) -> None:
        """Count again, from what is allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.stopped = False
        self._start, self._events_at_start = self._now()

    def report(self) -> dict:
        self.switch(IDLE)
        return {"reserved_peak_bytes": self.reserved_peak, "active_peak_bytes": self.active_peak,
                **self.events()}


def find_leak(live_after_steps: list[int], warmup_steps: int) -> dict | None:
    """Live memory that grows after every step past warm-up: something keeps each step's tensors
    (the source's `total_loss += loss`, which keeps every step's graph). Needs 3 such steps."""
    first = max(warmup_steps, 1)  # step 1 creates the optimizer state: never steady
    growth = [b - a for a, b in itertools.pairwise(live_after_steps[first:])]
    if len(growth) < 3 or min(growth) <= 0:
        return None
    return {"bytes_per_step": sum(growth) // len(growth), "steps": len(growth),
            "from_step": first + 1}


class SwapsParameters(nn.Module):
    """Base of a watched module whose parameters are replaced while it runs (FSDP sets each
    unit's gathered parameters in place of the sharded ones, and back): the meter looks their
    roles up again at every new peak, instead of once per phase."""


class _Phase:
    """`meter.phase(name)`: a class rather than a generator, since it runs four times a step."""

    __slots__ = ("meter", "name")

    def __init__(self, meter: MemoryMeter, name: str):
        self.meter, self.name = meter, name

    def __enter__(self) -> None:
        self.meter._switch(self.name)

    def __exit__(self, *exc) -> None:
        self.meter._switch(IDLE)


class MemoryMeter:
    """Use as a context around the training loop; mark phases with `meter.phase(name)` and the end
    of each optimizer step with `meter.end_step()`.

    With `track=False` the storage tracker is off and the loop runs at full speed; on CUDA the
    device counters still give the peaks (they cost nothing), on CPU nothing is measured.
    `pause()` turns the tracker off for the rest of the run; the phases seen until then keep
    their figures. The trainer pauses it after `measure_steps` steps (memory is the same at every
    step after the first two), so that the steps after it are timed at full speed; None measures
    every step, and so do an emulated budget and a CPU timeline (`budget`, `snapshot_to`), which
    need every step's allocations.

    `budget` (bytes) makes the device behave as if it had that size: on CUDA through the
    per-process memory fraction, elsewhere by the tracker raising torch.OutOfMemoryError.
    `snapshot_to` (a folder) gets a memory snapshot when the meter's context exits, normally or
    by an error: CUDA's allocator history (for pytorch.org/memory_viz), or on CPU a timeline of
    live bytes by category; at most `snapshot_entries` events are kept. `allocator` (estimates
    for CUDA) counts each storage as the caching allocator's block for it.

    A `compiled` model (compile=default|reduce-overhead) runs without the tracker, whose dispatch
    mode would make dynamo run it eagerly, and which would not see Inductor's buffers: its totals
    come from the allocator's own accounting, CUDA's counters or the CPU allocator's profiled
    events (memexp.memory.profiled), with no breakdown by category.
    """

    def __init__(self, device: torch.device, track: bool = True, budget: int | None = None,
                 snapshot_to: Path | None = None, snapshot_entries: int = 100_000,
                 warmup_steps: int = 3, allocator: CachingAllocatorModel | None = None,
                 measure_steps: int | None = None, compiled: bool = False):
        self.device = device
        cuda = device.type == "cuda"
        if not (track or cuda) and (budget or snapshot_to):
            raise ValueError("memory.budget and memory.snapshot on CPU need memory.track=true: "
                             "the live-storage tracker is what counts the bytes")
        if compiled and not cuda and (budget or snapshot_to):
            raise ValueError("memory.budget and memory.snapshot on CPU need the live-storage "
                             "tracker, and a compiled model runs without it (its dispatch mode "
                             "would run the model eagerly). Use compile=none with them")
        if measure_steps is not None and measure_steps < 1:
            raise ValueError(f"memory.measure_steps={measure_steps}: must be >= 1, or null to "
                             "measure every step")
        self.measure_steps = None if not cuda and (budget or snapshot_to) else measure_steps
        timeline = Timeline(snapshot_entries) if snapshot_to and not cuda else None
        # On a CPU run every tensor is device memory: no per-op device check is needed.
        self.tracker = (LiveStorageTracker(self._roles, None if cuda else budget, timeline,
                                           allocator, device.type if cuda else None)
                        if track and not compiled else None)
        self.profile = (AllocatorProfile(self._start_bytes) if track and compiled and not cuda
                        else None)
        # An estimate for CUDA counts with its allocator model: a fake device has no counters.
        self.counters = CudaCounters(device) if cuda and allocator is None else None
        if budget is not None and cuda:
            limit_cuda_memory(device, budget)
        self.budget = budget
        self.snapshot_to, self.snapshot_entries = snapshot_to, snapshot_entries
        self.warmup_steps = warmup_steps
        self.live_after_steps: list[int] = []
        # the tracker's bytes moved to the host and back, so far, after each step it measured
        self._transfers_after_steps: list[tuple[int, int]] = []
        self._model: nn.Module | None = None
        self._kept_apart: list[torch.Tensor] = []
        self._optimizer: torch.optim.Optimizer | None = None
        # what the optimizer updates that is not the model's (fp32 master copies)
        self._masters: list[torch.Tensor] = []
        self._swaps = False
        self._tracking: ExitStack | None = None
        self._grad_hooks: list = []  # the gradient hooks of the watched model's parameters
        self.last_phase: str | None = None  # the last named phase entered (OOM reports use it)

    def watch(self, model: nn.Module, kept_apart: list[torch.Tensor] = ()) -> None:
        """Name the model whose tensors are params and grads, and what its frozen weights keep
        outside its parameters (`kept_apart`: adapter=qlora's bitsandbytes scales), frozen too.
        Call it before the optimizer is built: the meter's gradient hooks must run before any
        optimizer's (optim.in_backward steps and frees each gradient in its own hook)."""
        self._model = model
        self._kept_apart = list(kept_apart)
        self._swaps = isinstance(model, SwapsParameters)
        if self.tracker is not None:
            self.tracker.track(*self._model_tensors())
            # removed when the tracker stops: a hook per parameter and backward costs time
            self._grad_hooks = [param.register_post_accumulate_grad_hook(self._count_grad)
                                for param in model.parameters() if param.requires_grad]
            self.tracker.on_new_peak = self._name_changed_roles

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Name the optimizer whose tensors are optimizer state (and master copies)."""
        self._optimizer = optimizer
        params = {id(p) for p in self._model.parameters()} if self._model is not None else set()
        self._masters = [p for group in optimizer.param_groups for p in group["params"]
                         if id(p) not in params]
        if self.tracker is not None:
            # and the gradients of its master copies, made with them (optim.offload=cpu's host
            # copies get theirs as they are built)
            self.tracker.track(*self._optimizer_tensors(),
                               *(m.grad for m in self._masters if m.grad is not None))

    def _count_grad(self, param: torch.Tensor) -> None:
        self.tracker.mark_grad(param.grad)

    def _name_changed_roles(self) -> None:
        """Before a new peak: roles given inside a phase without a hook. Master copies get their
        gradients in the optimizer step; FSDP swaps parameters in and out."""
        if self._swaps:
            self.tracker.refresh_roles()
        for master in self._masters:
            if master.grad is not None:
                self.tracker.name(master.grad, "grads")

    def __enter__(self) -> MemoryMeter:
        self._active = ExitStack()
        if self.snapshot_to is not None:
            self._active.callback(self.write_snapshot)
            if self.counters is not None:
                # Python frames only: full C++ stacks have taken minutes to symbolize at dump time.
                torch.cuda.memory._record_memory_history(
                    "all", context="all", stacks="python", max_entries=self.snapshot_entries)
        if self.profile is not None:
            self._active.callback(self.pause)
            self._tracking = ExitStack()
            self._tracking.enter_context(self.profile)
        if self.tracker is not None:
            self._active.callback(self.pause)
            self._tracking = ExitStack()
            # torch.compile cannot run under a TorchDispatchMode: compiled code (torchao's 8-bit
            # optimizer step, for one) runs eagerly while the tracker watches.
            self._tracking.enter_context(torch.compiler.set_stance("force_eager"))
            self._tracking.enter_context(self.tracker)
        return self

    def __exit__(self, *exc) -> None:
        self._active.__exit__(*exc)

    @property
    def tracking(self) -> bool:
        """Whether the storage tracker is counting now."""
        return self._tracking is not None

    @property
    def measuring(self) -> bool:
        """Whether the device's memory is still counted: by the tracker, or by CUDA's counters,
        which count every step of the run unless stopped."""
        return self.tracking or (self.counters is not None and not self.counters.stopped)

    def stop_counting(self) -> str | None:
        """Stop CUDA's counters too (the tracker is paused already), so that a baseline can run
        beside the run's next steps; `resume_counting()` once it is gone. Returns why they
        cannot stop, if they cannot."""
        if self.counters is None:
            return None
        if self.budget is not None or self.snapshot_to is not None:
            return ("memory.budget and memory.snapshot on CUDA count every step of the run, and "
                    "a baseline beside it would count in them")
        if self.measure_steps is None or len(self.live_after_steps) < self.measure_steps:
            return ("CUDA's counters measure the run's first memory.measure_steps steps (every "
                    "step where it is null), and a baseline beside them would count in them")
        self.counters.stop()
        return None

    def crowded(self) -> str | None:
        """On CUDA, after a baseline was built beside the run: why the run's next step might not
        fit beside it (its peak over what stays between its steps, on top of what is allocated
        now, against ROOM_SHARE of what the device has left for this process); else None."""
        if self.counters is None or not self.counters.peaks or not self.live_after_steps:
            return None
        needs = (torch.cuda.memory_allocated(self.device) + max(self.counters.peaks.values())
                 - self.live_after_steps[-1])
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free + torch.cuda.memory_reserved(self.device)
        if needs <= ROOM_SHARE * room:
            return None
        return (f"the run's peak beside it would need {needs / 2**20:.0f} MiB, more than "
                f"{ROOM_SHARE:.0%} of the {room / 2**20:.0f} MiB this process can have")

    def count_nothing(self) -> None:
        """Measure nothing from here on, CUDA's counters included: a baseline timed beside a run
        (memexp.paired.PairedBaseline) then pays for no counting the run's steps do not."""
        self.pause()
        if self.counters is not None:
            self.counters.stop()

    def resume_counting(self) -> None:
        if self.counters is not None:
            self.counters.resume()

    def pause(self) -> None:
        """Turn the tracker off for the rest of the meter's context: what follows runs at full
        speed. Frees are still seen, allocations are not, so nothing after this is measured."""
        if self._tracking is not None:
            self._tracking.close()
            self._tracking = None
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []

    def write_snapshot(self) -> None:
        folder = self.snapshot_to
        folder.mkdir(parents=True, exist_ok=True)
        if self.counters is not None:
            torch.cuda.memory._dump_snapshot(str(folder / "memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(None)
        else:
            self.tracker.timeline.write(folder)

    def end_step(self) -> None:
        """After each optimizer step: what stays alive between steps, for leak detection, over
        the steps before a baseline ran beside the run (the steps after them would not follow
        on from those)."""
        if self.profile is not None and self.tracking:
            self.profile.step()
        if self.tracker is not None and self.tracking:
            self._transfers_after_steps.append((self.tracker.to_host, self.tracker.to_device))
        live = self.live_bytes()
        if live is not None and not (self.counters is not None and self.counters.ever_stopped):
            self.live_after_steps.append(live)

    def phase(self, name: str) -> AbstractContextManager:
        """Mark a phase of the step; a shared null context when nothing is measured."""
        if self.tracker is None and self.counters is None and self.profile is None:
            return _NOTHING
        return _Phase(self, name)

    def _switch(self, name: str) -> None:
        if name != IDLE:
            self.last_phase = name
        if self._tracking is not None:
            if self.profile is not None:
                self.profile.mark(name)
            else:
                self.tracker.enter(name)
        if self.counters is not None:
            self.counters.switch(name)

    # -- roles -------------------------------------------------------------------------------
    def _model_tensors(self):
        if self._model is not None:
            yield from self._model.parameters()
            yield from self._model.buffers()
            yield from self._kept_apart
            yield from (p.grad for p in self._model.parameters() if p.grad is not None)

    def _optimizer_tensors(self):
        if self._optimizer is None:
            return
        for group in self._optimizer.param_groups:
            yield from group["params"]
        for state in self._optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _start_bytes(self) -> int:
        """The bytes of the model's and the optimizer's storages, each once."""
        storages = {id(s): s.nbytes() for t in (*self._model_tensors(), *self._optimizer_tensors())
                    for s in tensor_storages(t)}
        return sum(storages.values())

    def _roles(self) -> dict[int, str]:
        """Every storage the model and the optimizer hold now, by role (the tracker keeps each
        storage's answer until roles may have changed)."""
        roles: dict[int, str] = {}

        def assign(tensors, role):
            for tensor in tensors:
                for storage in tensor_storages(tensor):
                    roles.setdefault(id(storage), role)

        if self._model is not None:
            params = list(self._model.parameters())
            assign((p for p in params if not p.requires_grad), "frozen")
            assign(self._kept_apart, "frozen")
            assign(params, "params")
            assign(self._model.buffers(), "params")
            assign((p.grad for p in params if p.grad is not None), "grads")
        if self._optimizer is not None:
            # fp32 master copies' gradients are gradients too.
            assign(
                (p.grad for g in self._optimizer.param_groups for p in g["params"]
                 if p.grad is not None),
                "grads",
            )
        # Whatever else the optimizer holds (state, master copies) is optimizer memory.
        assign(self._optimizer_tensors(), "optimizer")
        return roles

    def live_bytes(self) -> int | None:
        """Device bytes in use now, where they can be read (not while the counters stand aside
        for a baseline, whose bytes they would hold)."""
        if self.counters is not None:
            return None if self.counters.stopped else torch.cuda.memory_allocated(self.device)
        # The CPU allocator's profile is read when it stops.
        return self.tracker.current if self.tracking and self.tracker is not None else None

    # -- report ------------------------------------------------------------------------------
    def report(self) -> dict:
        """The `memory` section of result.json."""
        report: dict = {
            "device": str(self.device),
            "source": ("cuda-counters" if self.counters is not None else
                       "cpu-allocator" if self.profile is not None else "storage-tracker"),
            "tracked": self.tracker is not None,
            "peak_bytes": None,
            "peak_phase": None,
            "breakdown_at_peak": None,
            "phases": {},
        }
        tracked = {}
        if self.tracker is not None:
            tracked = self.tracker.settled_peaks()
            # Running peaks of single categories, whenever they happened (tracker bytes).
            report["activations_peak_bytes"] = self.tracker.activations_peak
            report["saved_activations_bytes"] = self.tracker.saved_activations
            report["grads_peak_bytes"] = self.tracker.grads_peak
            report["offloaded_peak_bytes"] = self.tracker.host_peak
            # what offloading moves in a step: the last one measured (they repeat from the first)
            before, after = [(0, 0), (0, 0), *self._transfers_after_steps][-2:]
            report["transfer_bytes_per_step"] = {"to_host": after[0] - before[0],
                                                 "to_device": after[1] - before[1]}
        live_after_steps = self.live_after_steps
        if self.counters is not None:
            report.update(self.counters.report())
            peaks = dict(self.counters.peaks)
        elif self.profile is not None:
            measured = self.profile.result or AllocatorPeaks()  # never entered: no steps
            report["saved_activations_bytes"] = measured.saved_activations
            peaks, live_after_steps = dict(measured.peaks), measured.live_after_steps
        else:
            peaks = {name: p.peak_bytes for name, p in tracked.items()}
        report["leak"] = find_leak(live_after_steps, self.warmup_steps)
        if not peaks:
            return report
        for name in PHASES:
            if name in peaks:
                breakdown = tracked[name].breakdown if name in tracked else None
                report["phases"][name] = {"peak_bytes": peaks[name], "breakdown": breakdown}
        peak_phase = max(report["phases"], key=lambda n: report["phases"][n]["peak_bytes"])
        report["peak_phase"] = peak_phase
        report["peak_bytes"] = peaks[peak_phase]
        report["breakdown_at_peak"] = report["phases"][peak_phase]["breakdown"]
        return report
