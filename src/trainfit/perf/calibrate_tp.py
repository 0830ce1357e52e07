"""What tensor parallelism costs a rank's host beyond its compute and its collectives: DTensor's
Python dispatch (sharding propagation, to and from local tensors, redistribution) around the ops of
every tensor-parallel module. Run by trainfit.perf.calibrate_comms's ranks, all in one tp group;
imports torch.

A tiny Llama (TINY: its compute is a small part of its step) runs forward and backward on every
rank, plain, then under parallel/tensor_parallel.py's plan (with and without sequence parallelism),
at two depths. The tensor-parallel step's time, less the plain step's and less its collectives
(counted by DTensor's CommDebugMode, each at the time just measured for the smallest message), is
host work: per block from the difference of the depths, the rest (embedding, output projection,
vocabulary-parallel loss) the root's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode

from trainfit.config import load_config
from trainfit.models import build_model, materialize
from trainfit.parallel.tensor_parallel import apply_tensor_parallel, vocabulary_parallel_loss
from trainfit.perf.calibrate_probe import synchronized_median_seconds
from trainfit.train.loss import cross_entropy

TINY = ["--model.preset=", "--model.family=llama", "--model.dim=96", "--model.num_heads=12", "--model.num_kv_heads=12",
        "--model.ffn_dim=288", "--model.vocab_size=384", "--model.max_seq_len=24", "--training.seq_len=24"]
"""Heads, feed-forward, vocabulary and the sequence of 24 tokens (sequence parallelism shards it)
divisible by 2, 3 and 4 ranks."""
DEPTHS = (1, 3)
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def tensor_parallel_host_seconds(mesh: DeviceMesh, device: torch.device, smallest: dict[str, float], *,
                                 batch_s: float, repeats: int) -> dict[bool, tuple[float, float]]:
    """{sequence_parallel: (host seconds per block, the root's) of one forward and backward}, this
    rank's; `smallest`: seconds of one call of each collective kind at the smallest message size."""
    measured = {}
    for sequence_parallel in (False, True):
        host = []
        for layers in DEPTHS:
            plain, _ = _step(layers, None, sequence_parallel, device)
            parallel, collectives = _step(layers, mesh, sequence_parallel, device)
            seconds = [synchronized_median_seconds(step, device, batch_s=batch_s, repeats=repeats)
                       for step in (plain, parallel)]
            host.append(seconds[1] - seconds[0] - sum(n * smallest[kind] for kind, n in collectives.items()))
        block = max(0.0, (host[1] - host[0]) / (DEPTHS[1] - DEPTHS[0]))
        measured[sequence_parallel] = (block, max(0.0, host[0] - DEPTHS[0] * block))
    return measured


def _step(layers: int, mesh: DeviceMesh | None, sequence_parallel: bool, device: torch.device
          ) -> tuple[Callable[[], None], dict[str, int]]:
    """(one forward and backward of the tiny model, the collectives of one call by kind)."""
    cfg = load_config(None, [*TINY, f"--model.num_layers={layers}"])
    model = build_model(cfg.model)
    if mesh is not None:
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    model = materialize(model, device)
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.training.seq_len), generator=seeded).to(device)

    def step() -> None:
        with vocabulary_parallel_loss(mesh is not None):
            cross_entropy(model(tokens), tokens).backward()

    counter = CommDebugMode()
    with counter:
        step()
    counts = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op, n in counter.get_comm_counts().items():
        counts[next((kind for kind in COLLECTIVE_KINDS if kind in str(op)), "all_reduce")] += n
    return step, counts
