"""The keys of `trainfit estimate --json` and `trainfit plan --json`, each with what it holds: the one
description of those answers, from which the documentation's JSON reference is generated and
against which tests/test_docs.py holds the real answers (a key added, dropped or renamed fails it).
Bytes are integers, times seconds, rates per second. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Key:
    what: str
    """What the key holds."""
    keys: dict[str, Key] = field(default_factory=dict)
    """Its object's keys (of each element, for a list of objects); {} for a value, or an object whose
    keys are data (a collective kind, a phase)."""


def _keys(**keys: Key | str) -> dict[str, Key]:
    return {name: key if isinstance(key, Key) else Key(key) for name, key in keys.items()}


LAYOUT = _keys(
    num_gpus="ranks in all", dp_replicate="HSDP replicas (1: FSDP over every data-parallel rank)",
    dp_shard="ranks each replica shards over", tp="tensor-parallel degree", pp="pipeline stages",
    cp="context-parallel degree", ep="expert-parallel degree", zero_stage="ZeRO stage, 0-3",
    pp_virtual_stages="model chunks per pipeline rank", grad_accum_steps="micro-batches per optimizer step")

STAGE_MEMORY = _keys(
    stage="the pipeline stage (0 without pp)", params="parameters held, as stored", master_params="fp32 master "
    "copies (bf16-pure with master weights; 0 otherwise)", grads="gradients at the peak",
    optimizer="optimizer states", activations="what the backward pass keeps", logits="the output layer's logits "
    "and the loss's own tensors", buffers="communication and other framework buffers", peak="the tensors' peak",
    peak_phase="forward, backward or optimizer: where the peak falls", reserved_margin="what is held beyond "
    "the tensors (on a GPU: the CUDA context, the allocator's fragmentation, NCCL's buffers)",
    margin_terms="reserved_margin's terms by name ({} on the CPU)", non_tensor="measured only: what the "
    "allocator held beyond the tensors (0 in an estimate)", reserved_peak="measured only: the allocator's "
    "reserved peak (null in an estimate)", device_used="measured only: the device's used bytes (null in an "
    "estimate)", phase_peaks="the peak of each phase", device_memory="the device's memory (0: no limit, the CPU)",
    fits="peak + reserved_margin fits device_memory")
WORST_RANK = {**STAGE_MEMORY, "layout": Key("the rank's layout", LAYOUT)}

FIX = _keys(
    changes="each changed choice as the overrides a user types for it, without their dashes",
    overrides="every override, `--section.field=value`", memory_bytes="per GPU, peak + reserved margin",
    tokens_per_second="the whole job's", mfu="model FLOPs utilisation")

ESTIMATE = _keys(
    model=Key("the model", _keys(
        preset="the preset's name or the config.json's path", family="llama or gpt2",
        num_params="parameters in all", num_active_params="parameters a token passes through (MoE)",
        num_layers="blocks", dim="hidden size", vocab_size="embedding rows")),
    per_rank=Key("the worst rank's memory (the stage that needs the most)", WORST_RANK),
    per_stage=Key("the same for each pipeline stage (one entry without pp)", STAGE_MEMORY),
    flops=Key("FLOPs", _keys(
        model_flops_per_token="6N plus attention's", hardware_flops_per_token="with recomputation",
        model_flops_per_step="the whole job's", hardware_flops_per_step="with recomputation",
        recompute_flops_per_step="what checkpointing recomputes", flops_per_rank_per_step="one rank's work")),
    time=Key("the step's time (perf/timing.py)", _keys(
        step_time_s="one optimizer step", compute_s="every rank's compute", fp8_cast_s="fp8-mixed's casts",
        nf4_dequant_s="QLoRA's NF4 dequantization", compute_parts_s="on a catalog GPU: matmul, attention, "
        "elementwise and the kernel launches ({} elsewhere)", comm_s="each collective kind's time",
        exposed_comm_s="communication not hidden behind compute", exposed_comm_by_kind_s="the same per kind",
        offload_s="CPU offload's host copies and host optimizer step", exposed_offload_s="offload not hidden",
        bubble_s="the pipeline bubble", exposed_host_s="host work (dispatch, DTensor, FSDP2) not hidden",
        bubble_fraction="the bubble's share of the step", optimizer_s="the optimizer step",
        num_microbatches="micro-batches per step", tokens_per_second="the whole job's",
        mfu="model FLOPs utilisation", hfu="hardware FLOPs utilisation (recomputation counted)")),
    fits="every stage's peak + margin fits the device", attention_kernel="the attention kernel assumed (fused or "
    "math, training.attention_backend)", derived_defaults="the fields set from the model and device, not by the "
    "user (`section.field=value (why)`)",
    fixes=Key("when it does not fit: the fewest changes that fit, fewest first, then fastest", FIX),
    fixes_global_batch=Key("the global batch every fix keeps", _keys(
        global_batch_size="sequences per step", derived="true when training.global_batch_size is 0",
        micro_batch_size="when derived: the micro-batch it is derived from",
        data_parallel_ranks="when derived: the data-parallel ranks")),
    method_changes=Key("when it does not fit: changes of method (LoRA, QLoRA) faster than every fix",
                       {**FIX, "note": Key("what trains instead")}),
)
"""`trainfit estimate --json` (fixes, fixes_global_batch and method_changes only when it does not fit)."""

CANDIDATE = _keys(
    settings="every searched field's value, `section.field`", layout="the layout in words",
    memory_techniques="checkpointing, offload and the chunked loss in words", memory_bytes="per GPU, peak + "
    "reserved margin", device_memory="the device's memory", peak_bytes="the tensors' peak",
    step_time_s="one optimizer step", tokens_per_second="the whole job's", mfu="model FLOPs utilisation",
    compute_s="compute", fp8_cast_s="fp8-mixed's casts", exposed_comm_s="communication not hidden",
    bubble_s="the pipeline bubble", exposed_offload_s="offload not hidden",
    exposed_host_s="host work (dispatch, DTensor, FSDP2) not hidden",
    grad_accum_steps="micro-batches per optimizer step", num_microbatches="pipeline micro-batches")

GLOBAL_BATCH = ESTIMATE["fixes_global_batch"].keys

PLAN = _keys(
    candidates=Key("the time-memory frontier of the layouts that fit, fastest first (--top)", CANDIDATE),
    global_batch=Key("the global batch every candidate trains", GLOBAL_BATCH),
    search=Key("what the search did", _keys(
        layouts="layouts in the space", visited="groups of layouts visited", memory_estimates="memory estimates",
        time_estimates="time estimates", rejected="[reason, count] of the layouts rejected",
        seconds="the search's time")),
    error="when nothing fits: why, and what to change",
)
"""`trainfit plan --json` (error only when nothing fits)."""

MACHINES = _keys(
    options=Key("each device and count, fastest first", _keys(
        gpu="the device", num_gpus="how many", price_per_gpu_hour="per device-hour",
        seconds_to_train="on --tokens", cost="price x devices x hours", on_cost_frontier="cheaper than every "
        "faster option", candidate=Key("its fastest layout that fits (null when none does)", CANDIDATE))),
    global_batch=Key("the global batch every option trains", GLOBAL_BATCH),
)
"""`trainfit plan --json --tokens N`."""

ANSWERS = (("trainfit estimate --json", ESTIMATE), ("trainfit plan --json", PLAN),
           ("trainfit plan --json --tokens N", MACHINES))


def json_reference() -> str:
    """Each answer's keys as nested Markdown lists: the documentation's JSON reference."""
    lines: list[str] = []
    for command, keys in ANSWERS:
        lines += [f"## `{command}`", "", "One object:", ""]
        lines += _lines(keys, 0)
        lines.append("")
    return "\n".join(lines)


def _lines(keys: dict[str, Key], depth: int) -> list[str]:
    out = []
    for name, key in keys.items():
        out.append(f"{'    ' * depth}- `{name}`: {key.what}")
        out += _lines(key.keys, depth + 1)
    return out


def undocumented(answer: object, keys: dict[str, Key], where: str = "") -> list[str]:
    """The paths of an answer's keys that `keys` does not document, and of documented keys it lacks
    where the object is documented whole (optional keys named in OPTIONAL are let be)."""
    if isinstance(answer, list):
        return [p for item in answer for p in undocumented(item, keys, where + "[]")]
    if not isinstance(answer, dict) or not keys:
        return []
    out = [f"{where}.{name}" for name in answer if name not in keys]
    out += [f"{where}.{name} (documented, absent)" for name in keys if name not in answer
            and name not in OPTIONAL]
    for name, key in keys.items():
        if name in answer and answer[name] is not None:
            out += undocumented(answer[name], key.keys, f"{where}.{name}")
    return out


OPTIONAL = frozenset({"fixes", "fixes_global_batch", "method_changes", "error", "micro_batch_size",
                      "data_parallel_ranks", "note"})
"""Keys an answer has only in some cases (said in the key's description)."""
