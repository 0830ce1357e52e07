"""perf/fp8_casts.py's byte counts against what torchao's float8 linear really runs: one forward and
backward of a Float8Linear on CPU, every aten op's bytes counted at the dispatcher.

Tiny on purpose: three torch._scaled_mm calls of 64 x 128 x 256 per case, some 13 MFLOP (the suite's
fp8 budget, tests/_fp8_flops.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import Float8TrainingTensor
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from trainfit.perf.fp8_casts import gathered_shard_bytes, linear_cast_bytes

ROWS, K, N = 64, 128, 256
SCALE_OPS = 0.03
"""The formula leaves out the scales' own ops (one element per tensor, or one per row or column:
amax_to_scale's float64 clamp and reciprocal, rowwise's power-of-2 rounding, the GEMMs' inverse
scales), so the trace may exceed it by those: a few percent at these shapes with rowwise's per-row
scales, far less tensorwise."""
WRAPPERS = (Float8TrainingTensor, WeightWithDynamicFloat8CastTensor)


class OpBytes(TorchDispatchMode):
    """Bytes every kernel reads and writes: each op's tensor inputs and outputs, an in-place op's
    output written where it was read. Views move nothing; torch._scaled_mm is the GEMM, priced by
    FLOPs. Ops on torchao's fp8 wrappers are deferred to them (NotImplemented), so what they run
    inside on plain tensors is what is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(isinstance(t, WRAPPERS) for t in inputs):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_place = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        view = not in_place and all(t.untyped_storage().data_ptr() in storages for t in outputs)
        if func is not torch.ops.aten._scaled_mm.default and not view:
            self.bytes += sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
        return out


def traced_bytes(recipe: str, weight_dtype: torch.dtype) -> int:
    """One forward and backward of a ROWS x K -> N float8 linear with a bf16 input."""
    linear = torch.nn.Linear(K, N, bias=False, dtype=weight_dtype)
    float8 = Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(ROWS, K, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(ROWS, N, dtype=torch.bfloat16)
    with OpBytes() as counted:
        float8(x).backward(grad)
    return counted.bytes


def within_scale_ops(traced: float, formula: float) -> bool:
    return formula <= traced <= formula * (1 + SCALE_OPS)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_eager_casts_move_what_the_formula_counts(recipe: str) -> None:
    """bf16 weight (as FSDP2 and ZeRO-1 run it): six casts, three layout copies, rowwise's output scaling."""
    predicted = sum(linear_cast_bytes(ROWS, K, N, scaling=recipe, compiled=False, weight_bytes=2))
    assert within_scale_ops(traced_bytes(recipe, torch.bfloat16), predicted)


def test_an_fp32_weight_casts_at_the_same_bytes_and_autograd_casts_its_gradient_back() -> None:
    """Autocast's fp32 parameter: no upcast before the scale, and the amax reads 4 bytes where bf16's
    reads 2 and upcasts, 33 bytes either way. Autograd then casts the bf16 weight gradient to the
    parameter's fp32 (2 read, 4 written): not torchao's, and counted with autocast's casts
    (perf/kernels.py AUTOCAST_BYTES_PER_PARAM)."""
    predicted = sum(linear_cast_bytes(ROWS, K, N, scaling="tensorwise", compiled=False, weight_bytes=4))
    assert within_scale_ops(traced_bytes("tensorwise", torch.float32) - (2 + 4) * K * N, predicted)


def test_a_weight_gathered_in_fp8_is_cast_once_before_the_gather() -> None:
    """FSDP2 float8 all-gather on one rank: the fp32 shard cast with its precomputed scale before the
    gather, then the linear with the weight already fp8 (its copy for the input gradient remains)."""
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8 = Float8Linear.from_float(torch.nn.Linear(K, N, bias=False), config=config)
    weight = float8.weight
    weight._precomputed_scale = torch.tensor(1.0)  # precompute_float8_dynamic_scale_for_fsdp's, after a step
    x = torch.randn(ROWS, K, dtype=torch.bfloat16, requires_grad=True)
    with OpBytes() as counted:
        (data,), (scale,) = weight.fsdp_pre_all_gather(None)
        gathered, _ = weight.fsdp_post_all_gather((data,), (scale,), torch.bfloat16)
        out = matmul_with_hp_or_float8_args.apply(x, gathered.t(), float8.linear_mm_config, config)
        out.backward(torch.randn(ROWS, N, dtype=torch.bfloat16))
    linear = linear_cast_bytes(ROWS, K, N, scaling="tensorwise", compiled=False, weight_bytes=2, weight_gathered=True)
    assert within_scale_ops(counted.bytes, gathered_shard_bytes(K * N) + sum(linear))


def test_compiled_casts_are_one_amax_read_and_one_cast_pass() -> None:
    """The stated assumption under training.compile: 2h + 1 bytes per element cast, no layout copies."""
    compiled = linear_cast_bytes(ROWS, K, N, scaling="tensorwise", compiled=True, weight_bytes=2)
    assert compiled.forward == 5 * (ROWS * K + K * N)
    assert compiled.backward == 5 * (2 * ROWS * N + K * N + ROWS * K)
    fp32_weight = linear_cast_bytes(ROWS, K, N, scaling="tensorwise", compiled=True, weight_bytes=4)
    assert fp32_weight.forward - compiled.forward == (9 - 5) * K * N
