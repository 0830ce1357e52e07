"""`trainfit calibrate` and hardware.profile: the profile's TOML, a real quick calibration (2 gloo
ranks), the fits against perf/comms.py's cost model, and what a profile changes in the estimate; what
a GPU would measure, its batches sized warm and its memory checked, stood in for on this CPU."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

from _profiles import profile
from trainfit import hardware
from trainfit.calibrate import machine
from trainfit.calibrate.comms import fit_link, fit_nonnegative, model_terms
from trainfit.calibrate.probe import median_seconds, synchronized_median_seconds
from trainfit.calibrate.settings import CUDA_DEFAULT, CUDA_QUICK, DEFAULT, QUICK, Settings, settings_for
from trainfit.cli import main
from trainfit.config import ConfigError, HardwareConfig
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.fp8_matmul import DEADLINE_S, PROBE_SHAPE, Fp8MatmulRates
from trainfit.hardware_profile import (
    HOST_KINDS,
    CollectiveFit,
    Concurrency,
    HardwareProfile,
    HostOverhead,
    LinkFit,
    MatmulShape,
    load_profile,
    to_toml,
    write_profile,
)
from trainfit.parallel.resolve import build_layout
from trainfit.perf.comms import collective_time
from trainfit.perf.kernels import elementwise_bytes

KINDS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}


def write(tmp_path: Path, p: HardwareProfile, name: str = "hw.toml") -> str:
    return str(write_profile(p, tmp_path / name))


# ---------------------------------------------------------------- the file


def test_toml_roundtrip_and_atomic_write(tmp_path: Path) -> None:
    p = profile()
    path = write(tmp_path, p)
    assert load_profile(path) == p
    assert [f.name for f in tmp_path.iterdir()] == ["hw.toml"]  # no temp file left beside it
    assert load_profile(write(tmp_path, profile(link=None, collectives=()), "none.toml")).link is None
    together = profile(concurrency=(Concurrency(2, 0.875, 0.5), Concurrency(4, 0.25, 0.125)),
                       host_overhead=(HostOverhead(2, "tensor_parallel", 0.015, 0.004),
                                      HostOverhead(2, "fully_shard", 0.0175, 0.0078125)))
    assert load_profile(write(tmp_path, together, "together.toml")) == together
    assert to_toml(p).startswith("# Measured by `trainfit calibrate`")


def test_a_profile_is_read_once_per_file_state(tmp_path: Path) -> None:
    path = write(tmp_path, profile())
    assert load_profile(path) is load_profile(path)
    write(tmp_path, profile(memory_bytes_per_s=2e10))
    assert load_profile(path).memory_bytes_per_s == 2e10


BAD = [  # (what the file holds, words of the error)
    (None, ("hardware.profile", "cannot read it", "trainfit calibrate --out")),
    ("version = 1\n[machine\n", ("not a TOML profile",)),
    ("version = 2\n", ("version 2", "reads version 1")),
    ("memory_bytes_per_s = 1e10\n", ("not a hardware profile", "calibrate --out NEW_FILE")),
]


@pytest.mark.parametrize(("content", "says"), BAD)
def test_unreadable_profiles_are_named_errors(content: str | None, says: tuple[str, ...], tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--hardware.profile={path}"])
    assert str(err.value).startswith(f"hardware.profile={str(path)!r}: ")
    for words in says:
        assert words in str(err.value)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.replace("memory_bytes_per_s = 15000000000.0", "memory_bytes_per_s = -1.0"),
         "memory_bytes_per_s=-1.0 must be a finite number > 0"),
        (lambda t: t.replace("fp32 = 50000000000.0", "fp32 = 0"),
         "matmul_flops_per_s.fp32=0 must be a finite number > 0"),
        (lambda t: t.replace("latency_s = 0.0001", "latency_s = -0.0001", 1), "link.latency_s=-0.0001 must be"),
        (lambda t: t.replace("cores = 2", 'cores = "two"'), "machine.cores='two' must be an integer"),
        (lambda t: t.replace("world_size = 2", "world_size = 2.5"), "collectives[0].world_size=2.5 must be an integer"),
        (lambda t: t.replace("step_s = 2e-05", "step_s = nan"), "optimizer[0].step_s=nan must be a finite number"),
        (lambda t: t.replace("bf16 = 2000000000.0\n", ""), "matmul_flops_per_s has no bf16"),
        (lambda t: t.replace("memory_bytes_per_s", "memory_bytes_per_sec"), "unknown key memory_bytes_per_sec"),
        (lambda t: t.replace('name = "adamw"\n', ""), "optimizer[0].name is missing"),
        (lambda t: t.replace("seconds = [0.00022, 0.0012]", "seconds = [0.00022]"),
         "collectives[0]: nbytes and seconds must be non-empty arrays of one length"),
        (lambda t: t.replace("host_overhead = []",
                             'host_overhead = [{ranks = 2, kind = "pipeline", block_s = 0.01, root_s = 0.0}]'),
         "host_overhead[0]: ranks must be >= 2 and kind one of tensor_parallel, sequence_parallel, fully_shard"),
    ],
)
def test_bad_numbers_and_keys_name_the_field(edit, says: str, tmp_path: Path) -> None:
    text = to_toml(profile())
    path = tmp_path / "hw.toml"
    path.write_text(edit(text))
    assert path.read_text() != text
    with pytest.raises(ConfigError, match=r"^hardware\.profile=.*hw\.toml'") as err:
        load_config(None, [f"--hardware.profile={path}"])
    assert says in str(err.value) and "trainfit calibrate --out" in str(err.value)


def test_a_cpu_profile_cannot_stand_for_a_gpu(tmp_path: Path) -> None:
    path = write(tmp_path, profile())
    with pytest.raises(ConfigError, match="measured on cpu .* but hardware.gpu='H100-SXM-80GB'"):
        load_config(None, [f"--hardware.profile={path}", "--hardware.gpu=H100-SXM-80GB"])


# ---------------------------------------------------------------- what hardware.py makes of it


def test_measured_figures_replace_the_catalog_and_overrides_still_win(tmp_path: Path) -> None:
    path = write(tmp_path, profile())
    hw = HardwareConfig(profile=path)
    assert hardware.peak_flops(hw, "fp32") == 5e10 and hardware.peak_flops(hw, "bf16-mixed") == 2e9
    assert hardware.compute_efficiency(hw) == 1.0
    assert hardware.device_spec(hw).hbm_bytes_per_s == 1.5e10
    assert hardware.intra_node_link(hw) == hardware.Link("measured", 1e9, 1e-4)  # comm efficiency 1: measured
    assert hardware.inter_node_link(hw) == hardware.inter_node_link(HardwareConfig())  # one machine: no network

    custom = HardwareConfig(profile=path, peak_tflops=0.2, compute_efficiency=0.7, hbm_tbps=0.05,
                            intra_node_gbps=2, intra_node_latency_us=50, comm_efficiency=0.5)
    assert hardware.peak_flops(custom, "fp32") == pytest.approx(2e11)
    assert hardware.compute_efficiency(custom) == 0.7
    assert hardware.device_spec(custom).hbm_bytes_per_s == 5e10
    assert hardware.intra_node_link(custom) == hardware.Link("measured", 1e9, pytest.approx(5e-5))
    preset = HardwareConfig(profile=path, intra_node_link="pcie4")
    assert hardware.intra_node_link(preset).name == "pcie4"
    no_link = HardwareConfig(profile=write(tmp_path, profile(link=None, collectives=()), "none.toml"))
    assert hardware.intra_node_link(no_link) == hardware.intra_node_link(HardwareConfig())


def test_fp8_without_a_measured_rate_says_so(tmp_path: Path) -> None:
    hw = HardwareConfig(profile=write(tmp_path, profile()))
    with pytest.raises(ConfigError, match=r"precision.mode='fp8-mixed': hardware.profile=.* has no fp8 matmul rate"):
        hardware.peak_flops(hw, "fp8-mixed")


# ---------------------------------------------------------------- what is measured, and how long


def test_a_gpu_measures_gpu_sized_work_and_a_cpu_its_own() -> None:
    """CUDA: GEMMs of 4096-8192 tokens and dims, attention over 4096-8192 tokens at head dim 128 (and a
    smaller one), collectives up to 1 GiB; --quick a subset of it. A CPU keeps its own small settings."""
    assert settings_for("cpu", quick=False) is DEFAULT and settings_for("cpu", quick=True) is QUICK
    assert settings_for("cuda", quick=False) is CUDA_DEFAULT and settings_for("cuda", quick=True) is CUDA_QUICK
    for s in (CUDA_DEFAULT, CUDA_QUICK):
        assert all(4096 <= d <= 8192 for shape in s.shapes for d in shape), s.shapes
        assert {head_dim for *_, head_dim in s.attention_shapes} == {128}
        assert all(seq <= 8192 for _, _, seq, _ in s.attention_shapes)
        assert list(s.message_bytes) == sorted(s.message_bytes)
    assert {(1, 32, 4096, 128), (1, 32, 8192, 128)} < set(CUDA_DEFAULT.attention_shapes)
    assert min(seq for _, _, seq, _ in CUDA_DEFAULT.attention_shapes) < 4096  # the small one
    assert (8192, 8192) in CUDA_DEFAULT.shapes and max(CUDA_DEFAULT.message_bytes) == 2**30
    for field in ("shapes", "attention_shapes", "message_bytes"):
        assert set(getattr(CUDA_QUICK, field)) <= set(getattr(CUDA_DEFAULT, field)), field
    # a CPU's largest GEMM stays below a GPU's smallest, and its attention and messages below a GPU's
    cpu_gemm = max(m * d * 4 * d for s in (DEFAULT, QUICK) for m, d in s.shapes)
    assert cpu_gemm < min(m * d * d for s in (CUDA_DEFAULT, CUDA_QUICK) for m, d in s.shapes)
    assert max(seq for s in (DEFAULT, QUICK) for _, _, seq, _ in s.attention_shapes) <= 1024
    assert max(b for s in (DEFAULT, QUICK) for b in s.message_bytes) <= 16 * 2**20


def first_call_slow(calls: list[None]) -> Any:
    """A kernel whose first call pays for setup (a handle, autotuning, lazy loading) and whose later ones are fast."""
    def call() -> None:
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.3)
    return call


def test_a_slow_first_call_does_not_size_the_batches() -> None:
    """Timed, the first call would make each batch one call long; sized on a warm call, a batch holds
    as many fast calls as fill batch_s. Sized on the slow call, the two batches would hold one call
    each (about six calls in all); sized on a warm one, thousands (a busy machine's preemptions cost
    a fast call at most a few hundred microseconds, so more than 20 holds under load)."""
    calls: list[None] = []
    seconds = median_seconds(first_call_slow(calls), lambda: None, batch_s=0.01, repeats=2)
    assert len(calls) > 20 and seconds < 1e-3


def test_ranks_in_step_size_their_batches_on_a_warm_call_too() -> None:
    calls: list[None] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        seconds = synchronized_median_seconds(first_call_slow(calls), torch.device("cpu"), batch_s=0.01, repeats=2)
    finally:
        dist.destroy_process_group()
    assert len(calls) > 20 and seconds < 1e-3


def test_work_a_gpu_cannot_hold_is_skipped_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stood in on a CPU with small shapes and a GPU's free memory of 1 MiB: what fits runs, what does
    not is never allocated and a warning names it; a CPU's memory is not checked."""
    assert machine._free_bytes("cpu") is None
    assert machine._fitting_messages((2**12, 2**20), "cpu") == (2**12, 2**20)
    monkeypatch.setattr(machine, "_free_bytes", lambda device: 2**20)
    s = Settings(shapes=((64, 32), (1024, 1024)), attention_shapes=((1, 2, 16, 8), (1, 8, 1024, 64)), max_call_s=1e9,
                 batch_s=0.001, repeats=1, memory_bytes=2**12, message_bytes=(), optimizer_params=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matmuls = machine._matmuls("fp32", "cpu", s, lambda what: None)
        backward = machine._matmul_backwards("fp32", "cpu", s, lambda what: None)
        attention = machine._attentions("fp32", "cpu", s, lambda what: None)
        messages = machine._fitting_messages((2**12, 2**20), "cpu")
    assert [(x.m, x.k, x.n) for x in matmuls] == [(64, 32, 32), (64, 32, 128)]
    assert [(x.m, x.k, x.n) for x in backward] == [(64, 32, 32), (64, 32, 128)]
    assert [(a.heads, a.seq_len) for a in attention] == [(2, 16)] and messages == (2**12,)
    said = [str(w.message) for w in caught]
    assert "calibrate: matmul fp32 1024 x 1024 x 1024 skipped: its tensors take about 24.0 MiB and this GPU has " \
           "1.0 MiB free; the profile has no figure for it" in said
    assert any(m.startswith("calibrate: matmul backward fp32 1024 x 1024 x 4096 skipped") for m in said)
    assert any(m.startswith("calibrate: attention fp32 1 x 8 heads x 1024 x 64 skipped") for m in said)
    assert any(m.startswith("calibrate: collectives of 1 MiB skipped") for m in said)
    assert len(said) == 6  # 2 + 2 GEMMs, 1 attention, 1 message


# ---------------------------------------------------------------- fp8 on a reference kernel


def test_a_reference_fp8_kernel_is_measured_once_at_the_probe_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch._scaled_mm runs orders of magnitude below bf16 (here a kernel that sleeps past the
    probe's deadline), the default calibration's fp8 work is the probe's one call: the profile's fp8
    rate is the probe's, at its shape, and no shape of the grid is tried."""
    calls, real = [], torch._scaled_mm

    def slow(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        time.sleep(2 * DEADLINE_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", slow)
    steps: list[str] = []
    (shape,) = machine._fp8_matmuls("cpu", DEFAULT, steps.append)
    assert len(calls) == 1 and steps == ["fp8 matmul probe"]
    assert (shape.dtype, shape.m, shape.k, shape.n) == ("fp8", *PROBE_SHAPE)
    assert shape.flops_per_s < 2 * 128**3 / (2 * DEADLINE_S)


def test_the_probe_rate_bounds_the_fp8_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8's rate so far starts at the probe's: a shape whose one call would exceed max_call_s at it is skipped."""
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: pytest.fail("a grid shape was timed"))
    probe = MatmulShape("fp8", *PROBE_SHAPE, 1e6)  # every grid shape's call: longer than DEFAULT.max_call_s
    assert machine._matmuls("fp8", "cpu", DEFAULT, lambda what: None, probe=probe) == [probe]


def test_fp8_on_a_gpu_is_bounded_by_bf16s_rate_not_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU runs the probe's small GEMM in about a launch's time, a rate far below its grid shapes':
    fp8 not slow against bf16 is bounded by a tenth of bf16's best rate, so its grid is measured."""
    rates = Fp8MatmulRates("cpu", "tensorwise", PROBE_SHAPE, 1e6, 1e6)  # launch-bound, and not slow
    monkeypatch.setattr(machine, "probe_fp8_matmul", lambda device: rates)
    monkeypatch.setattr(machine, "_matmul", lambda *args: (lambda: None))
    s = Settings(shapes=((64, 32),), attention_shapes=(), max_call_s=0.05, batch_s=0.001, repeats=1,
                 memory_bytes=2**12, message_bytes=(), optimizer_params=())
    measured = machine._fp8_matmuls("cpu", s, lambda what: None, bf16_flops_per_s=1e11)
    assert [(x.m, x.k, x.n) for x in measured] == [(64, 32, 32), (64, 32, 128)]
    (probe,) = machine._fp8_matmuls("cpu", s, lambda what: None)  # at the probe's rate every call is too long
    assert (probe.m, probe.k, probe.n, probe.flops_per_s) == (*PROBE_SHAPE, 1e6)


def _printed(p: HardwareProfile) -> str:
    console = Console(file=io.StringIO(), width=200)
    for table in machine.profile_tables(p):
        console.print(table)
    return console.file.getvalue()


def test_the_tables_say_when_fp8_runs_below_bf16() -> None:
    rates = {"fp32": 5e10, "bf16": 1e11, "fp16": 1.5e9}
    reference = profile(matmul_flops_per_s={**rates, "fp8": 4.5e7},
                        matmul_shapes=(*profile().matmul_shapes, MatmulShape("fp8", *PROBE_SHAPE, 4.5e7)))
    printed = _printed(reference)
    assert re.search(r"matmul fp8 +│ 0.045 GFLOP/s", printed)
    assert ("2,222x slower (a reference kernel: no fp8 hardware): fp8-mixed trains slower than bf16-mixed here; "
            "use precision.mode=bf16-mixed") in printed
    assert re.search(r"128 x 128 x 128 │ - +│ - +│ - +│ 0.045", printed)  # the probe's shape: fp8's only one
    emulated = _printed(profile(matmul_flops_per_s={**rates, "fp8": 5e10}))
    assert "2.0x slower: fp8-mixed trains slower" in emulated and "no fp8 hardware" not in emulated
    assert "fp8 below bf16" not in _printed(profile(matmul_flops_per_s={**rates, "fp8": 2e11}))


def estimate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["estimate", "--hardware.num_gpus=2", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("fp32", "link", "slower"), [(1e10, 1e8, True), (1e12, 1e11, False)])
def test_a_profile_moves_the_estimate_the_way_its_numbers_say(
        fp32: float, link: float, slower: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The catalog's CPU runs at cores x 96 GFLOP/s x 0.5 and a 4 GB/s loopback link; a profile slower
    (faster) than that makes compute and communication, and so the step, slower (faster)."""
    p = profile(matmul_flops_per_s={"fp32": fp32, "bf16": 2e9, "fp16": 1.5e9}, link=LinkFit(link, 1e-4),
                collectives=(), matmul_shapes=(MatmulShape("fp32", 512, 128, 128, fp32),
                                               MatmulShape("bf16", 512, 128, 128, 2e9),
                                               MatmulShape("fp16", 512, 128, 128, 1.5e9)))
    path = write(tmp_path, p)
    catalog, measured = estimate_json(capsys), estimate_json(capsys, f"--hardware.profile={path}")
    flops = measured["flops"]["flops_per_rank_per_step"]
    cfg = load_config(None, ["--hardware.num_gpus=2", f"--hardware.profile={path}"])
    elementwise = sum(elementwise_bytes(cfg.model, build_layout(cfg), cfg.training))
    # efficiency 1.0 on the measured rates: every FLOP at the one matmul rate (no attention was measured),
    # the elementwise traffic at the measured bandwidth; 2 one-thread ranks on 2 cores share nothing
    assert measured["time"]["compute_s"] == pytest.approx(flops / fp32 + elementwise / p.memory_bytes_per_s)
    for key in ("compute_s", "step_time_s"):
        assert (measured["time"][key] > catalog["time"][key]) == slower, key
    assert (measured["time"]["comm_s"]["all_reduce"] > catalog["time"]["comm_s"]["all_reduce"]) == slower
    assert measured["flops"] == catalog["flops"]


def test_a_collective_measured_at_its_group_size_runs_at_its_fit(tmp_path: Path) -> None:
    """The profile's all-reduce fit at 2 ranks prices DDP's all-reduce; kinds it did not measure use its link."""
    fit = CollectiveFit("all_reduce", 2, 2e8, 3e-4, (4096,), (3e-4,))
    path = write(tmp_path, profile(link=LinkFit(1e9, 1e-4), collectives=(fit,)))
    for args, kind, link in (([], "all_reduce", hardware.Link("fit", 2e8, 3e-4)),
                             (["--parallel.zero_stage=3"], "all_gather", hardware.Link("link", 1e9, 1e-4))):
        cfg = load_config(None, ["--hardware.num_gpus=2", f"--hardware.profile={path}", *args])
        timed = [(c, one) for c, one in estimate(cfg).perf.collectives if c.kind == kind]
        assert timed and all(one == pytest.approx(collective_time(kind, c.nbytes, 2, link)) for c, one in timed)


def test_estimate_with_a_profile_imports_no_torch(tmp_path: Path) -> None:
    path = write(tmp_path, profile())
    code = (f"import sys; from trainfit.cli import main; main(['estimate', '--hardware.profile={path}', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- the fits


def test_the_link_fit_recovers_the_cost_model_of_perf_comms() -> None:
    """Times made by comms.collective_time on a known link fit back to that link, every kind and size."""
    truth = hardware.Link("truth", 2e9, 3e-5)
    sizes = (4096, 65536, 2**20, 2**24)
    points = [(kind, n, b, collective_time(kind, b, n, truth)) for n in (2, 3, 4) for b in sizes
              for kind in ("all_gather", "reduce_scatter", "all_to_all")]
    points += [(kind, 2, b, collective_time(kind, b, 2, truth)) for b in sizes for kind in ("all_reduce", "p2p")]
    fit = fit_link(points)
    assert fit.bytes_per_s == pytest.approx(2e9) and fit.latency_s == pytest.approx(3e-5)
    assert model_terms("all_reduce", 4) == (6.0, 1.5) and model_terms("all_gather", 4) == (3.0, 0.75)


def test_a_negative_intercept_is_clamped_at_zero() -> None:
    assert fit_nonnegative([(1.0, 1.0, 3.0), (1.0, 2.0, 5.0)]) == pytest.approx((1.0, 2.0))
    intercept, slope = fit_nonnegative([(1.0, 1.0, 1.0), (1.0, 2.0, 3.0), (1.0, 3.0, 5.0)])  # y = 2x - 1
    assert intercept == 0.0 and slope > 0


# ---------------------------------------------------------------- a real calibration


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`trainfit calibrate --quick --max-ranks 2 --json`, run once: (the profile, what it printed)."""
    out = tmp_path_factory.mktemp("calibrate") / "cpu.toml"
    proc = subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--quick", "--max-ranks", "2", "--out",
                           str(out), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_a_quick_calibration_measures_plausible_numbers(quick: tuple[Path, str]) -> None:
    path, printed = quick
    p = load_profile(str(path))
    printed = json.loads(printed)  # --json prints what the file holds (to its 6 significant digits)
    assert printed.keys() == p.as_dict().keys() and printed["machine"] == dataclasses.asdict(p.machine)
    assert printed["matmul_flops_per_s"] == pytest.approx(p.matmul_flops_per_s, rel=1e-5)
    assert printed["link"] == pytest.approx(dataclasses.asdict(p.link), rel=1e-5)
    assert (p.machine.device, p.machine.threads, p.machine.quick) == ("cpu", 1, True)  # OMP_NUM_THREADS=1
    assert {"fp32", "bf16", "fp16"} <= set(p.matmul_flops_per_s)
    for dtype, rate in p.matmul_flops_per_s.items():
        assert (1e6 if dtype == "fp8" else 1e8) < rate < 1e13, dtype  # fp8: a reference kernel's rate too
        assert rate == max(s.flops_per_s for s in p.matmul_shapes if s.dtype == dtype)
    # every fp32 shape of the grid but those whose call would pass max_call_s at the rate measured so far
    # (a busy machine's slower rate skips the largest): the smallest always runs
    grid = {(m, d, n) for m, d in QUICK.shapes for n in (d, 4 * d)}
    measured = {(s.m, s.k, s.n) for s in p.matmul_shapes if s.dtype == "fp32"}
    assert measured <= grid and min(grid, key=lambda shape: shape[0] * shape[1] * shape[2]) in measured
    for m, k, n in grid - measured:
        assert 2 * m * k * n / p.matmul_flops_per_s["fp32"] > QUICK.max_call_s / 100, (m, k, n)
    assert 1e8 < p.memory_bytes_per_s < 1e13
    assert {c.kind for c in p.collectives} == KINDS and {c.world_size for c in p.collectives} == {2}
    for c in p.collectives:
        assert 1e6 < c.bytes_per_s < 1e12 and 0 <= c.latency_s < 0.1, c
        assert c.nbytes == QUICK.message_bytes and all(t > 0 for t in c.seconds)
    assert 1e6 < p.link.bytes_per_s < 1e12 and 0 <= p.link.latency_s < 0.1
    assert [c.ranks for c in p.concurrency] == [2]  # two ranks ran the compute probe at once
    assert all(0.05 < c.matmul < 2 and 0.05 < c.bandwidth < 2 for c in p.concurrency)
    # the same two ranks as one group: DTensor's dispatch and FSDP2's hooks, per block and for the rest
    assert sorted((h.ranks, h.kind) for h in p.host_overhead) == [(2, kind) for kind in sorted(HOST_KINDS)]
    assert all(0 <= h.block_s < 1 and 0 <= h.root_s < 1 for h in p.host_overhead)
    # DTensor's dispatch is measured, not 0: a difference of two depths' step times, so its size moves
    # with the machine's load (a loaded suite read 0.5 ms where an idle machine reads several; the
    # figures of an idle machine are benchmarks/README.md's), and FSDP2's few milliseconds may read 0
    tp = next(h for h in p.host_overhead if h.kind == "tensor_parallel")
    assert 4 * tp.block_s + tp.root_s > 0
    assert {o.impl for o in p.optimizer} == {"fused", "foreach"}
    for o in p.optimizer:
        assert 1e-12 < o.s_per_param < 1e-6 and o.params == QUICK.optimizer_params


def test_the_measured_profile_drives_the_estimate(quick: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = quick
    p = load_profile(str(path))
    out = estimate_json(capsys, f"--hardware.profile={path}")
    cfg = load_config(None, ["--hardware.num_gpus=2", f"--hardware.profile={path}"])
    elementwise = sum(elementwise_bytes(cfg.model, build_layout(cfg), cfg.training)) / p.memory_bytes_per_s
    flops, compute = out["flops"]["flops_per_rank_per_step"], out["time"]["compute_s"]
    rates = [s.flops_per_s for s in p.matmul_shapes if s.dtype == "fp32"]
    rates += [a.flops_per_s for a in p.attention if a.dtype == "fp32"]
    rates += [r for b in p.matmul_backward if b.dtype == "fp32" for r in (b.input_grad_flops_per_s,
                                                                           b.weight_grad_flops_per_s)]
    (together,) = p.concurrency  # each of the 2 ranks computes at these fractions of one alone (perf/kernels.py)
    slowdowns = (1 / together.matmul, 1 / together.bandwidth)
    assert min(slowdowns) * (flops / max(rates) + elementwise) <= compute * (1 + 1e-9)
    assert compute <= max(slowdowns) * (flops / min(rates) + elementwise) * (1 + 1e-9)
    assert {(a.dtype, a.seq_len) for a in p.attention} >= {("fp32", QUICK.attention_shapes[0][2])}
    # backward at the forward's shapes, the smallest always; a larger one is skipped where its call would
    # outlast max_call_s at the rate measured so far (a busy machine's slower rates skip more)
    backward = {(b.m, b.k, b.n) for b in p.matmul_backward if b.dtype == "fp32"}
    forward = [(s.m, s.k, s.n) for s in p.matmul_shapes if s.dtype == "fp32"]
    assert min(forward) in backward and backward <= set(forward)
    assert all(1e7 < a.flops_per_s < 1e13 for a in p.attention)
    catalog = estimate_json(capsys)
    assert out["time"]["step_time_s"] != catalog["time"]["step_time_s"]


def test_calibrate_refuses_to_overwrite_without_force(quick: tuple[Path, str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = quick
    before = path.read_bytes()
    assert main(["calibrate", "--quick", "--out", str(path)]) == 2
    assert "the file exists; pass --force" in capsys.readouterr().err
    assert path.read_bytes() == before
