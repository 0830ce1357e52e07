"""training.attention_backend: the probe names the kernel torch runs, a kernel that cannot run stops
the run with a ConfigError, the choice reaches every attention (the recompute of a checkpointed block
too), and math and flash train to the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _runs import run_config
from trainfit.attention import MATH_OP, probe_attention_kernel
from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.memory.closed_form import assumed_attention_kernel
from trainfit.parallel.resolve import build_layout
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

CPU = torch.device("cpu")
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("masked", [False, True])
def test_probe_names_the_kernel_that_ran(masked: bool) -> None:
    for backend in ("auto", "flash"):
        kernel = probe_attention_kernel(backend, CPU, torch.bfloat16, 4, 2, 16, masked=masked)
        assert (kernel.op, kernel.name, kernel.fused) == (CPU_FLASH, "flash (CPU)", True)
    kernel = probe_attention_kernel("math", CPU, torch.float32, 4, 2, 16, masked=masked)
    assert (kernel.op, kernel.name, kernel.fused) == (MATH_OP, "math", False)
    assert "math" in kernel.note() and "training.attention_backend=math" in kernel.note()


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_the_device_lacks_is_a_config_error(backend: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"training.attention_backend='{backend}': torch cannot run this kernel"
                                          r".*float32 on cpu, 4 heads, 2 kv heads.*Choose auto"):
        Trainer(run_config(tmp_path, f"--training.attention_backend={backend}", "--training.device=cpu"),
                world=World())


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _train(tmp_path: Path, backend: str) -> tuple[dict[int, float], set[str], list[dict]]:
    """Two steps of the debug model under full checkpointing, fp32; the ops of the third step's
    backward (where the checkpointed blocks rerun their attention)."""
    cfg = run_config(tmp_path / backend, "--training.steps=2", "--training.warmup_steps=1", "--training.device=cpu",
                     f"--training.attention_backend={backend}", "--memory.activation_checkpointing=full")
    trainer = Trainer(cfg, world=World())
    try:
        losses = trainer.train().losses
        inputs, targets = trainer.sampler.next_batch()
        loss = trainer.stepper.loss(inputs, targets)[0]
        with _Ops() as seen:
            loss.backward()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / backend / "logs" / "metrics.jsonl").read_text().splitlines()]
    return losses, seen.ops, records


def test_math_and_flash_train_alike_and_the_choice_reaches_the_recompute(tmp_path: Path) -> None:
    flash, flash_ops, flash_records = _train(tmp_path, "flash")
    math, math_ops, math_records = _train(tmp_path, "math")
    # Same weights and batches; the kernels differ in summation order only (fp32).
    assert flash.keys() == math.keys() == {1, 2}
    for step in flash:
        assert math[step] == pytest.approx(flash[step], rel=1e-5)
    # The recompute in backward reran attention with the chosen kernel.
    assert CPU_FLASH in flash_ops and MATH_OP not in flash_ops
    assert MATH_OP in math_ops and CPU_FLASH not in math_ops
    assert {"step": 0, "attention_kernel": "flash (CPU)", "attention_op": CPU_FLASH} in flash_records
    assert {"step": 0, "attention_kernel": "math", "attention_op": MATH_OP} in math_records


def _assumed(*overrides: str) -> str:
    cfg = load_config(None, ["--model.preset=debug", *overrides])
    return assumed_attention_kernel(cfg.model, build_layout(cfg), cfg.training, cfg.hardware)


def test_the_estimate_assumes_torchs_choice() -> None:
    assert _assumed() == "fused"  # CPU: flash for every float input
    assert _assumed("--training.attention_backend=math") == "math"
    assert _assumed("--training.attention_backend=efficient", "--hardware.gpu=H100-SXM-80GB") == "fused"
    gpu, odd_head = "--hardware.gpu=H100-SXM-80GB", ("--model.dim=120", "--model.num_heads=4", "--model.num_kv_heads=2")
    assert _assumed(gpu, "--precision.mode=bf16-mixed", *odd_head) == "fused"  # flash: any head dim <= 256
    assert _assumed(gpu, *odd_head) == "math"  # fp32: memory-efficient only, head dim 30 not a multiple of 4
