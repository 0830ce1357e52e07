"""The checks of benchmarks/gpu_check.py, one per process: `python benchmarks/gpu_checks.py NAME --device
cuda|cpu --work DIR --result FILE`. Each exercises a CUDA path of trainfit through its own APIs and
writes plain figures (numbers, strings, booleans) to FILE as it goes, so a check killed at its
timeout still leaves what it measured. A check fails by raising: what must hold (a resume, a finite
loss, two MFUs against one peak) is asserted; what is only observed (an attention backend that does
not run, a compiled fp8 variant that fails) is recorded and, for fp8, fails the check at its end.

Shapes: on CUDA a ~124M-parameter Llama at 8 x 1024 tokens (GPU-sized work, milliseconds a step on
an H100) and the debug model where only a code path matters; on the CPU the debug model throughout,
so that the same code runs here in seconds. Three checks have shapes of their own: host_time trains
benchmarks/host_time.py's tiny Llama on either device, collective_latency moves 4 KiB to 1 MiB, and
fsdp_peak trains Llama 3 8B's shape (the debug model on the CPU) as rank 0 of 8 on the fake backend.

Also `--torchrun-train RESULT -- ARGS` (what torchrun launches: `trainfit train ARGS`, recording the
process group it trained in). The machine's description is trainfit.validate.machine's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _runs import DEBUG_RUN, run_config  # noqa: E402
from trainfit.config import Config  # noqa: E402
from trainfit.train.metrics import read_metrics  # noqa: E402
from trainfit.train.trainer import Trainer, TrainResult  # noqa: E402
from trainfit.validate.machine import first_line  # noqa: E402

GPU_MODEL = ("--model.preset=tiny", "--model.dim=768", "--model.num_layers=12", "--model.num_heads=12",
             "--model.num_kv_heads=4", "--model.ffn_dim=2048", "--model.vocab_size=32000",
             "--model.max_seq_len=1024", "--training.seq_len=1024", "--training.micro_batch_size=8",
             "--training.global_batch_size=8", "--training.warmup_steps=2")
"""~124M parameters (49M of them the 32,000-token embedding and output; the byte tokenizer uses 256)."""
FP8_GPU_MODEL = ("--model.preset=tiny", "--model.dim=1024", "--model.num_layers=4", "--model.num_heads=16",
                 "--model.num_kv_heads=8", "--model.ffn_dim=2816", "--model.max_seq_len=128",
                 "--training.warmup_steps=2")
"""Every block linear's dims a multiple of 16 (all of them fp8); the debug model's are too."""
SDPA_SHAPE = {"cuda": (1, 32, 4096, 128), "cpu": (1, 4, 256, 32)}
"""(batch, heads, sequence, head dim) of the causal attention timed per backend."""
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
FP8_TOKENS = (100, 128)
"""Micro-batch tokens of the fp8 runs (one sequence each): 100 is no multiple of 16, which the
weight-gradient GEMMs' inner dimension must be (trainfit.float8.pads_inner_dim)."""
EAGER_RUN_S, COMPILED_RUN_S = 15, 75
"""The least time left in the fp8 check for one more eager or compiled run to start (a plan for an
H100, where a compile takes most of it)."""
EXIT_S = 5
"""The check's time kept for the process to exit before its limit."""
OLD_CUDA_DEVICES = 8
"""The older checkpoints' CUDA RNG state: torch.cuda.get_rng_state_all() on an 8-GPU machine."""
HOST_ROUNDS = {"cuda": 7, "cpu": 5}
"""Rounds of host_time's timing (each times every call once, in turn); the lower quartile is kept."""
HOST_STEPS = 5
"""Steps per timed batch: the device is synchronized before and after them only."""
HOST_CPU_REPEATS = 11
"""benchmarks/host_time.py's repeats for its own measurement on the host's CPU (its default is 21)."""
COLLECTIVE_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
"""Messages of collective_latency (the all-gather's output, the reduce-scatter's input, in fp32):
latency-bound sizes, a norm gain's gradient up to a small block's parameters."""
COLLECTIVE_CALLS = {"cuda": 200, "cpu": 30}
"""Timed calls per size and kind, after COLLECTIVE_WARMUP."""
COLLECTIVE_WARMUP = 10
COLLECTIVE_CHUNK = 10
"""Calls timed back to back between two synchronizations (the issue rate; the median of such chunks is kept)."""
CPU_COLLECTIVE_WORLD = 2
"""gloo processes on the CPU (on CUDA: one per visible GPU)."""
FSDP_WORLD = 8
"""fsdp_peak's ranks: trainfit shards nothing at one rank (zero_stage=3 has no effect there), so the step
runs as rank 0 of an 8-rank FSDP2 job on the `fake` backend: every tensor an 8-GPU node's rank 0 holds,
allocated for real on this one device."""
FSDP_SHAPE = {"cuda": ("--model.preset=llama3-8b", "--training.seq_len=2048", "--training.warmup_steps=2"),
              "cpu": DEBUG_RUN}
FSDP_MICRO_BATCHES = {"cuda": (1, 2), "cpu": (2, 8)}
FSDP_LAYERS = {"cuda": (32, 16, 8), "cpu": (4, 2)}
"""Blocks to try, most first (Llama 3 8B's 32 on CUDA): the first whose estimate fits FSDP_MEMORY_SHARE of the
device runs."""
FSDP_MEMORY_SHARE = 0.8


@dataclasses.dataclass
class Context:
    device: str
    """cuda or cpu: where every run trains."""
    work: Path
    """This check's scratch folder (runs, checkpoints, traces)."""
    result: Path
    deadline: float
    """time.monotonic() by which the check should be done: the fp8 check skips variants that would end past it."""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: str = ""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def put(self, **figures: Any) -> None:
        """Record figures and rewrite the result file at once (a killed check keeps them)."""
        self.figures.update({key: plain(value) for key, value in figures.items()})
        self.write()

    def say(self, summary: str) -> None:
        self.summary = summary
        self.write()

    def write(self) -> None:
        tmp = self.result.with_suffix(".tmp")
        tmp.write_text(json.dumps({"figures": self.figures, "summary": self.summary}, indent=1))
        os.replace(tmp, self.result)

    def model(self) -> tuple[str, ...]:
        """The GPU-sized model on CUDA, the debug one on the CPU, both in bf16-mixed."""
        return (*(GPU_MODEL if self.cuda else DEBUG_RUN), "--precision.mode=bf16-mixed")

    def small(self) -> tuple[str, ...]:
        """The debug model on either device: where only the code path matters."""
        return (*DEBUG_RUN, "--precision.mode=bf16-mixed")


def plain(value: Any) -> Any:
    """A JSON scalar: floats to 4 significant digits, anything else that is no scalar as its str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if not math.isfinite(value) or value == 0 else float(f"{value:.4g}")
    return str(value)


# ---------------------------------------------------------------- runs


class NoFinalSave(Trainer):
    """A Trainer that writes no checkpoint: where the check is about speed or memory, the end-of-run
    save of a 124M model (1.5 GB with its optimizer states, hashed) would cost seconds for nothing."""

    def save(self) -> Path | None:  # type: ignore[override]
        return None


@dataclasses.dataclass
class Run:
    cfg: Config
    result: TrainResult
    records: list[dict[str, Any]]
    """metrics.jsonl: step records and notes."""
    seen: dict[str, Any]
    """What `inspect` returned."""
    seconds: float

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "loss" in r]

    @property
    def notes(self) -> list[str]:
        return [r["note"] for r in self.records if "note" in r]

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.steps if r.get(key) is not None]
        return statistics.median(values) if values else None

    def finite(self) -> bool:
        return bool(self.result.losses) and all(math.isfinite(v) for v in self.result.losses.values())


def config(ctx: Context, name: str, *overrides: str) -> Config:
    return run_config(ctx.work / name, f"--training.device={ctx.device}", *overrides, base=())


def train(ctx: Context, name: str, *overrides: str, save: bool = False,
          inspect: Callable[[Trainer, TrainResult], dict[str, Any]] | None = None) -> Run:
    """Train `overrides` (a whole shape: base=() below) in this process under ctx.work/name; `inspect`
    reads the trainer after training, before it is closed."""
    cfg = config(ctx, name, *overrides)
    torch._dynamo.reset()  # each run compiles its own shapes from scratch (training.compile)
    start = time.perf_counter()
    trainer = (Trainer if save else NoFinalSave)(cfg)
    try:
        result = trainer.train()
        seen = inspect(trainer, result) if inspect else {}
    finally:
        trainer.close()
        free_memory()
    return Run(cfg, result, read_metrics(cfg.logging.dir), seen, time.perf_counter() - start)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def config_here(cfg: Config, device: torch.device) -> Config:
    """`cfg` with hardware.gpu matched to this process's device (as a run's pre-flight estimate takes it)."""
    from trainfit.train.run_device import this_run_device

    return dataclasses.replace(cfg, hardware=this_run_device(cfg.hardware, cfg.precision.mode, device).hardware)


# ---------------------------------------------------------------- the checks


def attention_seconds(backends: list[Any] | None, shape: tuple[int, ...], device: str) -> float:
    """Median seconds of one bf16 causal attention's forward and backward under `backends` (None: torch picks)."""
    from torch.nn.attention import sdpa_kernel

    from trainfit.calibrate.probe import median_seconds

    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def call() -> None:
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return median_seconds(call, sync(device), batch_s=0.05, repeats=3)


def check_sdpa(ctx: Context) -> None:
    """Each attention backend on bf16 causal attention: does it run (trainfit's probe, the kernel
    training would use), and its forward + backward time and TFLOP/s (useful causal FLOPs)."""
    from trainfit.attention import BACKENDS, probe_attention_kernel
    from trainfit.config import ConfigError
    from trainfit.perf.flops import FLASH_ATTENTION_BWD_FACTOR

    batch, heads, seq, head_dim = shape = SDPA_SHAPE[ctx.device]
    flops = 2 * 2 * batch * heads * seq * seq * head_dim / 2 * (1 + FLASH_ATTENTION_BWD_FACTOR)
    ctx.put(shape="x".join(map(str, shape)), dtype="bf16", flops_per_call=flops)
    ran, not_run = [], []
    for backend in SDPA_BACKENDS:
        try:
            kernel = probe_attention_kernel(backend, torch.device(ctx.device), torch.bfloat16, heads, heads, head_dim)
        except ConfigError as err:
            not_run.append(backend)
            ctx.put(**{f"{backend}_runs": False, f"{backend}_error": str(err)[:600]})
            continue
        try:
            seconds = attention_seconds(BACKENDS[backend], shape, ctx.device)
        except RuntimeError as err:  # the probe's tiny shape ran, this one does not (an OOM, a size limit)
            not_run.append(backend)
            ctx.put(**{f"{backend}_runs": False, f"{backend}_kernel": kernel.name, f"{backend}_error": first_line(err)})
            continue
        finally:
            free_memory()
        ran.append(f"{backend} {flops / seconds / 1e12:.3g}")
        ctx.put(**{f"{backend}_runs": True, f"{backend}_kernel": kernel.name, f"{backend}_op": kernel.op,
                   f"{backend}_ms": seconds * 1e3, f"{backend}_tflops": flops / seconds / 1e12})
    ctx.say("TFLOP/s " + ", ".join(ran) + f"; not run: {', '.join(not_run) or 'none'}")


def catalog_device(ctx: Context) -> tuple[str, str | None]:
    """(this device's name, its catalog entry or None)."""
    from trainfit.hardware import catalog_gpu_of

    if not ctx.cuda:
        return platform.processor() or "cpu", "cpu"
    name = torch.cuda.get_device_name(0)
    return name, catalog_gpu_of(name)


def check_mfu(ctx: Context) -> None:
    """12 steps with hardware.gpu at its default, then named as the catalog's entry for this device:
    tokens/s, MFU and its note; both runs' MFUs must be against one peak; the instrumented steps (the
    first and the memory-measured one) have no tokens/s in metrics.jsonl."""
    from trainfit.perf.flops import training_flops_per_token

    name, matched = catalog_device(ctx)
    ctx.put(device_name=name, catalog_device=matched)
    steps = ("--training.steps=12",)
    runs = {"default": train(ctx, "default", *ctx.model(), *steps)}
    if matched is None:
        ctx.put(named="skipped: this device is not in the catalog")
    else:
        runs["named"] = train(ctx, "named", *ctx.model(), *steps, f"--hardware.gpu={matched}")
    peaks = {}
    for key, run in runs.items():
        r = run.result
        flops_per_token = training_flops_per_token(run.cfg.model, run.cfg.training.seq_len)
        null = [s["step"] for s in run.steps if s.get("tokens_per_s") is None]
        peaks[key] = r.tokens_per_s * flops_per_token / r.mfu if r.tokens_per_s and r.mfu else None
        ctx.put(**{f"{key}_tokens_per_s": r.tokens_per_s, f"{key}_mfu": r.mfu, f"{key}_mfu_note": r.mfu_note,
                   f"{key}_median_tokens_per_s": run.median("tokens_per_s"), f"{key}_median_mfu": run.median("mfu"),
                   f"{key}_peak_tflops": peaks[key] / 1e12 if peaks[key] else None,
                   f"{key}_notes": " | ".join(run.notes)[:1500],
                   f"{key}_null_tokens_per_s_steps": ",".join(map(str, null)), f"{key}_seconds": run.seconds,
                   f"{key}_num_params": r.num_params})
        assert null == [1, 2], f"{key}: tokens_per_s is null on steps {null}, expected the instrumented 1 and 2"
        assert run.finite(), f"{key}: a loss is not finite: {run.result.losses}"
    if "named" in peaks:
        a, b = peaks["default"], peaks["named"]
        agree = (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9))
        ctx.put(mfu_peaks_agree=agree)
        assert agree, f"MFU against different peaks: {peaks}"
    r = runs["default"].result
    ctx.say(f"{r.tokens_per_s or 0:,.0f} tok/s, MFU {r.mfu if r.mfu is not None else float('nan'):.1%} "
            f"({matched}); peaks agree: {ctx.figures.get('mfu_peaks_agree')}")


def memory_seen(trainer: Trainer, result: TrainResult) -> dict[str, Any]:
    """After a run: the analytic estimate of its config on this device, and the CUDA allocator's counters."""
    from trainfit.estimate import estimate

    here = config_here(trainer.cfg, trainer.device)
    stage = estimate(here, trainer.layout).memory.per_stage[0]
    seen = {"estimated_gpu": here.hardware.gpu, "estimated_peak_bytes": stage.peak,
            "estimated_reserved_margin_bytes": stage.reserved_margin,
            "estimated_total_bytes": stage.peak + stage.reserved_margin}
    if trainer.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(trainer.device)
        seen.update(cuda_max_memory_allocated=torch.cuda.max_memory_allocated(trainer.device),
                    cuda_max_memory_reserved=torch.cuda.max_memory_reserved(trainer.device),
                    cuda_memory_reserved=torch.cuda.memory_reserved(trainer.device),
                    cuda_mem_get_info_free=free, cuda_mem_get_info_total=total,
                    cuda_device_used_bytes=total - free)
    return seen


def check_memory(ctx: Context) -> None:
    """The measured step's peak and every memory_/device_ figure its metrics record holds, the CUDA
    allocator's own counters, and the analytic estimate of the same config on this device."""
    from trainfit.units import fmt_bytes

    run = train(ctx, "memory", *ctx.model(), "--training.steps=3", inspect=memory_seen)
    m = run.result.memory
    assert m is not None, "no measured step"
    measured = [r for r in run.steps if any(k.startswith("memory_") for k in r)]
    record = measured[-1] if measured else {}
    ctx.put(measured_step=record.get("step"), peak_bytes=m.peak, non_tensor_bytes=m.non_tensor,
            reserved_margin_bytes=m.reserved_margin, allocator_peak_bytes=m.peak + m.non_tensor,
            peak_phase=m.peak_phase, **run.seen,
            **{k: v for k, v in record.items() if k.startswith(("memory_", "device_"))})
    ctx.put(estimated_over_measured_peak=run.seen["estimated_peak_bytes"] / m.peak,
            estimated_total_over_allocator_peak=run.seen["estimated_total_bytes"] / (m.peak + m.non_tensor))
    reserved = run.seen.get("cuda_max_memory_reserved")
    if reserved:
        ctx.put(estimated_total_over_max_reserved=run.seen["estimated_total_bytes"] / reserved)
    ctx.say(f"peak {fmt_bytes(m.peak)} (+{fmt_bytes(m.non_tensor)} non-tensor), estimate "
            f"{fmt_bytes(run.seen['estimated_peak_bytes'])}"
            + (f", max reserved {fmt_bytes(reserved)}" if reserved else ""))


# ---------------------------------------------------------------- host time, collective latency, FSDP2 peak


def host_calls(ctx: Context, layers: int) -> tuple[Trainer, list[Callable[[], None]]]:
    """A trainer of benchmarks/host_time.py's tiny Llama at `layers` blocks on the device, and three calls of its
    own step code: a forward (no grad); a micro-batch (TrainStep.forward_backward: autocast, the loss, the scaled
    backward, as training runs it: what perf/host_costs.py prices); a whole training step (Trainer.train_step:
    the sampler's batch, the loss read back and the gradient norm, two host syncs, and the optimizer step)."""
    import host_time

    trainer = NoFinalSave(config(ctx, f"host{layers}", *host_time.TINY, f"--model.num_layers={layers}",
                                 "--training.global_batch_size=1", "--training.warmup_steps=2"))
    stepper = trainer.stepper
    tokens = torch.zeros(1, trainer.cfg.training.seq_len, dtype=torch.long, device=trainer.device)

    def forward() -> None:
        with torch.no_grad():
            stepper.loss(tokens, tokens)

    def micro_batch() -> None:
        stepper.forward_backward(tokens, tokens, num_microbatches=1, sync_gradients=True)

    return trainer, [forward, micro_batch, trainer.train_step]


def batch_quartiles(calls: list[Callable[[], None]], device: str, rounds: int, steps: int) -> list[float]:
    """Each call's wall seconds per step, the lower quartile over `rounds` of `steps` calls between two device
    synchronizations (host_time.quartiles)."""
    import host_time

    return host_time.quartiles(calls, rounds, steps, sync(device))


def check_host_time(ctx: Context) -> None:
    """trainfit's host seconds per block and micro-batch on this device: benchmarks/host_time.py's tiny Llama (kernels
    so small that the device never sets the pace) at its two depths, wall time per step; per block from the slope,
    the fixed part (embedding, final norm, head, loss) from the shallower depth; beside perf/host_costs.py's eager
    figures, and beside host_time.py's own measurement on this machine's CPU (CPU kernels, no autocast), which
    tells the host core's speed apart from the CUDA launches'."""
    import host_time
    from trainfit.perf.host_costs import TRAINFIT

    torch.set_num_threads(1)  # one host thread drives a GPU; host_time.py measures with one
    shallow, deep = host_time.DEPTHS
    built = [host_calls(ctx, layers) for layers in (shallow, deep)]
    try:
        f0, m0, s0, f1, m1, s1 = batch_quartiles([*built[0][1], *built[1][1]], ctx.device, HOST_ROUNDS[ctx.device],
                                                 HOST_STEPS)
    finally:
        for trainer, _ in built:
            trainer.close()
        free_memory()
    per = deep - shallow
    block_f, block_m, block_s = (f1 - f0) / per, (m1 - m0) / per, (s1 - s0) / per
    model_f, model_b = TRAINFIT.block_s["eager", 1]
    model_rest = sum(TRAINFIT.rest_s)
    ctx.put(depths=f"{shallow},{deep}", steps_per_batch=HOST_STEPS, rounds=HOST_ROUNDS[ctx.device],
            block_forward_s=block_f, block_backward_s=block_m - block_f, block_s=block_m,
            fixed_micro_batch_s=m0 - shallow * block_m, step_block_s=block_s, step_fixed_s=s0 - shallow * block_s,
            optimizer_block_s=block_s - block_m, micro_batch_s_at_depths=f"{m0:.3e},{m1:.3e}",
            model_block_forward_s=model_f, model_block_backward_s=model_b, model_block_s=model_f + model_b,
            model_rest_s=model_rest, model_source=TRAINFIT.source, block_over_model=block_m / (model_f + model_b),
            fixed_over_model_rest=(m0 - shallow * block_m) / model_rest)
    cpu_f, cpu_b, rest_f, rest_b = host_time.measure("eager", 1, [], repeats=HOST_CPU_REPEATS)
    ctx.put(cpu_kernels_block_forward_s=cpu_f, cpu_kernels_block_backward_s=cpu_b,
            cpu_kernels_block_s=cpu_f + cpu_b, cpu_kernels_rest_s=rest_f + rest_b)
    ctx.say(f"{block_m * 1e3:.2f} ms/block (fwd {block_f * 1e3:.2f}), fixed "
            f"{ctx.figures['fixed_micro_batch_s'] * 1e3:.2f} ms per micro-batch; host_costs "
            f"{(model_f + model_b) * 1e3:.2f} + {model_rest * 1e3:.2f} ms; host_time.py here "
            f"{(cpu_f + cpu_b) * 1e3:.2f} ms/block; whole step {block_s * 1e3:.2f} ms/block")
    assert block_f > 0 and block_m > block_f and block_s > 0, ctx.figures


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


def collective_seconds(kind: str, nbytes: int, world: int, device: torch.device, calls: int) -> tuple[float, float]:
    """(median seconds of one call alone, the device synchronized after it; median seconds per call of
    COLLECTIVE_CHUNK back to back) of an fp32 all-gather whose output, or reduce-scatter whose input, is `nbytes`
    (perf/comms.py's B)."""
    full = torch.zeros(nbytes // 4, device=device)
    shard = torch.zeros(nbytes // 4 // world, device=device)

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.11: the old names
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def call() -> None:
        if kind == "all_gather":
            gather(full, shard)
        else:
            scatter(shard, full)

    wait = sync(device.type)
    for _ in range(COLLECTIVE_WARMUP):
        call()
    wait()
    alone = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        wait()
        alone.append(time.perf_counter() - start)
    chunks = []
    for _ in range(calls // COLLECTIVE_CHUNK):
        start = time.perf_counter()
        for _ in range(COLLECTIVE_CHUNK):
            call()
        wait()
        chunks.append((time.perf_counter() - start) / COLLECTIVE_CHUNK)
    return statistics.median(alone), statistics.median(chunks)


def collective_worker(index: int, first_rank: int, world: int, device: str, store: str, out: str, calls: int) -> None:
    """Rank first_rank + index of collective_latency (rank 0 in the check's process, the others spawned): every
    kind and size of COLLECTIVE_BYTES; rank 0 writes the microseconds to `out`."""
    rank, cuda = first_rank + index, device == "cuda"
    here = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(here)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=here if cuda else None)
    try:
        seen = {}
        for kind in ("all_gather", "reduce_scatter"):
            for nbytes in COLLECTIVE_BYTES:
                alone, streamed = collective_seconds(kind, nbytes, world, here, calls)
                seen[f"{kind}_{size_label(nbytes)}_us"] = alone * 1e6
                seen[f"{kind}_{size_label(nbytes)}_streamed_us"] = streamed * 1e6
        if rank == 0:
            Path(out).write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def check_collective_latency(ctx: Context) -> None:
    """Small all-gathers and reduce-scatters on this machine's devices (one NCCL process per visible GPU; on the
    CPU 2 gloo processes), alone and back to back, beside what perf/comms.py prices: its fixed cost per
    collective (COLLECTIVE_BASE_LATENCY_S, Simple; the fastest of NCCL's protocols on the link) and the same call
    on the device's intra-node link. One GPU crosses no link: its figures are NCCL's call and launch floor only,
    and the model prices a 1-rank collective at 0 s, so the priced figures are for 2 ranks."""
    from trainfit.hardware import intra_node_link
    from trainfit.perf import comms

    world = torch.cuda.device_count() if ctx.cuda else CPU_COLLECTIVE_WORLD
    out, store = ctx.work / "latency.json", ctx.work / "store"
    store.unlink(missing_ok=True)  # a FileStore left by an earlier run (--keep-work) would hold its keys
    args = (world, ctx.device, str(store), str(out), COLLECTIVE_CALLS[ctx.device])
    spawn = torch.multiprocessing.spawn
    others = spawn(collective_worker, (1, *args), nprocs=world - 1, join=False) if world > 1 else None
    collective_worker(0, 0, *args)  # rank 0 here: one process fewer to start (and none at one GPU)
    while others is not None and not others.join():  # True once every rank has exited (raises if one failed)
        pass
    measured = json.loads(out.read_text())
    link = intra_node_link(config_here(config(ctx, "comms", *ctx.small()), torch.device(ctx.device)).hardware)
    ranks, base = max(world, 2), comms.COLLECTIVE_BASE_LATENCY_S
    fastest = min([base, *(p.base_s for p in link.protocols)])
    ctx.put(world_size=world, backend="nccl" if ctx.cuda else "gloo", calls=COLLECTIVE_CALLS[ctx.device],
            priced_ranks=ranks, link=link.name, model_base_us=base * 1e6, model_fastest_base_us=fastest * 1e6,
            model_hop_us=link.latency_s * 1e6, **measured,
            note="1 rank: the call and launch floor only, no link crossed; priced at 2 ranks" if world == 1
            else f"{world} ranks over {'NVLink/PCIe' if ctx.cuda else 'host memory'}")
    for kind in ("all_gather", "reduce_scatter"):
        for nbytes in COLLECTIVE_BYTES:
            ctx.put(**{f"{kind}_{size_label(nbytes)}_model_us": comms.collective_time(kind, nbytes, ranks, link) * 1e6})
    floor = min(v for k, v in measured.items() if not k.endswith("_streamed_us"))
    ctx.put(floor_us=floor, floor_over_model_base=floor / (base * 1e6))
    small = size_label(COLLECTIVE_BYTES[0])
    ctx.say(f"{ctx.figures['backend']} x{world}: {small} all-gather {measured[f'all_gather_{small}_us']:.1f} us "
            f"({measured[f'all_gather_{small}_streamed_us']:.1f} back to back), reduce-scatter "
            f"{measured[f'reduce_scatter_{small}_us']:.1f} us; model a0 {base * 1e6:.1f} us, {ranks}-rank "
            f"{ctx.figures[f'all_gather_{small}_model_us']:.1f} us on {link.name}")
    assert all(v > 0 and math.isfinite(v) for v in measured.values()), measured


@contextlib.contextmanager
def finite_fake_collectives() -> Iterator[None]:
    """FSDP2's all-gathers and reduce-scatters on the fake backend with finite outputs: a fake collective leaves
    its output as allocated (any bits; a NaN loss stops training: TrainStep raises), so each first fills it as if
    every rank held this rank's shard. Nothing is allocated: the memory stays the real step's."""
    gathers = [name for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]
    scatters = [name for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in gathers + scatters}
    """FSDP2 calls the *_single names where torch has them (2.13), the older ones before (2.11): both are
    wrapped, and a fill done twice (an old name that calls the new) writes the same values."""

    def filled_gather(gather: Callable[..., Any]) -> Callable[..., Any]:
        def all_gather(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rows = output_tensor.view(-1, input_tensor.numel())
            rows[1:].copy_(input_tensor.reshape(1, -1))  # this is rank 0: an in-place all-gather's input is row 0
            if rows[0].data_ptr() != input_tensor.data_ptr():
                rows[0].copy_(input_tensor.reshape(-1))
            return gather(output_tensor, input_tensor, *args, **kwargs)
        return all_gather

    def filled_scatter(scatter: Callable[..., Any]) -> Callable[..., Any]:
        def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
            if output.data_ptr() != input.data_ptr():  # rank 0's part of an in-place reduce-scatter holds it already
                output.copy_(input.reshape(-1)[:output.numel()].view_as(output))
            return scatter(output, input, *args, **kwargs)
        return reduce_scatter

    for name in gathers:
        setattr(dist, name, filled_gather(originals[name]))
    for name in scatters:
        setattr(dist, name, filled_scatter(originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def fsdp_shape(ctx: Context, layers: int, micro_batch: int) -> tuple[str, ...]:
    return (*FSDP_SHAPE[ctx.device], f"--model.num_layers={layers}", "--precision.mode=bf16-mixed",
            f"--hardware.num_gpus={FSDP_WORLD}", "--parallel.zero_stage=3", "--training.steps=2",
            f"--training.micro_batch_size={micro_batch}", f"--training.global_batch_size={micro_batch * FSDP_WORLD}")


def device_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fitting_layers(ctx: Context, micro_batch: int) -> int:
    """The most blocks of FSDP_LAYERS whose estimate (peak and reserved margin) fits FSDP_MEMORY_SHARE of the device."""
    from trainfit.estimate import estimate

    room = FSDP_MEMORY_SHARE * device_memory_bytes(ctx.device)
    for layers in FSDP_LAYERS[ctx.device]:
        cfg = config_here(config(ctx, "fit", *fsdp_shape(ctx, layers, micro_batch)), torch.device(ctx.device))
        stage = estimate(cfg).memory.per_stage[0]
        ctx.put(**{f"estimated_total_bytes_{layers}_layers": stage.peak + stage.reserved_margin})
        if stage.peak + stage.reserved_margin <= room:
            return layers
    raise AssertionError(f"no depth of {FSDP_LAYERS[ctx.device]} fits {room / 2**30:.1f} GiB")


def fsdp_figures(run: Run) -> dict[str, Any]:
    """One fsdp_peak run's figures: trainfit's measured step, the estimate, CUDA's allocator peaks, their ratios."""
    m, seen = run.result.memory, run.seen
    assert m is not None, "no measured step"
    assert seen["data_parallel"] == "fsdp", seen
    fig = {"num_params": run.result.num_params, "shards": seen["shards"], "measured_peak_bytes": m.peak,
           "non_tensor_bytes": m.non_tensor, "peak_phase": m.peak_phase, "seconds": run.seconds,
           "losses_finite": run.finite(), **{k: v for k, v in seen.items() if k.startswith("estimated_")},
           "estimated_over_measured_peak": seen["estimated_peak_bytes"] / m.peak}
    if "max_memory_reserved" in seen:
        fig.update(max_memory_allocated=seen["max_memory_allocated"], max_memory_reserved=seen["max_memory_reserved"],
                   device_used_bytes=m.device_used,
                   estimated_over_max_allocated=seen["estimated_peak_bytes"] / seen["max_memory_allocated"],
                   estimated_over_max_reserved=seen["estimated_reserved_bytes"] / seen["max_memory_reserved"])
    return fig


def check_fsdp_peak(ctx: Context) -> None:
    """A Llama-3-8B-shaped FSDP2 step (the debug model on the CPU) as rank 0 of FSDP_WORLD on the fake backend, at
    two micro-batch sizes, 2 steps each (the second measured): the peak the device held (CUDA: max_memory_allocated
    and max_memory_reserved over the measured step) beside the analytic estimate of the same config on this device
    (its peak; for the reserved figure, its peak plus its allocator-fragmentation term). On the CPU, which has no
    reserved figure, the measured tensors' peak against the estimate's."""
    from trainfit.estimate import estimate
    from trainfit.units import fmt_bytes

    def inspect(trainer: Trainer, result: TrainResult) -> dict[str, Any]:
        stage = estimate(config_here(trainer.cfg, trainer.device), trainer.layout).memory.per_stage[0]
        seen = {"data_parallel": trainer.layout.data_parallel, "shards": trainer.layout.zero_shards,
                "estimated_peak_bytes": stage.peak, "estimated_reserved_margin_bytes": stage.reserved_margin}
        if trainer.device.type == "cuda":
            seen.update(estimated_reserved_bytes=stage.peak + stage.margin_terms.get("allocator_fragmentation", 0),
                        max_memory_allocated=torch.cuda.max_memory_allocated(trainer.device),
                        max_memory_reserved=torch.cuda.max_memory_reserved(trainer.device))
        return seen

    micro_batches = FSDP_MICRO_BATCHES[ctx.device]
    dist.init_process_group("fake", rank=0, world_size=FSDP_WORLD, store=dist.HashStore())
    try:
        layers = fitting_layers(ctx, max(micro_batches))
        ctx.put(world_size=FSDP_WORLD, process_group="fake: collectives move no data, rank 0's memory is real",
                num_layers=layers, full_depth=layers == FSDP_LAYERS[ctx.device][0],
                device_memory_bytes=device_memory_bytes(ctx.device))
        rows = []
        for mb in micro_batches:
            with finite_fake_collectives():
                run = train(ctx, f"mb{mb}", *fsdp_shape(ctx, layers, mb), inspect=inspect)
            fig = fsdp_figures(run)
            ctx.put(**{f"mb{mb}_{key}": value for key, value in fig.items()})
            held, estimated = ((fig["max_memory_reserved"], fig["estimated_reserved_bytes"]) if ctx.cuda
                               else (fig["measured_peak_bytes"], fig["estimated_peak_bytes"]))
            rows.append(f"mb {mb}: {'reserved' if ctx.cuda else 'peak'} {fmt_bytes(held)}, "
                        f"estimate {fmt_bytes(estimated)}")
    finally:
        dist.destroy_process_group()
    ctx.say(f"{layers} blocks, rank 0 of {FSDP_WORLD} (fake): " + "; ".join(rows))


def check_fp8(ctx: Context) -> None:
    """fp8-mixed at 100 and 128 tokens per micro-batch and bf16-mixed at the same shapes, eager, then
    fp8-mixed compiled (on CUDA only: a CPU compile of fp8 takes a minute per shape): 4 steps each or
    its error; a variant that would not finish in the check's time is skipped. Fails at the end when
    any variant failed."""
    shape = FP8_GPU_MODEL if ctx.cuda else DEBUG_RUN
    variants = [(mode, tokens, False) for tokens in FP8_TOKENS for mode in ("bf16-mixed", "fp8-mixed")]
    variants += [("fp8-mixed", tokens, True) for tokens in FP8_TOKENS]
    failed, rows = [], []
    for mode, tokens, compiled in variants:
        key = f"{mode.split('-')[0]}_{tokens}_{'compiled' if compiled else 'eager'}"
        if compiled and not ctx.cuda:
            ctx.put(**{f"{key}_status": "skipped: compile on the CPU"})
            continue
        if ctx.deadline - time.monotonic() < (COMPILED_RUN_S if compiled else EAGER_RUN_S):
            ctx.put(**{f"{key}_status": "skipped: the check's time is up"})
            continue
        try:
            run = train(ctx, key, *shape, f"--precision.mode={mode}", f"--training.seq_len={tokens}",
                        "--training.micro_batch_size=1", "--training.global_batch_size=1",
                        f"--training.compile={str(compiled).lower()}", "--training.steps=4")
        except Exception as err:
            traceback.print_exc()
            failed.append(key)
            ctx.put(**{f"{key}_status": "failed", f"{key}_error": first_line(err)})
            continue
        r = run.result
        probe = next((rec for rec in run.records if "fp8_matmul_flops_per_s" in rec), {})
        ctx.put(**{f"{key}_status": "ok" if run.finite() else "failed: a loss is not finite",
                   f"{key}_tokens_per_s": r.tokens_per_s, f"{key}_compile_s": r.compile_seconds,
                   f"{key}_last_loss": r.losses.get(r.steps_done), f"{key}_seconds": run.seconds,
                   **({f"{key}_probe_fp8_gflops": probe["fp8_matmul_flops_per_s"] / 1e9,
                       f"{key}_probe_bf16_gflops": probe["bf16_matmul_flops_per_s"] / 1e9} if probe else {})})
        if not run.finite():
            failed.append(key)
        rows.append(f"{key} {r.tokens_per_s or 0:,.0f}")
    ctx.say("tok/s " + ", ".join(rows) + (f"; FAILED {', '.join(failed)}" if failed else ""))
    assert not failed, f"failed: {', '.join(failed)} (errors in the figures)"


def process_group(trainer: Trainer) -> dict[str, Any]:
    """The process group the trainer runs in, read before close() destroys it."""
    if not dist.is_initialized():
        return {"process_group": False}
    seen: dict[str, Any] = {"process_group": True, "world_size": dist.get_world_size()}
    for key, read in (("backend", dist.get_backend), ("backend_config", dist.get_backend_config)):
        try:
            seen[key] = str(read())
        except Exception as err:  # recorded, not fatal: the run itself is what the check asserts
            seen[key] = first_line(err)
    return seen


def check_offload(ctx: Context) -> None:
    """memory.offload=optimizer under ZeRO-3 in one process (a 1-rank group: on CUDA nccl for the
    device, gloo for the host's gradient shards): the backend it made, where the optimizer states
    live, and a finite loss."""
    from trainfit.train.distributed import process_group_backend

    def inspect(trainer: Trainer, result: TrainResult) -> dict[str, Any]:
        seen = process_group(trainer)
        states = [t for s in trainer.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]  # exp_avg, exp_avg_sq (not the step count)
        local = [t.to_local() if hasattr(t, "to_local") else t for t in states]
        seen["optimizer_state_devices"] = ",".join(sorted({t.device.type for t in local}))
        return seen

    run = train(ctx, "offload", *ctx.small(), "--parallel.zero_stage=3", "--memory.offload=optimizer",
                "--training.steps=3", save=True, inspect=inspect)
    expected = process_group_backend(ctx.device, "optimizer")
    ctx.put(expected_backend=expected, **run.seen, losses_finite=run.finite(),
            last_loss=run.result.losses.get(run.result.steps_done), checkpoint=str(run.result.checkpoint),
            seconds=run.seconds)
    ctx.say(f"backend {run.seen.get('backend')} ({expected} asked), states on {run.seen['optimizer_state_devices']}, "
            f"loss finite: {run.finite()}")
    assert run.seen["process_group"], "no process group was made"
    assert run.finite(), f"a loss is not finite: {run.result.losses}"
    assert run.seen["optimizer_state_devices"] == "cpu", "optimizer states are not on the host"


def check_resume_rng(ctx: Context) -> None:
    """Two steps and a checkpoint; its CUDA RNG state rewritten to the older format (a list of 8 per-device
    states, this device's first; no CUDA state on the CPU), the manifest's checksum updated; a resume
    for one step must run and restore the saved streams."""
    from trainfit.train import checkpoint as ckpt
    from trainfit.train import manifest

    shape = (*ctx.small(), "--checkpoint.resume=must")
    first = train(ctx, "run", *shape, "--checkpoint.resume=never", "--training.steps=2", save=True)
    path = first.result.checkpoint
    assert path is not None, "the first run saved no checkpoint"
    state_file = path / ckpt.TRAINER_STATE
    state = torch.load(state_file, weights_only=True)
    rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
    saved_cuda = rngs[0].get("cuda")
    if saved_cuda is not None:
        others = [torch.Generator(device="cuda").manual_seed(i).get_state() for i in range(1, OLD_CUDA_DEVICES)]
        rngs[0]["cuda"] = [saved_cuda, *others]
    state["rng"] = rngs
    torch.save(state, state_file)
    saved = manifest.read_manifest(path)
    manifest.write_manifest(path, saved.step, {**saved.files, ckpt.TRAINER_STATE: manifest.file_digest(state_file)},
                            saved.fingerprint)
    ctx.put(checkpoint_step=saved.step, cuda_states_written=OLD_CUDA_DEVICES if saved_cuda is not None else 0)

    cfg = config(ctx, "run", *shape, "--training.steps=3")
    trainer = Trainer(cfg)
    try:
        restored = {"torch_rng_restored": torch.equal(torch.get_rng_state(), rngs[0]["torch"])}
        if saved_cuda is not None:
            restored["cuda_rng_restored"] = torch.equal(torch.cuda.get_rng_state(trainer.device), saved_cuda)
        ctx.put(resumed_from=str(trainer.resumed_from), resumed_at=trainer.step, **restored)
        result = trainer.train()
    finally:
        trainer.close()
    finite = all(math.isfinite(v) for v in result.losses.values())
    ctx.put(steps_done=result.steps_done, started_at=result.started_at, losses_finite=finite,
            last_loss=result.losses.get(result.steps_done))
    ctx.say(f"resumed at step {result.started_at} -> {result.steps_done}; "
            + ", ".join(f"{k} {v}" for k, v in restored.items()))
    assert trainer.resumed_from == path, f"resumed from {trainer.resumed_from}, not {path}"
    assert (result.started_at, result.steps_done) == (2, 3), (result.started_at, result.steps_done)
    assert all(restored.values()), restored
    assert finite, result.losses


def check_profile_dump(ctx: Context) -> None:
    """logging.profile_steps=3 of a 4-step run (on CUDA the allocator snapshot too): how long stopping
    the profiler and writing its files takes, their sizes, and `trainfit report --profile` on them."""
    from trainfit.train.profile import StepProfiler

    dumps: list[float] = []
    close = StepProfiler.close

    def timed_close(self: StepProfiler) -> None:
        start = time.perf_counter()
        close(self)
        dumps.append(time.perf_counter() - start)

    StepProfiler.close = timed_close  # type: ignore[method-assign]
    run = train(ctx, "profile", *ctx.model(), "--training.steps=4", "--logging.profile_steps=3")
    out = Path(run.cfg.logging.dir) / "profile"
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())} if out.is_dir() else {}
    ctx.put(dump_seconds=dumps[0] if dumps else None, files=",".join(files),
            **{f"bytes_{name}": size for name, size in files.items()}, run_seconds=run.seconds)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainfit", "report", "--profile", str(out), "--json"],
                          capture_output=True, text=True)
    ctx.put(report_rc=proc.returncode, report_seconds=time.perf_counter() - start)
    if proc.returncode == 0:
        rank0 = json.loads(proc.stdout)["ranks"][0]
        ctx.put(**{f"report_{k}": v for k, v in rank0.items() if isinstance(v, (int, float, str)) and k != "host"})
    else:
        print(proc.stdout + proc.stderr, file=sys.stderr)
    ctx.say(f"dump {dumps[0] if dumps else float('nan'):.2f} s, "
            + ", ".join(f"{n} {s / 2**20:.1f} MiB" for n, s in files.items()) + f"; report rc {proc.returncode}")
    assert files, f"no profile files in {out}"
    assert proc.returncode == 0, "trainfit report --profile failed"


def check_measure_snapshot(ctx: Context) -> None:
    """CUDA only: a measured step (trainfit measure's) recording the allocator's history, dumped as a
    snapshot for pytorch.org/memory_viz: the step's time with it, the file's size and entries."""
    from trainfit.train.trainer import measure_step

    cfg = config(ctx, "snapshot", *ctx.model())
    path = ctx.work / "measured.memory_snapshot.pickle"
    start = time.perf_counter()
    measurement = measure_step(cfg, steps=2, cuda_snapshot=path)
    seconds = time.perf_counter() - start
    free_memory()
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    entries = sum(len(trace) for trace in snapshot.get("device_traces", []))
    ctx.put(seconds=seconds, snapshot_bytes=path.stat().st_size, trace_entries=entries,
            segments=len(snapshot.get("segments", [])), peak_bytes=measurement.breakdown.peak)
    ctx.say(f"{seconds:.1f} s with the snapshot, {path.stat().st_size / 2**20:.1f} MiB, {entries} entries")
    path.unlink()


def check_calibrate(ctx: Context) -> None:
    """`trainfit calibrate --quick --max-ranks 1` (one process: no collectives): its wall time and the
    profile's key rates; the profile is kept beside the results."""
    out = ctx.result.parent / "calibrate-quick.toml"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--quick", "--max-ranks", "1",
                           "--out", str(out), "--force", "--json"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(proc.stderr, file=sys.stderr)
    assert proc.returncode == 0, f"calibrate exited {proc.returncode}"
    profile = json.loads(proc.stdout)
    rates = {f"matmul_{dtype}_tflops": rate / 1e12 for dtype, rate in profile["matmul_flops_per_s"].items()}
    attention = {}
    for a in profile.get("attention", []):
        key = f"attention_{a['dtype']}_tflops"
        attention[key] = max(attention.get(key, 0.0), a["flops_per_s"] / 1e12)
    fused = [o for o in profile.get("optimizer", []) if o["impl"] == "fused"]
    ctx.put(wall_seconds=seconds, profile_seconds=profile["machine"].get("seconds"),
            device=profile["machine"]["device"], name=profile["machine"]["name"], **rates, **attention,
            memory_gb_per_s=profile["memory_bytes_per_s"] / 1e9,
            adamw_fused_ns_per_param=fused[0]["s_per_param"] * 1e9 if fused else None, profile=out.name)
    ctx.say(f"{seconds:.0f} s; bf16 matmul {rates.get('matmul_bf16_tflops', 0):.3g} TFLOP/s, "
            f"{profile['memory_bytes_per_s'] / 1e9:,.0f} GB/s")


def check_zero1_nccl(ctx: Context) -> None:
    """`torchrun --nproc_per_node=1 -m trainfit train` at parallel.zero_stage=1 (one rank holds every
    shard: trainfit warns and makes no process group), then at zero_stage=3 with memory.offload=optimizer,
    which makes a 1-rank group through torchrun's store (nccl, with gloo for the host, on CUDA)."""
    runs = {"zero1": ("--parallel.zero_stage=1",),
            "zero3_offload": ("--parallel.zero_stage=3", "--memory.offload=optimizer")}
    failed = []
    for key, layout in runs.items():
        seen = ctx.work / f"{key}.json"
        args = ["--", "train", *ctx.small(), f"--training.device={ctx.device}", "--training.steps=3", *layout,
                "--training.eval_interval=0", "--checkpoint.interval=0", f"--checkpoint.dir={ctx.work / key / 'ckpt'}",
                f"--logging.dir={ctx.work / key / 'logs'}", "--logging.progress=false"]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                               __file__, "--torchrun-train", str(seen), *args], capture_output=True, text=True)
        print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
        group = json.loads(seen.read_text()) if seen.is_file() else {}
        records = [r for r in read_metrics(ctx.work / key / "logs") if "loss" in r]
        ctx.put(**{f"{key}_rc": proc.returncode, f"{key}_seconds": time.perf_counter() - start,
                   **{f"{key}_{k}": v for k, v in group.items()},
                   f"{key}_last_loss": records[-1]["loss"] if records else None,
                   f"{key}_no_effect_warning": "has no effect" in proc.stderr})
        if proc.returncode != 0 or not records or not math.isfinite(records[-1]["loss"]):
            failed.append(key)
    f = ctx.figures
    ctx.say(f"zero1 rc {f['zero1_rc']} (group: {f.get('zero1_process_group')}), zero3+offload rc "
            f"{f['zero3_offload_rc']} (backend {f.get('zero3_offload_backend')})")
    assert not failed, f"failed: {', '.join(failed)}"


def check_compile(ctx: Context) -> None:
    """training.compile=true against eager, 6 steps each: compile seconds, tokens/s, first losses."""
    steps = "--training.steps=6"
    eager = train(ctx, "eager", *ctx.model(), steps)
    compiled = train(ctx, "compiled", *ctx.model(), steps, "--training.compile=true")
    speedup = (compiled.result.tokens_per_s / eager.result.tokens_per_s
               if compiled.result.tokens_per_s and eager.result.tokens_per_s else None)
    ctx.put(eager_tokens_per_s=eager.result.tokens_per_s, compiled_tokens_per_s=compiled.result.tokens_per_s,
            compiled_over_eager=speedup, compile_seconds=compiled.result.compile_seconds,
            eager_loss_step1=eager.result.losses.get(1), compiled_loss_step1=compiled.result.losses.get(1),
            eager_peak_bytes=eager.result.peak_memory_bytes, compiled_peak_bytes=compiled.result.peak_memory_bytes,
            eager_seconds=eager.seconds, compiled_seconds=compiled.seconds)
    ctx.say(f"compile {compiled.result.compile_seconds:.1f} s; tok/s eager {eager.result.tokens_per_s or 0:,.0f}, "
            f"compiled {compiled.result.tokens_per_s or 0:,.0f}")
    assert compiled.result.compile_seconds > 0, "no step compiled"
    assert eager.finite() and compiled.finite(), (eager.result.losses, compiled.result.losses)


def check_softcap(ctx: Context) -> None:
    """Gemma 2's soft-capped, windowed attention (models/softcapped_attention.py): FlexAttention (compiled; on
    the CPU torch's unfused reference, forward only: no CPU backward in torch 2.13) against the eager form on
    the same fp32 inputs, outputs and (CUDA) input gradients; then 4 training steps of a Gemma 2 block on the
    device, which on CUDA run FlexAttention: finite, falling losses."""
    from trainfit.models.architecture import softcap_kernel
    from trainfit.models.common import window_mask
    from trainfit.models.softcapped_attention import eager_softcapped_attention, flex_softcapped_attention

    cuda = ctx.device == "cuda"
    B, H, G, T, K = (2, 8, 4, 1024, 64) if cuda else (1, 4, 2, 128, 16)
    window, cap = T // 4, 50.0
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v = (torch.randn(B, heads, T, K, device=ctx.device, generator=generator, requires_grad=cuda)
               for heads in (H, G, G))
    eager = eager_softcapped_attention(q, k, v, window_mask(T, window, q), None, cap)
    flex = flex_softcapped_attention(q, k, v, None, cap, window, compiled=cuda)
    ctx.put(kernel=softcap_kernel(ctx.device), output_max_abs_diff=float((flex - eager).abs().max()))
    assert torch.allclose(flex, eager, rtol=1e-3, atol=1e-4), float((flex - eager).abs().max())
    if cuda:
        grads = [torch.autograd.grad(out.square().sum(), (q, k, v)) for out in (eager, flex)]
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*grads, strict=True))
        ctx.put(grad_max_rel_diff=worst)
        assert worst < 1e-3, worst
    gemma2 = ("--model.norm_placement=sandwich", "--model.norm_offset=true", "--model.mlp_activation=gelu_tanh",
              "--model.embedding_scale=true", "--model.sliding_window=16", "--model.sliding_window_pattern=2",
              "--model.attention_softcap=50", "--model.final_softcap=30")
    run = train(ctx, "softcap", *DEBUG_RUN, *gemma2, "--training.steps=4", "--training.seq_len=64")
    ctx.put(losses=run.result.losses)
    ctx.say(f"softcapped attention: {softcap_kernel(ctx.device)} within {float((flex - eager).abs().max()):.1e} of "
            f"eager; losses {[round(x, 3) for x in run.result.losses.values()]}")
    assert run.finite() and run.result.losses[4] < run.result.losses[1], run.result.losses


# ---------------------------------------------------------------- the caching allocator near the device's limit

PRESSURE_HEADROOM = (0.30, 0.10, 0.05, 0.02)
"""Caps on the caching allocator, as shares above the step's allocated peak: from roomy to where it must free
its cache and retry (num_alloc_retries) to serve the step, or run out."""
PRESSURE_STEPS = 5
"""Timed training steps per cap (after one that settles the allocator at it)."""


def _allocator_counts(device: torch.device) -> tuple[int, int, int]:
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)


def _timed_steps(trainer: Trainer, steps: int) -> tuple[float, tuple[int, int, int]]:
    """Seconds per training step over `steps`, and the allocator's retries, cudaMalloc and cudaFree calls in them."""
    device = trainer.device
    trainer.train_step()
    torch.cuda.synchronize(device)
    before = _allocator_counts(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    after = _allocator_counts(device)
    return seconds, tuple(a - b for a, b in zip(after, before, strict=True))  # type: ignore[return-value]


def check_allocator_pressure(ctx: Context) -> None:
    """What the caching allocator's cache flushes cost near the device's limit: the GPU model's training step,
    its allocator capped (torch.cuda.set_per_process_memory_fraction) at shares above the step's allocated
    peak; per cap, seconds per step against the uncapped step, and the retries (each a device synchronization
    and cudaFree of every cached block), cudaMalloc and cudaFree calls per step. The time model does not price
    layouts within a few percent of the device (benchmarks/README.md, the Playbook's ranking): these are the
    figures it needs."""
    assert ctx.cuda, "needs CUDA: the caching allocator is CUDA's"
    trainer = NoFinalSave(config(ctx, "pressure", *ctx.model()))
    device = trainer.device
    try:
        free_s, counts = _timed_steps(trainer, PRESSURE_STEPS)
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.mem_get_info(device)[1]
        ctx.put(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, device_bytes=total,
                uncapped_step_s=free_s, uncapped_retries_per_step=counts[0] / PRESSURE_STEPS)
        shown = []
        for headroom in PRESSURE_HEADROOM:
            label = f"headroom_{round(headroom * 100)}pct"
            trainer.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, allocated * (1 + headroom) / total), device)
            try:
                seconds, (retries, mallocs, frees) = _timed_steps(trainer, PRESSURE_STEPS)
            except torch.cuda.OutOfMemoryError:
                ctx.put(**{f"{label}_status": "out of memory"})
                shown.append(f"{headroom:.0%}: OOM")
                break
            ctx.put(**{f"{label}_step_s": seconds, f"{label}_slowdown": seconds / free_s,
                       f"{label}_retries_per_step": retries / PRESSURE_STEPS,
                       f"{label}_cuda_malloc_per_step": mallocs / PRESSURE_STEPS,
                       f"{label}_cuda_free_per_step": frees / PRESSURE_STEPS})
            shown.append(f"{headroom:.0%}: {seconds / free_s:.2f}x, {retries / PRESSURE_STEPS:.1f} retries")
        ctx.say(f"step {free_s * 1e3:.1f} ms uncapped (reserved/allocated {reserved / allocated:.2f}); capped "
                + ", ".join(shown))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        trainer.close()
        free_memory()


def check_imports(ctx: Context) -> None:
    """Every trainfit module imports under this machine's torch (pyproject allows torch 2.6 and later; the
    first GPU run's torch 2.11 lacked a name one module imported): the failures, named."""
    import importlib
    import pkgutil

    import trainfit

    names = [m.name for m in pkgutil.walk_packages(trainfit.__path__, "trainfit.") if m.name != "trainfit.__main__"]
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # each module's error recorded; the check fails at the end
            failed[name] = first_line(err)
    ctx.put(modules=len(names), failed=len(failed), torch=torch.__version__,
            **{f"failed_{name}": error for name, error in failed.items()})
    ctx.say(f"{len(names) - len(failed)} of {len(names)} modules import under torch {torch.__version__}"
            + (f"; failed: {', '.join(failed)}" if failed else ""))
    assert not failed, failed


GPT_OSS_BLOCK = ("--model.preset=debug-moe", "--model.num_shared_experts=0", "--model.max_seq_len=256",
                 "--model.norm_fp32_gain=true", "--model.attention_sinks=true", "--model.qkv_bias=true",
                 "--model.attention_out_bias=true", "--model.router_bias=true", "--model.expert_bias=true",
                 "--model.swiglu_limit=7", "--model.sliding_window=64", "--model.sliding_window_pattern=2",
                 "--model.rope_scaling_type=yarn", "--model.rope_scaling_factor=4",
                 "--model.rope_original_max_seq_len=64", "--model.rope_yarn_truncate=false")
"""gpt-oss's block on the debug MoE model: sinks, biases, the clamped SwiGLU, alternating windows, YaRN."""


def check_gpt_oss(ctx: Context) -> None:
    """gpt-oss's block (models/eager_attention.py's sinks on every device, biased experts with the clamped
    SwiGLU, YaRN) in bf16-mixed on the device: 4 steps, finite falling losses, the measured step's peak beside
    the analytic estimate of the same config on this device."""
    from trainfit.units import fmt_bytes

    run = train(ctx, "gpt_oss", *GPT_OSS_BLOCK, "--precision.mode=bf16-mixed", "--training.seq_len=256",
                "--training.micro_batch_size=4", "--training.global_batch_size=4", "--training.steps=4",
                inspect=memory_seen)
    m = run.result.memory
    losses = list(run.result.losses.values())
    measured = {"peak_bytes": m.peak, "non_tensor_bytes": m.non_tensor,
                "estimated_over_measured_peak": run.seen["estimated_peak_bytes"] / m.peak} if m else {}
    ctx.put(loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None, **run.seen,
            **measured)
    ctx.say(f"losses {[round(x, 3) for x in run.result.losses.values()]}"
            + (f"; peak {fmt_bytes(m.peak)}, estimate {fmt_bytes(run.seen['estimated_peak_bytes'])}" if m else ""))
    assert run.finite() and run.result.losses[4] < run.result.losses[1], run.result.losses
    assert m is not None, "no measured step"


CHECKS: dict[str, Callable[[Context], None]] = {
    "imports": check_imports, "gpt_oss": check_gpt_oss, "sdpa": check_sdpa, "mfu": check_mfu,
    "memory": check_memory, "offload": check_offload,
    "resume_rng": check_resume_rng, "profile_dump": check_profile_dump, "measure_snapshot": check_measure_snapshot,
    "zero1_nccl": check_zero1_nccl, "calibrate": check_calibrate, "compile": check_compile, "fp8": check_fp8,
    "softcap": check_softcap, "host_time": check_host_time, "collective_latency": check_collective_latency,
    "fsdp_peak": check_fsdp_peak, "allocator_pressure": check_allocator_pressure,
}


# ---------------------------------------------------------------- entry points


def torchrun_train(seen: Path, args: list[str]) -> int:
    """`trainfit train ARGS` as torchrun's worker, writing the process group it trained in to `seen`."""
    from trainfit import cli

    close = Trainer.close

    def recording_close(self: Trainer) -> None:
        if self.world.is_main:
            seen.write_text(json.dumps(process_group(self)))
        close(self)

    Trainer.close = recording_close  # type: ignore[method-assign]
    return cli.main(args)


def main() -> int:
    if sys.argv[1:2] == ["--torchrun-train"]:
        return torchrun_train(Path(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--work", type=Path, required=True, help="scratch folder of this check")
    parser.add_argument("--result", type=Path, required=True, help="JSON file of the figures")
    parser.add_argument("--time-s", type=float, default=600, help="time the check may take")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.device, args.work, args.result, time.monotonic() + args.time_s - EXIT_S)
    ctx.write()
    CHECKS[args.check](ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
