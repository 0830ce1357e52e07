"""How a rank joins its run (train/distributed.py) on the CUDA paths a CPU machine can still check:
the backend under CPU offload, the collective timeout, the GPU a rank takes; and which device MFU
is measured against (train/run_device.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from _runs import run_config
from trainfit.config import ConfigError
from trainfit.parallel.resolve import build_layout
from trainfit.train import distributed
from trainfit.train.distributed import init_world, pick_device, process_group_backend
from trainfit.train.run_device import run_device


class _Initialized(Exception):
    """Raised by the stand-in for init_process_group once it has recorded its arguments."""


def _fake_cuda(monkeypatch, visible: int, name: str = "NVIDIA H100 80GB HBM3") -> list[int]:
    """torch.cuda as a process that sees `visible` GPUs named `name`; returns the set_device calls."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    return chosen


def test_backend_maps_cpu_tensors_to_gloo_under_offload_only_on_cuda() -> None:
    assert process_group_backend("cpu", "none") == "gloo"
    assert process_group_backend("cpu", "optimizer") == "gloo"
    assert process_group_backend("cuda", "none") == "nccl"
    for offload in ("optimizer", "optimizer+params"):
        assert process_group_backend("cuda", offload) == "cuda:nccl,cpu:gloo"


@pytest.mark.parametrize(("launched", "offload", "backend"), [
    (False, "optimizer", "cuda:nccl,cpu:gloo"),  # one GPU with offload: FSDP2 on a 1-rank group
    (True, "optimizer+params", "cuda:nccl,cpu:gloo"),
    (True, "none", "nccl"),
])
def test_init_world_on_cuda_passes_the_backend_device_and_timeout(tmp_path, monkeypatch, launched, offload,
                                                                  backend) -> None:
    cfg = run_config(tmp_path, f"--memory.offload={offload}", "--parallel.zero_stage=3",
                     "--training.collective_timeout_minutes=45", f"--hardware.num_gpus={2 if launched else 1}",
                     "--training.global_batch_size=8")
    layout = build_layout(cfg, 2 if launched else 1)
    if launched:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", "1")
    _fake_cuda(monkeypatch, visible=2)
    calls: list[tuple[tuple, dict]] = []

    def init_process_group(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Initialized

    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    with pytest.raises(_Initialized):
        init_world(cfg, layout)
    (args, kwargs), = calls
    assert args == (backend,) and kwargs["timeout"] == timedelta(minutes=45)
    if launched:
        assert kwargs["device_id"] == torch.device("cuda", 1)


def test_every_group_takes_the_collective_timeout_also_groups_made_later(tmp_path) -> None:
    cfg = run_config(tmp_path, "--memory.offload=optimizer", "--parallel.zero_stage=3",
                     "--training.collective_timeout_minutes=45", "--training.device=cpu")
    world = init_world(cfg, build_layout(cfg, 1))  # offload: a 1-rank gloo group and its mesh
    try:
        assert world.owns_group and world.collective_timeout == timedelta(minutes=45)
        later = dist.new_group([0])  # e.g. an expert mesh built with the model: the backend's default (30)
        assert later._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=30)
        world.set_group_timeouts()
        timeouts = {group._get_backend(torch.device("cpu")).options._timeout for group in _world.pg_map}
        assert len(_world.pg_map) >= 2 and timeouts == {timedelta(minutes=45)}
    finally:
        world.close()
    assert not dist.is_initialized()


def test_collective_timeout_is_validated(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"training.collective_timeout_minutes=0(\.0)?: must be > 0"):
        run_config(tmp_path, "--training.collective_timeout_minutes=0")


@pytest.mark.parametrize(("local_rank", "visible", "index"), [(5, 1, 0), (5, 8, 5), (3, 2, 1), (0, 1, 0)])
def test_a_rank_takes_its_local_rank_modulo_the_gpus_it_sees(monkeypatch, local_rank, visible, index) -> None:
    chosen = _fake_cuda(monkeypatch, visible)
    device, note = pick_device("auto", local_rank)
    assert device == torch.device("cuda", index) and chosen == [index]
    assert note is not None and f"cuda:{index}" in note and f"local rank {local_rank}" in note
    assert ("ranks share GPU" in note) is (local_rank >= visible > 1)


def test_pick_device_on_cpu_and_cuda_without_a_gpu() -> None:
    assert pick_device("cpu", 3) == (torch.device("cpu"), None)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="training.device='cuda': no CUDA device"):
            pick_device("cuda", 0)


def test_mfu_on_a_gpu_is_against_the_gpu_found_never_a_cpu_peak(tmp_path) -> None:
    hw = run_config(tmp_path).hardware
    assert hw.gpu == "cpu"
    found = run_device(hw, "bf16-mixed", "cuda", "NVIDIA H100 80GB HBM3")
    assert found.hardware.gpu == "H100-SXM-80GB" and found.peak_flops == pytest.approx(989.4e12)
    assert "hardware.gpu derived: H100-SXM-80GB" in found.note
    unknown = run_device(hw, "bf16-mixed", "cuda", "NVIDIA A10")
    assert unknown.peak_flops is None and "not in the catalog" in unknown.note
    given = run_device(run_config(tmp_path, "--hardware.peak_tflops=125").hardware, "bf16-mixed", "cuda",
                       "NVIDIA A10")
    assert given.peak_flops == pytest.approx(125e12)
    with pytest.raises(ConfigError, match=r"hardware.gpu='A100-SXM-80GB': this process trains on NVIDIA H100 80GB "
                                          r"HBM3 \(H100-SXM-80GB\); set --hardware.gpu=H100-SXM-80GB"):
        run_device(run_config(tmp_path, "--hardware.gpu=A100-SXM-80GB").hardware, "bf16-mixed", "cuda",
                   "NVIDIA H100 80GB HBM3")
    alias = run_device(run_config(tmp_path, "--hardware.gpu=H100").hardware, "bf16-mixed", "cuda",
                       "NVIDIA H100 80GB HBM3")
    assert alias.peak_flops == pytest.approx(989.4e12) and alias.note is None


def test_training_on_the_cpu_measures_mfu_against_the_cpu_whatever_gpu_is_described(tmp_path) -> None:
    cpu = run_device(run_config(tmp_path).hardware, "fp32", "cpu")
    described = run_device(run_config(tmp_path, "--hardware.gpu=A100-SXM-80GB", "--hardware.peak_tflops=300").hardware,
                           "fp8-mixed", "cpu")  # an A100 has no fp8 peak: no error, the CPU is measured
    assert described.hardware.gpu == "cpu" and described.peak_flops == cpu.peak_flops
    assert "trains on the CPU" in described.note


def test_the_summary_says_why_throughput_or_mfu_is_missing() -> None:
    from trainfit.train.report import throughput_text
    from trainfit.train.trainer import TrainResult

    assert throughput_text(TrainResult(steps_done=2)).startswith("not measured: every step was a warm-up")
    unknown = TrainResult(steps_done=9, tokens_per_s=1234.0, mfu_note="MFU not computed: NVIDIA A10 is not in ...")
    assert throughput_text(unknown) == "1,234 tokens/s (MFU not computed: NVIDIA A10 is not in ...)"
    known = TrainResult(steps_done=9, tokens_per_s=1234.0, mfu=0.25, mfu_note="against H100-SXM-80GB's peak")
    assert throughput_text(known) == "1,234 tokens/s, MFU 25.0% (against H100-SXM-80GB's peak)"


def test_async_tp_is_refused_before_any_group_on_a_device_without_symmetric_memory(tmp_path, monkeypatch) -> None:
    """A config planned for H100s (parallel.async_tp) started on CPUs: a named error before a group exists."""
    cfg = run_config(tmp_path, "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=2", "--parallel.tp=2",
                     "--parallel.sequence_parallel=true", "--parallel.zero_stage=3", "--training.compile=true",
                     "--parallel.async_tp=true", "--training.device=cpu", "--training.global_batch_size=8")
    layout = build_layout(cfg)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: pytest.fail("a group was made"))
    with pytest.raises(ConfigError, match=r"parallel\.async_tp=true: .*this run's device is cpu; set "
                                          r"parallel\.async_tp=false"):
        init_world(cfg, layout)


def test_async_tp_enables_nothing_off_cuda() -> None:
    import types

    import torch._inductor.config as inductor_config

    from trainfit.parallel.tensor_parallel import enable_async_tp
    assert enable_async_tp(types.SimpleNamespace(device_type="cpu")) is False
    assert inductor_config._micro_pipeline_tp is False
