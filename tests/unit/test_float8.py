"""fp8-mixed's float8 linears (trainfit/float8.py): what is converted, what stays bf16 and is listed,
the named errors, FSDP2 float8 all-gather, and the estimators' view of the same filter (perf/fp8_casts.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from _dist import DP_BATCH, fake_world
from _runs import run_config
from trainfit.config import ConfigError
from trainfit.float8 import convert_to_float8, float8_notes
from trainfit.models import build_model
from trainfit.parallel.mesh import build_mesh
from trainfit.parallel.resolve import build_layout
from trainfit.perf.fp8_casts import DIM_MULTIPLE, float8_linears
from trainfit.precision import precision_policy
from trainfit.train.parallelize import parallelize

FP8 = "--precision.mode=fp8-mixed"


def test_block_linears_become_float8_the_output_and_odd_shapes_stay_bf16_and_are_listed(tmp_path) -> None:
    cfg = run_config(tmp_path, FP8, "--model.ffn_dim=72")  # 64 -> 72: not a multiple of 16
    model = build_model(cfg.model)
    convert_to_float8(model, precision_policy(cfg.precision.mode, "cpu"))
    float8 = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert float8 == {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert isinstance(model.output, torch.nn.Linear) and not isinstance(model.output, Float8Linear)
    (note,) = float8_notes(model)
    assert note.startswith("fp8-mixed: 8 linear(s) compute in float8; kept in bf16: ")
    assert "output (the output projection, kept in bf16 by design)" in note
    assert "layers.1.feed_forward.w2 (72 -> 64 features: fp8 matmuls need multiples of 16)" in note
    # the estimators convert the same ones (they cannot import torchao)
    assert set(float8_linears(cfg.model)) == {"wq", "wk", "wv", "wo"}


def test_named_errors(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"precision.fp8_all_gather=True: .*fp8_scaling='tensorwise'"):
        run_config(tmp_path, FP8, "--precision.fp8_scaling=rowwise", "--precision.fp8_all_gather=true")
    reason = build_layout(run_config(tmp_path, FP8, "--parallel.tp=2", "--hardware.num_gpus=2")).untrainable_reason()
    assert reason and reason.startswith("precision.mode='fp8-mixed' with parallel.tp=2")
    ineffective = build_layout(run_config(tmp_path, FP8, "--precision.fp8_all_gather=true")).ineffective_options()
    assert any(o.startswith("precision.fp8_all_gather=true has no effect") for o in ineffective)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install trainfit\[lowbit\]"):
        precision_policy("fp8-mixed", "cpu")


def test_fsdp_float8_all_gather_shards_float8_weights(tmp_path) -> None:
    cfg = run_config(tmp_path, *DP_BATCH, FP8, "--hardware.num_gpus=2", "--parallel.zero_stage=3",
                     "--precision.fp8_all_gather=true")
    layout = build_layout(cfg)
    with fake_world(2):
        model = build_model(cfg.model)
        policy = precision_policy(cfg.precision.mode, "cpu", fp8_all_gather=True)
        parallelize(model, layout, build_mesh(layout, "cpu"), policy)
        wq, output = model.layers[0].attention.wq, model.output
        assert isinstance(wq, Float8Linear) and isinstance(wq.weight, DTensor)
        assert isinstance(wq.weight.to_local(), WeightWithDynamicFloat8CastTensor)
        assert not isinstance(output.weight.to_local(), WeightWithDynamicFloat8CastTensor)


def test_analytic_prices_what_fp8_removes_and_adds(tmp_path) -> None:
    """bf16-mixed -> fp8-mixed, one process: the block linears' bf16 weight casts go (autocast no longer
    makes them), the float8 backward's casts come; FSDP2 float8 all-gather halves the gathered block."""
    from _analytic import memory_of, retained_of

    base = ("--model.dim=128", "--model.ffn_dim=1024", "--training.seq_len=128")
    bf16, fp8 = (run_config(tmp_path, *base, f"--precision.mode={m}") for m in ("bf16-mixed", "fp8-mixed"))
    block = 128 * (128 + 64 + 64 + 128) + 3 * 128 * 1024  # wq wk wv wo w1 w3 w2 (4 heads, 2 kv heads)
    assert retained_of(bf16) - retained_of(fp8) == 2 * 2 * block
    assert memory_of(fp8).worst.peak > memory_of(bf16).worst.peak  # the w2 backward's casts: 4 x 128 x 11 KiB
    zero3 = ("--hardware.num_gpus=2", "--parallel.zero_stage=3", *DP_BATCH, FP8)
    plain, gathered = (memory_of(run_config(tmp_path, *base, *zero3, f"--precision.fp8_all_gather={ag}")).worst
                       for ag in ("false", "true"))
    assert plain.buffers - gathered.buffers == 2 * block  # this block and the prefetched one: 1 byte, not 2


def _cuda_strict_scaled_mm(real):
    """torch._scaled_mm with the dimension checks of its CUDA kernel (aten/src/ATen/native/cuda/Blas.cpp:
    mat1's columns and both of mat2's dimensions multiples of 16), which the CPU kernel does not make."""

    def scaled_mm(mat1, mat2, *args, **kwargs):
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(f"mat1 {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)}: dimensions must be "
                               "divisible by 16")
        return real(mat1, mat2, *args, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_a_micro_batch_of_100_tokens_pads_the_weight_gradient_matmul_as_cuda_needs(monkeypatch, scaling) -> None:
    policy = precision_policy("fp8-mixed", "cpu", fp8_scaling=scaling)
    torch.manual_seed(0)
    x = torch.randn(100, 32, dtype=torch.bfloat16)  # a micro-batch of 100 tokens: 100 % 16 = 4

    def grads(tokens_per_matmul: int, strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False)).to(torch.bfloat16)
        convert_to_float8(model, policy, tokens_per_matmul=tokens_per_matmul)
        assert isinstance(model[0], Float8Linear)
        with monkeypatch.context() as patch:
            if strict:
                patch.setattr(torch, "_scaled_mm", _cuda_strict_scaled_mm(torch._scaled_mm))
            inputs = x.clone().requires_grad_()
            model(inputs).float().square().sum().backward()
        return model[0].weight.grad, inputs.grad

    with pytest.raises(RuntimeError, match="divisible by 16"):  # unpadded, the weight gradient's GEMM fails on CUDA
        grads(tokens_per_matmul=DIM_MULTIPLE, strict=True)
    padded = grads(tokens_per_matmul=100, strict=True)
    plain = grads(tokens_per_matmul=DIM_MULTIPLE, strict=False)  # the CPU kernel takes 100 as it is
    for got, expected in zip(padded, plain, strict=True):  # zero rows add nothing to the sum over tokens
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_run_pads_only_when_its_micro_batch_tokens_need_it(tmp_path) -> None:
    policy = precision_policy("fp8-mixed", "cpu")
    for tokens, pads in ((100, True), (128, False), (16 * 7, False)):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
        convert_to_float8(model, policy, tokens_per_matmul=tokens)
        assert model[0].config.pad_inner_dim is pads
        assert any("pad them with zeros" in n for n in float8_notes(model)) is pads
    cfg = run_config(tmp_path, FP8, "--training.micro_batch_size=3", "--training.global_batch_size=3",
                     "--training.seq_len=36")
    assert build_layout(cfg, 1).micro_batch_tokens == 108  # what train/parallelize.py converts with
