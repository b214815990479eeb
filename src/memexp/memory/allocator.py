"""A model of PyTorch's CUDA caching allocator, for estimates of allocated and reserved memory.

It follows c10/cuda/CUDACachingAllocator.cpp with its default settings (no expandable segments,
no max_split_size, one stream):

- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the
  large pool, whose segments are 20 MiB for requests under 10 MiB, else the request rounded up
  to a multiple of 2 MiB;
- a request takes the smallest cached free block that is large enough (best fit), and splits it
  when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool); an
  unsplit remainder stays with the block and counts as allocated, as the allocator's own
  `allocated_bytes` counts it;
- a freed block merges with free neighbours of its segment and stays cached (reserved).

`malloc` returns the bytes the allocator would count as allocated for the request.

What it cannot follow: among free blocks of one size the allocator takes the lowest address,
which a trace has not (the model takes the oldest segment's); and it sees only the tensors
traced, not the workspaces kernels allocate for one call (cuDNN's convolutions and attention),
whose blocks leave holes in reserved memory. With expandable_segments, max_split_size_mb or
roundup_power2_divisions set (PYTORCH_CUDA_ALLOC_CONF), the real allocator packs differently.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_REQUEST = 2**20  # up to this, the small pool
SMALL_SEGMENT = 2 * 2**20
LARGE_SEGMENT = 20 * 2**20  # for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocatorModel:
    def __init__(self):
        # per pool, the free blocks sorted by (size, segment, offset): bisect finds the best fit
        self._free: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        self._used: dict[int, _Block] = {}
        self._segments = 0
        self.allocated = self.reserved = 0
        self.allocated_peak = self.reserved_peak = 0

    def malloc(self, key: int, nbytes: int) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index < len(pool):
            block = pool.pop(index)[3]
        else:
            block = self._new_segment(segment_size(size), small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_REQUEST:
            rest = _Block(block.segment, block.offset + size, remaining, small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self._used[key] = block
        self.allocated += block.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return block.size

    def free(self, key: int) -> None:
        block = self._used.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                before = neighbour is block.prev
                first, second = (neighbour, block) if before else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                block = first
        self._insert(block)

    def _new_segment(self, size: int, small: bool) -> _Block:
        self._segments += 1
        self.reserved += size
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return _Block(self._segments, 0, size, small)

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.segment, block.offset, block))

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        pool.pop(bisect.bisect_left(pool, (block.size, block.segment, block.offset)))
