"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) as DTensor `parallelize_module` plans on the mesh's tp axis, built from parallel/tp_sites.py's
description of every module it touches (which parallel/collectives.py prices from too).

Per block:
- attention: wq, wk, wv column-parallel (each rank computes whole heads: its slice of the query
  and key/value heads), wo row-parallel (each rank's heads give a partial sum of the output);
  QK-norm on the rank's heads, its gains replicated;
- MLP: the up/gate projections (w1, w3) column-parallel, the down projection (w2) row-parallel;
- MoE: the whole feed-forward (router, routed and shared experts) is replicated on the tp ranks
  and computes on the whole sequence (Megatron's expert_tensor_parallel_size=1): its gradients
  are then identical on every tp rank, and expert parallelism is what shards the experts.
Around the blocks, the embedding is vocabulary-parallel (each rank a slice of the vocabulary's
rows, partial outputs summed), and the output projection column-parallel over the vocabulary,
its logits left sharded (Shard(-1)) into `loss_parallel()`'s cross-entropy: no rank ever holds
the whole [B, T, V] logits.

Without sequence parallelism the residual stream, the norms and their inputs are whole on every
tp rank; each row-parallel output is all-reduced. With it (parallel.sequence_parallel), they are
sharded along the sequence (Shard(1)): each row-parallel output is reduce-scattered instead, the
input of each column-parallel group all-gathered, and the norms compute on 1/tp of the tokens
(their gains are replicated DTensors, whose gradients DTensor sums over the tp ranks).

Applied to the meta-device model before activation checkpointing and data parallelism
(train/parallelize.py); parameter names are untouched, so checkpoints and the layout-independent
init (models/init.py, which fills each rank's slice) do not change.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import kind_of_layers, layer_kinds
from trainfit.parallel.tp_sites import TpSite, block_sites, root_sites


def _between_blocks(sequence_parallel: bool) -> Shard | Replicate:
    """The residual stream's placement on the tp ranks."""
    return Shard(1) if sequence_parallel else Replicate()


def _style(site: TpSite, sequence_parallel: bool, inputs: int = 1) -> ParallelStyle:
    """The torch style that lays `site` out (parallel/tp_sites.py says what each costs); `inputs`: the
    positional inputs of a branch (llama's attention: x, cos, sin; gpt2's: x)."""
    stream, rest = _between_blocks(sequence_parallel), [None] * (inputs - 1)
    styles: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(output_layouts=stream),
        # one replicated DTensor for all of a branch's column-parallel projections (all-gathered first
        # under SP): backward sums their partial input gradients locally and reduces once
        "branch_input": lambda: PrepareModuleInput(input_layouts=(stream, *rest),
                                                   desired_input_layouts=(Replicate(), *rest)),
        "replicated_moe": lambda: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),)),
        "stream_norm": SequenceParallel,
        # after a branch, whose output joins the residual stream (a local tensor): it leaves as one
        "branch_norm": lambda: SequenceParallel(use_local_output=True),
        # QK-norm on the rank's heads of [B, T, H, K] (dim 2 sharded, K whole)
        "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # GPT-2's learned positions [T, D], added to the sequence-sharded token embeddings: each rank
        # keeps the rows of its own positions (a slice; the backward all-gathers)
        "positions": lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        # the logits left sharded over the vocabulary into loss_parallel's cross-entropy
        "output": lambda: ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    return styles[site.style]()


def block_plan(cfg: ModelConfig, block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one transformer block (llama dense or MoE, gpt2) of a model whose layers are all of its
    kind (`cfg`: architecture.layer_kinds), keyed by submodule name: parallel/tp_sites.block_sites, each
    linear as models/block_spec.py splits it (the estimators read the same sites)."""
    inputs = len(_forward_inputs(block.attention))
    return {site.path: _style(site, sequence_parallel, inputs if site.path == "attention" else 1)
            for site in block_sites(cfg, sequence_parallel)}


def root_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and output projection (whichever this model or pipeline stage has)."""
    return {site.path: _style(site, sequence_parallel) for site in root_sites(model.cfg, sequence_parallel)
            if site.style != "loss" and getattr(model, site.path, None) is not None}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Shard `model` (meta device, before activation checkpointing and data parallelism) over the
    1-D `tp_mesh`, in place. A tied embedding/output weight is one parameter again afterwards
    (both are sharded by vocabulary rows, Shard(0), so one DTensor serves both)."""
    tied = model.output is not None and model.tok_embeddings is not None and \
        model.output.weight is model.tok_embeddings.weight
    kinds, of = layer_kinds(model.cfg), kind_of_layers(model.cfg)
    for i, block in model.layers.indexed():  # each block by its kind of layer (dense or MoE)
        parallelize_module(block, tp_mesh, block_plan(kinds[of[i]], block, sequence_parallel))
    parallelize_module(model, tp_mesh, root_plan(model, sequence_parallel))
    if tied:
        model.output.weight = model.tok_embeddings.weight
    return model


def recompute_gathers(model: nn.Module, tp_mesh: DeviceMesh, skip: Callable[[int], bool]) -> int:
    """parallel.sp_recompute_gather: every column group of the blocks `skip` does not name (the ones
    activation checkpointing leaves unwrapped) keeps its input's sequence shard for backward and
    all-gathers it there again (`_RegatherInBackward`). Returns how many groups do."""
    kinds, of = layer_kinds(model.cfg), kind_of_layers(model.cfg)
    groups = 0
    for i, block in model.layers.indexed():
        if skip(i):
            continue
        for site in block_sites(kinds[of[i]], True):
            if site.style == "branch_input":
                _RegatherInBackward(block.get_submodule(site.path), tp_mesh)
                groups += 1
    return groups


class _RegatherInBackward:
    """Around one column group (a branch whose input PrepareModuleInput all-gathers from the sequence
    shards): while the branch runs forward, every tensor autograd saves that is the gathered input, or a
    view or cast of it (each projection's matmul saves its 2-D view; torch.amp saves each projection's
    own cast), is packed as the input's shard, its shape and its dtype; backward's first unpack all-gathers
    the shard again (cast first: the same values, fewer bytes) and the group's other unpacks share that
    tensor until the last of them. The gathered values are bit-identical to the forward's, so the
    gradients are too (Megatron-LM's re-gather of the sequence-parallel input)."""

    def __init__(self, branch: nn.Module, tp_mesh: DeviceMesh) -> None:
        self.mesh, self.shard, self.gathered_shape, self.hooks = tp_mesh, None, None, None
        branch.register_forward_pre_hook(self._shard_in, prepend=True)  # before PrepareModuleInput
        branch.register_forward_pre_hook(self._gathered_in)  # after it
        branch.register_forward_hook(self._out, always_call=True)

    def _shard_in(self, module: nn.Module, args: tuple) -> None:
        shard = args[0]  # a sequence-sharded DTensor (a norm's output) or its local tensor
        self.shard = (shard.to_local() if isinstance(shard, DTensor) else shard).detach()

    def _gathered_in(self, module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        self.gathered_shape = args[0].shape
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        self.pending: dict[torch.dtype, list] = {}  # dtype -> [packs not yet unpacked, the gathered tensor]

    def _out(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
        self.hooks, self.shard = None, None

    def _pack(self, t: torch.Tensor) -> object:
        if not (isinstance(t, DTensor) and t.device_mesh == self.mesh and t.placements == (Replicate(),)
                and t.numel() == math.prod(self.gathered_shape) and t.shape[-1] == self.gathered_shape[-1]):
            return t
        group = self.pending.setdefault(t.dtype, [0, None])
        group[0] += 1
        return _Regather(self.shard, self.gathered_shape, t.shape, t.dtype, group, self.mesh)

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        if not isinstance(saved, _Regather):
            return saved
        group = saved.group
        if group[1] is None:
            local = funcol.all_gather_tensor(saved.shard.to(saved.dtype), gather_dim=1, group=saved.mesh)
            group[1] = DTensor.from_local(funcol.wait_tensor(local), saved.mesh, [Replicate()], run_check=False)
        out = group[1].reshape(saved.shape)
        group[0] -= 1
        if group[0] == 0:
            group[1] = None  # the last of the group's unpacks: the gathered tensor goes with it
        return out


@dataclass
class _Regather:
    """A saved tensor of a column group, packed as its input's shard (`_RegatherInBackward`)."""

    shard: torch.Tensor
    gathered_shape: torch.Size
    shape: torch.Size
    dtype: torch.dtype
    group: list
    mesh: DeviceMesh


def enable_async_tp(tp_mesh: DeviceMesh) -> bool:
    """parallel.async_tp: turn on torch's micro-pipeline TP, inductor's pass that splits each
    sequence-parallel all-gather before a matmul, and each matmul before a reduce-scatter, into tp
    chunks over symmetric memory (so it acts on compiled blocks only: training.compile). CUDA only;
    returns whether it was enabled (False on any other device, where the step runs without it)."""
    if tp_mesh.device_type != "cuda":
        return False
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    return True


def uneven_vocabulary(vocab_size: int, tp: int) -> str | None:
    """What a user should know when tp does not divide the vocabulary: DTensor shards its rows
    unevenly (torch.chunk's split: the first ranks one row more), which works, but those ranks
    hold the largest shard (what the estimators count) and the others wait on them."""
    if tp == 1 or vocab_size % tp == 0:
        return None
    padded = -(-vocab_size // tp) * tp
    return (f"model.vocab_size={vocab_size} is not divisible by parallel.tp={tp}: the embedding and output "
            f"rows are split unevenly ({-(-vocab_size // tp)} on the first ranks, estimated at that size); "
            f"model.vocab_size={padded} would split them evenly")


@contextlib.contextmanager
def vocabulary_parallel_loss(enabled: bool) -> Iterator[None]:
    """Around the loss and its backward: cross-entropy on logits sharded over the vocabulary
    (torch's loss_parallel) when tensor parallelism is on; nothing otherwise."""
    with loss_parallel() if enabled else contextlib.nullcontext():
        yield


def _forward_inputs(module: nn.Module) -> list[str]:
    """The positional parameters of `module.forward` (those a PrepareModuleInput lays out)."""
    return [name for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
