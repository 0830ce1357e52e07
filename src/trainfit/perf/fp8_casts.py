"""fp8-mixed's float8 linears: which Linears torchao converts, and the memory traffic of its casts
to fp8, per converted linear and micro-batch, eager and under training.compile. Torch-free: the
estimators read these counts; trainfit.float8 (which imports torchao) converts the same Linears.

Every count is bytes read plus written per element of the tensor cast, read from torchao 0.18's
code (torchao/float8/) and checked against a trace of its float8 linear on CPU
(tests/estimator/test_fp8_casts.py: each aten op's input and output bytes, views excluded).

Six casts per linear and micro-batch (float8_linear.matmul_with_hp_or_float8_args). Autograd saves
the high-precision input (rows x k) and weight (k x n), never their fp8 casts, so each GEMM casts its
operands afresh: the forward casts the input and the weight; the backward casts the output gradient
(rows x n) and the weight again for the input gradient, then the output gradient and the input
again for the weight gradient. The input and output gradient are bf16 (trainfit.float8 casts the
input to the autocast dtype; under FSDP2 the module runs in bf16); the weight is the fp32 parameter
under autocast (one process, DDP), else bf16.

One cast, eager (float8_scaling_utils.hp_tensor_to_float8_dynamic), h bytes per input element:
| op                                                                     | bytes                   |
|------------------------------------------------------------------------|-------------------------|
| float8_utils.tensor_to_amax: torch.abs                                 | h + h                   |
| ... then torch.max (tensorwise) or torch.amax along a dim (rowwise)    | h                       |
| float8_training_tensor._ToFloat8ConstrFunc: tensor.to(float32)         | h + 4 (none when h = 4) |
| ... `* scale`                                                          | 4 + 4                   |
| float8_utils.to_fp8_saturated: clamp                                   | 4 + 4                   |
| ... `.to(float8_dtype)`                                                | 4 + 1                   |

33 bytes per element for a bf16 tensor and for an fp32 one alike. Left out: the scale's own ops
(float8_utils.amax_to_scale's float64 clamp and reciprocal, rowwise's power-of-2 rounding,
float8_ops.addmm_float8_unwrapped's reciprocals) on one element per tensor, or one per row or column.

Eager layout copies (float8_ops.preprocess_addmm: torch._scaled_mm takes a row-major first operand
and a column-major second): the weight cast for the input gradient comes out row-major and is copied
(weight.t().contiguous().t()), and both operands of the weight gradient are copied (the output
gradient's transpose made contiguous, the input made column-major): 1 + 1 bytes per element each.
The forward needs none (the weight's transpose casts into column-major directly).

Rowwise only (float8_ops.addmm_float8_unwrapped): the input- and weight-gradient GEMMs run without
fast accumulation (Float8LinearConfig's gemm_config_grad_input and _grad_weight), for which torchao
calls the tensorwise kernel with unit scales and scales the output after: `a_inverse_scale *
b_inverse_scale` writes an fp32 outer product the size of the output (4), then `output *= it`
(2 + 4 + 2): 12 bytes per element of the bf16 input and weight gradients.

Under training.compile the casts fuse (an assumption, not traced): each cast is one read of the
tensor for its amax and one read and an fp8 write for the cast itself, 2h + 1 bytes per element; the
layout copies fold into the cast's write; rowwise's output scaling is one pointwise pass over the
bf16 output (2 + 2), since torch._scaled_mm stays an external kernel.

FSDP2 float8 all-gather (precision.fp8_all_gather, tensorwise): the weight arrives in fp8
(fsdp_utils.WeightWithDynamicFloat8CastTensor.fsdp_post_all_gather), so the linear casts it in
neither pass (float8_linear.py skips tensors already in fp8), but its input-gradient copy remains.
Instead every all-gather casts the rank's fp32 shard with the scale precomputed after the optimizer
step (fsdp_pre_all_gather -> hp_tensor_and_scale_to_float8: `* scale`, clamp, `.to(float8)`: 21
bytes per shard element; FSDP2's hooks run outside the compiled blocks, so eager in both modes), and
precompute_float8_dynamic_scale_for_fsdp reads each shard once per step (torch._foreach_norm, 4).

Kernel launches are not priced: the time model has no per-kernel cost on a GPU, whose host launches
ahead of its kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.parallel.layout import Layout
from trainfit.perf.kernels import Gemm, block_gemms

DIM_MULTIPLE = 16
"""torch._scaled_mm takes fp8 operands whose dims are multiples of 16 (cuBLAS's fp8 kernels; torchao's
own auto-filter, float8_linear_utils._auto_filter_for_*, skips other shapes for the same reason), so
fp8-mixed converts only Linears whose in and out features are (trainfit.float8 reads it from here)."""
ACTIVATION_BYTES = 2
"""The input and the output gradient of a float8 linear: bf16."""
FP32_BYTES = 4
FP8_BYTES = 1
SCALE_AND_CAST_BYTES = (4 + 4) + (4 + 4) + (4 + FP8_BYTES)
"""_ToFloat8ConstrFunc on fp32: `* scale`, to_fp8_saturated's clamp and `.to(float8_dtype)`."""
LAYOUT_COPY_BYTES = FP8_BYTES + FP8_BYTES
"""preprocess_addmm's contiguous copy of an fp8 operand."""
ROWWISE_OUTPUT_SCALE_BYTES = 4 + (2 + 4 + 2)
"""addmm_float8_unwrapped, rowwise without fast accumulation: the fp32 outer product of the inverse
scales, then the bf16 output multiplied by it in place."""
ROWWISE_OUTPUT_SCALE_COMPILED_BYTES = 2 + 2
"""The same scaling compiled: one pass over the bf16 output."""
SHARD_CAST_BYTES = SCALE_AND_CAST_BYTES
"""fsdp_pre_all_gather with a precomputed scale, on the fp32 shard (no amax, no upcast)."""
SCALE_PRECOMPUTE_BYTES = FP32_BYTES
"""precompute_float8_dynamic_scale_for_fsdp: the fp32 shard read once per optimizer step."""


class CastBytes(NamedTuple):
    forward: float
    backward: float


def float8_linears(m: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """A block's Linears that trainfit.float8.convert_to_float8 swaps, as name -> (in features, out
    features, bias elements); dims must be multiples of DIM_MULTIPLE. MoE's routed experts are
    stacked weights, not Linears: they stay bf16, and so does the output projection."""
    D, head_dim = m.dim, m.dim // m.num_heads
    q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
    if m.family == "gpt2":
        dims = {"wq": (D, D, D), "wk": (D, D, D), "wv": (D, D, D), "wo": (D, D, D), "w1": (D, m.ffn_dim, m.ffn_dim),
                "w2": (m.ffn_dim, D, D)}
    else:
        b = 1 if m.qkv_bias else 0
        dims = {"wq": (D, q, b * q), "wk": (D, kv, b * kv), "wv": (D, kv, b * kv), "wo": (q, D, 0)}
        if m.num_experts:
            shared = m.num_shared_experts * m.expert_ffn_dim
            dims["router"] = (D, m.num_experts, 0)
            if shared:
                dims.update({"shared_w1": (D, shared, 0), "shared_w3": (D, shared, 0), "shared_w2": (shared, D, 0)})
        else:
            dims.update({"w1": (D, m.ffn_dim, 0), "w3": (D, m.ffn_dim, 0), "w2": (m.ffn_dim, D, 0)})
    return {name: d for name, d in dims.items() if not (d[0] % DIM_MULTIPLE or d[1] % DIM_MULTIPLE)}


def float8_gemms(m: ModelConfig, layout: Layout) -> list[Gemm]:
    """The float8 linears' GEMMs of one block on one rank: perf/kernels.block_gemms' shapes (after
    tensor parallelism: a column-parallel linear's n and a row-parallel one's k over tp), of the
    Linears float8_linears names; none outside fp8-mixed. The time model prices their casts, the
    analytic memory their backward's (memory/analytic.py)."""
    if layout.precision != "fp8-mixed":
        return []
    converted = float8_linears(m)
    return [g for g in block_gemms(m, layout) if g.name in converted]


def cast_bytes(hp_bytes: int, *, compiled: bool) -> int:
    """Bytes per element of one dynamic cast of a tensor of `hp_bytes` per element (module docstring)."""
    if compiled:
        return hp_bytes + hp_bytes + FP8_BYTES
    amax = hp_bytes + hp_bytes + hp_bytes  # abs, then its max
    upcast = 0 if hp_bytes == FP32_BYTES else hp_bytes + FP32_BYTES
    return amax + upcast + SCALE_AND_CAST_BYTES


def linear_cast_bytes(rows: float, k: int, n: int, *, scaling: str, compiled: bool, weight_bytes: int,
                      weight_gathered: bool = False) -> CastBytes:
    """The cast traffic of one float8 linear (k -> n features) over `rows` tokens of one micro-batch:
    its six casts, the layout copies and rowwise's output scaling (module docstring). `weight_bytes`:
    the weight's dtype size; `weight_gathered`: FSDP2 gathered it in fp8 (no weight casts here)."""
    x, g, w = rows * k, rows * n, k * n  # input, output gradient, weight elements
    act, weight = cast_bytes(ACTIVATION_BYTES, compiled=compiled), cast_bytes(weight_bytes, compiled=compiled)
    weight_casts = 0 if weight_gathered else weight * w
    forward = act * x + weight_casts
    backward = act * (2 * g + x) + weight_casts
    if not compiled:
        backward += LAYOUT_COPY_BYTES * (w + g + x)
    elif weight_gathered:  # the gathered fp8 weight's copy for the input gradient is no cast to fold into
        backward += LAYOUT_COPY_BYTES * w
    if scaling == "rowwise":  # the input gradient (rows x k) and the weight gradient (k x n)
        per_element = ROWWISE_OUTPUT_SCALE_COMPILED_BYTES if compiled else ROWWISE_OUTPUT_SCALE_BYTES
        backward += per_element * (x + w)
    return CastBytes(forward, backward)


def gathered_shard_bytes(shard_elements: float) -> float:
    """One FSDP2 float8 all-gather's cast of a rank's fp32 shard of converted weights (eager)."""
    return SHARD_CAST_BYTES * shard_elements
