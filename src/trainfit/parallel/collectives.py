"""The collectives each parallelism issues, described once in config terms. Torch-free.

For one rank of the busiest pipeline stage of a Layout, `collective_calls` lists every collective
call of one optimizer step: which technique issues it, its kind, the mesh axes of its group, what
moves (a key of TENSORS, and the site in models/block_spec.py's terms), the phase, how many calls,
and whether gradient accumulation repeats them in every micro-batch. perf/comms.py prices each
call (bytes, then time on the group's link); the traced step's collectives are checked against it
(tests/estimator/test_consistency.py). Picotron keeps each parallelism's collectives beside it; this
is their one description here, read instead of each technique's code.

    CollectiveCall("tp", "reduce_scatter", ("tp",), "row_output", "attention.wo output", "forward", 2)
    # with sequence parallelism: each of 2 blocks reduce-scatters its wo output, every micro-batch
    CollectiveCall("fsdp", "all_gather", ("dp_shard", "cp"), "block_params", "a block's unit", "backward", 2)
    # ZeRO-3 gathers each of 2 blocks again in backward, over the shard ranks (dp_shard x cp)

What each technique issues (the modules that build it say why):
- DDP (zero_stage 0, parallel/data_parallel.apply_ddp): the gradients all-reduced over every
  data-parallel rank (x cp), bucket by bucket, once per step (accumulation syncs the last
  micro-batch only).
- ZeRO-1 (parallel/zero.py), around the optimizer step, bucket by bucket: the accumulated gradients
  reduce-scattered over the shard ranks (parallel/mesh.shard_mesh: dp_shard x cp), HSDP's all-reduce
  of the shard across dp_replicate, and the updated parameters all-gathered over the shard ranks.
- FSDP (zero_stage 2/3, data_parallel.apply_fsdp: one unit per block plus the root of embeddings,
  final norm and output), every micro-batch over the shard ranks: each unit's parameters all-gathered
  in forward, each block's again in backward under ZeRO-3 (reshard_after_forward; never the root),
  each unit's gradients reduce-scattered in backward; once per step, HSDP's all-reduce of the
  gradient shards across dp_replicate. Under expert parallelism a block's routed experts are gathered
  and reduce-scattered apart, over edp (parallel/mesh.expert_mesh). fp8_all_gather: the float8
  linears' weights travel in fp8 ("block_params_fp8").
- Tensor parallelism (parallel/tensor_parallel.py), per block and micro-batch on tp (Megatron's f
  and g): a column-parallel group's input (the attention's, a dense MLP's) is the identity forward and
  all-reduced backward, a row-parallel output (models/block_spec.py's tp="row" linears) all-reduced
  forward. Sequence parallelism turns each all-reduce into an all-gather before and a reduce-scatter
  after: column inputs all-gathered forward, reduce-scattered backward; row outputs reduce-scattered
  forward, all-gathered backward; an MoE feed-forward (replicated) gathers its input forward (a local
  input: no backward) and slices its output (the gradient all-gathered backward). Around the blocks:
  the vocabulary-parallel embedding's partial output summed (reduce-scattered under SP), the output
  projection's input as a column group, GPT-2's positions sliced under SP (all-gathered backward),
  loss_parallel's 3 per-token statistics all-reduced forward, and under FSDP2 with SP each norm
  gain's partial gradient all-reduced in backward. A checkpointed block's recomputation reruns its
  forward calls, except its last when that is a reduction ending the block (nothing saves its output)
  and the reductions when the policy keeps them (models/checkpoint_policy.py's "tp_reduction").
- Context parallelism (parallel/context_parallel.py), per attention layer and micro-batch on cp: K
  and V of the whole sequence all-gathered forward (again in recomputation: all-gathers are never
  kept), their gradients reduce-scattered backward.
- Expert parallelism (parallel/expert.py), per MoE layer and micro-batch on ep: the dispatch and
  combine all-to-alls forward, their reverses backward, the forward ones again in recomputation unless
  the policy keeps all-to-alls; dropless first exchanges the per-expert counts (forward and rerun).
- Pipeline parallelism: per micro-batch and virtual stage, the stage boundary's activation sent
  forward and its gradient backward.
- The trainer (train/step.py), once per step after the last backward, one number each: the logged
  loss all-reduced over the world (World.sum_, the default group), and clipping's gradient norm
  (data_parallel.clip_grad_norm_, always computed: grad_clip=0 clips at inf): each sharded
  gradient's partial norm all-reduced over the axes it is sharded on (DTensor.full_tensor: FSDP's
  shard ranks, HSDP's replicas aside, tp, the routed experts' ep and, under FSDP, edp; ZeRO-1's
  master shards over its shard ranks, zero.ZeroOptimizer.clip_grad_norm_), then the stages' squared
  norms over pp. ZeRO-1's engine reduces over its shard ranks only: it composes with no tp, ep or
  pp (Layout.untrainable_reason), where a global norm would need them too, as declared here.
  Declared untimed (CollectiveCall.timed): perf/comms.py leaves them out, but they open their
  groups' connections (memory/closed_form/comm_buffers.py).
Not described: without data parallelism the sequence-parallel gains' gradients DTensor all-reduces
at each later use, fp16 loss scaling's inf/nan flag, the loop's and checkpointing's collectives on
the default group (stop signals, barriers, broadcasts), padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import config_key, kind_of_layers, layer_kinds
from trainfit.models.block_spec import block_linears
from trainfit.models.checkpoint_policy import POLICIES
from trainfit.parallel.layout import AXES, Layout
from trainfit.parallel.stage_split import checkpointed
from trainfit.parallel.tp_sites import TpSite, block_sites, root_sites

Technique = Literal["ddp", "zero1", "fsdp", "tp", "cp", "ep", "pp", "train"]
Kind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]
Phase = Literal["forward", "backward", "step"]

TENSORS: dict[str, str] = {
    "bucket_grads": "a gradient bucket (DDP's, or ZeRO-1's of the accumulated gradients)",
    "bucket_grad_shard": "this rank's shard of a ZeRO-1 gradient bucket",
    "bucket_params": "a ZeRO-1 bucket of updated parameters (their dtype)",
    "root_params": "the root unit's parameters (embeddings, final norm, output: the stage's part)",
    "block_params": "one block's parameters, routed experts apart under expert parallelism",
    "block_params_fp8": "block_params with the float8 linears' weights in fp8",
    "expert_params": "one block's routed experts on this ep rank",
    "root_grads": "root_params' gradients", "block_grads": "block_params' gradients",
    "expert_grads": "expert_params' gradients",
    "root_grad_shard": "this rank's shard of root_grads", "block_grad_shard": "this rank's shard of block_grads",
    "row_output": "a row-parallel linear's output (or its gradient): the hidden states, activation dtype",
    "stream": "the residual stream (a norm's or the embedding's output, or the gradient into one)",
    "loss_stats": "one fp32 number per token (loss_parallel's max, sum of exps or target logit)",
    "positions": "GPT-2's learned positions of the rank's tokens",
    "norm_gain": "a norm gain's gradient (dim elements)",
    "qk_norm_gain": "a QK-norm gain's gradient (head_dim elements)",
    "kv": "K or V of the whole sequence (the rank's heads)",
    "routed_tokens": "the hidden state of each (token, choice) pair a rank sends (capacity: every slot)",
    "expert_counts": "the per-expert row counts (int64)",
    "boundary": "the stage boundary's hidden states (1/tp of them under sequence parallelism)",
    "regathered": "a column group's input all-gathered again in backward (parallel.sp_recompute_gather), in "
                  "the dtype its projections saved it in: the activations'",
    "loss": "the step's summed loss (one fp32 number)",
    "grad_norm": "a gradient norm, or its square (one fp32 number)",
}
"""What a call moves, as perf/comms.py sizes it."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a rank of the busiest pipeline stage issues, `count` times per micro-batch
    (per_microbatch) or per step, and per bucket where per_bucket."""

    technique: Technique
    kind: Kind
    axes: tuple[str, ...]
    """Mesh axes of the group (parallel/layout.AXES; "ep" and "edp": parallel/mesh.expert_mesh)."""
    tensor: str
    """What moves: a key of TENSORS."""
    site: str
    """Where, in models/block_spec.py's and the config's terms."""
    phase: Phase
    """forward | backward (recomputation counts as backward) | step (around the optimizer step)."""
    count: int
    per_microbatch: bool = True
    """Gradient accumulation repeats it in every micro-batch; else once per step."""
    unit: str = ""
    """Data parallel: root | blocks | experts (FSDP units) | buckets (DDP, ZeRO-1)."""
    per_bucket: bool = False
    """count is per gradient bucket (engine.py's bucket bytes say how many)."""
    timed: bool = True
    """perf/comms.py prices it; False for the trainer's one-number all-reduces, which it leaves out
    (their count is a floor: DTensor reduces each differently sharded gradient group's norm apart)."""
    overlaps: tuple[str, ...] = ()
    """Under parallel.async_tp, the GEMMs it is split across and hidden behind (perf/kernels.Gemm
    names; "output": the output projection): the forward GEMMs that consume what it gathers or
    produce what it reduces; in backward, their input-gradient GEMMs, of the same shape."""


def group_size(layout: Layout, axes: tuple[str, ...]) -> int:
    """Ranks in a group over `axes`."""
    if axes == ("ep",):
        return layout.ep
    if axes == ("edp",):
        return layout.dp_shard * layout.cp // layout.ep
    return math.prod(getattr(layout, axis) for axis in axes)


SHARD = ("dp_shard", "cp")
"""The ranks ZeRO/FSDP shards over (parallel/mesh.shard_mesh: the cp ranks of a replica hold the
same parameters, so they shard them too)."""
REPLICAS = ("dp_replicate",)
"""HSDP's replicas of a shard group."""


def _data_parallel(layout: Layout, layers: int, routed: bool = True) -> list[CollectiveCall]:
    if layout.zero_stage == 0:
        return [CollectiveCall("ddp", "all_reduce", ("dp_replicate", "dp_shard", "cp"), "bucket_grads",
                               "every gradient, in DDP buckets", "backward", 1, False, "buckets", True)]
    if layout.zero_stage == 1:
        return [CollectiveCall("zero1", "all_reduce" if layout.zero1_grad_all_reduce else "reduce_scatter", SHARD,
                               "bucket_grads", "the accumulated gradients", "step", 1, False, "buckets", True),
                CollectiveCall("zero1", "all_reduce", REPLICAS, "bucket_grad_shard", "the gradient shard (HSDP)",
                               "step", 1, False, "buckets", True),
                CollectiveCall("zero1", "all_gather", SHARD, "bucket_params", "the updated parameters",
                               "step", 1, False, "buckets", True)]
    blocks = "block_params_fp8" if layout.fp8_gathers else "block_params"
    out = [CollectiveCall("fsdp", "all_gather", SHARD, "root_params", "the root unit", "forward", 1, unit="root")]
    for tensor, axes, what in ((blocks, SHARD, "blocks"), ("expert_params", ("edp",), "experts")):
        if what == "experts" and (layout.ep == 1 or not routed):
            continue
        site = "a block's unit" if what == "blocks" else "a block's routed experts"
        out.append(CollectiveCall("fsdp", "all_gather", axes, tensor, site, "forward", layers, unit=what))
        if layout.zero_stage == 3:
            out.append(CollectiveCall("fsdp", "all_gather", axes, tensor, site, "backward", layers, unit=what))
    if layout.ep > 1:
        out.append(CollectiveCall("fsdp", "reduce_scatter", ("edp",), "expert_grads", "a block's routed experts",
                                  "backward", layers, unit="experts"))
    return out + [
        CollectiveCall("fsdp", "reduce_scatter", SHARD, "block_grads", "a block's unit", "backward", layers,
                       unit="blocks"),
        CollectiveCall("fsdp", "reduce_scatter", SHARD, "root_grads", "the root unit", "backward", 1, unit="root"),
        CollectiveCall("fsdp", "all_reduce", REPLICAS, "block_grad_shard", "a block's unit (HSDP)", "backward",
                       layers, False, "blocks"),
        CollectiveCall("fsdp", "all_reduce", REPLICAS, "root_grad_shard", "the root unit (HSDP)", "backward", 1,
                       False, "root")]


TpCall = tuple[Kind, str, str, tuple[str, ...]]
"""(kind, tensor, site, the GEMMs it overlaps under async TP)."""


def _moves(sites: tuple[TpSite, ...], phase: str) -> list[TpCall]:
    return [(m.kind, m.tensor, m.site, m.overlaps) for site in sites for m in site.moves if m.phase == phase
            for _ in range(m.count)]


def _tp(model: ModelConfig, layout: Layout, layers: int, wrapped: int) -> list[CollectiveCall]:
    """Tensor parallelism's calls, from parallel/tp_sites.py's sites: a block's on each of the rank's blocks,
    a checkpointed block's forward ones again in its recomputation, the ends' on their stage. Once per model
    and what it reads of the layout (the planner's layouts share a few)."""
    return list(_tp_calls(config_key(model), layout.sequence_parallel, layout.pp == 1,
                          layout.activation_checkpointing, layout.regathers, layout.data_parallel == "fsdp",
                          layers, wrapped))


@functools.lru_cache(maxsize=4096)
def _tp_calls(model_key: tuple, sp: bool, one_stage: bool, policy_name: str, regathers: bool, fsdp: bool,
              layers: int, wrapped: int) -> tuple[CollectiveCall, ...]:
    model = ModelConfig(*model_key)
    output = 1  # the busiest stage is the last: the output projection and the loss ...
    embedding = int(one_stage)  # ... and the embedding when there is one stage
    block, root = block_sites(model, sp), root_sites(model, sp)
    fwd, bwd = _moves(block, "forward"), _moves(block, "backward")
    rerun = fwd[:-1] if block_linears(model)[-1].tp == "row" else fwd  # a trailing reduction ends the block
    if POLICIES[policy_name].keeps("tp_reduction"):
        rerun = [call for call in rerun if call[0] == "all_gather"]
    on_stage = {"first": embedding, "last": output}

    def ends(phase: str, where: str) -> list[tuple[Kind, Phase, str, str, int, tuple[str, ...]]]:
        """The root sites' moves at `where` (a Move.site), on the stage that holds them."""
        return [(m.kind, m.phase, m.tensor, m.site, on_stage[site.stage] * m.count, m.overlaps)
                for site in root for m in site.moves if m.phase == phase and m.site == where]

    calls: list[tuple[Kind, Phase, str, str, int, tuple[str, ...]]] = [
        *ends("forward", "loss_parallel's statistics"),
        *[(kind, "forward", tensor, site, layers, gemms) for kind, tensor, site, gemms in fwd if kind == "all_gather"],
        *ends("forward", "output input"),
        *[(kind, "forward", tensor, site, layers, gemms) for kind, tensor, site, gemms in fwd if kind != "all_gather"],
        *ends("forward", "tok_embeddings output"),
        *[(kind, "backward", tensor, site, layers, gemms) for kind, tensor, site, gemms in bwd
          if tensor == "row_output"],
        *[(kind, "backward", tensor, site, layers, gemms) for kind, tensor, site, gemms in bwd
          if kind == "all_gather" and tensor == "stream"],
        *ends("backward", "tok_embeddings output"),
        *[(kind, "backward", tensor, f"{site} (recomputed)", wrapped, gemms) for kind, tensor, site, gemms in rerun
          if kind == "all_gather"],
        *[(kind, "backward", tensor, site, layers, gemms) for kind, tensor, site, gemms in bwd
          if kind != "all_gather" and tensor == "stream"],
        *ends("backward", "output input"),
        *[(kind, "backward", tensor, f"{site} (recomputed)", wrapped, gemms) for kind, tensor, site, gemms in rerun
          if kind != "all_gather"],
        *ends("backward", "pos_embeddings output"),
        # parallel.sp_recompute_gather: each column group's input again, in the unwrapped blocks' backward
        # (beside the group's input-gradient GEMMs, as its forward gather is beside their forward ones:
        # where the engine overlaps them, perf/engines.Engine.regather_overlaps_dgrad)
        *[("all_gather", "backward", "regathered", f"{site.path} input (regathered)", layers - wrapped,
           next(m.overlaps for m in site.moves if m.phase == "forward" and m.kind == "all_gather"))
          for site in block if site.style == "branch_input" and regathers],
    ]
    out = [CollectiveCall("tp", kind, ("tp",), tensor, site, phase, count, overlaps=gemms)
           for kind, phase, tensor, site, count, gemms in calls]
    return tuple(out + _partial_gains(fsdp, block, root, layers, on_stage))


def _partial_gains(fsdp: bool, block: tuple[TpSite, ...], root: tuple[TpSite, ...], layers: int,
                   on_stage: dict[str, int]) -> list[CollectiveCall]:
    """The gains whose gradient each tp rank holds a partial sum of (tp_sites.TpSite.partial_gains), one
    all-reduce per tensor. FSDP2 reduces them in every backward, before its reduce-scatter; otherwise they
    stay partial through accumulation and are reduced once, where the step first reads them (clipping's
    norm)."""
    def tensors(gain: str) -> int:
        return sum(s.partial_gains for s in block if s.gain_tensor == gain) * layers + \
            sum(s.partial_gains * on_stage[s.stage] for s in root if s.gain_tensor == gain)

    phase: Phase = "backward" if fsdp else "step"
    return [CollectiveCall("tp", "all_reduce", ("tp",), tensor, site, phase, count, per_microbatch=fsdp)
            for tensor, site in (("norm_gain", "norm gains"), ("qk_norm_gain", "QK-norm gains"))
            for count in [tensors(tensor)] if count]


def _train(model: ModelConfig, layout: Layout) -> list[CollectiveCall]:
    """The trainer's all-reduces after the last backward (module docstring), untimed."""
    fsdp = layout.data_parallel == "fsdp"
    experts = [("ep",), *[("edp",)] * fsdp] if model.num_experts and layout.ep > 1 else []
    sharded = [SHARD] if layout.data_parallel in ("zero1", "fsdp") else []
    norm = [*sharded, ("tp",), *experts, ("pp",)]
    calls = [CollectiveCall("train", "all_reduce", AXES, "loss", "the logged loss", "step", 1, False, timed=False)]
    return calls + [CollectiveCall("train", "all_reduce", axes, "grad_norm", "clipping's gradient norm", "step", 1,
                                   False, timed=False) for axes in norm]


def collective_calls(model: ModelConfig, layout: Layout) -> tuple[CollectiveCall, ...]:
    """Every collective one rank of the busiest pipeline stage issues per step (module docstring),
    in the order perf/comms.py lists them; none over a group of one rank, none of count 0. A model whose
    layers differ in their tensors (architecture.layer_kinds): each kind's calls over its blocks on that
    rank, and the model's own (its ends, the step's) once. The calls do not depend on the batch's shape
    (perf/comms.py sizes them): looked up once per model and the rest of the layout (the planner times
    every micro-batch size of a layout)."""
    return _calls_of(config_key(model), _BATCH_FREE(layout))


_BATCH_SHAPE = {"micro_batch_size": 1, "grad_accum_steps": 1, "num_microbatches": 1, "global_batch_size": 1,
                "seq_len": 1, "rows": None}
"""The fields collective_calls does not read, each with a value that stands for any."""
_BATCH_FREE_NAMES = tuple(f.name for f in dataclasses.fields(Layout) if f.name not in _BATCH_SHAPE)
_BATCH_FREE = operator.attrgetter(*_BATCH_FREE_NAMES)
"""A Layout's fields but _BATCH_SHAPE's, in order (scalars and frozen values): the key of _calls_of."""


@functools.lru_cache(maxsize=4096)
def _calls_of(model_key: tuple, batch_free: tuple) -> tuple[CollectiveCall, ...]:
    layout = Layout(**dict(zip(_BATCH_FREE_NAMES, batch_free, strict=True)), **_BATCH_SHAPE)
    return _collective_calls(ModelConfig(*model_key), layout)


def _collective_calls(model: ModelConfig, layout: Layout) -> tuple[CollectiveCall, ...]:
    # The rank with the most blocks, and how many of them are checkpointed (global indices: a stage
    # that starts at an odd block wraps other ones than its count alone says).
    layers, wrapped = max((blocks, wrapped) for blocks, wrapped, _ in layout.rank_shapes())
    policy = POLICIES[layout.activation_checkpointing]
    wrapped = wrapped if policy.wraps else 0
    kinds = layer_kinds(model)
    if len(kinds) == 1:
        return rank_calls(model, layout, layers, wrapped)
    counts: dict[CollectiveCall, int] = {}

    def add(calls: tuple[CollectiveCall, ...], sign: int) -> None:
        for c in calls:
            key = dataclasses.replace(c, count=0)
            counts[key] = counts.get(key, 0) + sign * c.count

    for kind, own, own_wrapped, sign in kind_parts(model, layout):
        add(rank_calls(kind, layout, own, own_wrapped), sign)
    return tuple(dataclasses.replace(key, count=n) for key, n in counts.items() if n > 0)


def kind_parts(model: ModelConfig, layout: Layout) -> list[tuple[ModelConfig, int, int, int]]:
    """A model whose layers differ in their tensors as parts whose calls add up (with their sign) to its
    busiest rank's: (kind, its blocks there, of them checkpointed, +1 or -1). The model's own calls (its
    ends, the step's) are those of a rank of no blocks; each kind's blocks add its calls with blocks over
    its calls without."""
    kinds, of = layer_kinds(model), kind_of_layers(model)
    blocks = max((place.blocks for place in (layout.rank_placement(r) for r in range(layout.pp))), key=len)
    wraps = POLICIES[layout.activation_checkpointing].wraps
    parts = [(next(k for k in kinds if k.num_experts), 0, 0, 1)]  # the grad-norm's expert axes: the model's
    for k, kind in enumerate(kinds):
        own = [i for i in blocks if of[i] == k]
        wrapped = sum(checkpointed(i, layout.ac_every_n_layers) for i in own) if wraps else 0
        parts += [(kind, len(own), wrapped, 1), (kind, 0, 0, -1)]
    return parts


def rank_calls(model: ModelConfig, layout: Layout, layers: int, wrapped: int) -> tuple[CollectiveCall, ...]:
    """collective_calls of a rank running `layers` blocks of `model` (its layers alike), `wrapped` of them
    checkpointed."""
    policy = POLICIES[layout.activation_checkpointing]
    calls = _data_parallel(layout, layers, bool(model.num_experts)) + _tp(model, layout, layers, wrapped)
    for name in ("K", "V"):
        calls.append(CollectiveCall("cp", "all_gather", ("cp",), "kv", f"attention {name}", "forward", layers))
    for name in ("K", "V"):
        calls.append(CollectiveCall("cp", "all_gather", ("cp",), "kv", f"attention {name} (recomputed)", "backward",
                                    wrapped))
    for name in ("K", "V"):
        calls.append(CollectiveCall("cp", "reduce_scatter", ("cp",), "kv", f"attention {name}", "backward", layers))
    if model.num_experts:
        rerun = 0 if policy.keeps("all_to_all") else wrapped
        for phase, count in (("forward", layers), ("backward", layers), ("backward", rerun)):
            for site in ("feed_forward dispatch", "feed_forward combine"):
                calls.append(CollectiveCall("ep", "all_to_all", ("ep",), "routed_tokens", site, phase, count))
        if not model.capacity_factor:
            for phase, count in (("forward", layers), ("backward", rerun)):
                calls.append(CollectiveCall("ep", "all_to_all", ("ep",), "expert_counts", "feed_forward dispatch",
                                            phase, count))
    for phase, site in (("forward", "stage boundary activation"), ("backward", "stage boundary gradient")):
        calls.append(CollectiveCall("pp", "p2p", ("pp",), "boundary", site, phase, layout.pp_virtual_stages))
    calls += _train(model, layout)
    sizes = {axes: group_size(layout, axes) for axes in {c.axes for c in calls}}  # a few distinct axes
    return tuple(c for c in calls if c.count > 0 and sizes[c.axes] > 1)
