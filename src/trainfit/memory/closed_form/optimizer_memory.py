"""The optimizer's memory on a rank: its states per optimizer (Adam-likes, SGD, 8-bit AdamW, Adafactor,
priced tensor by tensor where their size depends on each tensor's shape), their ZeRO shards (routed experts
sharded over the expert-data-parallel ranks only), and the temporaries step() allocates (fused, foreach or
single-tensor kernels), from optimizer_spec.py's facts, which train/optim.py builds the optimizer by, so the
two cannot disagree. Torch-free."""

from __future__ import annotations

import math

from trainfit.hardware import device_type
from trainfit.memory.closed_form.block.activation_terms import FP32
from trainfit.memory.closed_form.rank_layout import LayoutCommon, RankLayout
from trainfit.memory.closed_form.run_shape import Precision, Run
from trainfit.models.architecture import describe
from trainfit.models.block_spec import block_linears
from trainfit.optimizer_spec import (
    ADAM_STEP_TENSOR_BYTES,
    EIGHT_BIT_BLOCK,
    EIGHT_BIT_MIN_SIZE,
    EIGHT_BIT_TABLE_BYTES,
    OPTIMIZER_STATES,
    uses_fused_adam,
)


def optimizer_bytes(name: str, prec: Precision, params: int, tensors: int, small: int,
                     matrices: list[tuple[int, ...]] = ()) -> int:
    """States of `params` elements held in `tensors` tensors; `small` elements are norms and
    biases (1-D), `matrices` the local shapes of the others (matrix_shapes), which adamw-8bit and
    adafactor price tensor by tensor. Every Adam-like and Adafactor state has a 0-dim fp32 `step`
    per tensor (torch's and torchao's `torch.tensor(0.0)`)."""
    steps = ADAM_STEP_TENSOR_BYTES * tensors if name in ("adam", "adamw", "adamw-8bit", "adafactor") else 0
    if name == "adamw-8bit":
        eight_bit = sum(_eight_bit_state_bytes(prec, math.prod(shape)) for shape in matrices)
        return steps + eight_bit + 2 * small * prec.param
    if name == "adafactor":
        # torch/optim/_adafactor.py: >= 2-D: row_var (last dim 1) and col_var (second-to-last 1);
        # 1-D: a whole `variance`; all in the gradient's dtype (the updated parameters').
        factored = sum(math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] for shape in matrices)
        return steps + (factored + small) * prec.param
    return OPTIMIZER_STATES[name] * prec.param * params + steps


def _eight_bit_state_bytes(prec: Precision, n: int) -> int:
    """adamw-8bit's two states of a tensor with `n` local values (EIGHT_BIT_* above)."""
    if n < EIGHT_BIT_MIN_SIZE or n % EIGHT_BIT_BLOCK:
        return 2 * n * prec.param
    return 2 * (n + FP32 * n // EIGHT_BIT_BLOCK + EIGHT_BIT_TABLE_BYTES)


def matrix_shapes(run: Run, common: LayoutCommon, lay: RankLayout, shards: int) -> list[tuple[int, ...]]:
    """The >= 2-D parameters of a rank (train/optim.param_groups' decay group), as local shapes: after
    tp (column-parallel: rows / tp; row-parallel: columns / tp; vocabulary-parallel embedding and
    output), ep (routed experts: their first dim / ep) and ZeRO sharding over `shards` ranks, which
    splits dim 0 with torch.chunk (rank 0's, the largest chunk: ceil; routed experts over the edp
    ranks, shards / ep). The tp x ZeRO-sharded row-parallel weights take rows / shards of whole
    columns / tp (FSDP2's second mesh dimension)."""
    m, tp, ep = run.model, run.layout.tp, run.layout.ep
    block: list[tuple[int, ...]] = []
    experts: list[tuple[int, ...]] = []
    for kind, blocks in zip(common.kinds, lay.kind_blocks, strict=True):
        for linear in block_linears(kind.run.model):  # each weight as tp splits it (models/block_spec.py), (out, in)
            k, n = linear.local_shape(tp)
            if linear.routed:
                experts += [(max(1, linear.copies // ep), n, k)] * blocks
            else:
                block += [(n, k)] * blocks
    vocab = (-(-m.vocab_size // tp), m.dim)
    ends = [vocab] * lay.first + [(m.max_seq_len, m.dim)] * (lay.first and describe(m).learned_positions)
    ends += [vocab] * (lay.last and not lay.tied_here)

    def local(shape: tuple[int, ...], over: int) -> tuple[int, ...]:
        return (-(-shape[0] // over), *shape[1:])

    edp = max(1, shards // ep) if ep > 1 else shards
    return [local(shape, shards) for shape in block] + [local(shape, edp) for shape in experts] + \
        [local(shape, shards) for shape in ends]


def on_zero_shard(n: int, experts: int, shards: int, ep: int) -> int:
    """Elements of `n` on one of `shards` ZeRO shards (dp_shard x cp), where `experts` of them are
    routed experts already split over ep: FSDP2 shards those over the edp ranks (shards / ep) only,
    so expert states end divided by ep x edp, the rest by the shards (1: nothing sharded)."""
    if shards == 1:
        return n
    return (n - experts) // shards + experts * ep // shards


def largest_sharded_group(run: Run, common: LayoutCommon, lay: RankLayout, decay: int, experts: int,
                          shards: int) -> int:
    """The largest weight-decay layout group on a shard: _largest_layout_group's, and under expert
    parallelism the experts' (DTensors of their own mesh: a group apart)."""
    if run.layout.ep == 1:
        return _largest_layout_group(run, common, lay, decay) // shards
    dense = _largest_layout_group(run, common, lay, decay - experts) // shards
    return max(dense, on_zero_shard(experts, experts, shards, run.layout.ep))


def _largest_layout_group(run: Run, common: LayoutCommon, lay: RankLayout, decay: int) -> int:
    """The largest of the optimizer's weight-decay groups (elements on the rank): one, unless tensor
    parallelism splits it by layout (train/optim.param_groups, data_parallel.group_by_layout), as
    torch's foreach kernels take one kind of tensor at a time: the column-parallel weights with the
    vocabulary-parallel embedding and output (Shard(0)), the row-parallel ones (Shard(1): wo, w2),
    and what no plan shards (an MoE feed-forward)."""
    tp = run.layout.tp
    if tp == 1:
        return decay

    def weights(style: str) -> int:  # the rank's blocks' weights of one tensor-parallel style
        return int(common.per_kind(lay, lambda r, _: sum(math.prod(linear.local_shape(tp)) for linear in
                                                         block_linears(r.model) if linear.tp == style)))

    column = weights("column") + lay.embedding + lay.output_matmul * (not lay.tied_here)
    row = weights("row")
    return max(column, row, decay - column - row)


def optimizer_step_temporaries(run: Run, prec: Precision, decay: int, largest: int,
                                matrices: list[tuple[int, ...]] = ()) -> int:
    """What the optimizer allocates inside step() (torch 2.13 / torchao 0.18 source, measured on CPU).
    Fused Adam/AdamW (`uses_fused_adam`): nothing. foreach Adam/AdamW:
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, a state-sized list per parameter group
    (the largest is the weight-decay group); Adam's L2 decay first makes
    `grads = torch._foreach_add(grads, params, alpha=wd)`, deleted before the sqrt; foreach SGD with
    decay, the same copy. foreach Adafactor: `var_estimates = [row_var @ col_var ...]`, a
    parameter-sized list of the group, updated in place into the update. A single-tensor loop
    (foreach=False) holds all that for one tensor. adamw-8bit: torchao compiles each parameter's
    update; its kernel holds two fp32 buffers of the parameter's local shape and two of one value per
    block for a parameter with 8-bit states, nothing for plain states: on CUDA (triton's kernel
    assumed alike); on CPU inside one call no operator boundary sees (traced.py's
    _eight_bit_update_as_compiled): 0."""
    o = run.optimizer
    if o.name == "adamw-8bit":
        if _device(run) == "cpu":
            return 0
        quantized = [n for n in map(math.prod, matrices) if _eight_bit_state_bytes(prec, n) < 2 * n * prec.param]
        return max((2 * FP32 * (n + n // EIGHT_BIT_BLOCK) for n in quantized), default=0)
    if uses_fused_adam(o, _device(run), run.layout.sharded_loss_scaling):
        return 0
    size = decay if o.foreach else largest
    l2_copy = size * prec.param if run.training.weight_decay > 0 and o.name in ("adam", "sgd") else 0
    sqrt = size * prec.param if o.name in ("adam", "adamw", "adafactor") else 0
    return max(sqrt, l2_copy) if o.foreach else sqrt + l2_copy


def _device(run: Run) -> str:
    return device_type(run.hardware)
