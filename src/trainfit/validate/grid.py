"""The configurations `trainfit validate` measures, built torch-free from a description of the device.

One dense and one MoE Llama, each at several techniques: fp32, bf16-mixed, fp8-mixed, every
activation-checkpointing policy, the chunked loss, torch.compile and optimizer offload. On a GPU
the models are sized from the analytic estimate so that every point's predicted peak fills 20-60%
of the device's memory (GPU-sized work, far from an out-of-memory error); on the CPU they are the
debug presets, so the same grid runs in seconds. A point the device cannot run carries the reason
it is skipped; none is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import estimate

FILL = (0.20, 0.60)
"""The fraction of device memory every GPU point's analytic peak must lie in."""
FILL_TARGET = 0.40
"""Where each point's micro-batch puts its analytic peak, as closely as the ladder allows."""
STATES_FILL = 0.30
"""The largest fraction of device memory the sized model's base point (bf16-mixed, no
checkpointing, one sequence) may take: room left for the activations of a few sequences."""
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
"""The micro-batch sizes a GPU point chooses from."""
MAX_LAYERS = 64
FALLBACK_GPU = "H100-SXM-80GB"
"""hardware.gpu for a GPU the catalog does not hold: its figures, with the device's own memory
(and the calibrated profile's rates when calibrate ran)."""

GPU_SEQ_LEN = 2048
DENSE_SHAPE = ("--model.preset=", "--model.family=llama", "--model.dim=2048", "--model.num_heads=16",
               "--model.num_kv_heads=8", "--model.ffn_dim=5632", "--model.vocab_size=32000",
               f"--model.max_seq_len={GPU_SEQ_LEN}")
"""Llama-style dims, every linear a multiple of 16 (fp8-mixed converts them all); the 32,000-row
vocabulary (the byte tokenizer uses 256 of them) makes the logits large, as in real models."""
MOE_SHAPE = (*DENSE_SHAPE, "--model.num_experts=8", "--model.experts_per_token=2", "--model.expert_ffn_dim=1408",
             "--model.capacity_factor=1.25")
"""8 experts, top-2, with a capacity factor: memory bounded without assuming a routing (dropless
routing is estimated at its worst case)."""
CPU_RUN = ("--training.seq_len=32", "--training.micro_batch_size=4", "--memory.loss_chunk_tokens=32")
CPU_MODELS = {"dense": ("--model.preset=debug",),
              "moe": ("--model.preset=debug-moe", "--model.capacity_factor=1.25")}
COMMON = ("--training.warmup_steps=2", "--training.eval_interval=0", "--checkpoint.resume=never",
          "--logging.progress=false")


@dataclass(frozen=True)
class DeviceInfo:
    """What the grid needs to know of the device (trainfit.validate.machine.device_info reads it)."""

    kind: str
    """cuda | cpu."""
    name: str
    memory_bytes: int = 0
    """The GPU's total memory (cudaMemGetInfo); 0 on the CPU."""
    catalog_gpu: str | None = None
    """The catalog entry of the GPU (trainfit.hardware.catalog_gpu_of), None when it has none."""
    fp8_reason: str | None = None
    """Why fp8-mixed cannot run here; None where it can."""
    compile_reason: str | None = None
    """Why torch.compile cannot run here; None where it can."""


@dataclass(frozen=True)
class Point:
    name: str
    model: str
    """dense | moe."""
    technique: str
    """What the point exercises, in words."""
    overrides: tuple[str, ...]
    """The whole configuration, as --section.field=value (the run folders are the runner's)."""
    skip: str | None = None
    """Why the point is not run on this device; None: it runs."""
    analytic_peak: int = 0
    """The analytic estimate's peak at the chosen micro-batch (bytes)."""
    caveat: str | None = None
    """What to keep in mind when comparing its figures on this device."""


@dataclass(frozen=True)
class Grid:
    device: DeviceInfo
    hardware: tuple[str, ...]
    """hardware.* overrides every point shares (the calibrated profile is added by the runner)."""
    models: dict[str, tuple[str, ...]]
    """The sized models' overrides, by name."""
    points: list[Point]
    notes: list[str]


# (name, model, technique, overrides on top of the model). Compile last: it is the slowest.
TECHNIQUES: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("dense-fp32", "dense", "fp32", ("--precision.mode=fp32",)),
    ("dense-bf16", "dense", "bf16-mixed", ("--precision.mode=bf16-mixed",)),
    ("dense-bf16-selective", "dense", "bf16-mixed, selective checkpointing",
     ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=selective")),
    ("dense-bf16-selective-alternate", "dense", "bf16-mixed, selective-alternate checkpointing",
     ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=selective-alternate")),
    ("dense-bf16-full", "dense", "bf16-mixed, full checkpointing",
     ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=full")),
    ("dense-bf16-full-every2", "dense", "bf16-mixed, full checkpointing of every 2nd block",
     ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=full", "--memory.ac_every_n_layers=2")),
    ("dense-bf16-chunked-loss", "dense", "bf16-mixed, chunked loss",
     ("--precision.mode=bf16-mixed", "--memory.chunked_loss=true")),
    ("dense-fp8", "dense", "fp8-mixed (tensorwise)", ("--precision.mode=fp8-mixed",)),
    ("dense-bf16-offload", "dense", "bf16-mixed, ZeRO-3 in one process, optimizer offloaded to the host",
     ("--precision.mode=bf16-mixed", "--parallel.zero_stage=3", "--memory.offload=optimizer")),
    ("moe-bf16", "moe", "bf16-mixed", ("--precision.mode=bf16-mixed",)),
    ("moe-bf16-full", "moe", "bf16-mixed, full checkpointing",
     ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=full")),
    ("dense-bf16-compile", "dense", "bf16-mixed, torch.compile per block",
     ("--precision.mode=bf16-mixed", "--training.compile=true")),
]
POINT_NAMES = [name for name, *_ in TECHNIQUES]
CPU_CAVEATS = {"dense-bf16-offload": "on the CPU the host is the device: the measured peak holds the offloaded "
                                     "optimizer states, which the estimates leave off the device"}
CPU_SLOW = {"dense-bf16-compile": "CPU mode leaves out inductor's compile (slow on a CPU); "
                                  "`--only dense-bf16-compile` runs it"}


def analytic_peak(overrides: tuple[str, ...] | list[str]) -> int:
    """The analytic estimate's peak of a configuration (bytes)."""
    return estimate(load_config(None, list(overrides))).worst.peak


def sized_layers(shape: tuple[str, ...], hardware: tuple[str, ...], memory_bytes: int) -> int:
    """The most blocks for which `shape` at bf16-mixed, no checkpointing and one sequence of
    GPU_SEQ_LEN tokens stays within STATES_FILL of the device's memory (at least 2)."""
    def peak(layers: int) -> int:
        return analytic_peak((*shape, *hardware, f"--model.num_layers={layers}", *_gpu_batch(1),
                              "--precision.mode=bf16-mixed"))

    best = 2
    for layers in range(2, MAX_LAYERS + 1):
        if peak(layers) > STATES_FILL * memory_bytes:
            break
        best = layers
    return best


def _gpu_batch(micro_batch: int) -> tuple[str, ...]:
    return (f"--training.seq_len={GPU_SEQ_LEN}", f"--training.micro_batch_size={micro_batch}",
            f"--training.global_batch_size={micro_batch}")


def fitted_micro_batch(overrides: tuple[str, ...], memory_bytes: int) -> tuple[int, int]:
    """(micro-batch, analytic peak): the ladder's micro-batch whose peak is nearest FILL_TARGET of the
    device's memory among those inside FILL (the smaller on a tie); outside FILL only if none is."""
    peaks = [(mb, analytic_peak((*overrides, *_gpu_batch(mb)))) for mb in MICRO_BATCHES]
    inside = [p for p in peaks if FILL[0] * memory_bytes <= p[1] <= FILL[1] * memory_bytes]
    return min(inside or peaks, key=lambda p: abs(p[1] - FILL_TARGET * memory_bytes))


def gpu_hardware(device: DeviceInfo) -> tuple[tuple[str, ...], list[str]]:
    """hardware.* for the estimates of every point on this GPU, and what was assumed."""
    gib = device.memory_bytes / 1024**3
    if device.catalog_gpu is not None:
        return (f"--hardware.gpu={device.catalog_gpu}", f"--hardware.memory_gib={gib:.3f}"), []
    return ((f"--hardware.gpu={FALLBACK_GPU}", f"--hardware.memory_gib={gib:.3f}"),
            [f"{device.name} is not in the catalog: the estimates use {FALLBACK_GPU}'s figures with this device's "
             "memory (and the calibrated profile's rates where calibrate ran)"])


def _skip(extra: tuple[str, ...], device: DeviceInfo) -> str | None:
    """Why the device cannot run a point with these technique overrides; None where it can."""
    if "--precision.mode=fp8-mixed" in extra and device.fp8_reason:
        return device.fp8_reason
    if "--training.compile=true" in extra and device.compile_reason:
        return device.compile_reason
    return None


def build_grid(device: DeviceInfo) -> Grid:
    """Every point of the grid for `device`, sized on a GPU, the debug models on the CPU."""
    common = (*COMMON, f"--training.device={device.kind}")
    if device.kind == "cuda":
        hardware, notes = gpu_hardware(device)
        models = {model: (*shape, f"--model.num_layers={sized_layers(shape, hardware, device.memory_bytes)}")
                  for model, shape in (("dense", DENSE_SHAPE), ("moe", MOE_SHAPE))}
    else:
        hardware, notes = (), ["CPU mode: the debug models (no device memory to fill)"]
        models = {model: (*shape, *CPU_RUN) for model, shape in CPU_MODELS.items()}
    points = []
    for name, model, technique, extra in TECHNIQUES:
        overrides = (*models[model], *common, *hardware, *extra)
        skip = _skip(extra, device) or (CPU_SLOW.get(name) if device.kind == "cpu" else None)
        peak = 0  # a point the device cannot run may have no estimate here either (fp8 on a GPU without it)
        if device.kind == "cuda":
            mb = 1
            with contextlib.suppress(*((ConfigError,) if skip else ())):
                mb, peak = fitted_micro_batch(overrides, device.memory_bytes)
            overrides = (*overrides, *_gpu_batch(mb))
        else:
            peak = analytic_peak(overrides)
        caveat = CPU_CAVEATS.get(name) if device.kind == "cpu" else None
        points.append(Point(name, model, technique, overrides, skip, peak, caveat))
    return Grid(device, hardware, models, points, notes)


def select(grid: Grid | None, only: list[str], extra: list[str]) -> list[str]:
    """The names `--only` asks for, in the grid's order (the runner's own steps, `extra`, first); a
    name that is neither is an error naming the choices. No grid: every device's point names."""
    known = [*extra, *(p.name for p in grid.points)] if grid is not None else [*extra, *POINT_NAMES]
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ConfigError(f"--only {','.join(unknown)}: no such step or grid point; choose from {', '.join(known)}")
    return [n for n in known if n in only]


def with_cpu_slow_included(grid: Grid, names: list[str]) -> Grid:
    """A CPU grid in which the points named explicitly (--only) run even if CPU mode leaves them out."""
    points = [dataclasses.replace(p, skip=None) if p.name in names and p.skip == CPU_SLOW.get(p.name) else p
              for p in grid.points]
    return dataclasses.replace(grid, points=points)
