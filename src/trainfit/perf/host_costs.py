"""The host side of a training step on a GPU: what the CPU that drives it spends per block and micro-batch
(Python, the dispatcher, autograd, torch.amp, DTensor's sharding propagation and redistribution, FSDP2's
hooks, each kernel's launch), by engine. Torch-free.

A GPU's host queues kernels ahead of them, so its time is hidden while the device is busy and sets the
pace when it is not: a step takes the longer of the two (perf/timing.py: the host time beyond the device's
compute and exposed communication lengthens the step). The device's side shrinks with the micro-batch and
with tensor parallelism (each rank's GEMMs are 1/tp as large) while the host's does not, which is why
small micro-batches at high tp degrees run host-bound.

An engine's figures (`HostCosts`): forward and backward seconds per block and micro-batch by kind (plain
eager; under tensor parallelism with or without sequence parallelism, by the tp degree measured; FSDP2's
hooks on top), and the rest of the model's (embedding, final norm, head, loss) per micro-batch. A
checkpointed block runs its forward's host work again in backward; a compiled one (training.compile) only
launches its kernels. An engine with no figures (NO_ENGINE_HOST) costs its kernels' launches alone: the
time model's floor for every engine.

TRAINFIT is trainfit's own engine, measured by `python benchmarks/host_time.py` (a Llama with tiny tensors,
whose CPU kernels cost about what a CUDA launch does, on torch's fake backend; benchmarks/README.md has the
table, the machine and the date): one core of the development machine's AMD EPYC, torch 2.13. A GPU server's
host core may be faster or slower; `trainfit calibrate` on the GPU measures the parallel frameworks' part
itself (hardware_profile.HostOverhead), which then replaces these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainfit.parallel.layout import Layout

Kind = str
"""eager | tensor_parallel | sequence_parallel | fully_shard (FSDP2's hooks, on top of the others)."""


@dataclass(frozen=True)
class HostCosts:
    """One engine's host seconds per micro-batch (module docstring)."""

    name: str
    block_s: dict[tuple[Kind, int], tuple[float, float]] = field(default_factory=dict)
    """(kind, ranks) -> (forward, backward) seconds per block and micro-batch; a tp degree not measured
    takes the nearest measured one (by ratio)."""
    rest_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of the rest of the model per micro-batch, on the stage that has it."""
    boundary_s: dict[int, float] = field(default_factory=dict)
    """tp degree -> seconds per micro-batch a pipeline rank's host spends at its stage boundaries (sending
    and receiving activations and their gradients), nearest degree as for blocks; none measured for trainfit."""
    source: str = ""

    def block(self, layout: Layout) -> tuple[float, float]:
        """(forward, backward) host seconds of one block and micro-batch in `layout`."""
        kind = ("sequence_parallel" if layout.sequence_parallel else "tensor_parallel") if layout.tp > 1 else "eager"
        # a compiled block runs as one graph: its host work is its kernels' launches (perf/kernels.py), not
        # the eager dispatch of each op; FSDP2's hooks around it still run eagerly
        forward, backward = (0.0, 0.0) if layout.compile else self._nearest(kind, layout.tp)
        if layout.data_parallel == "fsdp":
            extra = self._nearest("fully_shard", max(2, layout.zero_shards))
            forward, backward = forward + extra[0], backward + extra[1]
        return forward, backward

    def _nearest(self, kind: Kind, ranks: int) -> tuple[float, float]:
        measured = [(r, s) for (k, r), s in self.block_s.items() if k == kind]
        if not measured:
            return 0.0, 0.0
        return min(measured, key=lambda rs: abs(math.log(rs[0] / ranks)))[1]

    def step_seconds(self, layout: Layout) -> float:
        """The busiest rank's host seconds per optimizer step: its blocks (a checkpointed one's forward
        twice) and, on the stage with the head, the rest, every micro-batch."""
        forward, backward = self.block(layout)
        rerun = forward if layout.activation_checkpointing != "none" else 0.0

        def rank(layers: int, wrapped: int, last_stage: bool) -> float:
            return layers * (forward + backward) + wrapped * rerun + last_stage * sum(self.rest_s)

        boundary = min(self.boundary_s.items(), key=lambda ts: abs(math.log(ts[0] / layout.tp)))[1] \
            if self.boundary_s and layout.pp > 1 else 0.0
        return (max(rank(*shape) for shape in layout.rank_shapes()) + boundary) * layout.num_microbatches


TRAINFIT = HostCosts(
    "trainfit",
    block_s={
        ("eager", 1): (0.27e-3, 0.66e-3),
        ("tensor_parallel", 2): (1.8e-3, 3.7e-3),
        ("tensor_parallel", 8): (2.2e-3, 3.7e-3),
        ("sequence_parallel", 2): (3.3e-3, 7.4e-3),
        ("sequence_parallel", 8): (3.5e-3, 8.5e-3),
        ("fully_shard", 8): (1.3e-3, 2.6e-3),
    },
    rest_s=(0.69e-3, 0.0),
    source="benchmarks/host_time.py, 2026-12-03: the mean of two runs on one AMD EPYC core, torch 2.13",
)
"""trainfit's engine (module docstring)."""

NO_ENGINE_HOST = HostCosts("launches only", source="an engine whose host side is its kernels' launches")
"""For engines whose layers dispatch no per-op framework code (Megatron-Core's and Transformer Engine's
modules call their kernels and NCCL directly): benchmarks/published_parallel.py prices their rows with it."""
