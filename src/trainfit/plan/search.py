"""`trainfit plan`: every layout of a model on a cluster that fits, ranked by predicted step time. Torch-free.

The user's config fixes what it names (model, hardware, global batch, sequence length, and any
field written in the file or on the command line; a global batch of 0 is the one `trainfit train`
derives from the config as given, micro_batch_size x its data-parallel ranks); every other choice
(plan/space.py's table) is searched, each candidate judged by the analytic estimators
(memory/closed_form/analytic.py for the fit, perf/timing.py for the time) on its own Layout, so a candidate
is exactly what `trainfit estimate` would say of it.

Only layouts `trainfit train` runs are kept (Layout.untrainable_reason, asked of each group and of
each of its memory settings: some rules read checkpointing or offload). A candidate fits when
every pipeline stage's peak plus its reserved margin is within the device memory.

What is listed: the fastest candidate, then each next fastest that needs at least MEMORY_STEP less
memory than the one above (the time-memory frontier), up to `top` rows within SLOWEST_LISTED of the
fastest.

Search: best-first over one heap of lower bounds of the step time, exact for the time model.
A *mesh* (precision, tp, cp, pp and schedule) is keyed by its groups' compute, least bubble and
tensor/context/pipeline traffic, which every group of it pays. Popped, it yields its *groups*
(everything but the three memory knobs: HSDP split, expert degree, ZeRO stage, micro-batch),
each keyed by its step time with the cheapest memory settings, which is estimated only when its
lower bound (its own compute and bubble, its mesh's traffic) comes out of the heap: the groups
of a mesh that the search stops before are never timed. A group's *settings* form a
lattice (each knob's options from cheapest to leanest); a setting's step time bounds every leaner
one, since checkpointing, offload and the chunked loss only add work (recomputation, host copies,
the host optimizer step) and added compute never shortens a step (it can only hide communication
it overlaps). So settings come out fastest first, and only those popped get a memory estimate. A
group's leanest setting is estimated first: if it does not fit, nothing of the group does; if a
listed candidate is faster and not MEMORY_STEP above that leanest memory, nothing of the group can
be listed. The search stops when the bound passes the `top`-th listed time (or SLOWEST_LISTED
times the fastest). tests/unit/test_plan.py checks it against an exhaustive search and a brute force.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, ParamSpec, TypeVar

from trainfit.config import Config, ConfigError
from trainfit.estimate import Estimate
from trainfit.memory import MemoryBreakdown
from trainfit.memory.closed_form import MemoryEstimate, SharedSizes, StageMemory
from trainfit.models.architecture import layer_kinds
from trainfit.models.params import param_counts
from trainfit.parallel.layout import Layout, offload_refusal
from trainfit.parallel.resolve import GlobalBatch, build_layout
from trainfit.parallel.schedules import bubble_fraction, default_virtual_stages
from trainfit.parallel.stage_split import balanced_split
from trainfit.perf import flops as F
from trainfit.perf.comms import Collective, collectives_key
from trainfit.perf.timing import (
    PerfEstimate,
    Rates,
    compute_time_s,
    estimate_perf,
    model_parallel_comm_s,
    timed_collectives,
)
from trainfit.plan.space import Space, replace_sections, replaced, settings_of, with_global_batch

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Candidate(Estimate):
    """One layout that fits: `trainfit estimate`'s judgement of its config, and what a plan ranks by."""

    @property
    def step_time_s(self) -> float:
        return self.perf.time["step_time_s"]

    @property
    def tokens_per_second(self) -> float:
        return self.perf.time["tokens_per_second"]

    @property
    def mfu(self) -> float:
        return self.perf.time["mfu"]

    def settings(self) -> dict[str, Any]:
        """The searched fields' values ("section.field" -> value)."""
        return settings_of(self.cfg)


@dataclass
class SearchStats:
    groups: int = 0
    """Groups (everything but the memory knobs) that form a valid, trainable layout."""
    groups_visited: int = 0
    """Groups whose memory knobs were searched (the rest were bounded out)."""
    memory_estimates: int = 0
    time_estimates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    """Why layouts were left out, counted: "does not fit", "not trainable: ...", "invalid: ..."."""


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]
    """The time-memory frontier of the layouts that fit, fastest first (at most `top`): each one
    slower than the one above and leaner (see `frontier`)."""
    fitting: list[Candidate]
    """Every fitting candidate the search evaluated (all of them with exhaustive=True)."""
    stats: SearchStats
    seconds: float
    global_batch: GlobalBatch
    """The sequences per step every candidate runs: training.global_batch_size, or when 0 the batch
    `trainfit train` derives from the config as given (plan/space.with_global_batch)."""


# ---------------------------------------------------------------- the space


@dataclass(frozen=True)
class _Group:
    """Everything but the memory knobs; `cfg` carries them at their cheapest."""

    cfg: Config
    layout: Layout


class _Splits:
    """Pipeline splits per stage count, computed once per search (balanced_split is the costly part
    of building a Layout)."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self._cache: dict[int, tuple[int, ...]] = {}

    def __call__(self, stages: int) -> tuple[int, ...]:
        if stages not in self._cache:
            self._cache[stages] = balanced_split(self._cfg.model, self._cfg.training.seq_len, stages)
        return self._cache[stages]


@dataclass(frozen=True)
class _Mesh:
    """The model-parallel shape of a group: what sets its compute per rank and its bubble."""

    precision: str
    tp: int
    sp: bool
    cp: int
    pp: int
    schedule: str
    split: tuple[int, ...]
    dp: int


def _meshes(space: Space) -> Iterator[_Mesh]:
    cfg, splits = space.cfg, _Splits(space.cfg)
    given_split = "parallel.pp_layers_per_stage" in space.fixed
    for precision in space.precision:
        for tp in space.tp:
            sp = cfg.parallel.sequence_parallel if "parallel.sequence_parallel" in space.fixed else tp > 1
            for cp in space.cp:
                for pp in space.pp:
                    if space.world % (tp * cp * pp):
                        continue
                    for schedule in space.schedules if pp > 1 else (cfg.parallel.pp_schedule,):
                        virtual = cfg.parallel.pp_virtual_stages or default_virtual_stages(schedule)
                        if pp > 1 and pp * virtual > cfg.model.num_layers:
                            continue
                        split = () if pp == 1 or given_split else splits(pp * virtual)
                        yield _Mesh(precision, tp, sp, cp, pp, schedule, split, space.world // (tp * cp * pp))


def _mesh_groups(space: Space, stats: SearchStats, mesh: _Mesh) -> Iterator[_Group]:
    """Every valid, trainable group of one mesh."""
    for replicate in space.dp_replicates(mesh.dp, mesh.cp * mesh.tp):
        for ep in space.ep:
            for zero in space.zero:
                for micro in space.micro_batches(mesh.dp):
                    if mesh.pp > 1 and space.cfg.training.global_batch_size // (mesh.dp * micro) < mesh.pp:
                        continue  # fewer micro-batches than pipeline ranks
                    group = _group(space, stats, mesh, replicate=replicate, ep=ep, zero=zero, micro=micro)
                    if group is not None:
                        yield group


def _kind(reason: str) -> str:
    """A reason's kind, its numbers left out ("parallel.zero_stage with parallel.pp and N data-parallel ranks")."""
    return re.sub(r"=\S+|\d+", lambda m: "" if m.group().startswith("=") else "N", reason.split(":")[0])


def _group(space: Space, stats: SearchStats, mesh: _Mesh, *, replicate: int, ep: int, zero: int, micro: int
           ) -> _Group | None:
    cfg = space.cfg
    parallel = {"tp": mesh.tp, "sequence_parallel": mesh.sp, "cp": mesh.cp, "pp": mesh.pp,
                "pp_schedule": mesh.schedule, "ep": ep, "dp_replicate": replicate, "dp_shard": mesh.dp // replicate,
                "zero_stage": zero}
    if mesh.split:
        parallel["pp_layers_per_stage"] = mesh.split
    cheapest = {"activation_checkpointing": space.ac[0][0], "ac_every_n_layers": space.ac[0][1],
                "offload": space.offload[0], "chunked_loss": space.chunked[0]}
    candidate = replace_sections(cfg, parallel=parallel, training={"micro_batch_size": micro},
                         precision={"mode": mesh.precision}, memory=cheapest)
    try:
        layout = build_layout(candidate)
    except ConfigError as err:
        stats.rejected["invalid: " + _kind(str(err))] += 1
        return None
    reason = layout.untrainable_reason()
    if reason is not None:
        stats.rejected["not trainable: " + _kind(reason)] += 1
        return None
    stats.groups += 1
    return _Group(candidate, layout)


# ---------------------------------------------------------------- evaluation


class _Evaluator:
    def __init__(self, cfg: Config, stats: SearchStats) -> None:
        self.cfg, self.stats = cfg, stats
        self.rates = Rates.of(cfg.hardware)  # every candidate's hardware is cfg's
        self.device_memory = self.rates.device.memory_bytes
        self.shared = SharedSizes(cfg.model)  # every candidate's model is cfg's

    def memory(self, cfg: Config, layout: Layout) -> MemoryEstimate | None:
        """The estimate if every pipeline rank fits, else None: the first and last ranks (the most
        micro-batches in flight, the logits) are asked first, and the first that does not fit ends it,
        each rank's floor (StageMemory.floor: at most its peak) before its whole breakdown."""
        self.stats.memory_estimates += 1
        order = dict.fromkeys([0, layout.pp - 1, *range(layout.pp)])
        stages: dict[int, MemoryBreakdown] = {}
        memory = StageMemory(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer, self.shared)
        for stage in order:
            if self.device_memory and memory.floor(stage) > self.device_memory:
                return None
            breakdown = memory(stage)
            if self.device_memory and breakdown.peak + breakdown.reserved_margin > self.device_memory:
                return None
            stages[stage] = breakdown
        per_stage = [stages[i] for i in range(layout.pp)]
        return MemoryEstimate(per_stage, max(range(layout.pp), key=lambda i: per_stage[i].peak))

    def perf(self, knobs: _Knobs, layout: Layout) -> PerfEstimate:
        """The estimate of one of a group's settings (`layout`), its collectives timed once per
        collectives_key of the group (the settings differ in memory knobs only)."""
        self.stats.time_estimates += 1
        cfg, key = knobs.group.cfg, collectives_key(layout)
        timed = knobs.timed.get(key)
        if timed is None:
            timed = knobs.timed[key] = timed_collectives(cfg.model, layout, cfg.training, self.rates)
        return estimate_perf(cfg.model, layout, cfg.training, cfg.hardware, self.rates, timed)


class _MeshGroups(NamedTuple):
    """A mesh's groups as the heap holds them until the mesh is popped (keyed by _mesh_bound)."""

    groups: list[_Group]
    traffic: float
    """The model-parallel traffic _mesh_bound counts: every group's is at least that."""


def _mesh_bound(mesh: _Mesh, groups: list[_Group], rates: Rates) -> tuple[float, float]:
    """A lower bound of the step time of every group of a mesh (`groups`, not empty): the least of
    their compute (each data-parallel split runs the same FLOPs per rank, but not the same bytes:
    fp8-mixed casts its weights every micro-batch, and a measured profile prices autocast's casts
    and stream) with the bubble of the most micro-batches any of them runs, plus the tensor, context
    and pipeline traffic of the one with the fewest calls (the largest micro-batch: the same bytes,
    the fewest latencies). Every group runs at least that much; its data-parallel traffic and memory
    knobs only add. Also that traffic (_first_bound adds it)."""
    first, fewest = groups[0], max(groups, key=lambda g: (g.layout.micro_batch_size, g.layout.zero_stage))
    # each group with its own config, as its estimates read it: rates.memo keeps what they share
    compute = min(compute_time_s(g.cfg.model, g.layout, g.cfg.training, g.cfg.hardware, rates) for g in groups)
    rows = first.cfg.training.global_batch_size // mesh.dp
    bubble = bubble_fraction(mesh.schedule, mesh.pp, rows, first.layout.pp_virtual_stages)
    c = fewest.cfg
    traffic = model_parallel_comm_s(c.model, fewest.layout, c.training, c.hardware, rates)
    return compute * (1 + bubble) + traffic, traffic


BOUND_SLACK = 1e-9
"""Relative room _first_bound leaves below the time it bounds: it adds a step's parts in another order
than estimate_perf, which may round the other way."""


def _first_bound(knobs: _Knobs, layout: Layout, rates: Rates, mesh: float, traffic: float) -> float:
    """A lower bound of the step time of a group's first setting (`layout`), at least its mesh's (`mesh`):
    its own compute; where no measured profile time-shares cores, the bubble of its own micro-batches over
    that compute; where the model's layers are alike (estimate_perf's own collectives, not its kinds' mix),
    its mesh's model-parallel `traffic`, all of it exposed (perf/timing.py's table). estimate_perf adds
    only parts >= 0 to these."""
    cfg = knobs.group.cfg
    compute = compute_time_s(cfg.model, layout, cfg.training, cfg.hardware, rates)
    bubble = 0.0 if rates.profile is not None else bubble_fraction(
        layout.pp_schedule, layout.pp, layout.num_microbatches, layout.pp_virtual_stages)
    traffic = traffic if len(layer_kinds(cfg.model)) == 1 else 0.0
    return max(mesh, (compute * (1 + bubble) + traffic) * (1 - BOUND_SLACK))


class _Deferred(NamedTuple):
    """A group's first setting in the heap before its time is estimated (search's push_first)."""

    layout: Layout
    place: int
    """Its place among settings of equal time, taken when its mesh was popped."""


def _knob_cost(cfg: Config, ac: tuple[str, int]) -> float:
    """Recomputed FLOPs per token of a checkpointing option (orders the options cheapest first)."""
    return F.recompute_flops_per_token(cfg.model, cfg.training.seq_len, ac[0], ac[1], cfg.parallel.ep)


Setting = tuple[int, int, int]
"""Indices into a group's checkpointing, offload and chunked-loss options."""


class _Knobs:
    """A group's memory knobs, each option list ordered from cheapest to leanest, and what the
    search learned of the group: its leanest memory, whether it is done."""

    def __init__(self, group: _Group, space: Space, ac: list[tuple[str, int]]) -> None:
        """`ac`: the checkpointing options, cheapest first (the same for every group). Under sequence
        parallelism no checkpointing comes twice, the second re-gathering the column groups' inputs in
        backward (parallel.sp_recompute_gather: leaner, one all-gather more per group and block; where some
        blocks are checkpointed the option saves less and is left to the user), unless the user set it."""
        self.group = group
        layout = group.layout
        if layout.sequence_parallel and layout.tp > 1 and "parallel.sp_recompute_gather" not in space.fixed:
            self.ac = [(p, n, regather) for p, n in ac for regather in (False, True) if not regather or p == "none"]
        else:
            self.ac = [(p, n, layout.sp_recompute_gather) for p, n in ac]
        self.offload = [o for o in space.offload if offload_refusal(o, group.layout.zero_stage) is None]
        # Where one chunk holds a micro-batch's whole logits the chunked loss only adds its recomputation
        # (Layout.loss_chunks): not an option, unless the user set it.
        self.chunked = [c for c in space.chunked if not c or group.layout.loss_chunks > 1] or list(space.chunked)
        self.seen: set[Setting] = {(0, 0, 0)}
        self.timed: dict[tuple[str, int, str, bool], list[tuple[Collective, float]]] = {}
        """Timed collectives by collectives_key (_Evaluator.perf)."""
        self.leanest: int | None = None
        """Memory per GPU under the leanest setting (a lower bound for every setting), once asked."""
        self.done = False

    def _values(self, index: Setting) -> dict[str, Any]:
        (policy, every, _), offload, chunked = self.ac[index[0]], self.offload[index[1]], self.chunked[index[2]]
        return {"activation_checkpointing": policy, "ac_every_n_layers": every, "offload": offload,
                "chunked_loss": chunked}

    def layout(self, index: Setting) -> Layout:
        return replaced(self.group.layout, **self._values(index), sp_recompute_gather=self.ac[index[0]][2])

    def config(self, index: Setting) -> Config:
        return replace_sections(self.group.cfg, memory=self._values(index),
                                parallel={"sp_recompute_gather": self.ac[index[0]][2]})

    def leanest_index(self) -> Setting:
        return len(self.ac) - 1, len(self.offload) - 1, len(self.chunked) - 1

    def successors(self, index: Setting) -> list[Setting]:
        """The settings one step leaner on one knob, not seen before."""
        sizes = (len(self.ac), len(self.offload), len(self.chunked))
        out = []
        for axis in range(3):
            step = (index[0] + (axis == 0), index[1] + (axis == 1), index[2] + (axis == 2))
            if step[axis] < sizes[axis] and step not in self.seen:
                self.seen.add(step)
                out.append(step)
        return out


def _without_cycle_collector(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs `fn` with Python's cyclic garbage collector off (as it was after). The search drops
    millions of short-lived tuples and makes no reference cycles (tests/unit/test_plan.py checks),
    so reference counting frees all of it, and the collector's passes over them are pure cost."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


class Cancelled(Exception):
    """A search stopped before its end because its caller said so (a newer question replaced it, or it ran
    past the web page's limit)."""


@_without_cycle_collector
def search(cfg: Config, fixed: frozenset[str] = frozenset(), *, top: int = 10, precisions: tuple[str, ...] = (),
           exhaustive: bool = False, stop: Callable[[], bool] | None = None) -> Plan:
    """The `top` fastest layouts of `cfg` that fit (see the module docstring); `fixed` names the
    fields ("section.field") the user set, which stay as they are; `exhaustive` visits every group
    (for a picture of all candidates) instead of stopping at the bound; `stop`, asked as the search
    goes, ends it with Cancelled when it says true."""
    start = time.perf_counter()
    cfg, batch = with_global_batch(cfg)  # kept: every candidate splits the same sequences per step
    space = Space.of(cfg, fixed, precisions)
    ac = sorted(space.ac, key=lambda ac: _knob_cost(cfg, ac))  # every group's: one model, one sequence length
    stats = SearchStats()
    ev = _Evaluator(cfg, stats)
    # Best-first over one heap of lower bounds of the step time: a mesh's (its groups' compute, least
    # bubble and model-parallel traffic) until it is popped; then each of its groups' settings of
    # the memory knobs, each keyed by its own step time (a group's first, until it is popped, by
    # _first_bound). A setting's step time bounds every leaner setting of its group (each knob only
    # adds work), so settings come out fastest first and memory is estimated only for those that
    # could still be listed.
    heap: list[tuple[float, int, Any]] = []
    order = itertools.count()
    before = itertools.count(-1, -1)  # ties: a deferred first setting leaves before any other setting
    for mesh in _meshes(space):
        groups = list(_mesh_groups(space, stats, mesh))
        if groups:
            bound, traffic = _mesh_bound(mesh, groups, ev.rates)
            heapq.heappush(heap, (bound, next(order), _MeshGroups(groups, traffic)))

    def push(knobs: _Knobs, index: Setting, bound: float) -> None:
        """A setting keyed lazily by `bound` (its leaner-than parent's time: a lower bound), its own
        estimated once it is popped."""
        heapq.heappush(heap, (bound, next(order), (knobs, index, None)))

    def push_estimated(knobs: _Knobs, index: Setting, bound: float, layout: Layout | None = None) -> None:
        """A setting keyed by its own step time; one Layout.untrainable_reason refuses is neither
        estimated nor listed, and its leaner settings, which may train, go on at `bound` (its own
        lower bound: its parent's time, or for a group's first setting its mesh's bound)."""
        layout = layout or knobs.layout(index)
        reason = layout.untrainable_reason()
        if reason is not None:
            stats.rejected["not trainable: " + _kind(reason)] += 1
            for step in knobs.successors(index):
                push(knobs, step, bound)
            return
        estimate_at(knobs, index, layout, next(order))

    def estimate_at(knobs: _Knobs, index: Setting, layout: Layout, place: int) -> None:
        """A setting keyed by its own step time, `place` breaking ties."""
        perf = ev.perf(knobs, layout)
        heapq.heappush(heap, (perf.time["step_time_s"], place, (knobs, index, (layout, perf))))

    def push_first(knobs: _Knobs, mesh: _MeshGroups, bound: float) -> None:
        """A group's first setting as push_estimated would push it, but estimated only once popped: until
        then keyed by _first_bound, a lower bound of its time, holding the place among equal times that
        push_estimated would take now. So the estimated settings leave the heap in the same order as if
        each were estimated here, and the first settings the search stops before are never estimated."""
        index: Setting = (0, 0, 0)
        layout = knobs.layout(index)
        if layout.untrainable_reason() is not None:
            push_estimated(knobs, index, bound, layout)
            return
        key = _first_bound(knobs, layout, ev.rates, bound, mesh.traffic)
        heapq.heappush(heap, (key, next(before), (knobs, index, _Deferred(layout, next(order)))))

    fitting: list[Candidate] = []
    listed: list[Candidate] = []  # frontier(fitting), kept as it grows
    while heap:
        if stop is not None and stop():
            raise Cancelled
        bound, _, item = heapq.heappop(heap)
        if not exhaustive and bound > _kth_time(listed, top):
            break
        if isinstance(item, _MeshGroups):
            for group in item.groups:
                push_first(_Knobs(group, space, ac), item, bound)
            continue
        knobs, index, estimated = item
        if knobs.done:
            continue
        if estimated is None:
            push_estimated(knobs, index, bound)
            continue
        if isinstance(estimated, _Deferred):
            estimate_at(knobs, index, *estimated)
            continue
        if not _worth_trying(knobs, ev, stats, bound, [] if exhaustive else listed):
            continue
        layout, perf = estimated
        memory = ev.memory(knobs.group.cfg, layout)
        if memory is None:
            stats.rejected["does not fit"] += 1
        else:
            found = Candidate(knobs.config(index), layout, memory, perf, ev.device_memory)
            fitting.append(found)
            listed = frontier([*listed, found])  # the frontier of a union is that of one's frontier and the other
        for step in knobs.successors(index):
            push(knobs, step, bound)
    return Plan(candidates=listed[:top], fitting=fitting, stats=stats, seconds=time.perf_counter() - start,
                global_batch=batch)


def _worth_trying(knobs: _Knobs, ev: _Evaluator, stats: SearchStats, bound: float, listed: list[Candidate]) -> bool:
    """Whether a group's setting popped at `bound` could fit and be listed. Its leanest setting is
    tried once, first: if that does not fit, nothing of the group does (most groups of a large
    model); if a listed candidate is faster than `bound` and not MEMORY_STEP above that leanest
    memory, no setting of the group popped from now on can be listed (`frontier` would drop it)."""
    if knobs.leanest is None:
        stats.groups_visited += 1
        leanest = ev.memory(knobs.group.cfg, knobs.layout(knobs.leanest_index()))
        if leanest is None:
            stats.rejected["does not fit"] += 1
            knobs.done = True
            return False
        knobs.leanest = max(s.peak + s.reserved_margin for s in leanest.per_stage)
    if any(c.step_time_s < bound and c.memory_bytes * (1 - MEMORY_STEP) <= knobs.leanest for c in listed):
        stats.rejected["no faster or leaner than one listed"] += 1
        knobs.done = True
        return False
    return True


SLOWEST_LISTED = 1.25
"""Layouts more than this many times slower than the fastest that fits are not listed (nor searched
for): a leaner one that slow is a different question (more GPUs, a smaller batch)."""
MEMORY_STEP = 0.01
"""A slower candidate is listed only if it needs at least this fraction less memory than the one above."""


def frontier(candidates: list[Candidate]) -> list[Candidate]:
    """The fastest first, then each next one only if it needs less memory than every faster one:
    the time-memory frontier, so every row trades speed for memory against the one above."""
    kept: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.step_time_s, c.memory_bytes)):
        if kept and c.step_time_s > kept[0].step_time_s * SLOWEST_LISTED:
            break
        if not kept or c.memory_bytes < kept[-1].memory_bytes * (1 - MEMORY_STEP):
            kept.append(c)
    return kept


def _kth_time(kept: list[Candidate], k: int) -> float:
    """No layout slower than this can be listed: the k-th candidate of the frontier so far, or
    failing that SLOWEST_LISTED times the fastest (inf before any fits)."""
    if len(kept) >= k:
        return kept[k - 1].step_time_s
    return kept[0].step_time_s * SLOWEST_LISTED if kept else math.inf


def model_summary(cfg: Config) -> str:
    """One line naming what is planned."""
    counts = param_counts(cfg.model)
    size = f"{counts.total / 1e9:.1f}B" if counts.total >= 1e9 else f"{counts.total / 1e6:.1f}M"
    hw = cfg.hardware
    nodes = math.ceil(hw.num_gpus / hw.gpus_per_node)
    where = f"{hw.num_gpus} x {hw.gpu}" + (f" ({nodes} nodes of {hw.gpus_per_node})" if nodes > 1 else "")
    return (f"{cfg.model.preset or 'model'} ({size} parameters) on {where}, global batch "
            f"{cfg.training.global_batch_size} x {cfg.training.seq_len} tokens")
