"""What collectives real code issues, as perf/comms.py counts them: CollectiveLog (CommDebugMode that
also notes each call's kind and bytes) and the DDP hook the fake process group needs. Used by
tests/estimator/test_comms.py (parts of a model on the fake backend) and
tests/estimator/test_consistency.py (the traced estimator's whole step)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten


class _NoModules:
    """CommDebugMode's module tracker, tracking nothing: the real one loses its place in torch's
    pipeline stages (an IndexError in its forward hook), and the calls per module are not read here."""

    name, is_bw, activation_checkpointing = "Global", False, False
    module_helper_dict: dict = {}
    parent_dict: dict = {}
    module_parents_dict: dict = {"Global": set()}

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class CollectiveLog(CommDebugMode):
    """CommDebugMode that also records (kind, bytes) of every collective, bytes as comms defines them
    (an all-gather's gathered output, a reduce-scatter's input, an all-reduce's buffer, a point-to-point
    message), while `counting` is set. Built on CommDebugMode, not a plain dispatch mode: it lets DTensor
    expand its ops first, so it also sees the collectives DTensor issues inside an op (loss_parallel's
    cross-entropy). `modules=False` drops its per-module tracking (see _NoModules)."""

    def __init__(self, *, modules: bool = True) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.counting = True
        if not modules:
            self.advanced_module_tracker = _NoModules()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.counting:
            self._note(str(func.overloadpacket).split(".")[-1], args, kwargs)
        return out

    def _note(self, name: str, args: tuple, kwargs: dict | None) -> None:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name == "_allgather_base_":  # (output, input): the gathered output
            self.calls["all_gather", tensors[0].nbytes] += 1
        elif name == "_reduce_scatter_base_":  # (output, input): the full input
            self.calls["reduce_scatter", tensors[1].nbytes] += 1
        elif name == "allreduce_":
            self.calls["all_reduce", sum(t.nbytes for t in tensors)] += 1
        elif name == "all_gather_into_tensor":  # functional: (shard, group_size, group)
            self.calls["all_gather", tensors[0].nbytes * args[1]] += 1
        elif name in ("reduce_scatter_tensor", "all_reduce"):
            self.calls[name.split("_tensor")[0], tensors[0].nbytes] += 1
        elif name in ("all_to_all_single", "alltoall_base_"):  # functional: (input, ...); c10d: (output, input)
            self.calls["all_to_all", tensors[0 if name == "all_to_all_single" else 1].nbytes] += 1
        elif name in ("send", "recv_"):  # CommDebugMode counts neither: noted here only
            self.calls["p2p", sum(t.nbytes for t in tensors)] += 1
        elif name == "broadcast_":
            self.calls["broadcast", sum(t.nbytes for t in tensors)] += 1


def sync_allreduce_hook(state, bucket):  # unannotated: DDP rejects the string annotations of callers' modules
    """DDP communication hook for the fake process group, whose work objects carry no result for DDP's
    reducer: all-reduce the bucket in place (the call real DDP makes) and hand back a finished future."""
    torch.distributed.all_reduce(bucket.buffer())
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
