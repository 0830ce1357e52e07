"""Collectives measured on real process groups and fitted to trainfit.perf.comms's cost model; imports torch.

For one world size n, n processes are spawned (torch.multiprocessing; the rendezvous is a TCPStore
this process holds open on a localhost port) and joined in one gloo group (nccl on CUDA, one GPU per
rank). They time all_reduce, all_gather (into one tensor), reduce_scatter (from one tensor),
all_to_all (single tensor) and, at n = 2, a send/recv ping-pong (half a round trip is one message),
each at several message sizes, fp32. A call lasts as long as its slowest rank; each point is the
median of `repeats` batches of back-to-back calls (sustained within a batch; the median, as the time
model predicts median step times).

After the collectives, every rank runs trainfit.calibrate.probe's compute probe at once, each
batch lasting until the slowest rank's ends (a synchronous step waits for it); its rates against
one rank's alone are the profile's `concurrency` at n ranks. Where the ranks do not outnumber the
cores, they then measure, as one group, the host work of tensor parallelism and FSDP2
(trainfit.calibrate.host).

Fit: comms.py's model, time = a0 + steps x a + factor x B / bw, with a0 its fixed launch cost
(trainfit.hardware.COLLECTIVE_BASE_LATENCY_S), B as comms.py defines it per kind, and

| kind                                   | steps   | factor    |
|----------------------------------------|---------|-----------|
| all_reduce (ring, comms.py's for large)| 2(n-1)  | 2(n-1)/n  |
| all_gather, reduce_scatter, all_to_all | n-1     | (n-1)/n   |
| p2p                                    | 1       | 1         |

solved for the latency per step a and the bandwidth bw by least squares on the relative error, so
small messages (latency) weigh as much as large ones (bandwidth); a negative latency is clamped at 0.
Gloo's reduce-scatter all-reduces a copy of its input (ProcessGroupGloo.cpp), so its effective
bandwidth under this model is about half the all-gather's: the fit reports what the backend does.
"""

from __future__ import annotations

import datetime
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainfit.calibrate.host import host_overhead_seconds
from trainfit.calibrate.probe import compute_probe, synchronized_median_seconds
from trainfit.hardware import COLLECTIVE_BASE_LATENCY_S
from trainfit.hardware_profile import CollectiveFit, LinkFit

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Measured at every world size; p2p at 2 ranks only (a send/recv pairs two ranks)."""
INIT_TIMEOUT_S = 120

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); as parallel/zero.py.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def model_terms(kind: str, n: int) -> tuple[float, float]:
    """(steps, factor) of comms.py's cost model for a kind at n ranks (the module docstring's table)."""
    if kind == "p2p":
        return 1.0, 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


def fit_nonnegative(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(p, q) minimising the relative error of y ~ p u + q v over rows (u, v, y), with p >= 0.

    Weighted least squares (weights 1 / y^2) from the 2 x 2 normal equations; when p comes out
    negative it is fixed at 0 and q refitted alone.
    """
    w = [1.0 / y**2 for _, _, y in rows]
    suu = sum(wi * u * u for wi, (u, _, _) in zip(w, rows, strict=True))
    suv = sum(wi * u * v for wi, (u, v, _) in zip(w, rows, strict=True))
    svv = sum(wi * v * v for wi, (_, v, _) in zip(w, rows, strict=True))
    suy = sum(wi * u * y for wi, (u, _, y) in zip(w, rows, strict=True))
    svy = sum(wi * v * y for wi, (_, v, y) in zip(w, rows, strict=True))
    det = suu * svv - suv * suv
    if det > 1e-12 * suu * svv:
        p, q = (suy * svv - svy * suv) / det, (svy * suu - suy * suv) / det
        if p >= 0 and q > 0:
            return p, q
    return 0.0, svy / svv


def fit_link(points: list[tuple[str, int, int, float]]) -> LinkFit:
    """The latency per step and bandwidth that best explain points (kind, world size, bytes, seconds)."""
    rows = []
    for kind, n, nbytes, seconds in points:
        steps, factor = model_terms(kind, n)
        rows.append((steps, factor * nbytes, seconds - COLLECTIVE_BASE_LATENCY_S))
    latency, inverse_bandwidth = fit_nonnegative(rows)
    return LinkFit(bytes_per_s=1.0 / inverse_bandwidth, latency_s=latency)


def fit_collectives(measured: dict[int, dict[str, list[tuple[int, float]]]]) -> tuple[LinkFit, list[CollectiveFit]]:
    """The one link fitting every point, and a fit per kind and world size, from
    {world size: {kind: [(bytes, seconds), ...]}}."""
    fits, everything = [], []
    for n, kinds in measured.items():
        for kind, points in kinds.items():
            these = [(kind, n, nbytes, seconds) for nbytes, seconds in points]
            link = fit_link(these)
            fits.append(CollectiveFit(kind, n, link.bytes_per_s, link.latency_s,
                                      tuple(b for b, _ in points), tuple(s for _, s in points)))
            everything += these
    return fit_link(everything), fits


def predicted_seconds(fit: CollectiveFit, nbytes: int) -> float:
    """A call's time under the fit (for the fit's error in the calibrate table)."""
    steps, factor = model_terms(fit.kind, fit.world_size)
    return COLLECTIVE_BASE_LATENCY_S + steps * fit.latency_s + factor * nbytes / fit.bytes_per_s


# ---------------------------------------------------------------- measuring


Points = dict[str, list[tuple[int, float]]]
"""{kind: [(bytes, seconds per call), ...]}"""


class RanksMeasured(NamedTuple):
    """What one world size's ranks measured."""

    points: Points
    probe: tuple[float, float]
    """The compute probe's rates (fp32 matmul FLOP/s, copy bytes/s) while all ranks ran it, in step."""
    host_overhead: dict[str, tuple[float, float]] | None
    """trainfit.calibrate.host's {kind: (block, root host seconds)} on these ranks."""


def measure_collectives(world_size: int, device_type: str, *, threads: int, sizes: tuple[int, ...], batch_s: float,
                        repeats: int, copy_bytes: int, time_shared: bool) -> RanksMeasured:
    """The collectives at one world size, from freshly spawned ranks, the compute probe on them all
    at once, and unless they `time_shared` the cores, the frameworks' host work."""
    # The rendezvous store listens here until the ranks are done: a port found free and released
    # before the ranks bind it can be taken meanwhile by any other process's connection.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    port = store.port
    with tempfile.TemporaryDirectory(prefix="trainfit-calibrate-") as tmp:
        out = Path(tmp) / "collectives.json"
        torch.multiprocessing.spawn(_rank, args=(world_size, port, device_type, threads, sizes, batch_s, repeats,
                                                 copy_bytes, time_shared, str(out)), nprocs=world_size)
        raw = json.loads(out.read_text())
    (matmul, bandwidth), host = raw.pop("compute probe"), raw.pop("host overhead", None)
    return RanksMeasured({kind: [(int(b), float(t)) for b, t in points] for kind, points in raw.items()},
                         (matmul, bandwidth),
                         {kind: (block, root) for kind, (block, root) in host.items()} if host else None)


def _rank(rank: int, world_size: int, port: int, device_type: str, threads: int, sizes: tuple[int, ...],
          batch_s: float, repeats: int, copy_bytes: int, time_shared: bool, out: str) -> None:
    torch.set_num_threads(threads)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=INIT_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        kinds = COLLECTIVE_KINDS + (("p2p",) if world_size == 2 else ())
        results: dict[str, list[tuple[int, float]]] = {kind: [] for kind in kinds}
        for nbytes in sizes:
            elements = max(world_size, nbytes // 4 // world_size * world_size)
            for kind in kinds:
                call = _collective(kind, elements, rank, world_size, device)
                seconds = synchronized_median_seconds(call, device, batch_s=batch_s, repeats=repeats)
                results[kind].append((elements * 4, seconds / 2 if kind == "p2p" else seconds))  # p2p: a round trip
        dist.barrier()
        rates = compute_probe(device, copy_bytes=copy_bytes, batch_s=batch_s, repeats=repeats, together=True)
        together: dict[str, object] = {"compute probe": rates}
        if not time_shared:
            smallest = {kind: results[kind][0][1] for kind in COLLECTIVE_KINDS}
            together["host overhead"] = host_overhead_seconds(world_size, device, smallest, batch_s=batch_s,
                                                              repeats=repeats)
        if rank == 0:
            Path(out).write_text(json.dumps({**results, **together}))
    finally:
        dist.destroy_process_group()


def _collective(kind: str, elements: int, rank: int, n: int, device: torch.device) -> Callable[[], None]:
    """One call of a kind moving `elements` fp32 values, as comms.py counts its bytes."""
    full = torch.zeros(elements, device=device)
    part = torch.zeros(elements // n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":  # B = the gathered output
        return lambda: _all_gather(full, part)
    if kind == "reduce_scatter":  # B = the input
        return lambda: _reduce_scatter(part, full)
    if kind == "all_to_all":  # B = what one rank holds
        out = torch.zeros_like(full)
        return lambda: dist.all_to_all_single(out, full)
    peer = 1 - rank

    def ping_pong() -> None:
        if rank == 0:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)
    return ping_pong
