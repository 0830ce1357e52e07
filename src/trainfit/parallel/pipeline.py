"""Pipeline parallelism on torch.distributed.pipelining: the model cut into stages, the stages this
rank runs, and torch's schedule over them.

- `split_stages` cuts the meta-device model into this rank's stages (Layout.pp_layers blocks each;
  parallel/stage_split.py decides the split): each stage is a copy of the model that keeps its own
  blocks under their global names (models/common.LayerStack), the embedding only on stage 0, the
  final norm and output only on the last stage; a stage between them may hold no block (it passes
  its input on, `_pass_on`), and a pipeline rank of such stages holds no parameter. `StageParts`
  holds the rank's stages' modules under the whole model's names: what the optimizer, gradient
  clipping, checkpoints and the memory meter see, so a pipeline checkpoint has the keys of every
  other layout's.
- `PipelineStep` builds torch's PipelineStage per stage and the schedule that runs them, and steps
  it: micro-batch loss on the last stage, gradients accumulated over the step's micro-batches in
  each stage and reduced by FSDP once, after the last one (the stage's own
  backward_maybe_with_nosync).
- MoE: a stage's auxiliary (load-balancing) loss never reaches the last stage's loss, so its
  gradient is started by the stage output's backward (`_AuxLossGrad`, an identity whose backward
  also returns the auxiliary loss's gradient, as Megatron's MoEAuxLossAutoScaler does).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from trainfit.config import ModelConfig
from trainfit.models.common import LayerStack
from trainfit.parallel.layout import Layout
from trainfit.parallel.schedules import SCHEDULES
from trainfit.parallel.stage_split import stage_ranges
from trainfit.precision import PrecisionPolicy

SCHEDULE_CLASSES = {name: getattr(torch_schedules, s.torch_class) for name, s in SCHEDULES.items()}
"""parallel.pp_schedule -> torch's schedule class (parallel/schedules.py names it)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a stage's activations may be (the evaluation's header names one by its index)."""
_HEAD = ("norm", "output")
_EMBEDDINGS = ("tok_embeddings", "pos_embeddings")  # pos_embeddings: GPT-2's


def split_stages(model: nn.Module, layout: Layout, pp_rank: int) -> list[nn.Module]:
    """This rank's stages of the meta-device `model`, in model order (`model` is left whole)."""
    embedding, output = model.tok_embeddings, model.output
    assert output is None or embedding is None or output.weight is not embedding.weight, \
        "Layout.untrainable_reason refuses tied embeddings under pipeline parallelism"
    ranges = stage_ranges(layout.pp_layers)
    stages = []
    for stage_id in layout.rank_stages(pp_rank):
        stage = copy.deepcopy(model)
        stage.layers.keep(ranges[stage_id])
        for name in (_EMBEDDINGS if stage_id > 0 else ()) + (_HEAD if stage_id < layout.num_stages - 1 else ()):
            if hasattr(stage, name):
                setattr(stage, name, None)
        stage.stage_id = stage_id
        if not ranges[stage_id] and 0 < stage_id < layout.num_stages - 1:
            stage.register_forward_hook(_pass_on)
        stages.append(stage)
    return stages


def _pass_on(stage: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """A stage without blocks between others (nanotron's split leaves such stages) returns its input,
    which is torch's receive buffer, a leaf: return `_PassOn`'s alias of it instead."""
    return _PassOn.apply(output) if output is args[0] else output


class _PassOn(torch.autograd.Function):
    """Identity: a new tensor on the input's storage (no copy), whose backward passes the gradient on
    to the input. Not the input itself: hooks registered on a stage's output (_announce_moments's)
    would pile up on the buffer step after step; not a view: the zero-bubble schedules detach a
    stage's output in place after its input's backward (torch refuses that on a view)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return hidden.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class StageParts(nn.Module):
    """A pipeline rank's share of the model: its stages' modules under the whole model's names
    (`tok_embeddings` where stage 0 runs, `layers.{i}` of its stages, `norm` and `output` where the
    last stage runs). The stages themselves (`stages`, not registered: they share these modules)
    are what the schedule runs; this module is never called."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = tuple(stages)
        for name in stages[0]._modules:  # the whole model's attributes, None where no stage of this rank has them
            setattr(self, name, None)
        for stage in stages:
            for name, child in stage.named_children():
                if name != "layers" and child is not None:
                    setattr(self, name, child)
        self.layers = LayerStack({i: block for stage in stages for i, block in stage.layers.indexed()})
        self.sequence = stages[0].sequence

    def train(self, mode: bool = True) -> StageParts:
        """Train or eval mode for the stages too (they are not children of this module)."""
        for stage in self.stages:
            stage.train(mode)
        return super().train(mode)

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("a pipeline rank's stages run through its schedule (parallel/pipeline.PipelineStep)")

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> StageParts:
        """Allocate every stage (their buffers, the RoPE tables, are each stage's own)."""
        for stage in self.stages:
            stage.to_empty(device=device, recurse=recurse)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Each stage fills its own parameters (by name: the whole model's values) and tables."""
        for stage in self.stages:
            stage.init_weights(seed)


@dataclass(frozen=True)
class StageBoundary:
    """What crosses a stage boundary, per micro-batch: handed to torch's PipelineStage up front
    (static metadata), so no stage runs a metadata-inference forward at the first step and every
    step, the first included, allocates what later ones do (the traced estimator's fake world can
    run no inference exchange at all)."""

    tokens: tuple[int, ...]
    """The first stage's input: token ids [micro-batch, positions of this rank]."""
    hidden: tuple[int, ...]
    """Hidden states between stages: [micro-batch, positions, dim] (1/tp of the positions under
    sequence parallelism)."""
    hidden_dtype: torch.dtype
    logits: tuple[int, ...]
    """The last stage's output, to the loss: logits [micro-batch, positions, vocabulary / tp], or under
    memory.chunked_loss the final hidden states (shaped as `hidden`)."""
    logits_dtype: torch.dtype

    def examples(self, stage_id: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) example tensors of stage `stage_id`, on the meta device. The last
        stage's output goes to the loss, never to a peer: torch reads only how many there are (so
        its local logits stand for tensor parallelism's vocabulary-sharded DTensor too)."""
        if stage_id == 0:
            inputs = torch.empty(self.tokens, dtype=torch.long, device="meta")
        else:
            inputs = torch.empty(self.hidden, dtype=self.hidden_dtype, device="meta", requires_grad=True)
        last = stage_id == num_stages - 1
        shape, dtype = (self.logits, self.logits_dtype) if last else (self.hidden, self.hidden_dtype)
        return inputs, torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def stage_boundary(model: ModelConfig, seq_len: int, layout: Layout, policy: PrecisionPolicy) -> StageBoundary:
    """The boundary of `layout`'s stages. Hidden states travel in the dtype the residual stream has:
    FSDP2's compute copies under mixed precision make it the low dtype (blocks' inputs are cast to
    it); autocast leaves the residual adds in the parameters' fp32; bf16-pure is bf16 throughout.
    The logits are the output projection's: autocast's or the parameters' dtype; under
    memory.chunked_loss the last stage returns the final norm's output, in the residual's dtype
    (the loss projects it, train/loss.py)."""
    positions = seq_len // layout.cp
    shards = layout.tp if layout.sequence_parallel else 1
    fsdp_mixed = layout.data_parallel == "fsdp" and policy.keeps_master_weights
    hidden_dtype = policy.autocast_dtype if fsdp_mixed and policy.autocast_dtype else policy.param_dtype
    rows = layout.micro_batch_size
    hidden = (rows, positions // shards, model.dim)
    logits, logits_dtype = (rows, positions, model.vocab_size // layout.tp), policy.autocast_dtype or policy.param_dtype
    if layout.chunked_loss:
        logits, logits_dtype = hidden, hidden_dtype
    return StageBoundary(tokens=(rows, positions), hidden=hidden, hidden_dtype=hidden_dtype, logits=logits,
                         logits_dtype=logits_dtype)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also returns d(aux)/d(aux) = 1 for the stage's
    weighted auxiliary loss, so that loss's backward runs inside the stage's."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: torch.Tensor,  # type: ignore[override]
                aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=torch.float32, device=grad.device)


def carry_aux_loss(stage: nn.Module, weight: Callable[[], float]) -> None:
    """After each forward of `stage`, tie its auxiliary loss, times `weight()` (the coefficient,
    the loss scale and 1 / micro-batches), to its output's backward."""

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        if not module.training or not torch.is_grad_enabled():
            return output
        return _AuxLossGrad.apply(output, module.aux_loss.float() * weight())

    stage.register_forward_hook(hook)


def _announce_moments(stage: nn.Module, on_moment: Callable[[str], None]) -> None:
    def before_forward(module: nn.Module, args: object) -> None:
        on_moment("forward")

    def after_forward(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: on_moment("backward"))

    stage.register_forward_pre_hook(before_forward)
    stage.register_forward_hook(after_forward)


class PipelineStep:
    """The schedule of this rank's stages; `run` steps one optimizer step's micro-batches."""

    def __init__(self, parts: StageParts, layout: Layout, pp_mesh: DeviceMesh, device: torch.device,
                 boundary: StageBoundary, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 on_moment: Callable[[str], None]) -> None:
        """`loss_fn(logits, targets)` -> the micro-batch's loss to backpropagate; `on_moment` is
        called with "forward" before each stage forward and "backward" when its backward starts."""
        self.parts = parts
        for stage in parts.stages:
            _announce_moments(stage, on_moment)
        group = pp_mesh.get_group()
        self.stages = []
        for stage in parts.stages:
            inputs, outputs = boundary.examples(stage.stage_id, layout.num_stages)
            self.stages.append(PipelineStage(stage, stage.stage_id, layout.num_stages, device, input_args=inputs,
                                             output_args=outputs, group=group))
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        schedule_class = SCHEDULE_CLASSES[layout.pp_schedule]
        single = issubclass(schedule_class, PipelineScheduleSingle)
        # scale_grads=False: loss_fn divides by the micro-batches itself (and scales fp16 losses).
        self.schedule = schedule_class(self.stages[0] if single else self.stages,
                                       n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.owner = {stage: rank for rank in range(layout.pp) for stage in layout.rank_stages(rank)}
        """Global stage index -> the pp rank that runs it."""
        self.group, self.pp_rank, self.layout = group, pp_mesh.get_local_rank(), layout
        self.loss_fn = loss_fn

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Forward and backward of every micro-batch of `inputs` [rows, T] through the pipeline, in
        the schedule's order; the first stage reads the inputs, the last the targets (loss_fn sees
        each micro-batch)."""
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, return_outputs=False)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Forward only, micro-batch after micro-batch, stage after stage (each rank runs its own and
        passes the activations on): evaluation needs no schedule, and torch 2.13's `eval` of the V
        schedules also runs their backward actions, and fails. loss_fn sees each micro-batch."""
        stages = {stage.stage_id: stage for stage in self.parts.stages}
        last = self.layout.num_stages - 1
        for tokens, target in zip(inputs.tensor_split(self.layout.num_microbatches),
                                  targets.tensor_split(self.layout.num_microbatches), strict=True):
            hidden = tokens
            for stage_id in range(self.layout.num_stages):
                if self.owner[stage_id] != self.pp_rank:
                    continue
                if stage_id > 0 and self.owner[stage_id - 1] != self.pp_rank:
                    hidden = self._receive(self.owner[stage_id - 1])
                hidden = stages[stage_id](hidden)
                if stage_id == last:
                    self.loss_fn(hidden, target)
                elif self.owner[stage_id + 1] != self.pp_rank:
                    self._send(hidden, self.owner[stage_id + 1])

    def _send(self, tensor: torch.Tensor, pp_rank: int) -> None:
        """Shape and dtype first (a small header), then the tensor."""
        peer = dist.get_global_rank(self.group, pp_rank)
        header = torch.tensor([_DTYPES.index(tensor.dtype), *tensor.shape], dtype=torch.int64, device=tensor.device)
        dist.send(torch.tensor([header.numel()], device=tensor.device), peer, group=self.group)
        dist.send(header, peer, group=self.group)
        dist.send(tensor.contiguous(), peer, group=self.group)

    def _receive(self, pp_rank: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.group, pp_rank)
        device = self.stages[0].device
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, peer, group=self.group)
        header = torch.zeros(int(length), dtype=torch.int64, device=device)
        dist.recv(header, peer, group=self.group)
        tensor = torch.empty(header[1:].tolist(), dtype=_DTYPES[int(header[0])], device=device)
        dist.recv(tensor, peer, group=self.group)
        return tensor
