"""memory/traced/caching_allocator.py: the CUDA caching allocator's rules, replayed on hand-made sequences."""

from __future__ import annotations

import random

from trainfit.memory.traced.caching_allocator import CachingAllocator, round_size, segment_size

MIB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_by_size_class() -> None:
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(MIB) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == 20 * MIB  # 1-10 MiB share 20 MiB
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB + 1) == 12 * MIB  # 2 MiB rounding


def test_small_requests_share_a_segment_and_freed_blocks_are_reused() -> None:
    a = CachingAllocator()
    for key in range(4):
        a.malloc(key, 256 * 1024)  # four quarter-MiB blocks fit one 2 MiB segment
    assert a.reserved == 2 * MIB and a.allocated == MIB
    a.free(1)
    a.malloc(9, 200 * 1024)  # best fit: the freed quarter (split: 56 KiB stays free)
    assert a.reserved == 2 * MIB and a.allocated == MIB - 56 * 1024


def test_a_large_pool_block_is_split_only_when_over_1_mib_remains() -> None:
    a = CachingAllocator()
    a.malloc(0, 3 * MIB)  # a 20 MiB segment: 3 MiB used, 17 MiB free beside it
    a.malloc(1, 16 * MIB)  # the 17 MiB rest: 1 MiB would remain, not more than 1 MiB: not split
    assert a.reserved == 20 * MIB and a.allocated == 3 * MIB + 17 * MIB
    a.free(1)
    a.malloc(2, 15 * MIB)  # the 17 MiB block again, split now (2 MiB remain)
    assert a.allocated == 18 * MIB and a.reserved == 20 * MIB


def test_freeing_merges_neighbours_and_nothing_returns_to_the_driver() -> None:
    a = CachingAllocator()
    for key in range(3):
        a.malloc(key, 4 * MIB)  # 12 of one 20 MiB segment
    for key in (0, 2, 1):  # the middle one last: it merges with both sides, and the free tail
        a.free(key)
    assert a.allocated == 0 and a.reserved == 20 * MIB
    a.malloc(3, 19 * MIB)  # the whole merged 20 MiB serves it
    assert a.reserved == 20 * MIB


def test_fragmentation_a_growing_request_cannot_use_smaller_holes() -> None:
    """Activations of 12 MiB kept, a 12 MiB temporary freed between them, then a 14 MiB request: the
    holes hold 12 MiB each, none holds 14: a new segment, reserved grows past the tensors' peak."""
    a = CachingAllocator()
    a.malloc("x", 12 * MIB)
    a.malloc("tmp", 12 * MIB)
    a.malloc("y", 12 * MIB)
    a.free("tmp")
    a.malloc("z", 14 * MIB)
    assert a.peak_allocated == 38 * MIB
    assert a.reserved == 12 * MIB * 3 + 14 * MIB  # the 12 MiB hole stays reserved


def test_every_byte_is_accounted_for_over_a_random_sequence() -> None:
    rng = random.Random(0)
    a = CachingAllocator()
    live: dict[int, int] = {}
    for key in range(3000):
        if live and rng.random() < 0.45:
            victim = rng.choice(list(live))
            a.free(victim)
            del live[victim]
        size = rng.choice([100, 4096, 300_000, 2 * MIB, 7 * MIB, 33 * MIB])
        a.malloc(key, size)
        live[key] = size
        assert a.allocated >= sum(round_size(s) for s in live.values())
        assert a.reserved >= a.allocated
    for key in list(live):
        a.free(key)
    assert a.allocated == 0 and a.peak_reserved == a.reserved >= a.peak_allocated


def test_held_counts_segments_with_a_live_block_and_a_full_device_releases_the_rest() -> None:
    a = CachingAllocator()
    a.malloc("x", 12 * MIB)
    a.malloc("tmp", 12 * MIB)
    a.free("tmp")  # its segment stays reserved, holding nothing
    assert (a.reserved, a.held) == (24 * MIB, 12 * MIB)
    a.malloc("z", 14 * MIB)
    assert (a.reserved, a.held, a.peak_held) == (38 * MIB, 26 * MIB, 26 * MIB)
    # the same with room for 30 MiB: the free 12 MiB segment goes back before the 14 MiB one is made
    b = CachingAllocator(capacity=30 * MIB)
    b.malloc("x", 12 * MIB)
    b.malloc("tmp", 12 * MIB)
    b.free("tmp")
    b.malloc("z", 14 * MIB)
    assert (b.reserved, b.peak_reserved, b.out_of_memory) == (26 * MIB, 26 * MIB, False)
    b.malloc("w", 6 * MIB)  # a 20 MiB segment: 46 MiB, past 30 with nothing free to give back
    assert b.out_of_memory
