"""The storage ledger, `StorageLedger`: a TorchDispatchMode holding every live tensor storage with
its bytes and its component, the total sampled after every aten operator with the phase and the
innermost module (torch's ModTracker). The traced estimator (traced.py) runs it on fake
tensors, measurement (memory/measured/attribution.py) on real ones, so both attribute by the same rules.
Not torch's MemTracker / FSDPMemTracker: their categories (parameter, activation, temp, ...)
cannot tell logits, autocast's 16-bit weight copies or recomputation apart, and they snapshot
every module after every operator, which is slow on 32+ layers.

The components, as memory/breakdown.py names them and analytic.py counts them:

- params: the parameters under fp32 / bf16-pure (their local shards under FSDP); under *-mixed
  the 16-bit compute copies instead (outputs of a cast whose input is a parameter: autocast's
  weight casts; ZeRO-1's replicated 16-bit parameters), and under ZeRO-2 FSDP's unsharded
  parameters (kept from forward to backward).
- master_params: *-mixed only: the fp32 parameters (their shards under FSDP; ZeRO-1's master shards).
- grads: storages held by a parameter's `.grad` (sharded gradients under FSDP; DDP's buckets, which
  its gradients are views of), ZeRO-1's flat gradient buffers and its master shards' gradients
  (parallel/data_parallel.model_state_tensors names every model state).
- optimizer: storages in the optimizer's state (this rank's shard under ZeRO-1).
- logits: the model's output, everything the loss computation creates, and in backward
  everything created until the output's gradient exists (nll_loss, log_softmax, cast gradients).
- activations: what the forward creates (saved for backward or in flight, the input tokens too)
  and backward's activation gradients and temporaries (a gradient autograd made before a hook
  moves it into a bucket, too).
- buffers: operands and results of the data-parallel engines' collectives (_COMM_NAMESPACES) and
  FSDP's copy-in / copy-out ops (all-gather, reduce-scatter, unsharded gradients; ZeRO-1's
  per-bucket reduce-scatter output and all-gather input and output), what autograd's gradient
  accumulation reads and makes for an FSDP unsharded parameter (a gradient it copies into the
  parameter's layout: the incoming one too), ZeRO-3's unsharded parameters, what activation
  checkpointing recomputes in backward, optimizer-step temporaries, module buffers (RoPE tables)
  and other persistent tensors (loss-scaler state).

A storage's component is its final one: when it is recognised later (a tensor becomes a `.grad`,
a reduce-scatter result a sharded gradient), the figures of the peak moment are corrected too.

One job, one module: everything here serves the ledger's attribution. The mode itself is most of
it; the rest (the module tracker that survives pipeline stages, the global-hook juggling around a
compiled block, the sharding propagation kept out of the count, `phase_listener`) only feeds it the
phase and the module it attributes by, and would be read nowhere else.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainfit.memory.breakdown import COMPONENTS, PHASES, MemoryBreakdown
from trainfit.memory.traced.caching_allocator import CachingAllocator
from trainfit.parallel.data_parallel import model_state_tensors
from trainfit.parallel.layout import Layout
from trainfit.precision import PrecisionPolicy

aten = torch.ops.aten


class _StageSafeModTracker(ModTracker):
    """torch's ModTracker, minus its gradient hooks on leaf inputs: a pipeline stage's received
    activations are leaves, and the schedule's input-gradient pass (autograd.grad) refuses hooks
    on leaves. Its backward then leaves the stage's own module on the parent stack, where the
    stage's root is anyway.

    `backward_hooks=False` registers no gradient hooks at all (modules are then named in forward
    only): a schedule that splits backward (input gradients with retain_graph, weight gradients
    later, through other nodes) never runs the input path's nodes again, and a hook registered in
    such a node holds it through a reference cycle via C++ that Python's collector cannot see, so
    the node and its saved activations would outlive the step, and pile up step after step."""

    backward_hooks = True

    def __init__(self) -> None:
        super().__init__()
        self._forward_depth = 0
        """Modules whose forward has begun and not ended, outside backward."""

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        args, _ = tree_flatten(input)
        kept = [a for a in args if not (isinstance(a, torch.Tensor) and a.is_leaf)] if self.backward_hooks else []
        if not self.is_bw:
            self._forward_depth += 1
        super()._fw_pre_hook(mod, kept)

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        if not self.is_bw and self._forward_depth:
            self._forward_depth -= 1
        super()._fw_post_hook(mod, input, output if self.backward_hooks else ())

    def _maybe_set_engine_callback(self) -> None:
        """A backward that runs inside a forward (a kernel that traces its own backward graph when first
        called, or torch.autograd.grad in a model's code) ends with torch's callback that empties the parent
        stack, and the forward's modules then fail ModTracker's nesting check as they return. Such a
        backward's end puts the forward's stack back instead."""
        if self._has_callback:
            return
        forward = (set(self.parents), dict(self._active_module_cnt)) if self._forward_depth else None
        super()._maybe_set_engine_callback()
        if forward is not None:
            def restore() -> None:
                self.parents, self._active_module_cnt = forward
            torch.autograd.Variable._execution_engine.queue_callback(restore)

TimelinePoint = tuple[int, int, str, str]
"""(operator index within the step, bytes in use after it, phase, module)."""

_CASTS = frozenset({aten._to_copy.default})
_COMM_NAMESPACES = frozenset({"c10d", "fsdp"})
"""The data-parallel engines' collectives (FSDP's, DDP's, ZeRO-1's), whose operands and results are
buffers. The model's own (functional collectives: tensor parallelism's DTensor redistributions,
context parallelism's K/V all-gathers) are its computation: their results are classified like any
other operator's (the vocabulary-parallel embedding's all-reduce makes the first block's input)."""
_FSDP_COPY_OUT = torch.ops.fsdp.split_with_sizes_copy.default if hasattr(torch.ops.fsdp, "split_with_sizes_copy") \
    else None
HOST = "host"
"""Component of tensors outside the device's memory (CPU offload); not in the totals or the breakdown."""
_PERSISTENT = ("params", "master_params", "grads", "optimizer", HOST)


@dataclass
class _Storage:
    nbytes: int
    component: str
    born: int
    """Operator index at which the storage appeared (or last changed size)."""
    ref: weakref.ref = field(repr=False)
    resized: bool = False
    """FSDP resizes it: an all-gather output, which its unsharded parameters are views of."""


class StorageLedger(TorchDispatchMode):
    """Live tensor storages by component, sampled after every aten operator.

    Works on fake tensors (tracing) and real ones (attribution). The owner drives the phase
    (`phase`), marks the loss region through `watch_model` and classifies model states with
    `classify`; `on_sample(op_index)` is called after every sample (the allocator probe of a
    measurement). Use it with `with ledger:` around everything that allocates.
    """

    def __init__(self, *, fake: bool, unsharded_component: str = "buffers", host_states: bool = False,
                 device_type: str | None = None, on_sample: Callable[[int], None] | None = None,
                 allocator: CachingAllocator | None = None) -> None:
        super().__init__()
        self.fake = fake
        self.allocator = allocator
        """Fed every device storage's allocation and release in order (the traced estimate's reserved pool)."""
        self._in_comm_op = False
        self.unsharded_component = unsharded_component
        """Component of FSDP's unsharded parameters (their storages are resized, not allocated)."""
        self.host_states = host_states
        """Model states live in host memory (CPU offload): a trace on CPU cannot see it, so say it."""
        self.device_type = device_type
        """Tensors on another device type are host memory (a CUDA measurement with CPU offload)."""
        self.on_sample = on_sample
        self.pins: dict[str, tuple[int, dict[str, int]]] = {}
        """Components at pinned moments (name -> (operator index, components)), kept up to date
        when a storage alive at that moment changes component; "peak" is the ledger's own peak."""
        self.entries: dict[int, _Storage] = {}
        self.current = dict.fromkeys((*COMPONENTS, HOST), 0)
        self.total = 0
        self.op = 0
        self.phase = "forward"
        self.in_loss = False
        self.suspended = False
        """Operators pass through untracked (DTensor computing output shapes on global-size fakes)."""
        self.in_prologue = False
        """Between the start of the forward and the model's own pre-hook (wrappers' hooks run first)."""
        self.recording = False
        self.timeline: list[TimelinePoint] = []
        self.peak = -1
        self.peak_op = -1
        self.peak_phase = ""
        self.peak_module = ""
        self.phase_peaks: dict[str, int] = {}
        self._param_storages: set[int] = set()
        self._forward_depth = 0
        self._nonzero_calls = 0
        self._route: list[int] | None = None
        self._mods = _StageSafeModTracker()
        self._stack = contextlib.ExitStack()
        self._orig_resize = torch.UntypedStorage.resize_

    # ------------------------------------------------------------ bookkeeping

    def _move(self, entry: _Storage, component: str) -> None:
        old = entry.component
        if old == component:
            return
        entry.component = component
        self.current[old] -= entry.nbytes
        self.current[component] += entry.nbytes
        self.total += entry.nbytes * ((old == HOST) - (component == HOST))
        for op, components in self.pins.values():
            if entry.born <= op:  # alive at that moment: correct it too
                components[old] -= entry.nbytes
                components[component] += entry.nbytes

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self.entries.get(key)
        if entry is None or entry.ref is not ref:
            return
        del self.entries[key]
        self.current[entry.component] -= entry.nbytes
        if entry.component != HOST:
            self.total -= entry.nbytes
            if self.allocator is not None:
                self.allocator.free(key)

    def _track_tensor(self, t: torch.Tensor, component: str, *, retag: tuple[str, ...] = ()) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            component, retag = HOST, ()
        if t.device.type != "meta":  # meta tensors hold no memory
            for storage in get_untyped_storages(t):  # tensor subclasses: their inner tensors' storages
                self._track(storage, component, retag=retag)

    def _track(self, storage: torch.UntypedStorage, component: str, *, retag: tuple[str, ...] = ()) -> None:
        key = id(storage)
        entry = self.entries.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda r, k=key: self._freed(k, r))
            self.entries[key] = _Storage(nbytes, component, self.op, ref)
            self.current[component] += nbytes
            if component != HOST:
                self.total += nbytes
                if self.allocator is not None:
                    self.allocator.malloc(key, nbytes, "comm" if self._in_comm_op else "default")
        elif entry.component in retag:
            self._move(entry, component)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self.entries.get(id(storage))
        nbytes = storage.nbytes()
        if entry is None:
            self._track(storage, self.unsharded_component)
            self.entries[id(storage)].resized = True
            return
        entry.resized = True
        self.current[entry.component] += nbytes - entry.nbytes
        if entry.component != HOST:
            self.total += nbytes - entry.nbytes
            if self.allocator is not None:  # FSDP's unsharded storages: freed at size 0, allocated anew
                self.allocator.free(id(storage))
                self.allocator.malloc(id(storage), nbytes)
        entry.nbytes, entry.born = nbytes, self.op
        if nbytes:
            self._move(entry, self.unsharded_component)

    def tag(self, tensors: Any, component: str) -> None:
        """Give the storages of `tensors` (any pytree; DTensors by their local shard) `component`."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                for storage in get_untyped_storages(_local(t)):
                    entry = self.entries.get(id(storage))
                    if entry is None:
                        self._track(storage, component)
                    else:
                        self._move(entry, component)

    def ignore_compile_internals(self) -> bool:
        """On real tensors (a measured step) torch.compile'd code runs compiled under the ledger: dynamo
        otherwise skips every frame while a dispatch mode is active, and the step runs eager (torchao's
        8-bit optimizer update, compiled with fullgraph=True, refuses to). Compiled blocks
        (training.compile) then show the ledger their dispatcher calls only (extern kernels: matmuls,
        attention): what a fused kernel allocates it never sees created (a measurement counts it in
        non_tensor, memory/measured/attribution.py); the 8-bit update's buffers live and die inside one call,
        unseen like any operator's workspace (memory/measured/measure.py). Fake tensors cannot run compiled
        code (traced.py traces the eager step)."""
        return not self.fake

    def classify(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy,
                 *, others: str | None = None) -> None:
        """Tag the model states; with `others`, every other live storage gets that component."""
        if others is not None:
            for entry in list(self.entries.values()):
                if entry.component not in _PERSISTENT:
                    self._move(entry, others)
        params = list(model.parameters())
        for component, tensors in model_state_tensors(model, optimizer, policy).items():
            self.tag(tensors, self.state(component))
        self.tag(list(model.buffers()), "buffers")
        self._param_storages = {id(_local(p).untyped_storage()) for p in params}

    def state(self, component: str) -> str:
        """`component` for a model state (parameters, gradients, optimizer states), or HOST."""
        return HOST if self.host_states else component

    def tag_grads(self, params: Any) -> None:
        self.tag([p.grad for p in params if p.grad is not None], self.state("grads"))

    def reset_peak(self) -> None:
        """Start a new step: operator index 0, empty timeline, peaks from the current total. Every
        live storage is alive from operator 0 on, so what was done before (how many operators
        materialization ran) cannot change which pinned moments a later re-tag corrects."""
        self.op = 0
        for entry in self.entries.values():
            entry.born = 0
        self.timeline = []
        self.peak, self.peak_op = -1, -1
        self.pins.clear()
        self.phase_peaks = {}
        self.recording = True
        self._sample(None)

    # ------------------------------------------------------------ what a new storage is

    def _component(self, func: Any, args: Any) -> str:
        if self.phase == "optimizer":
            return self.state("buffers")  # with CPU offload, clipping and the step run on the host
        if func in _CASTS and isinstance(args[0], torch.Tensor) and id(args[0].untyped_storage()) in \
                self._param_storages:
            return "params"
        if self.in_loss:
            return "logits"
        if self.in_prologue:
            return "buffers"  # a data-parallel wrapper's work before the model runs (DDP's lazy init)
        if self.phase == "backward" and self._forward_depth > 0:
            return "buffers"  # activation checkpointing recomputes a block's forward
        return "activations"

    # ------------------------------------------------------------ hooks

    def watch_model(self, model: nn.Module, *, split_backward: bool = False) -> None:
        """Mark the loss region: from the model's output (which becomes `logits`) to its gradient.
        A pipeline rank's model (parallel/pipeline.StageParts) is never called: its stages are, and
        only the last stage's output is logits. `split_backward`: a schedule that runs input and
        weight gradients apart (Layout.splits_backward), where modules are named in forward only
        (_StageSafeModTracker)."""
        self._mods.backward_hooks = not split_backward

        def pre(module: nn.Module, args: Any) -> None:
            self.in_loss = self.in_prologue = False

        def post(module: nn.Module, args: Any, output: Any) -> None:
            self.tag(output, "logits")
            self.in_loss = True
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._logits_grad)

        for module in model.modules():
            if isinstance(module, OptimizedModule):
                self._stack.callback(module.register_forward_pre_hook(_hide_global_hooks).remove)
                self._stack.callback(module.register_forward_hook(_restore_global_hooks, always_call=True).remove)
        stages = getattr(model, "stages", None)
        for module in stages or (model,):
            self._stack.callback(module.register_forward_pre_hook(pre).remove)
            if stages is None or module.output is not None:
                self._stack.callback(module.register_forward_hook(post).remove)

    def _logits_grad(self, grad: torch.Tensor) -> None:
        self.in_loss = False

    def _module_pre(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1

    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1

    def grad_hooks(self, params: list[nn.Parameter]) -> None:
        """Tag each gradient when autograd accumulates it (plain parameters and tensor parallelism's
        DTensors; FSDP's sharded gradients, which autograd never accumulates, are tagged by
        `classify` and the collectives rule)."""

        def hook(p: torch.Tensor) -> None:
            self.tag_grads([p])

        for p in params:
            if p.requires_grad:  # a frozen parameter (PEFT's base) has no gradient to tag
                self._stack.callback(p.register_post_accumulate_grad_hook(hook).remove)

    def route(self, rows_per_expert: list[int]) -> None:
        """Fake tensors only: the n-th `nonzero` returns rows_per_expert[n % num_experts] rows (an MoE
        layer's dropless experts query their tokens in order; traced.py says why)."""
        self._route = list(rows_per_expert)

    # ------------------------------------------------------------ mode

    supports_higher_order_operators = True
    """Compiled blocks call higher-order operators (full checkpointing's run_and_save_rng_state): run
    them as any operator, their outputs tracked, their insides unseen."""

    def __enter__(self) -> StorageLedger:
        self._fake_on_entry = active_fake_mode()
        self._stack.callback(register_module_forward_pre_hook(self._module_pre).remove)
        self._stack.callback(register_module_forward_hook(self._module_post, always_call=True).remove)
        ledger = self
        orig = self._orig_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = orig(storage, size)
            ledger._resized(storage)
            return out

        # FSDP allocates and frees unsharded parameters by resizing storages, which no dispatch
        # mode sees (MemTracker patches the same method).
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._stack.callback(setattr, torch.UntypedStorage, "resize_", orig)
        if self.fake:
            self._stack.enter_context(_untracked_sharding_propagation(self))
        self._stack.enter_context(self._mods)
        # Compiled blocks (training.compile) see the global hooks hidden (_hide_global_hooks), not absent.
        self._stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._stack.close()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local operators, which come back here
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        if self.fake:
            out = self._fake_override(func, args)
            if out is None:
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if active_fake_mode() is not self._fake_on_entry:
            return out  # DTensor's sharding propagation runs under a fake mode of its own
        self.op += 1
        if func.namespace in _COMM_NAMESPACES:
            if func is _FSDP_COPY_OUT:  # all-gather output -> the unsharded parameters
                for t in kwargs["out"]:
                    self._track_tensor(t, self.unsharded_component, retag=("activations", "buffers"))
            self._in_comm_op = True  # what a collective creates, FSDP2 allocates on its own streams
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self._track_tensor(t, "buffers", retag=("activations",))
            self._in_comm_op = False
        elif self._accumulating_unsharded_grad():
            # AccumulateGrad's work on an FSDP unsharded parameter's gradient (a copy into the
            # parameter's layout, or a sum): the incoming gradient and the result are FSDP's
            # unsharded gradients, buffers until the reduce-scatter's copy-in.
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self._track_tensor(t, "buffers", retag=("activations",))
        else:
            component = None
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    component = component or self._component(func, args)
                    self._track_tensor(t, component)
        if self.recording:
            self._sample(func)
        return out

    def _accumulating_unsharded_grad(self) -> bool:
        """Autograd is accumulating the gradient of an FSDP unsharded parameter. AccumulateGrad copies
        an incoming gradient whose strides differ from the parameter's (a stacked expert weight's,
        made by a batched matmul on its transpose) before it becomes `.grad`: the copy is what FSDP
        reduces, and the incoming one, freed right after, never reaches FSDP's copy-in."""
        if self.phase != "backward":
            return False
        node = torch._C._current_autograd_node()
        if node is None or type(node).__name__ != "AccumulateGrad":
            return False
        param = _local(node.variable)
        entry = self.entries.get(id(param.untyped_storage())) if param.device.type != "meta" else None
        return entry is not None and entry.resized

    def _fake_override(self, func: Any, args: Any) -> Any:
        if func is aten.nonzero.default and self._route is not None:
            count = self._route[self._nonzero_calls % len(self._route)]
            self._nonzero_calls += 1
            return torch.empty((count, args[0].dim()), dtype=torch.long, device=args[0].device)
        if func is aten._local_scalar_dense.default:
            return 1 if not args[0].is_floating_point() else 1.0
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]  # in eager, waiting returns the same tensor (the fake kernel makes a new one)
        return None

    def _sample(self, func: Any) -> None:
        total = self.total
        module = self.module()
        self.timeline.append((self.op, total, self.phase, module))
        if total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = total
        if total > self.peak:
            self.peak, self.peak_op, self.peak_phase, self.peak_module = total, self.op, self.phase, module
            self.pin("peak")
        if self.on_sample is not None:
            self.on_sample(self.op)

    def pin(self, name: str) -> None:
        """Remember the components of this moment under `name` (see `pins`)."""
        self.pins[name] = (self.op, dict(self.current))

    def module(self) -> str:
        """Where the step is: the innermost running module, "loss" or "optimizer"."""
        if self.phase == "optimizer":
            return "optimizer"
        if self.in_loss:
            return "loss"
        name = max(self._mods.parents, key=lambda n: (n != "Global", n.count("."), len(n)))
        if "." not in name:
            return "model"  # the root ("Transformer") or no module at all
        # "Transformer.layers.3._checkpoint_wrapped_module.attention" -> "layers.3.attention"
        return name.split(".", 1)[1].replace("_checkpoint_wrapped_module.", "")

    def breakdown(self) -> MemoryBreakdown:
        """The components at the step's peak, its phase and the per-phase peaks."""
        at_peak = self.pins["peak"][1]
        parts = {name: at_peak[name] for name in COMPONENTS}
        # The sum, not self.peak: it differs when a storage alive at the peak was later found to be
        # host memory (an offloaded gradient), and the peak moment's device bytes are what count.
        return MemoryBreakdown(**parts, peak=sum(parts.values()), peak_phase=self.peak_phase,
                               phase_peaks={p: self.phase_peaks[p] for p in PHASES if p in self.phase_peaks})


@contextlib.contextmanager
def _untracked_sharding_propagation(ledger: StorageLedger) -> Iterator[None]:
    """DTensor derives an operator's output shape by running it on fake tensors of the global
    shape. Eagerly it does so under a fake mode of its own, which the ledger skips; inside our
    fake mode it reuses ours, so those tensors (a whole model's gradients for one `_foreach_norm`)
    would count as memory. Private: ShardingPropagator is torch.distributed.tensor's internals."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        suspended, ledger.suspended = ledger.suspended, True
        try:
            return original(self, *args, **kwargs)
        finally:
            ledger.suspended = suspended

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def unsharded_component(layout: Layout) -> str:
    """FSDP's unsharded parameters: compute copies kept from forward to backward under ZeRO-2 and
    under a split-backward schedule (params), per-block all-gather buffers under ZeRO-3 (buffers),
    as analytic.py counts them."""
    return "params" if layout.zero_stage == 2 or layout.splits_backward else "buffers"


_GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                        "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")
_hidden_hooks: list[list[dict[int, Any]]] = []


def _hide_global_hooks(module: nn.Module, args: Any) -> None:
    """Before a torch.compile'd block (training.compile) runs: empty the global module hooks (the
    ledger's and ModTracker's), which dynamo would otherwise trace into the block's graph and guard
    on (their handles' ids), compiling the block again for every watched or measured step. The
    block itself is still seen, from outside (its OptimizedModule); the modules inside it are not."""
    dicts = [getattr(torch.nn.modules.module, name) for name in _GLOBAL_MODULE_HOOKS]
    _hidden_hooks.append([dict(d) for d in dicts])
    for d in dicts:
        d.clear()


def _restore_global_hooks(module: nn.Module, args: Any, output: Any) -> None:
    saved = _hidden_hooks.pop()
    for name, hooks in zip(_GLOBAL_MODULE_HOOKS, saved, strict=True):
        getattr(torch.nn.modules.module, name).update(hooks)


def _local(t: torch.Tensor) -> torch.Tensor:
    # The attribute, not to_local(): that is an operator, which the ledger would count as a step.
    return t._local_tensor if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- phases of a trainer step


def phase_listener(ledger: StorageLedger, trainer: Any,
                   on_forward: Callable[[str], None] | None = None) -> Callable[[str], None]:
    """A Trainer step listener (Trainer.listening) that drives `ledger.phase`: forward (with the
    loss) per micro-batch, backward after it, optimizer from the gradient reduction on; gradients
    are tagged at each phase change, and every model state once the optimizer is about to step
    (ZeRO-1's master gradients appear in the optimizer phase). `trainer`: its model, optimizer and
    precision policy are read. `on_forward("start" | "end")` is called around each forward + loss."""
    model = trainer.model
    in_forward = False

    def listen(moment: str) -> None:
        nonlocal in_forward
        if in_forward and on_forward is not None and moment != "forward":
            on_forward("end")
        in_forward = moment == "forward"
        if moment == "forward":
            ledger.tag_grads(model.parameters())
            ledger.phase = "forward"
            ledger.in_prologue = True
            if on_forward is not None:
                on_forward("start")
        elif moment == "backward":
            ledger.phase = "backward"
        elif moment == "optimizer":
            ledger.tag_grads(model.parameters())
            ledger.phase = "optimizer"
        elif moment == "update":
            ledger.classify(model, trainer.optimizer, trainer.policy)

    return listen
