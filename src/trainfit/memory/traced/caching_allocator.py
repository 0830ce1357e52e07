"""What PyTorch's CUDA caching allocator reserves for a sequence of tensor allocations and frees. Torch-free.

A step's tensors at their peak are what the estimators count; the device holds more: the caching
allocator takes memory from the driver in segments, cuts blocks out of them, keeps freed blocks
for reuse and returns nothing to the driver during a step. Where a freed block is too small for
the next request, or a request's segment is larger than the request, reserved memory grows past
the tensors'. This replays the allocator's rules (c10/cuda/CUDACachingAllocator.cpp, torch 2.x
defaults: no max_split_size, no expandable segments) over the step's allocations in
order, as the traced estimator sees them, to predict the reserved peak instead of assuming a share:

- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) come from the small pool, the rest from the large pool;
- a request is served by the smallest free block of its pool that holds it (best fit, the lower
  address on a tie); a block is split when what is left is at least 512 bytes (small pool) or more
  than 1 MiB (large pool), the rest staying free beside it;
- with no such block, a new segment is reserved from the driver: 2 MiB for a small request
  (kSmallBuffer), 20 MiB for a request under 10 MiB (kLargeBuffer, kMinLargeAlloc), else the
  request rounded up to 2 MiB (kRoundLarge);
- a freed block merges with free neighbours of its segment; segments are never released.

Blocks belong to the stream that allocated them and serve only its requests: the ledger puts what
the data-parallel engines' collective operators create (FSDP2's all-gather and reduce-scatter
buffers, which it allocates on its own streams) on a "comm" stream, everything else on the default
one. Not modelled: record_stream's delayed reuse, workspaces that kernels allocate inside one
operator, and the allocator's configuration options (PYTORCH_CUDA_ALLOC_CONF: expandable segments,
max_split_size_mb).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The block size a request of `nbytes` takes."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """What the allocator reserves from the driver for a rounded request it cannot serve from its cache."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    stream: str
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None
    """Neighbours in the segment, by address."""

    def key(self) -> tuple[int, int, int]:
        return self.size, self.segment, self.offset


@dataclass
class _Pool:
    free: list[tuple[int, int, int]] = field(default_factory=list)
    """(size, segment, offset) of every free block, sorted: the best fit is the first that holds a request."""
    blocks: dict[tuple[int, int], _Block] = field(default_factory=dict)
    """Free blocks by (segment, offset)."""

    def add(self, block: _Block) -> None:
        bisect.insort(self.free, block.key())
        self.blocks[(block.segment, block.offset)] = block

    def remove(self, block: _Block) -> None:
        del self.free[bisect.bisect_left(self.free, block.key())]
        del self.blocks[(block.segment, block.offset)]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1, -1))
        return self.blocks[self.free[i][1:]] if i < len(self.free) else None


class CachingAllocator:
    """The allocator's block bookkeeping, fed `malloc(key, nbytes)` and `free(key)` in the step's order."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        """What the allocator may reserve (the device's memory less what is not its own), or None: unbounded."""
        self._pools: dict[tuple[str, bool], _Pool] = {}  # (stream, small?)
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, list[int]] = {}  # segment -> [size, live blocks]
        self._ids = itertools.count()
        self.reserved = 0
        self.allocated = 0
        """Bytes of the blocks in use (rounded requests, and split remainders too small to split off)."""
        self.held = 0
        """Bytes of the segments holding a live block: what no release of cached memory can give back."""
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.peak_held = 0
        self.out_of_memory = False
        """A segment did not fit `capacity` even after every wholly free segment was released."""

    def malloc(self, key: int, nbytes: int, stream: str = "default") -> None:
        """Allocate `nbytes` for `key` on `stream`: each stream's blocks serve only its own requests."""
        if nbytes <= 0 or key in self._live:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools.setdefault((stream, small), _Pool())
        block = pool.best_fit(size)
        if block is None:
            total = segment_size(size)
            if self.capacity is not None and self.reserved + total > self.capacity:
                self._release_free_segments()  # what the allocator does before it reports out of memory
                self.out_of_memory |= self.reserved + total > self.capacity
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = _Block(next(self._ids), 0, total, small, stream)
            self._segments[block.segment] = [total, 0]
        else:
            pool.remove(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining, small, stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        segment = self._segments[block.segment]
        if segment[1] == 0:
            self.held += segment[0]
            self.peak_held = max(self.peak_held, self.held)
        segment[1] += 1

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        segment = self._segments[block.segment]
        segment[1] -= 1
        if segment[1] == 0:
            self.held -= segment[0]
        pool = self._pools[(block.stream, block.small)]
        block.free = True
        after = block.next
        if after is not None and after.free:
            pool.remove(after)
            _join(block, after)
        before = block.prev
        if before is not None and before.free:
            pool.remove(before)
            _join(before, block)
            block = before
        pool.add(block)

    def _release_free_segments(self) -> None:
        """Give every wholly free segment back to the driver (the allocator's retry before an OOM)."""
        for pool in self._pools.values():
            for free in [b for b in pool.blocks.values() if b.offset == 0 and b.next is None]:
                pool.remove(free)
                self.reserved -= free.size
                del self._segments[free.segment]


def _join(left: _Block, right: _Block) -> None:
    """`right`, adjacent after `left` in one segment, becomes part of `left`."""
    left.size += right.size
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
