"""Allocator-level peak measurement on CPU (glibc mallinfo2 sampled at every operator)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
from torch import nn

from _toy import Net
from trainfit.memory.measured import current_allocated_bytes, measure, measure_peak
from trainfit.recompute import apply_activation_checkpointing

MiB = 2**20


@pytest.fixture(autouse=True)
def _warm() -> None:
    """Run each kind of op once so lazy runtime allocations (thread pools, BLAS) stay out of peaks."""
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    model(torch.randn(8, 64)).sum().backward()
    torch.optim.AdamW(model.parameters()).step()


def test_known_tensor_created_and_freed():
    with measure_peak("cpu") as result:
        tensor = torch.empty(64 * MiB, dtype=torch.uint8)
        del tensor
        tensor = torch.ones(32 * MiB, dtype=torch.uint8)  # after the free: must not add up to 96
        del tensor
    assert result.peak_bytes == pytest.approx(64 * MiB, rel=0.01)
    assert result.baseline_bytes > 0 and result.num_samples == 2


def test_matmul_output():
    a, b = torch.randn(2048, 256), torch.randn(256, 2048)
    a @ b  # noqa: B018 (a shape's first matmul leaves ~3 MiB of math-library buffers behind)
    with measure_peak("cpu") as result:
        out = a @ b
    assert out.nbytes == 16 * MiB
    assert result.peak_bytes == pytest.approx(16 * MiB, rel=0.02)


def test_garbage_collected_mid_step_does_not_hide_the_peak():
    cycle: list = [torch.empty(32 * MiB, dtype=torch.uint8)]
    cycle.append(cycle)
    del cycle  # pending garbage, freed whenever the collector next runs
    with measure_peak("cpu") as result:
        _ = [[] for _ in range(10_000)]  # enough new containers to trigger a collection
        tensor = torch.empty(16 * MiB, dtype=torch.uint8)
        del tensor
    assert result.peak_bytes == pytest.approx(16 * MiB, rel=0.01)
    gc.collect()


def test_first_measurement_of_a_process_is_not_inflated():
    # The first Python dispatch mode of a process imports ~800 modules (~22 MiB); a fresh process
    # is needed to see it, since this one has run dispatch modes already.
    code = (
        "import torch\n"
        "from trainfit.memory.measured.measure import measure_peak\n"
        "a = torch.randn(64, 64, requires_grad=True)\n"
        "(a @ a).sum().backward()\n"
        "with measure_peak('cpu') as result:\n"
        "    (a @ a).relu().sum().backward()\n"
        "print(result.peak_bytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < MiB


def test_current_allocated_bytes_follows_a_tensor():
    before = current_allocated_bytes()
    tensor = torch.zeros(8 * MiB, dtype=torch.uint8)
    assert current_allocated_bytes() - before == pytest.approx(tensor.nbytes, rel=0.02)
    with pytest.raises(ValueError, match="cpu and cuda only"):
        current_allocated_bytes("meta")


def test_without_glibc_mallinfo_the_error_is_clear(monkeypatch):
    measure._mallinfo.cache_clear()
    monkeypatch.setattr(measure.ctypes, "CDLL", lambda *_: object())
    try:
        with pytest.raises(RuntimeError, match="mallinfo2"):
            current_allocated_bytes()
    finally:
        measure._mallinfo.cache_clear()


def mlp(dim: int = 512, depth: int = 4) -> nn.Sequential:
    layers = [m for _ in range(depth) for m in (nn.Linear(dim, dim), nn.GELU())]
    return nn.Sequential(*layers)


def test_training_step_peak_covers_params_grads_and_adam_states():
    with measure_peak("cpu") as result:
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(64, 512)).square().mean().backward()
        optimizer.step()
    param_bytes = sum(p.nbytes for p in model.parameters())
    assert result.peak_bytes > 4 * param_bytes  # params + grads + exp_avg + exp_avg_sq


class _BackwardScratch(torch.autograd.Function):
    """Identity whose backward allocates and frees a 32 MiB scratch tensor."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(32 * MiB, dtype=torch.uint8)
        return grad + scratch[:1].float()


def test_backward_and_optimizer_operators_are_sampled():
    x = torch.randn(16, requires_grad=True)
    loss = _BackwardScratch.apply(x).sum()
    with measure_peak("cpu") as backward:
        loss.backward()
    # Freed before backward returned: only per-operator sampling inside backward can see it.
    assert backward.peak_bytes >= 32 * MiB

    model = mlp()
    model(torch.randn(8, 512)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    param_bytes = sum(p.nbytes for p in model.parameters())
    with measure_peak("cpu") as step:
        optimizer.step()
    # Two new states, plus the foreach step's transient denominator (freed by the end).
    assert step.peak_bytes > 2.9 * param_bytes
    assert current_allocated_bytes() - step.baseline_bytes < 2.1 * param_bytes


def step_peak(policy: str) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(dim=64, num_layers=8)
    apply_activation_checkpointing(model, policy)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 128, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step has optimizer states already, like a steady state
        with measure_peak("cpu") as result:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return result.peak_bytes, model.layers[0].state_dict()["qkv.weight"]


def test_checkpointing_lowers_the_measured_peak_and_composes_with_sac():
    # Activations dominate: 8 blocks of 16 x 128 tokens, 0.4 M parameters.
    none, weight = step_peak("none")
    selective, weight_selective = step_peak("selective")
    full, weight_full = step_peak("full")
    activation_unit = 16 * 128 * 64 * 4  # one (batch, seq, dim) fp32 tensor
    # Saved per block: ~16 units (none), ~11 (selective: input + matmul and attention outputs), 1
    # (full); the peaks differ by a little less, as backward transients add to all three.
    assert none > selective + 8 * 3 * activation_unit
    assert selective > full + 8 * 7 * activation_unit
    assert full < none / 3
    # Measuring changed nothing about the math (SAC's own dispatch modes ran under ours).
    torch.testing.assert_close(weight_selective, weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight_full, weight, rtol=1e-6, atol=1e-6)


def test_cuda_allocated_bytes_read_without_flattening_every_statistic(monkeypatch) -> None:
    """The per-operator probe on CUDA reads one counter of the allocator's nested statistics;
    torch.cuda.memory_allocated would flatten and sort all of them on every operator."""
    nested = {"allocated_bytes": {"all": {"current": 12345, "peak": 99999}, "small_pool": {"current": 45}},
              "reserved_bytes": {"all": {"current": 20000}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: nested)

    def flattening(*args, **kwargs):
        raise AssertionError("flattens every statistic")

    monkeypatch.setattr(torch.cuda, "memory_stats", flattening)
    monkeypatch.setattr(torch.cuda, "memory_allocated", flattening)
    assert current_allocated_bytes("cuda:0") == 12345
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})  # CUDA not initialized
    assert current_allocated_bytes("cuda:0") == 0
class _FakeCuda:
    """torch.cuda's memory statistics as a device would report them, for the CUDA branch on a CPU."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.reserved_peak = 100 * MiB, 100 * MiB, 0
        self.free, self.total = 70 * 1024 * MiB, 80 * 1024 * MiB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(device: object = None) -> None:
            self.peak, self.reserved_peak = self.allocated, 0

        for name, fn in {"synchronize": lambda device=None: None, "reset_peak_memory_stats": reset,
                         "memory_allocated": lambda device=None: self.allocated,
                         "max_memory_allocated": lambda device=None: self.peak,
                         "max_memory_reserved": lambda device=None: self.reserved_peak,
                         "mem_get_info": lambda device=None: (self.free, self.total)}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def step(self) -> None:
        """What a step does to the figures: 60 MiB above the start at its peak, 320 MiB reserved."""
        self.peak, self.reserved_peak, self.free = self.allocated + 60 * MiB, 320 * MiB, self.free - 2 * MiB


def test_cuda_reserved_peak_and_device_used_are_recorded_beside_the_allocated_peak(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    with measure_peak(torch.device("cuda")) as result:
        fake.step()
    assert (result.baseline_bytes, result.peak_bytes, result.num_samples) == (100 * MiB, 60 * MiB, 0)
    assert result.reserved_peak_bytes == 320 * MiB  # the reserved peak since the reset at entry
    assert result.device_used_bytes == 10 * 1024 * MiB + 2 * MiB  # total - free at the end: context, NCCL, ...
    readings = measure.device_readings("cuda")
    assert (readings.reserved_peak_bytes, readings.device_used_bytes) == (320 * MiB, 10 * 1024 * MiB + 2 * MiB)


def test_the_cpu_has_no_reserved_or_device_figures():
    assert measure.device_readings("cpu") == measure.DeviceReadings(None, None)
    with measure_peak("cpu") as result:
        torch.ones(MiB, dtype=torch.uint8)
    assert result.reserved_peak_bytes is None and result.device_used_bytes is None
