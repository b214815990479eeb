"""Peak memory by the CPU allocator's own accounting, for what the live-storage tracker cannot
see: a compiled model. Inductor's generated code allocates its buffers straight from the
allocator (`empty_strided_cpu`), not through aten ops, and dynamo runs nothing compiled while a
TorchDispatchMode such as the tracker is active.

torch's profiler, with `profile_memory`, records every allocation and free of c10's CPU
allocator as a `[memory]` event: whoever asked for the bytes. The phases are marked with
record_function events on the same clock; the events are read when profiling stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from memexp.memory.tracker import IDLE
from memexp.quiet import c_stderr_dropped

MARK = "memexp.phase:"  # a phase's start, as a record_function event
STEP = "memexp.step"  # an optimizer step's end


@dataclass
class AllocatorPeaks:
    """What the events of one profiled stretch say."""

    peaks: dict[str, int] = field(default_factory=dict)
    # the most bytes a forward pass left alive (what autograd keeps for backward, the logits
    # and the loss), as the tracker's saved_activations counts them
    saved_activations: int = 0
    live_after_steps: list[int] = field(default_factory=list)


class AllocatorProfile:
    """A context: profiles the CPU allocator while open. `mark(phase)` starts a phase; `step()`
    ends an optimizer step. `start_bytes()` gives the bytes alive when profiling starts (the
    model's and the optimizer's, which it never sees allocated); `result` holds the peaks once
    it closes."""

    def __init__(self, start_bytes: Callable[[], int]):
        self.start_bytes = start_bytes
        self.result: AllocatorPeaks | None = None

    def __enter__(self) -> AllocatorProfile:
        self._base = self.start_bytes()
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with c_stderr_dropped():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with c_stderr_dropped():
            self._profile.__exit__(*exc)
        self.result = peaks_of(self._profile.profiler.kineto_results.events(), self._base)
        self._profile = None

    @staticmethod
    def mark(phase: str) -> None:
        with record_function(MARK + phase):
            pass

    @staticmethod
    def step() -> None:
        with record_function(STEP):
            pass


def peaks_of(events, base: int) -> AllocatorPeaks:
    """Each phase's peak of live CPU bytes (`base` plus the allocations since, less the frees),
    counting what is alive as a phase starts, except in the idle phase, which counts only if it
    allocated; the saved activations; and the bytes alive after every step."""
    timeline = []
    for event in events:
        name = event.name()
        if name == "[memory]":
            if event.device_type() == DeviceType.CPU:
                timeline.append((event.start_ns(), 0, event.nbytes()))
        elif name.startswith(MARK) or name == STEP:
            timeline.append((event.start_ns(), 1, name))
    timeline.sort(key=lambda item: (item[0], item[1]))
    result = AllocatorPeaks()
    live, phase, started, forward_from = base, IDLE, base, None
    for _, kind, value in timeline:
        if kind == 0:
            live += value
            if phase != IDLE or live > started:
                result.peaks[phase] = max(result.peaks.get(phase, 0), live)
            continue
        if value == STEP:
            result.live_after_steps.append(live)
            continue
        if phase == "forward":
            result.saved_activations = max(result.saved_activations, live - forward_from)
        phase, started = value.removeprefix(MARK), live
        if phase == "forward":
            forward_from = live
        if phase != IDLE:
            result.peaks[phase] = max(result.peaks.get(phase, 0), live)
    return result
