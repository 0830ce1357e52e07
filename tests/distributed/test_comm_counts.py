"""perf/comms.py's model-parallel collectives against one real training step on gloo ranks: the calls
and bytes of every tensor-, context- and expert-parallel collective torch's CommDebugMode sees the
Trainer issue, per kind, equal what comms.step_collectives predicts for purposes "tp", "cp" and "ep".
Expert parallelism's dropless all-to-alls are the routing's: a rank sends exactly its (token, choice)
pairs in the dispatch and in the combine's backward, but the combine and the dispatch's backward send
what it received; those are compared as calls per rank and bytes summed over the expert group.

What is compared, by a named rule: the functional collectives (torch.ops._c10d_functional: DTensor's
and context_parallel.py's) over the ranks of the mesh's tp and cp axes issued inside
TrainStep.forward_backward (forward, loss, backward). Left out, so, and not modelled in comms.py: what
runs after the last backward (the logged loss's all-reduce, clipping's gradient-norm all-reduces and,
without data parallelism, the sequence-parallel gains' partial gradients, which DTensor all-reduces at
each use); left out as comms' other purposes: DDP's and FSDP2's collectives, c10d ops (DDP's may run on
the very process group of cp: with dp_shard 1 the data-parallel mesh is the cp axis).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten

from _dist import FourRankGlooTestCase, GlooTestCase, with_comms
from _runs import run_config
from trainfit.models.moe import GroupedExperts
from trainfit.perf import comms
from trainfit.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEP = ("--training.seq_len=64", "--training.micro_batch_size=2", "--training.global_batch_size=2")
"""One micro-batch of 2 rows of 64 tokens per data-parallel rank (debug model: 2 layers, dim 64)."""
EP2 = ("--model.preset=debug-moe", "--parallel.ep=2", "--parallel.zero_stage=3", "--training.global_batch_size=0")
"""Expert parallelism on every rank's own micro-batch (the global batch derived: 2 rows per rank)."""
POLICIES = ("none", "selective", "selective-alternate", "full")
MODEL_PARALLEL = ("tp", "cp", "ep")
Tally = Counter[tuple[str, str, int]]
"""Calls by (purpose, kind, bytes of one call as comms defines them)."""


class CollectiveLog(CommDebugMode):
    """CommDebugMode (it counts calls, not bytes) that also notes every collective it counts: its kind,
    bytes (comms' convention: an all-gather's gathered output, a reduce-scatter's input, an
    all-reduce's buffer), process group's ranks, and whether `inside` was set then. Built on
    CommDebugMode, not a plain dispatch mode: it lets DTensor expand its ops first, so it also sees the
    collectives DTensor issues inside an op (loss_parallel's cross-entropy), which a plain mode misses."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.seen: list[tuple[bool, str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            self.seen.append((self.inside, *_describe(func, args, kwargs or {})))
        return out


def _describe(func: Any, args: tuple, kwargs: dict) -> tuple[str, tuple[int, ...], int]:
    """(kind, ranks of the process group, bytes) of one collective call. A c10d op (not functional:
    DDP, FSDP2, the logged loss; never compared) is kind "c10d.<op>", its bytes those of all its tensors."""
    bound = {**dict(zip([a.name for a in func._schema.arguments], args, strict=False)), **kwargs}
    name = func._schema.name.split("::")[-1]
    if "group_name" not in bound:
        group = dist.ProcessGroup.unbox(bound["process_group"])
        nbytes = sum(t.nbytes for t in tree_flatten(bound)[0] if isinstance(t, torch.Tensor))
        return f"c10d.{name}", tuple(dist.get_process_group_ranks(group)), nbytes
    ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(bound["group_name"])))
    nbytes = bound["input"].nbytes
    if name == "all_gather_into_tensor":
        return "all_gather", ranks, nbytes * bound["group_size"]
    kinds = {"reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}
    return kinds.get(name, name), ranks, nbytes


def counted_step(trainer: Trainer) -> Tally:
    """One train step under a CollectiveLog; the model-parallel collectives of its forward_backward.
    Groups are told apart by their ranks, not their names: DTensor's sharding cache compares meshes
    by value, so a later Trainer in the process may run its collectives on an earlier one's groups."""
    log = CollectiveLog()
    forward_backward = trainer.stepper.forward_backward

    def inside(*args: Any, **kwargs: Any) -> torch.Tensor:
        log.inside = True
        try:
            return forward_backward(*args, **kwargs)
        finally:
            log.inside = False

    trainer.stepper.forward_backward = inside
    with log:
        trainer.train_step()
    mesh = trainer.world.mesh
    axes = {tuple(dist.get_process_group_ranks(mesh[a].get_group())): a
            for a in MODEL_PARALLEL if a in (mesh.mesh_dim_names or ())}
    axes.update({tuple(dist.get_process_group_ranks(m.dispatch.group)): "ep" for m in trainer.model.modules()
                 if isinstance(m, GroupedExperts) and m.dispatch is not None})
    tally: Tally = Counter((axes[ranks], kind, nbytes) for inside_, kind, ranks, nbytes in log.seen
                           if inside_ and ranks in axes and not kind.startswith("c10d."))
    return tally


def predicted(trainer: Trainer) -> Tally:
    """What comms.step_collectives says this trainer's forward_backward issues for tp and cp (not the
    step's own: without FSDP the gains' partial gradients are reduced where the step first reads them)."""
    cfg = trainer.cfg
    tally: Tally = Counter()
    for c in comms.step_collectives(cfg.model, trainer.layout, cfg.training):
        if c.purpose in MODEL_PARALLEL and c.phase != "step":
            tally[c.purpose, c.kind, c.nbytes] += c.count
    return tally


def by_kind(tally: Tally) -> dict[tuple[str, str], tuple[int, int]]:
    """(calls, bytes) per (purpose, kind): the assertion message's summary."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for (purpose, kind, nbytes), calls in sorted(tally.items()):
        before = out.get((purpose, kind), (0, 0))
        out[purpose, kind] = (before[0] + calls, before[1] + calls * nbytes)
    return out


class CommCounts(GlooTestCase):
    def check(self, overrides: tuple[str, ...]) -> None:
        name = "_".join(o.split(".")[-1] for o in overrides).replace("=", "-")
        trainer = Trainer(run_config(self.shared_dir / name, *STEP, *overrides))
        try:
            counted = counted_step(trainer)
            expected = predicted(trainer)
        finally:
            trainer.close()
        self.assertTrue(counted)
        self.assertEqual(counted, expected, f"{overrides}: counted {by_kind(counted)}, predicted {by_kind(expected)}")

    def run_cases(self, cases: list[tuple[str, ...]]) -> None:
        self.run_subtests({"overrides": cases}, self.check)

    def check_expert(self, overrides: tuple[str, ...]) -> None:
        """Capacity: as check. Dropless: the calls per rank, the counts' exchange, and the routed
        bytes summed over the expert group (the module docstring says why)."""
        if "--model.capacity_factor=0" not in overrides:
            return self.check(overrides)
        name = "_".join(o.split(".")[-1] for o in overrides).replace("=", "-")
        trainer = Trainer(run_config(self.shared_dir / name, *STEP, *overrides))
        try:
            counted, expected = counted_step(trainer), predicted(trainer)
        finally:
            trainer.close()
        said = f"{overrides}: counted {by_kind(counted)}, predicted {by_kind(expected)}"
        counts = trainer.cfg.model.num_experts * comms.COUNT_BYTES
        self.assertEqual(sum(counted.values()), sum(expected.values()), said)
        self.assertEqual(counted["ep", "all_to_all", counts], expected["ep", "all_to_all", counts], said)
        group_bytes = [0] * self.world_size
        dist.all_gather_object(group_bytes, by_kind(counted)["ep", "all_to_all"][1])
        self.assertEqual(sum(group_bytes), self.world_size * by_kind(expected)["ep", "all_to_all"][1], said)

    @with_comms
    def test_tensor_and_context_parallel(self) -> None:
        sp = "--parallel.sequence_parallel=true"
        cases = [(*layout, f"--memory.activation_checkpointing={policy}") for policy in POLICIES
                 for layout in (("--parallel.tp=2",), ("--parallel.tp=2", sp), ("--parallel.cp=2",))]
        self.run_cases(cases + [
            ("--parallel.tp=2", sp, "--model.preset=debug-moe", "--memory.activation_checkpointing=full"),
            ("--parallel.tp=2", sp, "--model.preset=debug-gpt2"),  # learned positions: gathered in backward
            ("--parallel.tp=2", sp, "--precision.mode=bf16-mixed"),  # autocast: the residual stream is fp32
            ("--parallel.cp=2", "--precision.mode=bf16-mixed"),
        ])


    @with_comms
    def test_expert_parallel(self) -> None:
        self.run_subtests({"overrides": [
            (*EP2, f"--model.capacity_factor={factor}", f"--memory.activation_checkpointing={policy}")
            for factor in (0, 1.0) for policy in ("none", "selective", "full")]}, self.check_expert)


@pytest.mark.slow  # 12-24 s on its own: 4 processes on 2 busy cores (the 2-rank class takes 10-15 s)
class FourRanks(CommCounts, FourRankGlooTestCase):
    @with_comms
    def test_tensor_and_context_parallel(self) -> None:
        # FSDP2 over the cp ranks: the gains' partial gradients are all-reduced in backward
        self.run_cases([("--parallel.tp=2", "--parallel.cp=2", "--parallel.sequence_parallel=true",
                         "--parallel.zero_stage=2", "--memory.activation_checkpointing=selective")])

    @with_comms
    def test_expert_parallel(self) -> None:  # ep2 x dp2: the expert groups {0, 1} and {2, 3}
        self.run_subtests({"overrides": [(*EP2, f"--model.capacity_factor={factor}") for factor in (0, 1.0)]},
                          self.check_expert)

