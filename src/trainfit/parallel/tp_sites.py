"""Every place tensor parallelism touches a model, described once (`block_sites`, `root_sites`): which
module, which of torch's parallel styles lays it out (`style`), and what that costs on the tp group,
forward and backward (`moves`). parallel/tensor_parallel.py builds its DTensor plan from these sites and
parallel/collectives.py lists its calls from them, so the plan and its priced collectives cannot drift
apart. Torch-free.

Placements: without sequence parallelism the residual stream is whole on every tp rank; with it, sharded
along the sequence. A column-parallel group's input (the attention's, a dense MLP's) is replicated for
its projections: all-gathered first under SP, and its gradient, a partial sum over the ranks' columns,
reduced backward (reduce-scattered under SP, else all-reduced: Megatron's f). A row-parallel linear's
output is a partial sum: all-reduced (Megatron's g), or reduce-scattered under SP, whose backward
all-gathers. An MoE feed-forward is replicated on the tp ranks (parallel/tensor_parallel.py says why):
under SP its input is all-gathered (a local input: no backward) and its output sliced back (the slice's
backward all-gathers). Around the blocks: the vocabulary-parallel embedding's partial output summed
(reduce-scattered under SP), the output projection's input a column group, its logits left sharded over
the vocabulary into loss_parallel, whose cross-entropy all-reduces 3 per-token statistics; GPT-2's
positions sliced under SP. A norm that computes on the rank's tokens (SP) or heads (QK-norm) has a
replicated gain whose gradient is a partial sum: one all-reduce per gain tensor (`partial_gains`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import config_key, describe
from trainfit.models.block_spec import block_linears

Style = Literal["colwise", "rowwise", "branch_input", "replicated_moe", "stream_norm", "branch_norm", "head_norm",
                "embedding", "positions", "output", "loss"]
"""How tensor_parallel.py lays a site out: a torch style over the module ("loss": loss_parallel around it)."""
Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class Move:
    """A collective a site issues on the tp group, each time its module runs."""

    phase: Literal["forward", "backward"]
    kind: Collective
    tensor: str
    """What moves: a key of parallel/collectives.TENSORS."""
    site: str
    """Where, in models/block_spec.py's terms."""
    overlaps: tuple[str, ...] = ()
    """The GEMMs async TP splits it across (perf/kernels.Gemm names; "output": the output projection)."""
    count: int = 1


@dataclass(frozen=True)
class TpSite:
    """A module tensor parallelism lays out, and what that costs."""

    path: str
    """The module, under the block (block_sites) or the model (root_sites)."""
    style: Style
    moves: tuple[Move, ...] = ()
    partial_gains: int = 0
    """Tensors of the module (gains, biases) whose gradients each tp rank holds a partial sum of."""
    gain_tensor: str = "norm_gain"
    stage: Literal["", "first", "last"] = ""
    """Root sites: on the pipeline stage that holds the embedding (first) or the head (last)."""


def _reduce(sp: bool) -> Collective:
    return "reduce_scatter" if sp else "all_reduce"


def block_sites(model: ModelConfig, sp: bool) -> tuple[TpSite, ...]:
    """One block's sites of a model whose layers are alike (architecture.layer_kinds), in forward order:
    each column group's input and linears, then its row-parallel output; the norms; QK-norm."""
    return _block_sites(config_key(model), sp)


@functools.lru_cache(maxsize=1024)
def _block_sites(key: tuple, sp: bool) -> tuple[TpSite, ...]:
    """block_sites, once per config (the planner prices thousands of layouts of one)."""
    model = ModelConfig(*key)
    linears = block_linears(model)
    sites: list[TpSite] = []
    groups = list(dict.fromkeys(linear.path.split(".")[0] for linear in linears if linear.tp == "column"))
    for group in groups:
        columns = tuple(linear.name for linear in linears if linear.tp == "column" and linear.path.startswith(group))
        gathered = columns if sp else ()
        sites.append(TpSite(group, "branch_input", (
            *([Move("forward", "all_gather", "stream", f"{group} input", gathered)] if sp else []),
            Move("backward", _reduce(sp), "stream", f"{group} input", gathered))))
        sites += [TpSite(linear.path, "colwise") for linear in linears
                  if linear.tp == "column" and linear.path.startswith(group + ".")]
        for row in linears:
            if row.tp == "row" and row.path.startswith(group + "."):
                scattered = (row.name,) if sp else ()
                sites.append(TpSite(row.path, "rowwise", (
                    Move("forward", _reduce(sp), "row_output", f"{row.path} output", scattered),
                    *([Move("backward", "all_gather", "row_output", f"{row.path} output", scattered)] if sp else []))))
    layer = describe(model).block
    if model.num_experts and sp:  # the replicated MoE: its input gathered, its output sliced
        sites.append(TpSite("feed_forward", "replicated_moe", (
            Move("forward", "all_gather", "stream", "feed_forward input"),
            Move("backward", "all_gather", "stream", "feed_forward output"))))
    per_norm = layer.norm.params(model.dim) // model.dim  # tensors of dim elements in one norm
    if sp:  # the norms on the stream: before the branches, or after them, or both (sandwich)
        if layer.norm_placement != "post":
            sites += [TpSite(name, "stream_norm", partial_gains=per_norm) for name in ("attention_norm", "ffn_norm")]
        if layer.norm_placement != "pre":
            sites += [TpSite(name, "branch_norm", partial_gains=per_norm)
                      for name in ("attention_post_norm", "ffn_post_norm")]
    if layer.attention.qk_norm:  # on the rank's heads, whatever SP does
        sites += [TpSite(f"attention.{name}", "head_norm", partial_gains=1, gain_tensor="qk_norm_gain")
                  for name in ("q_norm", "k_norm")]
    return tuple(sites)


def root_sites(model: ModelConfig, sp: bool) -> tuple[TpSite, ...]:
    """The sites around the blocks: the embeddings on the first stage, the final norm, the output
    projection and the loss on the last."""
    return _root_sites(config_key(model), sp)


@functools.lru_cache(maxsize=1024)
def _root_sites(key: tuple, sp: bool) -> tuple[TpSite, ...]:
    model = ModelConfig(*key)
    arch = describe(model)
    gathered = ("output",) if sp else ()
    sites = [
        TpSite("tok_embeddings", "embedding", (
            Move("forward", _reduce(sp), "stream", "tok_embeddings output"),
            *([Move("backward", "all_gather", "stream", "tok_embeddings output")] if sp else [])), stage="first"),
        TpSite("output", "output", (
            *([Move("forward", "all_gather", "stream", "output input", gathered)] if sp else []),
            Move("backward", _reduce(sp), "stream", "output input", gathered)), stage="last"),
        TpSite("", "loss", (Move("forward", "all_reduce", "loss_stats", "loss_parallel's statistics", count=3),),
               stage="last"),
    ]
    if sp:
        sites.append(TpSite("norm", "stream_norm", partial_gains=arch.norm.params(model.dim) // model.dim,
                            stage="last"))
        if arch.learned_positions:
            sites.append(TpSite("pos_embeddings", "positions", (
                Move("backward", "all_gather", "positions", "pos_embeddings output"),), stage="first"))
    return tuple(sites)
