"""Per-rank training memory in closed form: pure arithmetic on the config, no torch.

`estimate_memory(model, layout, training, hardware, optimizer)` returns one `MemoryBreakdown` per
pipeline stage (the figures of one rank of that stage) and the worst stage. The components are
their values at the step's peak moment, the largest of: the end of the model's forward, the loss,
the start of the backward, the backward of the stage's last, first and middle blocks, and the optimizer
step (`phase_peaks` keeps the largest of each phase). tests/estimator/ checks them against measured steps of our models.
`StageMemory` gives them rank by rank (the planner stops at the first that does not fit), each
distinct rank once; `SharedSizes` keeps what the layouts of one model share.

Conventions (memory/breakdown.py's vocabulary; parallel/data_parallel.py's layouts and its table
of model-state forms per ZeRO stage):
- params: the tensors the rank computes with. fp32 / bf16-pure: the parameters (their FSDP shard
  at ZeRO-2/3), plus at ZeRO-2 the unsharded copies FSDP keeps from forward to backward.
  *-mixed: the 16-bit compute copies alive at the peak: with torch.amp (one process, DDP)
  autocast's weight casts, which autograd saves for backward (all of them at the end of the
  forward without checkpointing, the recomputed block's with it); under ZeRO-1 the replicated
  16-bit parameters (2Ψ, always); under FSDP2's MixedPrecisionPolicy (ZeRO 2/3) the gathered bf16
  parameters (ZeRO-2: all, from forward to backward; ZeRO-3: per block, reported as all-gather
  `buffers`).
- master_params: *-mixed only: the fp32 parameters the optimizer updates (torch.amp: the module's
  own parameters; FSDP2: their shard; ZeRO-1: its master shards, 4Ψ/N). Equal to what fp32
  reports as params, but for ZeRO-1, whose fp32 parameters are whole and its own masters.
- grads: those that exist at the peak: in the updated parameters' dtype (fp32 under *-mixed), but
  ZeRO-1's flat buffers in the parameters' dtype (optimizer.grad_accum_dtype='fp32': fp32) plus,
  in the optimizer step, its master shards' fp32 gradients (4Ψ/N). Where the gradients are
  buckets (DDP's, as `.grad` views: gradient_as_bucket_view; ZeRO-1's) they exist all step long.
- logits: logits, their fp32 copy, log-softmax and the logits' gradient (train/loss.py:
  `F.cross_entropy(logits.float(), ...)`), on the last stage; under memory.chunked_loss the model's
  output (the final hidden states) and one chunk's logits, log-softmax and gradients (memory/closed_form/logits.py).
- buffers: FSDP all-gather / reduce-scatter buffers (ZeRO-1's collectives run in place in its
  gradient buffers: none), expert-parallel all-to-all buffers (in backward: moe_activations.py's
  routed moments), optimizer-step temporaries, the
  recompute buffer of a checkpointed block (what it rebuilds in backward beyond what it kept),
  and module buffers (RoPE tables).
- memory.offload (FSDP2's CPUOffloadPolicy, either setting): the sharded parameters, their
  gradients (copied out after the reduce-scatter) and the optimizer states and step live on the
  host. On the device stay the unsharded compute copies (ZeRO-2: all of them from forward to
  backward; ZeRO-3: the current and prefetched block and the root), the unsharded gradients
  until their reduce-scatter, activations and logits.
- training.compile: the eager step's tensors (what inductor's partitioner saves instead follows its
  graph heuristics; benchmarks/compile.py measures the gap), but fp8-mixed's casts to fp8, which fuse
  into kernels that allocate only their fp8 output (FLOAT8_CAST_BYTES_COMPILED).

Also here: `model_states` (a rank's resident model states after backward), `forward_retained_bytes`
(what a micro-batch's forward leaves for its backward: the measurable activation figure) and
`zero_model_state_bytes` (the ZeRO paper's own accounting).

The terms, one job per module: run_shape.py (the sections, dtypes and micro-batch shape every term
is sized by), rank_layout.py (what a rank of a stage holds, in elements), zero_states.py (model
states per data-parallel engine), optimizer_memory.py (optimizer states and step temporaries),
activations.py and the modules it names (what a block saves), micro_batch.py (a micro-batch's
activation sizes, shared across layouts), logits.py (the loss region), pipeline_held.py (what a
pipeline schedule holds), step_peak.py (the step's moments and its peak), margin.py (the reserved
margin).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.config import HardwareConfig, ModelConfig, OptimizerConfig, TrainingConfig
from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.closed_form.micro_batch import SharedSizes
from trainfit.memory.closed_form.peak_floor import peak_floor
from trainfit.memory.closed_form.pipeline_held import PipelineHeld, pipeline_held
from trainfit.memory.closed_form.rank_layout import (
    LayoutCommon,
    RankLayout,
    first_block_casts_unsaved,
    first_block_saving,
    layout_common,
    rank_layout,
)
from trainfit.memory.closed_form.run_shape import Run
from trainfit.memory.closed_form.step_peak import rank_breakdown
from trainfit.memory.closed_form.zero_states import StageStates, stage_states
from trainfit.parallel.layout import Layout
from trainfit.perf.engines import TRAINFIT_ENGINE, Engine


@dataclass(frozen=True)
class MemoryEstimate:
    per_stage: list[MemoryBreakdown]
    """One per pipeline stage (len 1 without pp); each the figures of one rank of that stage."""
    worst_stage: int
    """Index of the stage whose peak is largest."""

    @property
    def worst(self) -> MemoryBreakdown:
        return self.per_stage[self.worst_stage]


class StageMemory:
    """The breakdowns of one layout's pipeline ranks, each when asked: what the ranks share is
    computed once, then a rank's own shape (RankLayout: its blocks and ends; PipelineHeld: what its
    schedule holds), and each distinct shape once (ranks alike have equal breakdowns; ranks of one
    RankLayout differ only in what the pipeline holds). The planner asks the ranks one by one and
    stops at the first that does not fit (plan/search.py)."""

    def __init__(self, model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                 optimizer: OptimizerConfig, shared: SharedSizes | None = None, engine: Engine = TRAINFIT_ENGINE
                 ) -> None:
        if shared is not None and shared.model is not model:
            raise ValueError("StageMemory: `shared` holds another model's sizes")
        self._run = Run(model, layout, training, hardware, optimizer, engine)
        self._common = layout_common(self._run, shared or SharedSizes(model))
        self._layouts: dict[RankLayout, Callable[[PipelineHeld], MemoryBreakdown]] = {}
        self._shapes: dict[tuple[RankLayout, PipelineHeld], MemoryBreakdown] = {}
        self._ranks: dict[int, tuple[RankLayout, PipelineHeld]] = {}

    def _shape(self, stage: int) -> tuple[RankLayout, PipelineHeld]:
        """A rank's own shape (what __call__ and floor read), once per stage."""
        if stage not in self._ranks:
            run, common, mb = self._run, self._common, self._common.micro_batch
            place = run.layout.rank_placement(stage)
            lay = rank_layout(run, common, place)
            self._ranks[stage] = lay, pipeline_held(run, lay, place, mb, mb.final + mb.loss.saved, mb.loss.output)
        return self._ranks[stage]

    def __call__(self, stage: int) -> MemoryBreakdown:
        """The breakdown of a rank of pipeline stage (pp rank) `stage`."""
        shape = self._shape(stage)
        if shape not in self._shapes:
            lay, pipe = shape
            if lay not in self._layouts:
                self._layouts[lay] = rank_breakdown(*self._common.at_moment(lay), lay)
            self._shapes[shape] = self._layouts[lay](pipe)
        return self._shapes[shape]

    def floor(self, stage: int) -> int:
        """At most the peak of a rank of `stage` (memory/closed_form/peak_floor.py), at a fraction of its cost:
        where it exceeds the device's memory the rank does not fit (the planner asks it first)."""
        lay, pipe = self._shape(stage)
        return peak_floor(*self._common.at_moment(lay), lay, pipe)


def estimate_memory(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                    optimizer: OptimizerConfig, engine: Engine = TRAINFIT_ENGINE) -> MemoryEstimate:
    """Per-rank memory of one training step, one breakdown per pipeline stage (`engine`: whose engine runs
    it, perf/engines.py). Pure: the planner calls it for thousands of layouts of one config without
    copying anything."""
    memory = StageMemory(model, layout, training, hardware, optimizer, engine=engine)
    stages = [memory(s) for s in range(layout.pp)]
    worst = max(range(len(stages)), key=lambda i: stages[i].peak)
    return MemoryEstimate(per_stage=stages, worst_stage=worst)


def _rank(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
          optimizer: OptimizerConfig, stage: int) -> tuple[Run, LayoutCommon, StageStates]:
    run = Run(model, layout, training, hardware, optimizer)
    common = layout_common(run, SharedSizes(model))
    lay = rank_layout(run, common, layout.rank_placement(stage))
    run, common = common.at_moment(lay)
    return run, common, stage_states(run, common, lay)


def model_states(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                 optimizer: OptimizerConfig, stage: int = 0) -> MemoryBreakdown:
    """The resident model states of a rank of `stage` when its optimizer is about to step: params
    (the updated parameters under fp32 / bf16-pure: their shard under FSDP, which reshards ZeRO-2's
    unsharded copies after each block's backward; ZeRO-1's replicated 16-bit ones under *-mixed),
    master_params (*-mixed), all gradients (ZeRO-1: its buffers and its master shards' gradients),
    optimizer states. What the rank's tensors add up to then (Trainer's state_bytes)."""
    _, _, st = _rank(model, layout, training, hardware, optimizer, stage)
    return MemoryBreakdown(params=st.compute_params + (0 if st.prec.mixed else st.persistent),
                           master_params=st.persistent if st.prec.mixed else 0,
                           grads=st.grads + st.master_grads, optimizer=st.optimizer)


def forward_retained_bytes(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                           optimizer: OptimizerConfig, stage: int = 0) -> int:
    """Bytes one micro-batch's forward and loss leave allocated for its backward on `stage`: saved
    activations, the saved log-probabilities and, with torch.amp, the 16-bit weight copies autograd
    saved, and under FSDP the unsharded parameters kept for backward (ZeRO-2: all; ZeRO-3: the
    root's). The measurable counterpart: (in use after forward + loss) - (in use before)."""
    run, common, st = _rank(model, layout, training, hardware, optimizer, stage)
    lay, act, mb = st.lay, st.prec.act, common.micro_batch
    total = int(common.per_kind(lay, lambda _, k: k.micro_batch.none, wrapped=False)
                + common.per_kind(lay, lambda _, k: k.micro_batch.policy, wrapped=True)) + mb.positions
    total -= first_block_saving(run, lay, act)
    chunked = run.layout.chunked_loss
    if lay.last:
        total += mb.final + mb.loss.saved
        total += mb.loss.output if mb.loss.keeps_output else 0
    if act.autocast:  # the chunked loss's output-weight cast is recomputed in backward, not saved
        blocks = common.per_kind(lay, lambda _, k: k.block.matmul - k.block.float8 - k.block.nf4, wrapped=False)
        total += st.prec.compute * (int(blocks) + (0 if chunked else lay.output_matmul)
                                    - first_block_casts_unsaved(run, lay, act))
    if st.fsdp:  # unsharded parameters gathered in the forward and kept for backward
        zero = run.layout.zero_stage
        kept = st.params if zero == 2 else lay.embedding + lay.head if zero == 3 else 0
        total += st.prec.compute * kept
        if zero == 2 and run.layout.fp8_gathers:  # the float8 weights gathered in fp8
            total -= (st.prec.compute - 1) * lay.summed.float8
        if zero == 2:  # QLoRA's weights gathered in NF4
            total -= st.prec.compute * lay.summed.nf4 - lay.summed.nf4_bytes
    return total


def zero_model_state_bytes(num_params: int, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                           optimizer_bytes: int = 12) -> int:
    """Model-state bytes per rank as the ZeRO paper counts them (Rajbhandari et al., arXiv
    1910.02054, Sec. 3.1 and 5): fp16 parameters (2 bytes) and gradients (2 bytes) plus K = 12
    bytes of Adam state (fp32 master copy, momentum, variance) per parameter; stage 1 shards the K
    bytes over the dp ranks, stage 2 also the gradients, stage 3 also the parameters.

    The paper's closed forms, against which estimate_memory's engines compare (*-mixed AdamW;
    parallel/data_parallel.py's table): stage 0 (DDP) holds the same 16 bytes, split 4 + 4 + 8
    (fp32 parameters and gradients; autocast's 16-bit copies on top); stage 1 (parallel/zero.py) is
    this form exactly, 2Ψ + 2Ψ + 12Ψ/N (6Ψ + 12Ψ/N with optimizer.grad_accum_dtype='fp32'); stage 2
    (FSDP2, reshard_after_forward=False) is 2Ψ + 16Ψ/N, its gradient shards fp32 (4Ψ/N, not 2Ψ/N);
    stage 3 (FSDP2) is 16Ψ/N."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: choose 0, 1, 2 or 3")
    per_param = (param_bytes / (dp if stage >= 3 else 1) + grad_bytes / (dp if stage >= 2 else 1)
                 + optimizer_bytes / (dp if stage >= 1 else 1))
    return round(num_params * per_param)
