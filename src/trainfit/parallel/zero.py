"""ZeRO-1 as the ZeRO paper defines it (Rajbhandari et al. 2020, P_os), in the form of DeepSpeed's
stage-1 optimizer and Megatron's distributed optimizer: the model's parameters are the compute
copies (bf16/fp16 under mixed precision, fp32 under fp32), replicated on every data-parallel rank;
master weights and optimizer states exist only for this rank's shard.

Sharding: each parameter is split along dim 0 with torch.chunk semantics over the group (FSDP2's
and DTensor Shard(0)'s: chunks of ceil(rows / N) rows, the last ones short or empty). The master
shard is those rows in `master_dtype` (fp32 by default); when the parameters already are in that
dtype (fp32 training; bf16-pure with master_dtype=bf16) it *is* the parameter's rows (a view, no
copy), and the inner optimizer updates the parameter in place.

One optimizer step (no communication during forward and backward):

1. backward, for every micro-batch: a post-accumulate-grad hook adds each parameter's gradient into
   its bucket's flat gradient buffer (in `grad_dtype`) and frees `.grad`. A buffer is laid out
   rank-major (rank r's chunks of the bucket's parameters contiguous), so it is the reduce-scatter
   input as it stands, and `grad_dtype=torch.float32` is Megatron's fp32 main_grad: bf16 gradients
   accumulate across micro-batches in fp32 (a bf16 parameter's `.grad` cannot hold fp32). A
   parameter that got no gradient steps on zeros, as in Megatron (one ZeroOptimizer per model:
   the hooks stay on its parameters).
2. `reduce_gradients()`, after the last micro-batch: per bucket, `reduce_scatter_tensor` (average
   over the group) in place, into this rank's own segment of the buffer (Megatron's form; NCCL
   reduce-scatters in place when the output is the input's rank-th chunk); then, with
   `replicate_group`, HSDP's all-reduce of that segment across the replicas. Its form in the
   master dtype becomes each master shard's `.grad` (a view when the dtypes agree, else a cast
   copy).
3. optional: fp16 loss scaling with `ShardedGradScaler(device, process_group=group)` (it unscales
   the master shards' gradients through `param_groups` and all-reduces the inf/nan flag, so a step
   is skipped on every rank or on none), then `clip_grad_norm_(max_norm)` (one all-reduce).
4. `step()`: the inner optimizer updates the master shards; per bucket, the shards cast to the
   parameter dtype are all-gathered in place into the bucket's gradient buffer (no longer needed:
   zero_grad clears it; it is at least as wide as the parameters), then copied into the
   replicated parameters.
5. `zero_grad()` (required before the next backward: until then the buffers hold parameters).

On gloo (CPU) the same two collectives allocate a bucket-sized copy each: its reduce_scatter_tensor
all-reduces a clone of the input (ProcessGroupGloo.cpp, reduce_scatter_tensor_coalesced), its
all_gather_into_tensor gathers into a flat temporary of the output's size on its worker thread
(AsyncAllgatherWork); measured, +1 bucket each, seen or not by the allocator's in-use bytes
depending on when the worker runs. So on gloo the engine all-reduces the bucket in place (what
gloo's reduce-scatter does, without the copy) and all-gathers by one in-place broadcast of each
rank's segment (measured: nothing allocated). NCCL, and the fake backend the traced estimator
runs on, take the reduce-scatter and all-gather.

    zero = ZeroOptimizer(model, optim.param_groups(model, wd), make_inner, group, param_dtype=torch.bfloat16)
    for inputs, targets in micro_batches: (loss_fn(model(inputs), targets) / num_micro).backward()
    zero.reduce_gradients(); zero.clip_grad_norm_(1.0); zero.step(); zero.zero_grad()

    state = {"model": zero.model_state_dict(), "optimizer": zero.optimizer_state_dict(flatten=True)}
    dcp.save(state, checkpoint_id=path)  # or, to resume:
    dcp.load(state, checkpoint_id=path)
    zero.load_model_state_dict(state["model"]); zero.load_optimizer_state_dict(state["optimizer"])

`param_dtype`: the model is built and initialized in fp32 as one process would build it; the
masters are taken from those fp32 weights, then the parameters are cast to the compute dtype in
place (autocast stays off: the model itself computes in that dtype, as under FSDP2's
MixedPrecisionPolicy).

`ZeroOptimizer` is a torch Optimizer whose `param_groups` and `state` are the inner optimizer's
(master shards): LR schedulers and GradScaler work on it unchanged. Checkpoints: `model_state_dict()`
gives the master weights at the model's parameter names, `optimizer_state_dict()` the states in
get_optimizer_state_dict's form (`flatten=True`: its flattened form, `state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`, as train/checkpoint.py saves every layout); sharded tensors are DTensors
(Shard(0) over the group as a 1-D DeviceMesh), so dcp.save / dcp.load reshard them to any layout,
one plain process included.

Model states per rank (`state_bytes()`), Ψ parameters, N ranks, AdamW:

| precision, grad_dtype            | params | grads | master_params | optimizer | sum                  |
| -------------------------------- | ------ | ----- | ------------- | --------- | -------------------- |
| bf16/fp16, param dtype           | 2Ψ     | 2Ψ    | 4Ψ/N          | 8Ψ/N      | 4Ψ + 12Ψ/N (paper)   |
| bf16/fp16, fp32 (Megatron's)     | 2Ψ     | 4Ψ    | 4Ψ/N          | 8Ψ/N      | 6Ψ + 12Ψ/N           |
| fp32                             | 4Ψ     | 4Ψ    | 0 (views)     | 8Ψ/N      | 8Ψ + 8Ψ/N            |
| bf16-pure (master_dtype=bf16)    | 2Ψ     | 2Ψ    | 0 (views)     | 4Ψ/N      | 4Ψ + 4Ψ/N            |

Sharded terms count whole padded chunks (exact when N divides every dim 0), the optimizer's `step`
counters add 4 bytes per parameter tensor. Transient: `master_grads`, this rank's gradient shard in
the master dtype (4Ψ/N) from reduce_gradients to zero_grad when grad_dtype is not the master dtype
(as DeepSpeed's and Megatron's cast copies); the collectives, in place, allocate nothing here (a
backend may inside: gloo's all-reduce its transfer buffers).

One engine in one file, over ~500 lines on purpose: the buckets, the hooks, the collectives, the
step and the checkpoint forms share one flat layout of each bucket, which a split would expose
between modules.

Collectives are torch's reduce_scatter_tensor / all_gather_into_tensor (torch 2.13 names them
reduce_scatter_single / all_gather_single; called by the new names where they exist), one
all_reduce for the gradient norm, and under HSDP one all_reduce per bucket across the replicas.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainfit.parallel.engine import ZERO1_BUCKET_BYTES

BUCKET_BYTES = ZERO1_BUCKET_BYTES
"""Largest bucket (parallel/engine.py, where the estimators read it too)."""

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names are
# deprecated aliases warning at every call); the project supports torch >= 2.6, which has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(eq=False)
class _Shard:
    """One parameter in its bucket: rank r's chunk of its rows sits at r * shard_numel + offset."""

    param: nn.Parameter
    fqns: list[str]
    """Every name the model gives the parameter (a tied weight has several); the first keys its states."""
    chunk_rows: int
    """ceil(rows / N): every rank's chunk is this long in the buffers, padded where torch.chunk's is shorter."""
    row_numel: int
    offset: int
    master: torch.Tensor = field(init=False)
    """This rank's rows in the master dtype (a view of the parameter's own rows when the dtypes agree)."""

    def rows(self, rank: int) -> slice:
        """Rank `rank`'s rows of the parameter (torch.chunk's: empty past the end)."""
        start = min(rank * self.chunk_rows, self.param.shape[0])
        return slice(start, min(start + self.chunk_rows, self.param.shape[0]))

    def matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, shaped like the parameter, as (rows, row_numel)."""
        return tensor.reshape(-1, self.row_numel)


@dataclass(eq=False)
class _Bucket:
    shards: list[_Shard]
    shard_numel: int
    """One rank's segment: the sum of its parameters' padded chunks."""
    grads: torch.Tensor
    """(N * shard_numel,) rank-major, in grad_dtype: accumulated gradients, the reduce-scatter input."""

    def chunks(self, flat: torch.Tensor, shard: _Shard) -> torch.Tensor:
        """`shard`'s N chunks in a rank-major flat buffer of this bucket, as (N, chunk_rows, row_numel)."""
        per_rank = flat.view(-1, self.shard_numel)
        return per_rank[:, shard.offset:shard.offset + shard.chunk_rows * shard.row_numel].view(
            per_rank.shape[0], shard.chunk_rows, shard.row_numel)


def _row_pairs(chunks: torch.Tensor, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching (chunk part, rows part) views covering `rows` (R, K) in `chunks` (N, C, K): the full
    chunks as one block, then the partial one (later chunks are padding)."""
    num_full = rows.shape[0] // chunks.shape[1]
    split = num_full * chunks.shape[1]
    pairs = [(chunks[:num_full], rows[:split].view(num_full, *chunks.shape[1:]))]
    if split < rows.shape[0]:
        pairs.append((chunks[num_full, :rows.shape[0] - split], rows[split:]))
    return pairs


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """`t`, or the tensors a tensor subclass is made of (torchao's 8-bit optimizer states: uint8
    codes, fp32 scales and code table, under an fp32 appearance whose element size is not theirs)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [inner for name in t.__tensor_flatten__()[0] for inner in plain_tensors(getattr(t, name))]


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage, also for fake tensors (whose data_ptr is 0): torch keeps one Python
    object per live storage, as memory/traced/ledger.py relies on too."""
    return id(t.untyped_storage())


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over `group` for `model` (see the module docstring for the step and the memory)."""

    def __init__(self, model: nn.Module, param_groups: list[dict[str, Any]],
                 make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 group: dist.ProcessGroup | DeviceMesh, *, param_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                 replicate_group: dist.ProcessGroup | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        """`param_groups`: groups of `model`'s parameters (train/optim.py's param_groups, so the
        decay split is the plain optimizer's); `make_optimizer` builds the inner optimizer from the
        same groups over the master shards (train/optim.py's make_optimizer). `group`: the ranks
        sharding the states (a process group, or a 1-D DeviceMesh of them).
        `param_dtype`: the compute dtype the parameters are cast to once the master shards are
        taken from them (None: keep the model's dtype). `master_dtype`: of the master weights and so
        of the optimizer states (fp32; bf16 for bf16-pure training, where they are the parameters'
        own rows). `grad_dtype`: dtype gradients accumulate and are reduce-scattered in; None: the
        parameters'. `replicate_group`: HSDP's replicas of this shard group (gradients are averaged
        across them too), or None."""
        params = [p for g in param_groups for p in g["params"]]
        initial_dtype = _check_params(model, params)
        self.param_dtype = param_dtype or initial_dtype
        self.master_dtype = master_dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        for name, dtype in (("param_dtype", self.param_dtype), ("master_dtype", master_dtype),
                            ("grad_dtype", self.grad_dtype)):
            if not dtype.is_floating_point:
                raise ValueError(f"{name}={dtype}: needs a floating dtype (torch.float32, torch.bfloat16, ...)")
        if self.grad_dtype.itemsize < self.param_dtype.itemsize:
            raise ValueError(f"grad_dtype={self.grad_dtype}: narrower than the parameters' {self.param_dtype}; the "
                             "parameters are all-gathered into the gradient buffers (use None or torch.float32)")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive; the default is BUCKET_BYTES")
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(f"group: a {group.ndim}-D DeviceMesh; pass the 1-D mesh of the sharding ranks")
            self.mesh = group
            group = group.get_group()
        self.model, self.group, self.replicate_group = model, group, replicate_group
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._on_gloo = dist.get_backend(group) == "gloo"  # in-place forms of the collectives (module docstring)
        self._buckets = self._plan_buckets(model, params, bucket_bytes)
        self._shards = {id(s.param): s for b in self._buckets for s in b.shards}
        self._take_masters()
        self._reduced = False
        self.inner = make_optimizer([{**g, "params": [self._shards[id(p)].master for p in g["params"]]}
                                     for g in param_groups])
        """The torch optimizer stepping this rank's master shards (its states are 1/N of the model's)."""
        self._group_fqns = [[self._shards[id(p)].fqns[0] for p in g["params"]] for g in param_groups]
        super().__init__(self.inner.param_groups, self.inner.defaults)
        # One set of groups and states: schedulers and GradScaler edit and read the inner optimizer's.
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def _plan_buckets(self, model: nn.Module, params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        """Consecutive parameters (in `param_groups` order, the same on every rank) per bucket, each
        bucket's flat gradient buffer, and the hooks that fill it."""
        fqns: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            fqns.setdefault(id(p), []).append(name)
        element_size = max(self.grad_dtype.itemsize, self.param_dtype.itemsize)
        planned: list[list[tuple[nn.Parameter, int]]] = [[]]
        size = 0
        for p in params:
            chunk_rows = -(-p.shape[0] // self.num_ranks)
            padded = self.num_ranks * chunk_rows * math.prod(p.shape[1:]) * element_size
            if planned[-1] and size + padded > bucket_bytes:
                planned.append([])
                size = 0
            planned[-1].append((p, chunk_rows))
            size += padded
        buckets = []
        for members in planned:
            shards, offset = [], 0
            for p, chunk_rows in members:
                shards.append(_Shard(p, fqns[id(p)], chunk_rows, math.prod(p.shape[1:]), offset))
                offset += chunk_rows * shards[-1].row_numel
            grads = torch.zeros(self.num_ranks * offset, dtype=self.grad_dtype, device=params[0].device)
            buckets.append(_Bucket(shards, offset, grads))
            for shard in shards:
                shard.param.register_post_accumulate_grad_hook(functools.partial(self._accumulate, buckets[-1], shard))
        return buckets

    @torch.no_grad()
    def _take_masters(self) -> None:
        """This rank's master rows, then the parameters in param_dtype: masters in another dtype are
        copies of the weights as they are now (the fp32 init), the others views of the cast parameters."""
        for shard in self._shards.values():
            own = shard.param.detach()[shard.rows(self.rank)]
            if self.master_dtype != self.param_dtype:
                shard.master = own.to(self.master_dtype, copy=True)
        for shard in self._shards.values():
            if shard.param.dtype != self.param_dtype:
                shard.param.data = shard.param.data.to(self.param_dtype)
            if self.master_dtype == self.param_dtype:
                shard.master = shard.param.detach()[shard.rows(self.rank)]

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def _accumulate(self, bucket: _Bucket, shard: _Shard, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move this micro-batch's gradient into the bucket's buffer."""
        if self._reduced:
            raise RuntimeError("backward after ZeroOptimizer.reduce_gradients(): call zero_grad() first "
                               "(the buffers hold the reduced shard until then)")
        for chunk, rows in _row_pairs(bucket.chunks(bucket.grads, shard), shard.matrix(param.grad)):
            chunk.add_(rows)
        param.grad = None

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the accumulated gradients over the group (and the replicas) into this rank's
        shard, bucket by bucket; its form in the master dtype becomes the master shards' `.grad`.
        Once per step, after the last backward."""
        for bucket in self._buckets:
            own = bucket.grads.view(self.num_ranks, -1)[self.rank]
            if self._on_gloo:
                dist.all_reduce(bucket.grads, op=dist.ReduceOp.AVG, group=self.group)
            else:
                _reduce_scatter(own, bucket.grads, op=dist.ReduceOp.AVG, group=self.group)
            if self.replicate_group is not None:
                dist.all_reduce(own, op=dist.ReduceOp.AVG, group=self.replicate_group)
            for shard in bucket.shards:
                grad = own[shard.offset:shard.offset + shard.master.numel()].view_as(shard.master)
                shard.master.grad = grad if grad.dtype == self.master_dtype else grad.to(self.master_dtype)
        self._reduced = True

    def _require_reduced(self, what: str) -> None:
        if not self._reduced:
            raise RuntimeError(f"ZeroOptimizer.{what} before reduce_gradients(): call it once after the last "
                               "micro-batch's backward")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the master shards' gradients to a global L2 norm of `max_norm` (inf: measure only);
        returns the norm. One all-reduce of the local sums of squares over the group (replicas hold
        the same shards)."""
        self._require_reduced("clip_grad_norm_()")
        masters = [s.master for s in self._shards.values()]
        total = torch.nn.utils.get_total_norm([m.grad for m in masters]).float().square()
        dist.all_reduce(total, group=self.group)
        total = total.sqrt()
        torch.nn.utils.clip_grads_with_norm_(masters, max_norm, total)
        return total

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]  # no closure: the loss is computed outside
        """Update the master shards, then all-gather them into the replicated parameters."""
        self._require_reduced("step()")
        self.inner.step()
        self._all_gather_params()

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """The master shards, in the parameter dtype, all-gathered in place into each bucket's
        gradient buffer (its storage seen in the parameter dtype), then copied into the parameters.
        Overwrites the accumulated gradients: zero_grad() before the next backward."""
        for bucket in self._buckets:
            whole = bucket.grads.view(self.param_dtype)[:self.num_ranks * bucket.shard_numel]
            own = whole.view(self.num_ranks, -1)[self.rank]
            for shard in bucket.shards:
                own[shard.offset:shard.offset + shard.master.numel()].copy_(shard.master.view(-1))
            if self._on_gloo:
                works = [dist.broadcast(segment, src=dist.get_global_rank(self.group, r), group=self.group,
                                        async_op=True) for r, segment in enumerate(whole.view(self.num_ranks, -1))]
                for work in works:
                    work.wait()
            else:
                _all_gather(whole, own, group=self.group)
            for shard in bucket.shards:
                for chunk, rows in _row_pairs(bucket.chunks(whole, shard), shard.matrix(shard.param.detach())):
                    rows.copy_(chunk)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (persistent, like DDP's buckets); drop the master
        shards' gradients (set_to_none=False: zero them, as torch's optimizers do)."""
        for bucket in self._buckets:
            bucket.grads.zero_()
        for shard in self._shards.values():
            if set_to_none:
                shard.master.grad = None
            elif shard.master.grad is not None:
                shard.master.grad.zero_()
        self._reduced = False

    # ------------------------------------------------------------ checkpoints

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """`group` as a 1-D DeviceMesh: the state dicts' sharded tensors are DTensors on it."""
        return DeviceMesh.from_group(self.group, self._buckets[0].grads.device.type)

    def _sharded(self, local: torch.Tensor, shard: _Shard) -> DTensor:
        shape = shard.param.shape
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def _local(self, value: Any, shard: _Shard) -> Any:
        """This rank's rows of a value shaped like the parameter (a DTensor's local shard, or rows of a
        whole tensor); anything else (a `step` counter) as it is."""
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(value, torch.Tensor) and value.shape == shard.param.shape:
            return value[shard.rows(self.rank)]
        return value

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state dict with its optimized parameters as their master weights, sharded
        DTensors: what dcp.save writes and dcp.load fills in place (then load_model_state_dict)."""
        state = self.model.state_dict()
        for shard in self._shards.values():
            master = self._sharded(shard.master, shard)
            state.update(dict.fromkeys(shard.fqns, master))
        return state

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Set the master weights (sharded DTensors, or whole tensors) and the model's other entries
        from `state`, then the replicated parameters from the masters (collective)."""
        managed = {fqn for shard in self._shards.values() for fqn in shard.fqns}
        with torch.no_grad():
            for shard in self._shards.values():
                shard.master.copy_(self._local(state[shard.fqns[0]], shard))
        missing, unexpected = self.model.load_state_dict({k: v for k, v in state.items() if k not in managed},
                                                         strict=False)
        missing = sorted(set(missing) - managed)
        if unexpected or missing:
            raise ValueError(f"model state dict: unexpected keys {unexpected}, missing {missing}; load a state "
                             "dict of this model (ZeroOptimizer.model_state_dict gives its keys)")
        self._all_gather_params()
        self.zero_grad()  # the buffers held the gathered parameters

    def optimizer_state_dict(self, *, flatten: bool = False) -> dict[str, Any]:
        """{"state": {fqn: {"step": ..., "exp_avg": ...}}, "param_groups": [{..., "params": [fqn, ...]}]}:
        get_optimizer_state_dict's form for a plain optimizer, states shaped like the parameter as
        sharded DTensors; `flatten`: its flattened form (StateDictOptions(flatten_optimizer_state_dict=
        True): `state.<fqn>.<key>`, `param_groups.<fqn>.<key>`). Creates the states first when no
        step has run, so dcp.load can fill them."""
        self.init_states()
        state = {}
        for shard in self._shards.values():
            state[shard.fqns[0]] = {
                key: self._sharded(value, shard)
                if isinstance(value, torch.Tensor) and value.ndim and value.shape == shard.master.shape else value
                for key, value in self.inner.state[shard.master].items()
            }
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)}
                  for group, fqns in zip(self.inner.param_groups, self._group_fqns, strict=True)]
        if not flatten:
            return {"state": state, "param_groups": groups}
        flat = {f"state.{fqn}.{key}": value for fqn, states in state.items() for key, value in states.items()}
        for group in groups:
            flat.update({f"param_groups.{fqn}.{k}": v for fqn in group["params"] for k, v in group.items()
                         if k != "params"})
        return flat

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Set the states and the groups' hyperparameters from `state` (optimizer_state_dict's form,
        flattened or not; sharded DTensors or whole tensors)."""
        if set(state) != {"state", "param_groups"}:
            state = self._unflatten(state)
        self.init_states()
        with torch.no_grad():
            for shard in self._shards.values():
                current = self.inner.state[shard.master]
                for key, value in state["state"][shard.fqns[0]].items():
                    if isinstance(value, torch.Tensor):
                        current[key].copy_(self._local(value, shard))
                    else:
                        current[key] = value
        for group, saved, fqns in zip(self.inner.param_groups, state["param_groups"], self._group_fqns, strict=True):
            if saved["params"] != fqns:
                raise ValueError(f"optimizer state dict: a group of parameters {saved['params']} where this "
                                 f"optimizer has {fqns}; build both from the same param_groups")
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _unflatten(self, flat: dict[str, Any]) -> dict[str, Any]:
        """optimizer_state_dict(flatten=True)'s form back to the nested one, for this optimizer's keys."""
        self.init_states()
        try:
            state = {s.fqns[0]: {key: flat[f"state.{s.fqns[0]}.{key}"] for key in self.inner.state[s.master]}
                     for s in self._shards.values()}
            groups = [{**{k: flat[f"param_groups.{fqns[0]}.{k}"] for k in group if k != "params"},
                       "params": list(fqns)}
                      for group, fqns in zip(self.inner.param_groups, self._group_fqns, strict=True)]
        except KeyError as err:
            raise ValueError(f"optimizer state dict: no entry {err} (a flattened state dict of another model or "
                             "optimizer?); load one this optimizer's optimizer_state_dict(flatten=True) describes"
                             ) from err
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def init_states(self) -> None:
        """Create missing states as torch's get_optimizer_state_dict does: one inner step on zero
        gradients at learning rate 0, which leaves the master weights as they are."""
        masters = [s.master for s in self._shards.values()]
        if all(m in self.inner.state for m in masters):
            return
        grads, lrs = [m.grad for m in masters], [g["lr"] for g in self.inner.param_groups]
        for m in masters:
            m.grad = torch.zeros_like(m)
        for group in self.inner.param_groups:  # torchao's AdamW8bit keeps lr a tensor, and refuses a float
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        self.inner.step()
        for m, grad in zip(masters, grads, strict=True):
            m.grad = grad
        for group, lr in zip(self.inner.param_groups, lrs, strict=True):
            group["lr"] = lr

    # ------------------------------------------------------------ accounting

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The model states this rank holds, by category (the module docstring's table), each
        storage in the first category holding it: masters that are views of the parameters are
        params, master gradients that are views of the buffers grads."""
        categories = {
            "params": [s.param for s in self._shards.values()],
            "grads": [b.grads for b in self._buckets],
            "master_params": [s.master for s in self._shards.values()],
            "master_grads": [s.master.grad for s in self._shards.values() if s.master.grad is not None],
            # torchao's 8-bit states by the tensors they are made of (uint8 codes, fp32 scales and table)
            "optimizer": [t for state in self.inner.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor) for t in plain_tensors(v)],
        }
        seen: set[int] = set()
        out = {}
        for name, tensors in categories.items():
            out[name] = [t for t in tensors if _storage_key(t) not in seen]
            seen.update(_storage_key(t) for t in tensors)
        return out

    def state_bytes(self) -> dict[str, int]:
        """Bytes of `state_tensors()` by category, each storage counted once."""
        counts = {}
        for name, tensors in self.state_tensors().items():
            storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
            counts[name] = sum(storages.values())
        return counts


def _check_params(model: nn.Module, params: list[nn.Parameter]) -> torch.dtype:
    """Reject what ZeroOptimizer cannot shard; returns the one compute dtype."""
    names = {id(p): name for name, p in model.named_parameters()}
    if not params:
        raise ValueError("param_groups: no parameters; pass groups of the model's parameters "
                         "(train/optim.py: param_groups)")
    for p in params:
        if id(p) not in names:
            raise ValueError(f"param_groups: a tensor of shape {tuple(p.shape)} is not a parameter of the model; "
                             "build the groups from model.parameters() (train/optim.py: param_groups)")
        name = names[id(p)]
        if p.ndim == 0 or p.shape[0] == 0:
            raise ValueError(f"parameter {name}: shape {tuple(p.shape)} has no rows to split along dim 0; "
                             "give it shape (1,) or more, or leave it out of param_groups")
        if not p.requires_grad:
            raise ValueError(f"parameter {name}: requires_grad=False; leave frozen parameters out of param_groups")
        if not p.is_contiguous():
            raise ValueError(f"parameter {name}: not contiguous; make it contiguous before sharding it")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"model parameters: dtypes {sorted(map(str, dtypes))}; cast the model to one floating "
                         "compute dtype first (model.to(torch.bfloat16))")
    return dtypes.pop()
