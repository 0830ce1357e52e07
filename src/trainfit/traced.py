"""Traced memory estimate: trainfit's own training step, executed on fake tensors in a fake world.

`trace_step(cfg)` builds the model as `Trainer` does (meta device, the precision policy's dtype,
the real `train.parallelize.parallelize`: activation checkpointing, DDP / FSDP2; ZeRO-1's engine as
the trainer's optimizer, its buffers and master shards fake tensors too), on torch's
built-in "fake" process group of the layout's world size as rank 0, materializes it under
`FakeTensorMode` (shapes and dtypes, no data: no weight memory whatever the model size, ties kept
by the model's own init), builds the trainer's optimizer, LR schedule and loss scaler, creates the
optimizer states (one optimizer step on zero gradients) and traces the trainer's step itself
(train/step.TrainStep): forward + loss per micro-batch, backward, unscale / clip / optimizer step /
zero_grad.

The tracer is memory/traced/ledger.py's `StorageLedger`, which attributes every storage to a component.

Fake execution needs a few stand-ins, each at one place (here, or in the ledger's fake overrides):
Dropless MoE routing is data-dependent (`torch.nonzero`): `nonzero` returns a skewed routing, the
busiest expert at memory.moe_imbalance x the balanced load, third from last after two experts as
light as the others allow (models/routing.dropless_loads says why that is the worst place). Every
expert's tensors scale with its rows and all are alive together at the end of the forward, so
saved activations are exact whatever the real split; the transients of the experts' backward are
those of the worst split at that imbalance. Under expert parallelism the dispatch reads its routing
to size its all-to-alls (parallel/expert.py's Routes): traced as the busiest rank of its group,
receiving routing.expert_parallel_loads' rows. With a capacity factor the experts' shapes are fixed
by the config and nothing is stood in for. `.item()` reads 1 (an fp16 loss scaler never skips the
traced step). DDP's construction-time shape check and broadcast, and its C++ all-reduce hook, read
tensor data: skipped and replaced by an in-place hook. DTensor's output-shape propagation on
global-size fakes is not counted. Gradient accumulation traces two micro-batches at most: later
ones repeat the second's memory.

Pipeline parallelism: every pipeline rank is traced (as the first rank of its stage group; under a
fill-drain schedule, GPipe, ranks holding alike stages once: `_trace_key`), its
stages run by torch's own schedule over all the step's micro-batches, in the schedule's order, on
the fake world: the stages take static metadata (pipeline.StageBoundary) and the schedule's
metadata vote is skipped (_run_unvoted), and the schedules' point-to-point Works hold their tensors
as gloo's and NCCL's do (_works_hold_tensors: the fake world's hold nothing). A whole step runs
before the traced one, so the receive buffers torch allocates at the first step and keeps are
there, as in a trained step.

Fidelity limits: a CPU build runs the CPU kernels' output shapes, torch.amp's CPU autocast op list
and CPU fused attention; CUDA's caching-allocator rounding and fragmentation are not modelled
(analytic.py's reserved_margin is). On CPU, traced peaks land within 3% of measured ones (the bound
tests/estimator/test_accuracy.py holds them to), usually a little below: the allocator also holds
autograd's graph objects and tensor headers, which no storage accounts for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainfit.config import Config
from trainfit.hardware import device_spec, device_type
from trainfit.memory import CUDA_CONTEXT_BYTES, MemoryBreakdown
from trainfit.memory.traced import CachingAllocator, StorageLedger, TimelinePoint, phase_listener, unsharded_component
from trainfit.models import materialize
from trainfit.models.moe import GroupedExperts
from trainfit.models.routing import dropless_loads, expert_parallel_loads
from trainfit.models.softcapped_attention import traced_as
from trainfit.parallel.data_parallel import init_optimizer_states, local_state_bytes
from trainfit.parallel.expert import Routes
from trainfit.parallel.layout import Layout
from trainfit.parallel.mesh import build_mesh
from trainfit.parallel.pipeline import PipelineStep
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.schedules import SCHEDULES
from trainfit.parallel.stage_split import checkpointed
from trainfit.train.build import build_parallel_model, run_precision
from trainfit.train.distributed import World, trainable
from trainfit.train.step import TrainStep


@dataclass
class TracedEstimate:
    per_stage: list[MemoryBreakdown]
    """One breakdown per pipeline rank (one without pipeline parallelism): the figures of the first
    rank of its stage group (rank 0's without pipeline parallelism)."""
    worst_stage: int
    timeline: list[TimelinePoint]
    """In-use bytes after every operator of the traced step."""
    peak_module: str
    """The innermost module running at the peak ("loss", "optimizer" outside the model)."""
    seconds: float
    """Wall time of trace_step."""
    peak_rss_bytes: int
    """Peak resident memory of this process so far (getrusage: a lifetime maximum)."""
    num_ops: int = 0
    """Operators traced in the step."""
    state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rank 0's model-state bytes once the optimizer is about to step, counted from the traced
    trainer's tensors as a measured step counts its own (data_parallel.local_state_bytes)."""

    @property
    def worst(self) -> MemoryBreakdown:
        return self.per_stage[self.worst_stage]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: per_stage as the breakdowns' dicts, the timeline as lists."""
        out = dataclasses.asdict(self)
        out["timeline"] = [list(point) for point in self.timeline]
        return out


# ---------------------------------------------------------------- the fake world


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank `rank` of `world_size` ranks on torch's "fake" backend (collectives
    return at once, moving nothing); destroyed on exit, so tracing can run again in the same process."""
    if dist.is_initialized():
        raise RuntimeError("trace_step needs a process without a default process group (it creates a fake one "
                           "of hardware.num_gpus ranks); run `trainfit estimate --traced` outside torchrun")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=_fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's native sharding cache keys on mesh *shape*: a later trace whose meshes look the
        # same would be handed this world's, whose process groups are gone ("Could not resolve the
        # process group registered under the name 3"). Private (an API move breaks this line).
        torch._C._clear_DTensor_sharding_propagator_cache()


@contextlib.contextmanager
def _ddp_without_init_sync() -> Iterator[None]:
    """DDP's constructor checks every rank's parameter shapes and broadcasts rank 0's values, in C++
    that reads tensor data, which fake tensors do not have; in a fake world both are no-ops anyway.
    Private names of torch.nn.parallel.distributed (an API move breaks this one function)."""
    import torch.nn.parallel.distributed as ddp

    saved = ddp._verify_param_shape_across_processes, ddp._sync_module_states
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    ddp._sync_module_states = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes, ddp._sync_module_states = saved


def _fake_allreduce_hook(state, bucket):  # no annotations: DDP compares them with dist.GradBucket at run time
    """DDP communication hook for the fake world: the fake process group's work carries no result
    for DDP's C++ hook to read; an all-reduce is in place on the bucket, so return it as is."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _fake_store() -> dist.Store:
    # Private: torch ships the fake backend's store only in its testing package (importing it
    # also registers the backend). An API move breaks this one function.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class _FakeBatches:
    """The sampler's interface, yielding int64 (inputs, targets) of the configured shape, and the document
    ids of packed rows (Layout.rows) when the run packs samples."""

    def __init__(self, micro_batch_size: int, seq_len: int, packed: bool = False) -> None:
        self.shape, self.packed = (micro_batch_size, seq_len), packed

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(self.shape, dtype=torch.long) for _ in range(3 if self.packed else 2))


class _FakeSampleBatches(_FakeBatches):
    """...of fine-tuning samples (Layout.rows): their targets are masked, so the step's loss is the masked
    mean (train/step.py), whose trained rows the chunked loss takes at the samples' share (train/loss.py)."""

    def step_trained_tokens(self) -> int:
        return self.shape[0] * self.shape[1]


class _TakenStepScaler:
    """The fp16 loss scaler, except that it always steps: fake values cannot say whether gradients
    overflowed, so the trace is of the step that is taken. Everything else is the real scaler."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self._scaler = scaler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scaler, name)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)


class _TracedStep(TrainStep):
    """The trainer's own step (train/step.py) around a model built here; only the loss scaler is
    wrapped (build_grad_scaler), so the traced step is the trained one."""

    def build_grad_scaler(self) -> Any:
        scaler = super().build_grad_scaler()
        return _TakenStepScaler(scaler) if scaler.is_enabled() else scaler


def _modeled_expert_routes(model: torch.nn.Module, cfg: Config, layout: Layout) -> None:
    """Dropless expert parallelism: each dispatch's Routes, which read the routing's values, become
    the busiest rank's (routing.expert_parallel_loads; shapes only, all from and to itself: the fake
    all-to-alls move nothing)."""
    m = cfg.model
    pairs = layout.micro_batch_size * cfg.training.seq_len // layout.cp * m.experts_per_token
    loads = expert_parallel_loads(pairs // m.experts_per_token, m.experts_per_token, m.num_experts, layout.ep,
                                  layout.moe_imbalance)
    others = [0] * (layout.ep - 1)

    def routes(expert_NK: torch.Tensor, num_experts: int) -> Routes:
        received = sum(loads)
        return Routes(torch.arange(pairs), [pairs, *others], [received, *others], loads, torch.arange(received))

    for module in model.modules():
        if isinstance(module, GroupedExperts) and module.dispatch is not None:
            module.dispatch.routes = routes


def _allocate_unsharded_parameters(model: torch.nn.Module) -> None:
    """Unshard and reshard every FSDP2 unit once, as a trained step's previous one did. A group of one
    rank (expert parallelism's experts when ep covers every shard rank) creates its unsharded copy
    at its first unshard with torch.empty, where the ledger would see an activation; from then on
    FSDP2 reallocates it by resizing the storage, which the ledger attributes to the parameters."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def _two_micro_batches_at_most(layout: Layout) -> Layout:
    """Gradient accumulation: every micro-batch after the first runs with the gradients already
    allocated, so the second is the last one memory can tell apart (it also syncs gradients)."""
    if layout.grad_accum_steps <= 2:
        return layout
    return dataclasses.replace(layout, grad_accum_steps=2, num_microbatches=2)


def _create_optimizer_states(step: TrainStep) -> None:
    """The warm-up: one optimizer step on zero gradients creates the states an optimizer makes
    lazily (data_parallel.init_optimizer_states). Not a whole train_step: DDP rebuilds its buckets
    at the second iteration's forward, broadcasting bucket indices from a tensor's data, which fake
    tensors do not have; its first iteration allocates the same buckets."""
    init_optimizer_states(step.model, step.optimizer)


def _state_counter(step: TrainStep, out: dict[str, int]) -> Any:
    """A step listener filling `out` with the model states at the 'update' moment, as a measured
    step counts them (memory/measured/attribution.py)."""

    def listen(moment: str) -> None:
        if moment == "update":
            out.update(local_state_bytes(step.model, step.optimizer))

    return listen


class _HoldingWork:
    """A fake-world Work that keeps its operation's tensor alive as long as it lives, as gloo's and
    NCCL's do (the fake process group's Work holds nothing): the schedules keep their send Works
    (the multi-stage ones until the step ends), and with them every tensor sent."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self._work, self._tensor = work, tensor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def _works_hold_tensors() -> Iterator[None]:
    """Within the block, the pipeline schedules' point-to-point Works hold their tensors. Private:
    torch.distributed.pipelining.schedules._batch_p2p (an API move breaks this one function)."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
        works = original(ops, desc)
        if len(works) != len(ops):  # coalesced (a mixed batch): one Work for every op
            return [_HoldingWork(work, [op.tensor for op in ops]) for work in works]
        return [_HoldingWork(work, op.tensor) for work, op in zip(works, ops, strict=True)]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextlib.contextmanager
def _eight_bit_update_as_compiled(active: bool, device_type: str) -> Iterator[None]:
    """torchao's AdamW8bit (optimizer.name=adamw-8bit) runs each parameter's update through
    `torch.compile(single_param_adam, fullgraph=True)`, which cannot run on fake tensors, and whose
    eager form would allocate a dozen temporaries (int64 codes of its binary search among them) the
    compiled kernel never does. Within the block torch.compile runs eagerly
    (torch.compiler.set_stance("force_eager")) and the update is a stand-in allocating what the
    compiled kernel holds at the allocator (torch 2.13 + torchao 0.18, read from inductor's generated
    code, TORCH_LOGS=output_code): for a parameter with 8-bit states, two fp32 buffers of its (local)
    shape and two of one value per block, alive while the kernel runs; for plain states nothing. On
    CPU the kernel is one call whose buffers no operator boundary sees (a measured CPU step cannot,
    memory/measured/measure.py), so the stand-in holds them for a CUDA target only (`device_type`), where
    max_memory_allocated counts them (CUDA's triton kernel assumed to hold what the CPU one does).
    Values are not computed: fake tensors have none. Private: torchao.optim.adam.single_param_adam
    (an API move breaks this one function). Inactive (another optimizer) it does nothing."""
    if not active:
        yield
        return
    from torchao.optim import adam
    from torchao.optim.subclass_8bit import OptimState8bit

    def compiled_allocations(p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, exp_avg: torch.Tensor,
                             *args: Any) -> None:
        state = exp_avg.to_local() if isinstance(exp_avg, DTensor) else exp_avg
        if device_type == "cuda" and isinstance(state, OptimState8bit):
            held = [torch.empty(shape, dtype=torch.float32) for shape in (state.shape, state.shape,
                                                                         state.scale.shape, state.scale.shape)]
            del held

    original = adam.single_param_adam
    adam.single_param_adam = compiled_allocations
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        adam.single_param_adam = original


def _run_unvoted(pipeline: PipelineStep) -> None:
    """Torch's schedule starts with a vote over the pipeline's ranks on whether every stage's
    metadata is static (p2p of a tensor, which the fake world leaves at zero: "dynamic", then a
    metadata exchange it cannot do). The trainer gives every stage static metadata
    (pipeline.StageBoundary), which is the vote's result in a real world; set it and skip the vote.
    Private attributes of torch.distributed.pipelining (an API move breaks this one function)."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in pipeline.stages:
        stage._inference_mode = InferenceMode.STATIC
    pipeline.schedule._warmup_p2p = lambda *args, **kwargs: None


def _target_device_type(cfg: Config) -> str:
    """The device the traced run stands for (it executes on fake CPU tensors either way)."""
    return device_type(cfg.hardware)


# ---------------------------------------------------------------- entry point


def trace_step(cfg: Config, layout: Layout | None = None) -> TracedEstimate:
    """Trace one training step of `cfg` (validated) on `layout` (default: its own on
    hardware.num_gpus ranks) as rank 0 of its world, and under pipeline parallelism as the first
    rank of every pipeline stage (of every distinct one: `_trace_key`); see the module docstring.

    training.compile: the eager step is traced. Dynamo under FakeTensorMode and the fake process
    group crashed the process (segmentation fault, torch 2.13 CPU), and a compiled graph's fused
    kernels allocate outside the dispatcher, where the ledger cannot see them. Compiled blocks
    save fewer activations than eager ones: benchmarks/compile.py measures by how much (the
    trace is that much above a compiled step's peak)."""
    start = time.perf_counter()
    layout = trainable(dataclasses.replace(layout or build_layout(cfg), compile=False))
    ranks_per_stage = layout.world_size // layout.pp  # pp is the mesh's outermost axis (layout.AXES)
    # The first rank of a key is the one traced, so the worst rank (the first with the highest
    # peak) has its own timeline and peak module.
    traced: dict[tuple[Any, ...], _RankTrace] = {}
    traces = []
    for pp_rank in range(layout.pp):
        key = _trace_key(layout, pp_rank)
        if key not in traced:
            traced[key] = _trace_rank(cfg, layout, pp_rank * ranks_per_stage)
        traces.append(traced[key])
    worst = max(range(len(traces)), key=lambda i: traces[i].breakdown.peak)
    at = traces[worst]
    return TracedEstimate(per_stage=[trace.breakdown for trace in traces], worst_stage=worst, timeline=at.timeline,
                          peak_module=at.peak_module, seconds=time.perf_counter() - start,
                          peak_rss_bytes=peak_rss_bytes(), num_ops=sum(trace.num_ops for trace in traces),
                          state_bytes=traces[0].state_bytes)


def _trace_key(layout: Layout, pp_rank: int) -> tuple[Any, ...]:
    """What pipeline rank `pp_rank`'s trace depends on: ranks of one key allocate alike, byte for
    byte, and only the first of them is traced. Under a fill-drain schedule: whether it runs the
    first or the last stage (embedding, head, loss, which neighbours it exchanges with) and, block
    after block, whether activation checkpointing wraps it (blocks are otherwise alike: one config,
    one tensor-parallel plan, one FSDP unit each). Under other schedules the rank itself.

    Not traced, a rank warms none of torch's caches for the next: a later rank's timeline can then
    hold an extra `.device` query (an operator that allocates nothing, the same bytes on either
    side), so a timeline and `num_ops` are exact to such operators, the figures to the byte."""
    if not SCHEDULES[layout.pp_schedule].fill_drain:
        return ("rank", pp_rank)
    placement = layout.rank_placement(pp_rank)
    return (placement.first, placement.last,
            tuple(checkpointed(block, layout.ac_every_n_layers) for block in placement.blocks))


@dataclass
class _RankTrace:
    breakdown: MemoryBreakdown
    timeline: list[TimelinePoint]
    peak_module: str
    num_ops: int
    state_bytes: dict[str, int]


def _trace_rank(cfg: Config, layout: Layout, rank: int) -> _RankTrace:
    """One step of global rank `rank`, traced."""
    pipelined = layout.pp > 1
    if not pipelined:
        layout = _two_micro_batches_at_most(layout)
    policy = run_precision(layout, "cpu")
    grouped = layout.needs_process_group
    world_cm = fake_process_group(layout.world_size, rank) if grouped else contextlib.nullcontext()
    rows, seq_len = layout.micro_batch_size, cfg.training.seq_len
    with world_cm, warnings.catch_warnings():
        # Initialising sharded parameters on a CPU mesh warns that DTensor's RNG is incomplete there:
        # values do not matter here.
        warnings.filterwarnings("ignore", message="DTensor random operators")
        world = World(device=torch.device("cpu"), rank=rank, size=layout.world_size, layout=layout)
        if grouped:  # the mesh outside FakeTensorMode: DTensor and FSDP2 read real device tensors there
            world.attach_mesh(build_mesh(layout, "cpu"))
        mesh = world.mesh
        built = build_parallel_model(cfg, layout, mesh, policy)  # the trainer's own build
        model = built.model
        if layout.ep > 1 and not cfg.model.capacity_factor:
            _modeled_expert_routes(model, cfg, layout)
        if hasattr(model, "register_comm_hook"):  # DDP (replicate), zero_stage 0 and 1
            model.register_comm_hook(None, _fake_allreduce_hook)
        eight_bit = _eight_bit_update_as_compiled(cfg.optimizer.name == "adamw-8bit", _target_device_type(cfg))
        allocator = (CachingAllocator(capacity=device_spec(cfg.hardware).memory_bytes - CUDA_CONTEXT_BYTES)
                     if _target_device_type(cfg) == "cuda" else None)
        with _ddp_without_init_sync(), _works_hold_tensors(), eight_bit, traced_as(_target_device_type(cfg)), \
                FakeTensorMode(allow_non_fake_inputs=True), \
                StorageLedger(fake=True, unsharded_component=unsharded_component(layout),
                              host_states=layout.offload != "none", allocator=allocator) as ledger:
            if cfg.model.num_experts and not cfg.model.capacity_factor:
                tokens = rows * seq_len // layout.cp
                ledger.route(dropless_loads(tokens, cfg.model.experts_per_token, cfg.model.num_experts,
                                            layout.moe_imbalance))
            materialize(model, "cpu")
            batches = (_FakeBatches if layout.rows is None else _FakeSampleBatches)(
                rows, seq_len, layout.rows is not None and layout.rows.packed)
            step = _TracedStep(cfg, layout, world, policy, model, batches,
                               optimizer_device_type=_target_device_type(cfg))
            ledger.watch_model(model, split_backward=layout.splits_backward)
            ledger.grad_hooks(list(model.parameters()))
            if step.pipeline is not None:
                _run_unvoted(step.pipeline)
                # A whole step first: the stages' receive buffers, which torch allocates at the
                # schedule's first step and keeps, exist before the traced one, as in a trained step.
                step()
            else:
                _create_optimizer_states(step)
                _allocate_unsharded_parameters(model)
            state_bytes: dict[str, int] = {}
            with step.listening(phase_listener(ledger, step)), step.listening(_state_counter(step, state_bytes)):
                ledger.classify(model, step.optimizer, policy, others="buffers")
                ledger.reset_peak()
                step()
            ledger.recording = ledger.in_loss = False
            ledger.classify(model, step.optimizer, policy)
            breakdown = ledger.breakdown()
            if allocator is not None:  # the caching allocator replayed: what it cannot give back, what it reserves
                breakdown = dataclasses.replace(breakdown, reserved_peak=allocator.peak_reserved, margin_terms={
                    "allocator_fragmentation": max(0, allocator.peak_held - breakdown.peak)})
            trace = _RankTrace(breakdown, ledger.timeline, ledger.peak_module, ledger.op, state_bytes)
            del step, model
    return trace


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
