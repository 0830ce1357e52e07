"""A measured hardware profile: what `trainfit calibrate` measured on one machine, as TOML. Torch-free.

trainfit.calibrate.machine measures and writes it; config validation reads it (hardware.profile) and
trainfit.hardware uses its figures in place of the catalog's. The TOML layout is the dataclasses'
own (field names are the keys), so the file, `trainfit calibrate --json` and `HardwareProfile`
read alike:

    version = 1
    memory_bytes_per_s = 1.5e10       # large elementwise copy/add, read + write bytes
    [machine]                         # device, name, cores, threads, torch, date, quick, seconds
    [matmul_flops_per_s]              # best sustained rate per dtype: fp32, bf16, fp16 (and fp8)
    [[matmul_shapes]]                 # dtype, m, k, n, flops_per_s: one per GEMM shape measured
    [[matmul_backward]]               # dtype, m, k, n, input_grad_flops_per_s, weight_grad_flops_per_s
    [[attention]]                     # dtype, batch, heads, seq_len, head_dim, flops_per_s: causal SDPA
    [[optimizer]]                     # name, impl, dtype, s_per_param, step_s, params, seconds
    [link]                            # bytes_per_s, latency_s: one link fitting every collective
    [[collectives]]                   # kind, world_size, bytes_per_s, latency_s, nbytes, seconds
    [[concurrency]]                   # ranks, matmul, bandwidth: one rank's rates among others, as fractions
    [[host_overhead]]                 # ranks, kind, block_s, root_s: DTensor's and FSDP2's host work

Bandwidths are per direction and latencies per step of trainfit.perf.comms's cost model
(time = a0 + steps x latency + factor x bytes / bandwidth). Every number is finite and >= 0, every
rate (a name ending in _per_s) > 0; [link] and [[collectives]] are absent when no collectives ran.
"""

from __future__ import annotations

import functools
import math
import os
import stat
import tomllib
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from trainfit.config.dump import dump_toml, write_atomic
from trainfit.config.schema import ConfigError, field_error

PROFILE_VERSION = 1
MATMUL_DTYPES = ("fp32", "bf16", "fp16")
"""Dtypes every profile measures; fp8 only where torch._scaled_mm runs on the device."""


@dataclass(frozen=True)
class Machine:
    device: str
    """cpu | cuda: the torch device measured."""
    name: str
    """The processor's or GPU's model name."""
    cores: int
    threads: int
    """torch threads of the measuring process (and of each collective rank)."""
    torch: str
    date: str
    quick: bool
    """Measured with `--quick` (fewer, smaller samples)."""
    seconds: float
    """How long the calibration took."""


@dataclass(frozen=True)
class MatmulShape:
    """One GEMM, (m x k) @ (k x n): tokens x dim by dim x dim or dim x 4 dim."""

    dtype: str
    m: int
    k: int
    n: int
    flops_per_s: float


@dataclass(frozen=True)
class MatmulBackward:
    """The backward GEMMs of one linear layer's (m x k) @ (k x n): the input gradient (m x n) @ (n x k)
    and the weight gradient (n x m) @ (m x k), each 2mkn FLOPs; their memory layouts differ from the
    forward's, and CPU kernels for 16-bit dtypes run them at very different rates."""

    dtype: str
    m: int
    k: int
    n: int
    input_grad_flops_per_s: float
    weight_grad_flops_per_s: float


@dataclass(frozen=True)
class AttentionShape:
    """One causal scaled_dot_product_attention, forward and backward, on the kernel training picks:
    flops_per_s counts trainfit.perf.flops's attention FLOPs (causal half, fused backward 2.5x)."""

    dtype: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    flops_per_s: float


@dataclass(frozen=True)
class LinkFit:
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class CollectiveFit:
    """One collective kind at one world size: the fit and the points it was fitted to."""

    kind: str
    """A key of trainfit.perf.comms.KINDS."""
    world_size: int
    bytes_per_s: float
    latency_s: float
    nbytes: tuple[int, ...]
    """Message sizes as trainfit.perf.comms's cost functions define them."""
    seconds: tuple[float, ...]
    """Measured time of one call at each size."""


@dataclass(frozen=True)
class OptimizerFit:
    """seconds of one optimizer step = step_s + s_per_param x params, fitted to the points."""

    name: str
    impl: str
    """fused | foreach."""
    dtype: str
    s_per_param: float
    step_s: float
    params: tuple[int, ...]
    seconds: tuple[float, ...]


@dataclass(frozen=True)
class Concurrency:
    """One rank's compute rates while `ranks` ranks of one machine compute at once, as fractions of
    its rates alone: on a CPU, ranks share caches, memory bandwidth and (beyond the cores) the
    cores themselves; GPUs share none of these."""

    ranks: int
    matmul: float
    """The fp32 matmul rate of ranks in step (each batch as long as its slowest rank's) over one
    rank's alone."""
    bandwidth: float
    """The same for copy bandwidth."""


HOST_KINDS = ("tensor_parallel", "sequence_parallel", "fully_shard")
"""What adds host work: DTensor's dispatch under tensor parallelism (without and with sequence
parallelism), FSDP2's hooks around its units."""


@dataclass(frozen=True)
class HostOverhead:
    """Host seconds of one forward and backward that a parallel framework adds to a rank beyond its
    compute and collectives, measured on `ranks` ranks in one group (trainfit.calibrate.host)."""

    ranks: int
    kind: str
    """One of HOST_KINDS."""
    block_s: float
    """Per transformer block (its tensor-parallel modules, or its fully_shard unit)."""
    root_s: float
    """The rest of the model's: embedding, output projection and loss (the root unit)."""


@dataclass(frozen=True)
class HardwareProfile:
    version: int
    machine: Machine
    matmul_flops_per_s: dict[str, float]
    """Best sustained matmul rate per dtype over matmul_shapes: the peak estimate uses."""
    matmul_shapes: tuple[MatmulShape, ...]
    memory_bytes_per_s: float
    optimizer: tuple[OptimizerFit, ...]
    link: LinkFit | None = None
    """The one bandwidth and latency per step that best fit every collective measured (relative
    error): what estimate uses as the intra-node link. None when no collectives ran."""
    collectives: tuple[CollectiveFit, ...] = ()
    attention: tuple[AttentionShape, ...] = ()
    """Absent from profiles written before it was measured: attention then runs at the matmul rate."""
    matmul_backward: tuple[MatmulBackward, ...] = ()
    """Absent from profiles written before they were measured (and for fp8): backward GEMMs then run
    at the forward's rate."""
    concurrency: tuple[Concurrency, ...] = ()
    """Per world size measured (2..max ranks); absent from profiles written before it was measured:
    ranks then slow down only where ranks x threads exceed the cores."""
    host_overhead: tuple[HostOverhead, ...] = ()
    """Per world size measured (2..max ranks, as far as ranks x threads fit the cores) and HOST_KINDS;
    absent from profiles written before it was measured: parallelism then costs its compute and
    collectives only."""

    def as_dict(self) -> dict[str, Any]:
        """The profile as plain data (dicts, tuples), keys in the TOML's order; no None values."""
        return {k: v for k, v in asdict(self).items() if v is not None}


# ---------------------------------------------------------------- writing


def to_toml(profile: HardwareProfile) -> str:
    return dump_toml(profile.as_dict(), "Measured by `trainfit calibrate`; use it with --hardware.profile=FILE "
                                        "(trainfit.hardware_profile).")


def write_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write atomically (config/dump.write_atomic): a crash mid-write leaves any earlier profile whole."""
    return write_atomic(path, to_toml(profile))


# ---------------------------------------------------------------- reading


class _Bad(Exception):
    """A problem at a place in the file (e.g. collectives[1].bytes_per_s)."""


def _read(cls: type, raw: object, where: str) -> Any:
    """A dataclass from its TOML table, every field checked against its type hint."""
    if not isinstance(raw, dict):
        raise _Bad(f"{where} must be a table")
    hints = typing.get_type_hints(cls)
    unknown = sorted(raw.keys() - hints.keys())
    if unknown:
        raise _Bad(f"unknown key {where + '.' if where else ''}{unknown[0]}")
    values = {}
    for f in fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name in raw:
            values[f.name] = _value(hints[f.name], raw[f.name], name, rate=f.name.endswith("_per_s"))
        elif f.default is MISSING:
            raise _Bad(f"{name} is missing")
    return cls(**values)


def _value(hint: Any, raw: object, where: str, *, rate: bool) -> Any:
    """One value of a type hint; a rate (a field named *_per_s, or a value of one) must be > 0."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:  # X | None, present: an X
        return _value(next(a for a in args if a is not type(None)), raw, where, rate=rate)
    if is_dataclass(hint):
        return _read(hint, raw, where)
    if origin is tuple:
        if not isinstance(raw, list):
            raise _Bad(f"{where} must be an array")
        return tuple(_value(args[0], v, f"{where}[{i}]", rate=rate) for i, v in enumerate(raw))
    if origin is dict:
        if not isinstance(raw, dict):
            raise _Bad(f"{where} must be a table")
        return {k: _value(args[1], v, f"{where}.{k}", rate=rate) for k, v in raw.items()}
    if hint is str or hint is bool:
        if not isinstance(raw, hint):
            raise _Bad(f"{where}={raw!r} must be {'a string' if hint is str else 'true or false'}")
        return raw
    if isinstance(raw, bool) or not isinstance(raw, int | float) or hint is int and not isinstance(raw, int):
        raise _Bad(f"{where}={raw!r} must be {'an integer' if hint is int else 'a number'}")
    if not math.isfinite(raw) or raw < 0 or rate and raw == 0:
        raise _Bad(f"{where}={raw!r} must be a finite number {'> 0' if rate else '>= 0'}")
    return hint(raw)


def _check(profile: HardwareProfile) -> None:
    """What the types cannot say: the dtypes estimate needs, fits with their points."""
    missing = [d for d in MATMUL_DTYPES if d not in profile.matmul_flops_per_s]
    if missing:
        raise _Bad(f"matmul_flops_per_s has no {missing[0]}")
    for i, c in enumerate(profile.collectives):
        if len(c.nbytes) != len(c.seconds) or not c.nbytes:
            raise _Bad(f"collectives[{i}]: nbytes and seconds must be non-empty arrays of one length")
    for i, o in enumerate(profile.optimizer):
        if len(o.params) != len(o.seconds) or not o.params:
            raise _Bad(f"optimizer[{i}]: params and seconds must be non-empty arrays of one length")
    for i, c in enumerate(profile.concurrency):
        if c.ranks < 2 or c.matmul <= 0 or c.bandwidth <= 0:
            raise _Bad(f"concurrency[{i}]: ranks must be >= 2 and matmul and bandwidth fractions > 0")
    for i, h in enumerate(profile.host_overhead):
        if h.ranks < 2 or h.kind not in HOST_KINDS:
            raise _Bad(f"host_overhead[{i}]: ranks must be >= 2 and kind one of {', '.join(HOST_KINDS)}")


def load_profile(path: str) -> HardwareProfile:
    """The profile at `path` (hardware.profile), checked; a ConfigError naming hardware.profile otherwise.

    Cached per file state (path, inode, size, modification time; an atomic rewrite is a new inode): the
    estimator reads it at every call, and the planner estimates thousands of layouts.
    """
    fix = f"write one with `trainfit calibrate --out {path}`"
    try:
        info = os.stat(path)
    except OSError as err:
        raise field_error("hardware.profile", path, f"cannot read it ({err.strerror}); {fix}") from err
    if stat.S_ISDIR(info.st_mode):
        raise field_error("hardware.profile", path,
                          "is a folder; give a profile file (`trainfit calibrate --out FILE` writes one)")
    return _load(path, info.st_ino, info.st_size, info.st_mtime_ns)


def is_profile(path: str | Path) -> bool:
    """Whether the file at `path` is a hardware profile (of any version): a TOML file with an integer
    version, as `trainfit calibrate` writes. Only such a file is ever replaced (--force)."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return False
    return _has_version(raw)


def _has_version(raw: dict[str, Any]) -> bool:
    return isinstance(raw.get("version"), int) and not isinstance(raw.get("version"), bool)


@functools.lru_cache(maxsize=16)
def _load(path: str, inode: int, size: int, mtime_ns: int) -> HardwareProfile:
    redo = f"re-run `trainfit calibrate --out {path} --force`"
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as err:
        raise field_error("hardware.profile", path, f"not a TOML profile ({err}); give a file that `trainfit "
                          "calibrate --out NEW_FILE` wrote (a new path: calibrate replaces only a profile)") from err
    if not _has_version(raw):
        raise field_error("hardware.profile", path, "not a hardware profile (no version); give a file that "
                          "`trainfit calibrate --out NEW_FILE` wrote (a new path: calibrate replaces only a profile)")
    if raw.get("version") != PROFILE_VERSION:
        raise field_error("hardware.profile", path, f"version {raw.get('version')!r}, this trainfit reads version "
                                                    f"{PROFILE_VERSION}; {redo}")
    try:
        profile = _read(HardwareProfile, raw, "")
        _check(profile)
    except _Bad as err:
        raise field_error("hardware.profile", path, f"{err}; {redo}") from None
    return profile


def check_matches_device(profile: HardwareProfile, path: str, gpu: str) -> None:
    """A CPU profile cannot stand for a GPU, nor a GPU's for the CPU (hardware.gpu)."""
    if (profile.machine.device == "cpu") != (gpu == "cpu"):
        raise ConfigError(f"hardware.profile={path!r} was measured on {profile.machine.device} "
                          f"({profile.machine.name}) but hardware.gpu={gpu!r}: set hardware.gpu to the device "
                          "measured, or calibrate on this one")
