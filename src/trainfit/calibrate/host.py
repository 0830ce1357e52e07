"""What the parallel frameworks cost a rank's host beyond its compute and its collectives: DTensor's
Python dispatch (sharding propagation, to and from local tensors, redistribution) around the ops of
every tensor-parallel module, and FSDP2's hooks around every fully_shard unit (unsharding and
resharding, copying into and out of the collectives' buffers, gradient bookkeeping). Run by
trainfit.calibrate.comms's ranks, all in one group; imports torch.

A tiny Llama (TINY: its compute, and its messages, a small part of its step) runs forward and
backward on one rank plain, then on every rank parallelized as training parallelizes it
(train/parallelize.py: tensor parallelism with and without sequence parallelism, ZeRO-3's fully_shard
per block and at the root), at two depths. The parallel step's time, less the plain step's and less its
collectives (counted at the dispatcher by DTensor's CommDebugMode, each at the time just measured
for the smallest message), is host work: per block from the difference of the depths, the rest
(embedding, output projection, loss) the root's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from trainfit.calibrate.probe import synchronized_median_seconds
from trainfit.configure import load_config
from trainfit.hardware_profile import HOST_KINDS
from trainfit.models import build_model, materialize
from trainfit.parallel.mesh import build_mesh
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.tensor_parallel import vocabulary_parallel_loss
from trainfit.precision import precision_policy
from trainfit.train.parallelize import parallelize

TINY = ["--model.preset=", "--model.family=llama", "--model.dim=48", "--model.num_heads=12", "--model.num_kv_heads=12",
        "--model.ffn_dim=96", "--model.vocab_size=384", "--model.max_seq_len=24", "--training.seq_len=24",
        "--training.micro_batch_size=1", "--precision.mode=fp32"]
"""Heads, feed-forward, vocabulary and the sequence of 24 tokens (sequence parallelism shards it)
divisible by 2, 3 and 4 ranks; a block's parameters ~92 KB, its messages near the smallest measured."""
DEPTHS = (1, 4)
BATCHES = 3
"""Each timed batch lasts BATCHES x calibrate's batch_s: a step takes tens of milliseconds, and what
is kept is the difference of two steps."""
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def host_overhead_seconds(world_size: int, device: torch.device, smallest: dict[str, float], *,
                          batch_s: float, repeats: int) -> dict[str, tuple[float, float]]:
    """{kind (HOST_KINDS): (host seconds per block, the root's) of one forward and backward}, the
    slowest rank's, on the default process group's `world_size` ranks; `smallest`: seconds of one
    call of each collective kind at the smallest message."""
    def seconds(step: Callable[[], None]) -> float:
        return synchronized_median_seconds(step, device, batch_s=BATCHES * batch_s, repeats=repeats)

    plain = {layers: seconds(_step(layers, 1, [], device)[0]) for layers in DEPTHS}  # one per depth, for every kind
    measured = {}
    for kind in HOST_KINDS:
        host = []
        for layers in DEPTHS:
            parallel, collectives = _step(layers, world_size, _settings(kind, world_size), device)
            host.append(seconds(parallel) - plain[layers] - sum(n * smallest[c] for c, n in collectives.items()))
        block = max(0.0, (host[1] - host[0]) / (DEPTHS[1] - DEPTHS[0]))
        measured[kind] = (block, max(0.0, host[0] - DEPTHS[0] * block))
    return measured


def _settings(kind: str, world_size: int) -> list[str]:
    """The parallel settings of a HOST_KINDS kind over all the ranks."""
    if kind == "fully_shard":
        return ["--parallel.zero_stage=3"]
    return [f"--parallel.tp={world_size}", f"--parallel.sequence_parallel={str(kind == 'sequence_parallel').lower()}"]


def _step(layers: int, world_size: int, framework: list[str], device: torch.device
          ) -> tuple[Callable[[], None], dict[str, int]]:
    """(one forward and backward of the tiny model on `world_size` ranks, parallelized as training
    parallelizes it; the collectives of one call by kind)."""
    cfg = load_config(None, [*TINY, f"--model.num_layers={layers}", f"--hardware.num_gpus={world_size}",
                             f"--training.global_batch_size={world_size}", *framework])
    layout = build_layout(cfg)
    mesh = build_mesh(layout, device.type) if world_size > 1 else None
    model = parallelize(build_model(cfg.model), layout, mesh, precision_policy("fp32", device.type))
    model = materialize(model, device)
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.training.seq_len), generator=seeded).to(device)

    def step() -> None:
        with vocabulary_parallel_loss(layout.tp > 1):
            F.cross_entropy(model(tokens).flatten(0, -2), tokens.flatten()).backward()

    counter = CommDebugMode()
    with counter:
        step()
    counts = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op, n in counter.get_comm_counts().items():  # functional (all_gather_into_tensor) or c10d (_allgather_base_)
        name = str(op).replace("_", "")
        counts[next((c for c in COLLECTIVE_KINDS if c.replace("_", "") in name), "all_reduce")] += n
    return step, counts
