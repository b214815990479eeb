"""A step's time on the GPU an estimate is for, read from its trace as its memory is.

`memexp estimate --target cuda` walks every aten op of the run's steps with its shapes and
dtypes (memexp.estimate._FlopsByPhase). StepTimer sits beside that walk and prices each op of the
last traced optimizer step (forward, backward with what checkpointing recomputes, the optimizer
step, every micro-batch of an accumulation; not evaluation) on the GPU's figures (memexp.gpus),
then plays the ops in their order on two timelines, the host's and the GPU's:

- the host dispatches op i once it has dispatched op i-1: every op costs it a fixed time,
  whether it launches a kernel or only makes a view (memexp.gpus.HOST_OP; ops on host tensors
  alone, HOST_TENSOR_OP);
- a kernel starts when the host has launched it and the GPU has finished the kernel before it,
  and takes the slower of its arithmetic and its bytes. Its arithmetic (matmuls, convolutions,
  attention: torch's FLOP formulas) runs at the GPU's dense peak for its dtype times the share a
  real kernel of its kind achieves (cuDNN's convolutions have a share of their own); an fp32
  matmul takes the TF32 rate where torch lets it (`torch.backends.cuda.matmul.allow_tf32`,
  `torch.backends.cudnn.allow_tf32` for convolutions, as precision=tf32 sets them). Its bytes
  move at the bandwidth a streaming kernel achieves, and they are the bytes the kernel moves,
  not those of its arguments: a softmax over a row too long for one block's registers or
  shared memory reads it three times, layer norm's and batch norm's backward (and batch norm's
  training forward) pass over their inputs twice, a loss or an embedding reads only the rows its
  indices pick (_MOVED);
- a copy between host and device moves its bytes at the GPU's host link, on the GPU's queue;
  a collective moves its bytes at the link between the ranks (NVLink, or the network beyond a
  node) as a ring does, an all-reduce 2(n-1)/n of them, an all-gather or a reduce-scatter
  (n-1)/n, also on the queue;
- an op that reads a device value on the host (`.item()`, `.tolist()`, a non-finite check's
  verdict, `nonzero`, a copy to or from the host that is not non_blocking) makes the host wait
  until the GPU has run everything launched before it. The step ends with both idle (the
  trainer synchronizes, as a timed step must).

So the host's time hides under the GPU's where the GPU has work queued, and shows where the GPU
waits for it: after every wait for a device value, and wherever the kernels are shorter than
their dispatch. The step's time is the GPU's busy time plus its time waiting for the host.

What the model leaves out: communication overlapping computation (DDP's bucketed all-reduce in
backward, FSDP's prefetched all-gathers: on the one queue, after the compute before them),
kernels that run concurrently, a kernel's own launch latency on the GPU, the L2 cache (every
byte at DRAM's bandwidth), shapes that fill the GPU badly (small matmuls, unaligned dimensions),
attention kernels other than FlashAttention-2 (all at its share), convolutions of every shape
at one share, kernel fusion (compile=none only: estimate refuses a compiled run), the caching
allocator's cudaMalloc on the first steps, the data loader, and Python that dispatches no op (a
module's hooks, the optimizer's loops over parameters) beyond the per-op average the host
figure was measured as.

Every field is a plain sum: over the ops of a phase (PhaseTime), or, for the time the GPU waits
for the host, over a segment, the stretch between two waits of the host for the GPU (Segment;
which phase a wait falls in moves with the model's depth, the segment's time does not). With a
model's blocks alike, a trace of fewer blocks extrapolates to a deeper model as any other
figure of the estimate: memexp.depth checks that the copies' sums lie on a line, and
extrapolation_doubt that no other critical path overtakes theirs at the model's depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from memexp.gpus import Gpu, gpu

_ops = torch.ops.aten
# The phases of a training step (evaluation is not one; "other" is the time between phases:
# the batch's copy to the device, the step's loss read).
STEP_PHASES = ("forward", "backward", "optimizer", "other")

# Ops that launch no kernel beyond what their schema says is a view: they make a tensor's
# metadata (an uninitialised allocation, a reinterpreted view) or answer a question about one.
_NO_KERNEL = {_ops.empty, _ops.empty_strided, _ops.empty_like, _ops.new_empty,
              _ops.new_empty_strided, _ops._unsafe_view, _ops._reshape_alias, _ops.lift_fresh,
              _ops.set_, _ops.resize_, _ops.resize_as_, _ops.is_pinned,
              _ops._has_compatible_shallow_copy_type, _ops.sym_size, _ops.sym_stride,
              _ops.sym_numel, _ops.sym_storage_offset, _ops.record_stream}
_COPIES = {_ops._to_copy, _ops.copy_, _ops._copy_from, _ops._copy_from_and_resize}
_MATMULS = {_ops.mm, _ops.addmm, _ops.bmm, _ops.baddbmm, _ops.addbmm, _ops._addmm_activation,
            _ops.mv, _ops.addmv, _ops.dot, _ops.vdot, _ops._int_mm, _ops._scaled_mm}
_CONVOLUTIONS = {_ops.convolution, _ops.convolution_backward, _ops._convolution,
                 _ops.cudnn_convolution, _ops.cudnn_convolution_transpose}
# Ops whose result the host reads before it goes on: a value (`.item()`, `.tolist()`, `bool()`,
# an `if` on a tensor) or a size that depends on the values
_HOST_READS = {_ops._local_scalar_dense, _ops.is_nonzero, _ops.equal, _ops.nonzero,
               _ops.masked_select, _ops._unique2, _ops.unique_consecutive, _ops.unique_dim}
_HALF = (torch.float16, torch.bfloat16)
# A ring collective's traffic per rank, as a share of its buffer, for n ranks
_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "allreduce": lambda n: 2 * (n - 1) / n,
         "all_gather": lambda n: (n - 1) / n, "allgather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "alltoall": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
         "send": lambda n: 1.0, "recv": lambda n: 1.0}


@dataclass
class PhaseTime:
    """One phase of one optimizer step, summed over its ops. Every field is a sum."""

    ops: int = 0  # aten ops dispatched from the host
    host_ops: int = 0  # of which on host tensors alone (no kernel, no launch)
    kernels: int = 0  # ops that launch GPU kernels (a foreach op's several launches: one)
    host_reads: int = 0  # ops after which the host waits for the GPU (a value read, a copy)
    flops: int = 0
    bytes: int = 0  # moved by the kernels
    host_s: float = 0.0  # the host's dispatch of the ops
    compute_s: float = 0.0  # kernels whose arithmetic is slower than their bytes
    convolution_s: float = 0.0  # of compute_s: cuDNN's convolutions
    memory_s: float = 0.0  # kernels whose bytes are slower than their arithmetic
    transfer_s: float = 0.0  # copies between host and device
    collective_s: float = 0.0  # communication between ranks

    @property
    def gpu_s(self) -> float:
        return self.compute_s + self.memory_s


@dataclass
class Segment:
    """The ops between two waits of the host for the GPU (or the step's ends): the time from
    the one wait to the next, and by phase what the host dispatched and what the GPU ran. The
    GPU's time waiting for the host is a segment's own (its time less what the GPU ran): which
    phase it falls in moves with the depth where the segment's time does not."""

    seconds: float = 0.0
    host_s: dict[str, float] = field(default_factory=dict)
    queued_s: dict[str, float] = field(default_factory=dict)  # kernels, copies, collectives


@dataclass
class StepTime:
    """The predicted time of one optimizer step on `gpu`, by phase, and by segment (the
    stretches between the host's waits for the GPU, in order: what extrapolation checks)."""

    gpu: str  # the memexp.gpus key
    phases: dict[str, PhaseTime] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self):
        # from JSON (the CUDA trace's process), or from extrapolated figures
        self.phases = {name: phase if isinstance(phase, PhaseTime) else PhaseTime(**phase)
                       for name, phase in self.phases.items()}
        self.segments = [segment if isinstance(segment, Segment) else Segment(**segment)
                         for segment in self.segments]

    def _sum(self, part: str) -> float:
        return sum(getattr(phase, part) for phase in self.phases.values())

    @property
    def seconds(self) -> float:
        """The step's time: the parts below add up to it."""
        return sum(segment.seconds for segment in self.segments)

    @property
    def parts(self) -> dict[str, float]:
        """GPU arithmetic, GPU memory, the GPU waiting for the host (the host's time not hidden
        under the GPU's), transfers, collectives (s): their sum is `seconds`."""
        queued = {part: self._sum(part)
                  for part in ("compute_s", "memory_s", "transfer_s", "collective_s")}
        return {"compute_s": queued["compute_s"], "memory_s": queued["memory_s"],
                "exposed_host_s": self.seconds - sum(queued.values()),
                "transfer_s": queued["transfer_s"], "collective_s": queued["collective_s"]}

    @property
    def host_s(self) -> float:
        return self._sum("host_s")

    @property
    def kernels(self) -> int:
        return self._sum("kernels")

    @property
    def ops(self) -> int:
        return self._sum("ops")

    def as_dict(self) -> dict:
        """For --json and result files: the sums by phase, and the figures derived from them."""
        return {"gpu": self.gpu, "seconds": self.seconds, **self.parts, "host_s": self.host_s,
                "phases": {name: {f.name: getattr(phase, f.name) for f in fields(phase)}
                           for name, phase in self.phases.items()},
                "segments": [{f.name: getattr(segment, f.name) for f in fields(segment)}
                             for segment in self.segments]}


def extrapolation_doubt(steps: list[StepTime]) -> str | None:
    """Why the step times of copies of a model at consecutive depths (memexp.depth) may not
    lie on the line of the model's own depth; None where they must.

    Between two waits for the GPU, the segment's time is its critical path: the host's
    dispatch up to some op, then the GPU's work from it on. With the model's blocks alike, a
    path that leaves the host in a phase of n blocks grows by that phase's host time per block
    if it leaves at the last block, by its GPU time if at the first: the segment's time is the
    largest of lines in the depth, the steepest of which grows by, per block, the largest over
    its phases j of the host's growth before j, the larger of j's own two, and the GPU's after
    j. If the copies' segment grows by exactly that, the line through them is the steepest, and
    no other overtakes it at any greater depth; if by less, a steeper one will (a phase whose
    GPU kept ahead of its host over 2 to 4 blocks falls behind at 32), and the model's own
    depth must be traced. (A phase's growth is taken to come block by block, its host's and its
    GPU's interleaved, as a model's blocks run.)"""
    if len({len(step.segments) for step in steps}) != 1:
        return "the host waits for the GPU a different number of times at each depth"
    last, before = steps[-1], steps[-2]
    for number, (segment, earlier) in enumerate(zip(last.segments, before.segments,
                                                    strict=True)):
        phases = list(segment.host_s)
        if not phases:  # the step ended on a wait
            continue
        if list(earlier.host_s) != phases:
            return f"step time segment {number} holds other phases at each depth"
        host = [segment.host_s[p] - earlier.host_s[p] for p in phases]
        queued = [segment.queued_s.get(p, 0.0) - earlier.queued_s.get(p, 0.0) for p in phases]
        steepest = max(sum(host[:j]) + max(host[j], queued[j]) + sum(queued[j + 1:])
                       for j in range(len(phases)))
        grows = segment.seconds - earlier.seconds
        if abs(grows - steepest) > 1e-9 * segment.seconds:
            return (f"step time segment {number} ({', '.join(phases)}) grows by "
                    f"{grows * 1e6:.3f} us a block over the copies' depths, its critical path "
                    f"at greater depths by {steepest * 1e6:.3f} us: the host and the GPU take "
                    "turns differently at the model's depth")
    return None


def _tensors(tree, found: list) -> list:
    """The tensors of an op's arguments or outputs (lists of them too), in order."""
    for item in tree:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            _tensors(item, found)
    return found


def _nbytes(tensor: torch.Tensor | None) -> int:
    """The bytes a kernel touches in `tensor`: a broadcast dimension (stride 0) is read once."""
    if tensor is None:
        return 0
    count = tensor.element_size()
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride:
            count *= size
    return count


class _Call:
    """An op's arguments by their schema's names."""

    def __init__(self, names: tuple[str, ...], args, kwargs):
        self.names, self.args, self.kwargs = names, args, kwargs

    def __getitem__(self, name: str):
        """The argument `name` as the op was given it: None where not given or not in the
        schema."""
        if name not in self.names:
            return None
        index = self.names.index(name)
        return self.args[index] if index < len(self.args) else self.kwargs.get(name)


# Shared memory a block may use without opting in: the limit torch's softmax checks
# (cudaDeviceProp.sharedMemPerBlock, 48 KiB on every GPU since Kepler)
_SMEM_PER_BLOCK = 48 * 1024


def _softmax_in_one_pass(tensor: torch.Tensor, dim: int) -> bool:
    """Whether torch's CUDA softmax reads `tensor` once along `dim` (SoftMax.cu, host_softmax):
    a row of at most 1024 elements and 4 KiB sits in one warp's registers (the persistent
    kernel); a longer one that fits a block's shared memory, in whole 16-byte vectors, is read
    into it once (cunn_SoftMaxForwardSmem). Otherwise the kernel reads the row once for its
    maximum, once for the sum of exponentials and once to write the result (cunn_SoftMaxForward,
    and cunn_SpatialSoftMaxForward where the dimension is not the innermost)."""
    if tensor.dim() == 0:
        return True
    dim %= tensor.dim()
    size, itemsize = tensor.shape[dim], tensor.element_size()
    if math.prod(tensor.shape[dim + 1:]) != 1:
        return False
    return (size <= 1024 and size * itemsize <= 4096
            or size * itemsize < _SMEM_PER_BLOCK - 1024 and size % (16 // itemsize) == 0)


def _softmax_forward(call: _Call, inputs, outputs) -> int:
    base = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    return base + (0 if _softmax_in_one_pass(call["self"], call["dim"])
                   else 2 * _nbytes(call["self"]))


def _softmax_backward(call: _Call, inputs, outputs) -> int:
    """cunn_SoftMaxBackward sums the incoming gradient over the row, then reads it again with
    the output to write the result; softmax's (not log_softmax's) first multiplies the gradient
    by the output in a kernel of its own (SoftMax.cu, softmax_backward_cuda_out)."""
    grad, output = call["grad_output"], call["output"]
    moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    if not _softmax_in_one_pass(output, call["dim"]):
        moved += _nbytes(grad)
    return moved


def _softmax_backward_data(call: _Call, inputs, outputs) -> int:
    grad, output = call["grad_output"], call["output"]
    return _softmax_backward(call, inputs, outputs) + 2 * _nbytes(grad) + _nbytes(output)


def _layer_norm_backward(call: _Call, inputs, outputs) -> int:
    """The input's gradient in one kernel (layer_norm_grad_input_kernel), the weight's and the
    bias's in another that reads the gradient and the input again (layer_norm_kernel.cu,
    LayerNormBackwardKernelImplInternal, LaunchGammaBetaBackwardCUDAKernel)."""
    moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    mask = call["output_mask"]
    if mask[1] or mask[2]:
        moved += _nbytes(call["grad_out"]) + _nbytes(call["input"])
    return moved


def _batch_norm(call: _Call, inputs, outputs) -> int:
    """In training, one pass over the input for its statistics and one to normalise it
    (Normalization.cuh: batch_norm_collect_statistics_kernel, then
    batch_norm_transform_input_kernel). cuDNN's kernels are not published: taken as the same."""
    moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    return moved + (_nbytes(call["input"]) if call["training"] else 0)


def _batch_norm_backward(call: _Call, inputs, outputs) -> int:
    """In training, a reduction over the gradient and the input, then a pass over both again
    to write the input's gradient (Normalization.cuh: batch_norm_backward_reduce_kernel,
    batch_norm_backward_elemt_kernel); cuDNN's taken as the same."""
    moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    grad = call["grad_out"] if call["grad_out"] is not None else call["grad_output"]
    training = call["train"] if "train" in call.names else True  # cuDNN's: training only
    return moved + (_nbytes(grad) + _nbytes(call["input"]) if training else 0)


def _nll_loss(call: _Call, inputs, outputs) -> int:
    """The loss reads the log-probability of each target's class, not every class."""
    target = call["target"]
    return (_nbytes(target) + target.numel() * call["self"].element_size()
            + _nbytes(call["weight"]) + sum(map(_nbytes, outputs)))


def _nll_loss_backward(call: _Call, inputs, outputs) -> int:
    """The input's gradient zeroed and each target's entry written; the input itself is
    passed for its shape only."""
    return sum(_nbytes(t) for t in inputs if t is not call["self"]) + sum(
        map(_nbytes, outputs))


def _embedding(call: _Call, inputs, outputs) -> int:
    """The rows the indices pick, read, and the output written: not the whole table."""
    return _nbytes(call["indices"]) + 2 * sum(map(_nbytes, outputs))


# The bytes a kernel moves where they are not its arguments' and its outputs' once each
_MOVED = {_ops._softmax: _softmax_forward, _ops._log_softmax: _softmax_forward,
          _ops._log_softmax_backward_data: _softmax_backward,
          _ops._softmax_backward_data: _softmax_backward_data,
          _ops.native_layer_norm_backward: _layer_norm_backward,
          _ops.native_batch_norm: _batch_norm, _ops._native_batch_norm_legit: _batch_norm,
          _ops.cudnn_batch_norm: _batch_norm,
          _ops.native_batch_norm_backward: _batch_norm_backward,
          _ops.cudnn_batch_norm_backward: _batch_norm_backward,
          _ops.nll_loss_forward: _nll_loss, _ops.nll_loss2d_forward: _nll_loss,
          _ops.nll_loss_backward: _nll_loss_backward,
          _ops.nll_loss2d_backward: _nll_loss_backward, _ops.embedding: _embedding}


@dataclass(frozen=True)
class _Kind:
    """What an op is, for its price: decided once per op overload from its schema and name."""

    kernel: bool  # launches a kernel (else a view or metadata)
    names: tuple[str, ...] = ()  # its arguments' names
    copy: bool = False  # a copy, maybe between host and device
    host_read: bool = False  # the host reads its result (a value, or a size from values)
    collective: str = ""  # a collective's kind, a key of _RING ("": none that moves data)
    written: tuple[int, ...] = ()  # the arguments it writes in place
    attention: bool = False
    matmul: bool = False
    convolution: bool = False
    moved: object = None  # _MOVED's rule for its bytes, if it has one


def _kind(func) -> _Kind:
    packet = func._overloadpacket
    schema = func._schema
    written = tuple(i for i, argument in enumerate(schema.arguments)
                    if argument.alias_info is not None and argument.alias_info.is_write)
    name = packet.__name__
    names = tuple(argument.name for argument in schema.arguments)
    if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        share = next((key for key in _RING if key in name), None)
        return _Kind(kernel=False, collective=share or "", written=written)
    if func.is_view or packet in _NO_KERNEL or func.namespace == "profiler":
        return _Kind(kernel=False)
    return _Kind(kernel=True, names=names, copy=packet in _COPIES,
                 host_read=packet in _HOST_READS, written=written,
                 attention="attention" in name, matmul=packet in _MATMULS,
                 convolution=packet in _CONVOLUTIONS, moved=_MOVED.get(packet))


class StepTimer:
    """Prices the ops of the `step`-th optimizer step of a trace (`record`, from the estimate's
    op walk; the last traced, whose optimizer state is the run's from then on), plays them on
    the host's and the GPU's timelines, and keeps their sums by phase (`result`). A step ends
    where its optimizer phase does: the first op of another phase after it begins the next.
    The ops of other steps are only counted past. `device` is the trace's device type: "cuda",
    or "cpu" for the CPU stand-in, whose host tensors stand for the device's: there a read of a
    value cannot be told from a read of a host tensor (an optimizer's step counters, on the
    host in a CUDA run), so the stand-in's host never waits for the GPU."""

    def __init__(self, gpu: Gpu, device: str = "cuda", step: int = 1):
        self.gpu, self.device, self.priced = gpu, device, step
        self.world_size = 1
        self.kinds: dict = {}
        self.phases: dict[str, PhaseTime] = {}
        self.step, self.in_optimizer = 1, False
        # the timelines, from the priced step's start (the step before ended synchronized):
        # when the host has dispatched its last op, when the GPU runs out of launched work
        self.host_clock = self.gpu_clock = 0.0
        self.current_phase = ""
        self.segments: list[Segment] = [Segment()]
        self.segment_start = 0.0
        speeds = gpu.speeds
        self.host_op, self.host_tensor_op = speeds.host_op.value, speeds.host_tensor_op.value
        self.bandwidth = speeds.memory.value * speeds.memory_share.value
        self.host_link = speeds.host_link.value
        self.waits_for_reads = device != "cpu"

    def record(self, func, args, kwargs, out, flops: int, phase: str) -> None:
        if phase == "optimizer":
            self.in_optimizer = True
        elif self.in_optimizer:  # the step before has ended
            self.step, self.in_optimizer = self.step + 1, False
        if self.step != self.priced or phase not in STEP_PHASES or func.namespace == "prim":
            return  # (prim.device: a fake tensor's own question, no op of a run)
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _kind(func)
        sums = self.phases.get(phase)
        if sums is None:
            sums = self.phases[phase] = PhaseTime()
        self.current_phase = phase
        inputs = _tensors(kwargs.values(), _tensors(args, []))
        outputs = _tensors(out if isinstance(out, (list, tuple)) else (out,), [])
        on_device = any(t.device.type == self.device for t in outputs or inputs)
        sums.ops += 1
        host = self.host_op if on_device else self.host_tensor_op
        sums.host_ops += not on_device
        sums.host_s += host
        self.host_clock += host
        segment = self.segments[-1]
        segment.host_s[phase] = segment.host_s.get(phase, 0.0) + host
        waits = False
        if kind.collective:
            self._queue(sums, "collective_s", self._collective(kind, inputs, outputs))
        elif kind.copy and self._crosses(inputs, outputs):
            self._queue(sums, "transfer_s",
                        sum(map(_nbytes, outputs or inputs)) / self.host_link)
            # torch synchronizes the stream after a copy to or from the host unless asked not
            # to (ATen/native/cuda/Copy.cu)
            waits = not _Call(kind.names, args, kwargs)["non_blocking"]
        elif kind.kernel and on_device:
            self._kernel(sums, kind, args, kwargs, inputs, outputs, flops)
            waits = kind.host_read and self.waits_for_reads
        if waits:
            sums.host_reads += 1
            self.host_clock = max(self.host_clock, self.gpu_clock)
            segment.seconds = self.host_clock - self.segment_start
            self.segments.append(Segment())
            self.segment_start = self.host_clock

    def _queue(self, sums: PhaseTime, part: str, seconds: float) -> None:
        """Work on the GPU's queue: it starts once launched and once the GPU is free (while the
        GPU waits for the launch, the host's time shows)."""
        self.gpu_clock = max(self.host_clock, self.gpu_clock) + seconds
        setattr(sums, part, getattr(sums, part) + seconds)
        queued = self.segments[-1].queued_s
        queued[self.current_phase] = queued.get(self.current_phase, 0.0) + seconds

    def _crosses(self, inputs: list, outputs: list) -> bool:
        """A copy between host and device (a copy_ writes its first argument)."""
        return len({t.device.type for t in inputs + outputs}) > 1

    def _kernel(self, sums: PhaseTime, kind: _Kind, args, kwargs, inputs, outputs,
                flops: int) -> None:
        written = outputs or [t for i in kind.written if i < len(args)
                              for t in _tensors((args[i],), [])]
        nbytes = (kind.moved(_Call(kind.names, args, kwargs), inputs, written)
                  if kind.moved is not None
                  else sum(map(_nbytes, inputs)) + sum(map(_nbytes, written)))
        sums.kernels += 1
        sums.bytes += nbytes
        memory = nbytes / self.bandwidth
        compute = 0.0
        if flops:
            if kind.attention and _Call(kind.names, args, kwargs)["is_causal"]:
                flops //= 2  # the kernel skips the blocks above the diagonal
            sums.flops += flops
            compute = flops / self._rate(kind, inputs[0].dtype)
        if compute > memory:
            self._queue(sums, "compute_s", compute)
            if kind.convolution:
                sums.convolution_s += compute
        else:
            self._queue(sums, "memory_s", memory)

    def _rate(self, kind: _Kind, dtype: torch.dtype) -> float:
        """The FLOP/s a kernel of `kind` reaches on `dtype`'s inputs: the GPU's dense peak for
        that dtype, times the share its kind achieves."""
        speeds = self.gpu.speeds
        if kind.attention:
            share = speeds.attention_share
        elif kind.convolution:
            share = speeds.convolution_share
        else:
            share = speeds.matmul_share
        if dtype in _HALF:
            peak = speeds.fp16 if dtype == torch.float16 else speeds.bf16
        elif dtype.itemsize == 1:  # fp8 and int8 matmuls: at bf16's rate (their 2x not modelled)
            peak = speeds.bf16
        elif (kind.matmul and torch.backends.cuda.matmul.allow_tf32
              or kind.convolution and torch.backends.cudnn.allow_tf32):
            peak = speeds.tf32
        else:
            peak = speeds.fp32
        return peak.value * share.value

    def _collective(self, kind: _Kind, inputs, outputs) -> float:
        """A ring collective's traffic at the link between this rank and the next (s)."""
        ranks = self.world_size
        if ranks < 2 or kind.collective not in _RING:
            return 0.0
        # the larger side: an all-gather's output, a reduce-scatter's input
        buffer = max(sum(map(_nbytes, inputs)), sum(map(_nbytes, outputs)))
        link = self.gpu.speeds.link(ranks)
        return _RING[kind.collective](ranks) * buffer / link.value

    def result(self) -> StepTime:
        """The priced step, by phase and by segment: the last ends when both the host and the
        GPU are done."""
        phases = {name: self.phases[name] for name in STEP_PHASES if name in self.phases}
        segments = [replace(segment) for segment in self.segments]
        segments[-1].seconds = max(self.host_clock, self.gpu_clock) - self.segment_start
        return StepTime(self.gpu.key, phases, segments)


def duration(seconds: float) -> str:
    """A time in s or ms, for people."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def step_time_lines(step: StepTime, accumulate: int, trace: str) -> list[str]:
    """The predicted step time for `memexp estimate`: its figure on a line that begins `step
    time`, how its parts add up to it, and each phase's sums."""
    micro = f"{accumulate} micro-batches" if accumulate > 1 else "one batch"
    parts = step.parts
    lines = [f"step time    {duration(step.seconds)} per optimizer step on the {step.gpu} "
             f"(forward, backward, optimizer; {micro}; evaluation not included)",
             f"  = GPU arithmetic {duration(parts['compute_s'])} + GPU memory "
             f"{duration(parts['memory_s'])} + the GPU waiting for the host "
             f"{duration(parts['exposed_host_s'])} + transfers {duration(parts['transfer_s'])} "
             f"+ collectives {duration(parts['collective_s'])}",
             f"  {'phase':<10}{'host':>10}{'GPU':>10}{'kernels':>9}{'ops':>8}{'TFLOP':>9}"
             f"{'GB':>9}"]
    for name, phase in step.phases.items():
        lines.append(f"  {name:<10}{duration(phase.host_s):>10}{duration(phase.gpu_s):>10}"
                     f"{phase.kernels:>9,.0f}{phase.ops:>8,.0f}{phase.flops / 1e12:>9.2f}"
                     f"{phase.bytes / 1e9:>9.1f}")
    speeds = gpu(step.gpu).speeds
    lines.append(f"  priced by memexp.steptime on memexp.gpus' {step.gpu}: datasheet peaks, "
                 f"{speeds.matmul_share.value:.0%} of them for a matmul, "
                 f"{speeds.convolution_share.value:.0%} for a convolution and "
                 f"{speeds.attention_share.value:.0%} for attention, "
                 f"{speeds.memory_share.value:.0%} of the memory bandwidth, "
                 f"{speeds.host_op.value * 1e6:.1f} us of host per op (measured on the H100's "
                 "host), host and GPU on two timelines; not modelled: communication overlapping "
                 "compute, kernel fusion, the L2 cache, the data loader, the first steps' "
                 "allocations")
    if trace != "cuda":
        lines.append("  CPU stand-in: the CPU kernels' ops priced as the GPU's (attention, "
                     "autocast and the optimizer's kernels may differ on CUDA)")
    return lines
