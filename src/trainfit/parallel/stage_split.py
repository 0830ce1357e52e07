"""Which blocks each pipeline stage runs, and which stages each pipeline rank holds. Torch-free:
the Layout (and so the estimators and the planner) decide the split, the trainer only applies it.

Default split: contiguous blocks per stage, the embedding on the first stage, the final norm, the
output projection and the loss on the last. It minimizes the largest stage's share of the model,
where a stage's share is the larger of its share of the forward FLOPs per token (its blocks' matmuls
and attention; the output projection's matmul, 2 x dim x vocab; an embedding lookup costs no
FLOPs) and its share of the parameters (the embedding and output weights count where they live).
Compute sets the pipeline's pace (every stage waits for the slowest), parameters set the model
states each stage keeps. So with a large vocabulary the first and last stages get fewer blocks
(Llama 3.1 405B on 16 stages: 7 blocks on the first and last, 8 on the others: the 2.1B-parameter
embedding and head each weigh about 0.65 of a 3.2B block); where the head weighs more than a block (a
small model with a large vocabulary) the last stage may hold it alone, as nanotron's split does (a first
stage of the embedding alone is refused: its in-flight moments are not modelled). The in-flight activations, which
depend on the schedule (1F1B's first stage keeps pp micro-batches, its last one), are not
balanced: `parallel.pp_layers_per_stage` sets any split by hand, where every stage after the first may
hold no block (nanotron's split leaves such stages before the head's; parallel/pipeline.py passes their
input on).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import kind_of_layers, layer_kinds
from trainfit.models.block_cost import block_attention_flops, block_matmul_params, head_matmul_params
from trainfit.models.params import param_counts
from trainfit.parallel.schedules import SCHEDULES

# The functions below are cached: the estimators ask them per stage of thousands of layouts (plan/search.py).


@functools.lru_cache(maxsize=4096)
def rank_stages(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` runs, in model order: r, r + pp, ... (looped), or r and
    2 pp - 1 - r (V schedules; without pipeline parallelism the one stage, whatever the schedule)."""
    if SCHEDULES[schedule].v_shape and virtual_stages == 2:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(virtual_stages))


@functools.lru_cache(maxsize=1024)
def stage_owners(pp: int, virtual_stages: int, schedule: str) -> tuple[int, ...]:
    """The pipeline rank that runs each stage, first stage to last."""
    owner = {s: r for r in range(pp) for s in rank_stages(r, pp, virtual_stages, schedule)}
    return tuple(owner[s] for s in range(len(owner)))


@functools.lru_cache(maxsize=1024)
def stage_ranges(layers_per_stage: tuple[int, ...]) -> tuple[range, ...]:
    """Global block indices of each stage."""
    starts = itertools.accumulate(layers_per_stage, initial=0)
    return tuple(range(start, start + n) for start, n in zip(starts, layers_per_stage, strict=False))


@functools.lru_cache(maxsize=4096)
def rank_blocks(pp_rank: int, layers_per_stage: tuple[int, ...], pp: int, virtual_stages: int, schedule: str
                ) -> tuple[int, ...]:
    """Global indices of the blocks pipeline rank `pp_rank` runs, in model order."""
    ranges = stage_ranges(layers_per_stage)
    return tuple(i for stage in rank_stages(pp_rank, pp, virtual_stages, schedule) for i in ranges[stage])


class RankPlacement(NamedTuple):
    """Where a pipeline rank sits: what it holds of the model, and which of its stages exchange
    activations with stages of other ranks (what the memory estimate reads per rank)."""

    rank: int
    """Its index on the pp axis."""
    stages: tuple[int, ...]
    """Its stages, in model order."""
    blocks: tuple[int, ...]
    """Global indices of its blocks, in model order."""
    first: bool
    """It runs the first stage (the embedding)."""
    last: bool
    """It runs the last stage (the final norm, the output projection and the loss)."""
    boundaries: int
    """Stage inputs and outputs at a stage boundary: every stage's but the first's input and the last's output."""
    sends_next: int
    """Its stages whose next stage runs on another rank."""
    sends_prev: int
    """Its stages whose previous stage runs on another rank."""


@functools.lru_cache(maxsize=1024)
def rank_placements(layers_per_stage: tuple[int, ...], pp: int, virtual_stages: int, schedule: str
                    ) -> tuple[RankPlacement, ...]:
    """Every pipeline rank's placement, rank 0 first."""
    n, owner = pp * virtual_stages, stage_owners(pp, virtual_stages, schedule)
    placements = []
    for rank in range(pp):
        stages = rank_stages(rank, pp, virtual_stages, schedule)
        placements.append(RankPlacement(
            rank, stages, rank_blocks(rank, layers_per_stage, pp, virtual_stages, schedule), first=0 in stages,
            last=n - 1 in stages, boundaries=sum((s > 0) + (s < n - 1) for s in stages),
            sends_next=sum(s < n - 1 and owner[s + 1] != rank for s in stages),
            sends_prev=sum(s > 0 and owner[s - 1] != rank for s in stages)))
    return tuple(placements)


def checkpointed(block: int, every_n_layers: int) -> bool:
    """Does activation checkpointing wrap global block `block` (memory.ac_every_n_layers = n)? The
    blocks i with i % n == 0, counted from the model's first block, whichever pipeline stage runs
    them: the last block stays unwrapped when n > 1, where backward starts at the step's peak
    (recompute.apply_activation_checkpointing wraps by this; the estimators count by it)."""
    return block % every_n_layers == 0


@functools.lru_cache(maxsize=4096)
def rank_shapes(layers_per_stage: tuple[int, ...], pp: int, virtual_stages: int, schedule: str, every_n_layers: int
                ) -> frozenset[tuple[int, int, bool]]:
    """The distinct (blocks, blocks i with i % every_n_layers == 0, runs the last stage) of the
    pipeline ranks: all a per-rank cost model needs to find the busiest."""
    last = len(layers_per_stage) - 1
    return frozenset(
        (len(blocks), sum(checkpointed(i, every_n_layers) for i in blocks),
         last in rank_stages(r, pp, virtual_stages, schedule))
        for r in range(pp) for blocks in [rank_blocks(r, layers_per_stage, pp, virtual_stages, schedule)])


def balanced_split(m: ModelConfig, seq_len: int, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage minimizing the largest stage's share (the module docstring's cost), each block
    weighed as its kind of layer (architecture.layer_kinds: a dense layer among MoE ones weighs less)."""
    counts, kinds = param_counts(m), layer_kinds(m)
    cost = [(2 * block_matmul_params(k) + block_attention_flops(k, seq_len), param_counts(k).per_layer) for k in kinds]
    blocks = tuple(cost[k] for k in kind_of_layers(m))
    first = (0, counts.embedding)
    last = (2 * head_matmul_params(m), counts.final_norm + counts.output)
    return _split_solver(blocks, first, last)(0, num_stages)[1]


@functools.lru_cache(maxsize=16)
def _split_solver(blocks: tuple[tuple[int, int], ...], first: tuple[int, int], last: tuple[int, int]
                  ) -> Callable[[int, int], tuple[float, tuple[int, ...]]]:
    """best(start, stages): (largest share, split) of blocks start.. over `stages` stages, memoized
    across stage counts of one model (the planner asks for many). `blocks`: each block's (FLOPs,
    parameters)."""
    num_layers = len(blocks)
    before = [tuple(itertools.accumulate((b[i] for b in blocks), initial=0)) for i in range(2)]  # prefix sums
    total = tuple(before[i][-1] + first[i] + last[i] for i in range(2))

    def share(start: int, stop: int) -> float:
        """The share of a stage of blocks start..stop - 1, with the embedding if it starts the model
        and the head if it ends it."""
        return max((before[i][stop] - before[i][start] + first[i] * (start == 0) + last[i] * (stop == num_layers))
                   / total[i] for i in range(2))

    @cache
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        if stages == 1:  # the last stage: its blocks and the head (the head alone where none are left)
            return share(start, num_layers), (num_layers - start,)
        # The first stage's share grows with its end and the rest's best never does (fewer blocks
        # over as many stages), so once the first is the larger, every later end costs at least as
        # much. Ties: the split with fewer blocks early (the smallest end). The last stage may hold the
        # head alone (stages == 1 at start == num_layers): every other stage keeps a block.
        cost, end = float("inf"), start
        for stop in range(start + 1, num_layers - stages + 3):
            own, rest = share(start, stop), best(stop, stages - 1)[0]
            if max(own, rest) < cost:
                cost, end = max(own, rest), stop
            if own >= rest:
                break
        return cost, (end - start, *best(end, stages - 1)[1])

    return best
