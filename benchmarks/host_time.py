"""trainfit's host time per block and micro-batch: what Python, the dispatcher, autograd, torch.amp, DTensor and
FSDP2's hooks cost the CPU that drives a GPU, measured where the kernels cost almost nothing.

A GPU's host runs ahead of its kernels, so this time is hidden while a block's kernels take longer, and it
sets the pace when they do not (small micro-batches, high tensor-parallel degrees; perf/host_costs.py says
how the time model uses it). It cannot be read off a GPU step, but it can be measured without one: a Llama
with tiny tensors (dim 64, 16 tokens; every CPU kernel a few microseconds, about what a CUDA launch costs)
runs forward and backward as training parallelizes it (train/parallelize.py), in one process, as rank 0 of
a world on torch's `fake` backend (collectives return at once: DTensor and FSDP2 run their real code, with
nothing to wait for). Per block from the difference of two depths; the rest of the model (embedding, head,
loss) from the shallower one. The meta device is no substitute: its ops run torch's Python reference
decompositions, several times slower than any real dispatch.

    python benchmarks/host_time.py                 # the table, and the figures as perf/host_costs.py holds them
    python benchmarks/host_time.py --repeats 31

Run it on an idle machine: the medians are of single steps, and another process's time lands in them.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainfit.configure import load_config
from trainfit.models import build_model, materialize
from trainfit.parallel.mesh import build_mesh
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.tensor_parallel import vocabulary_parallel_loss
from trainfit.precision import precision_policy
from trainfit.tables import print_table
from trainfit.train.parallelize import parallelize

TINY = ["--model.preset=", "--model.family=llama", "--model.dim=64", "--model.num_heads=8", "--model.num_kv_heads=8",
        "--model.ffn_dim=128", "--model.vocab_size=256", "--model.max_seq_len=16", "--training.seq_len=16",
        "--training.micro_batch_size=1", "--precision.mode=bf16-mixed"]
DEPTHS = (2, 10)
CASES = {  # kind as perf/host_costs.py names it -> (ranks, parallel settings)
    ("eager", 1): [],
    ("tensor_parallel", 2): ["--parallel.tp=2"],
    ("tensor_parallel", 8): ["--parallel.tp=8"],
    ("sequence_parallel", 2): ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
    ("sequence_parallel", 8): ["--parallel.tp=8", "--parallel.sequence_parallel=true"],
    ("fully_shard", 8): ["--parallel.zero_stage=3"],
}


def _calls(layers: int, ranks: int, settings: list[str]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(a forward, a forward and backward) of the tiny model with `layers` blocks, parallelized."""
    cfg = load_config(None, [*TINY, f"--model.num_layers={layers}", f"--hardware.num_gpus={ranks}",
                             f"--training.global_batch_size={ranks}", *settings])
    layout = build_layout(cfg)
    mesh = build_mesh(layout, "cpu") if ranks > 1 else None
    model = materialize(parallelize(build_model(cfg.model), layout, mesh, precision_policy("bf16-mixed", "cpu")),
                        torch.device("cpu"))
    tokens = torch.zeros(1, cfg.training.seq_len, dtype=torch.long)

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, -2).float(), tokens.flatten())

    def forward() -> None:
        with vocabulary_parallel_loss(layout.tp > 1), torch.no_grad():
            loss()

    def step() -> None:
        with vocabulary_parallel_loss(layout.tp > 1):
            loss().backward()

    return forward, step


def quartiles(calls: list[Callable[[], None]], repeats: int, steps: int = 1,
              wait: Callable[[], None] = lambda: None) -> list[float]:
    """The lower quartile of each call's seconds, the calls timed in turn (so a slow spell of the
    machine lands on all of them), after warm-up, with Python's collector off (a collection landing
    in one call's times and not another's would skew their difference). A round times `steps` calls in
    a row between two `wait`s (a GPU's synchronization: the host queues ahead of kernels this small, so
    the wall time is the host's)."""
    for call in calls:
        for _ in range(3):
            call()
    wait()
    times: list[list[float]] = [[] for _ in calls]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for call, out in zip(calls, times, strict=True):
                wait()
                start = time.perf_counter()
                for _ in range(steps):
                    call()
                wait()
                out.append((time.perf_counter() - start) / steps)
    finally:
        gc.enable()
    return [statistics.quantiles(t, n=4)[0] for t in times]


def measure(kind: str, ranks: int, settings: list[str], repeats: int) -> tuple[float, float, float, float]:
    """(forward, backward) seconds per block and (forward, backward) of the rest, per micro-batch."""
    if ranks > 1:
        dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        (shallow_f, shallow_s), (deep_f, deep_s) = (_calls(layers, ranks, settings) for layers in DEPTHS)
        f0, s0, f1, s1 = quartiles([shallow_f, shallow_s, deep_f, deep_s], repeats)
    finally:
        if ranks > 1:
            dist.destroy_process_group()
    per = DEPTHS[1] - DEPTHS[0]
    block_f, block_s = (f1 - f0) / per, (s1 - s0) / per
    root_f, root_s = f0 - DEPTHS[0] * block_f, s0 - DEPTHS[0] * block_s
    return block_f, block_s - block_f, root_f, root_s - root_f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a GPU's host drives it from one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    table = Table(title="trainfit's host time per micro-batch (tiny kernels, one process, fake collectives)")
    for header in ("kind", "ranks", "block forward ms", "block backward ms", "rest forward ms", "rest backward ms"):
        table.add_column(header, justify="left" if header == "kind" else "right")
    found = {}
    for (kind, ranks), settings in CASES.items():
        found[kind, ranks] = measure(kind, ranks, settings, args.repeats)
        table.add_row(kind, str(ranks), *(f"{1e3 * x:.2f}" for x in found[kind, ranks]))
    print_table(table, console)
    eager = found["eager", 1]
    console.print("as perf/host_costs.py holds them (seconds; fully_shard's beyond eager):")
    for (kind, ranks), (bf, bb, rf, rb) in found.items():
        if kind == "fully_shard":
            bf, bb, rf, rb = (max(0.0, x - e) for x, e in zip((bf, bb, rf, rb), eager, strict=True))
        console.print(f'    ("{kind}", {ranks}): ({bf:.2e}, {bb:.2e}, {rf:.2e}, {rb:.2e}),')


if __name__ == "__main__":
    main()
