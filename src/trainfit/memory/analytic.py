"""Per-rank training memory in closed form: pure arithmetic on the config, no torch.

`estimate_memory(cfg)` returns one `MemoryBreakdown` per pipeline stage (the figures of one rank
of that stage) and the worst stage. Components are their values at the step's peak moment; the
moments evaluated are the end of the forward (inside the loss), the start of the backward (the
loss gradient), the backward of the stage's last and first block, and the optimizer step.

Conventions (what each component holds):
- `params`: tensors the rank computes with. fp32 / bf16-pure: the parameters themselves (their
  ZeRO-2/3 shard, plus under ZeRO-2 the unsharded copies FSDP keeps from forward to backward).
  *-mixed: the 16-bit compute copies alive at the peak. With torch.amp (ZeRO 0/1) those are the
  casts autocast makes per matmul, which autograd saves for backward (all of them at the end of
  the forward without checkpointing, one block's worth with it); under FSDP2's
  MixedPrecisionPolicy (ZeRO 2/3) they are the gathered bf16 parameters (ZeRO-3: the per-block
  all-gather outputs, reported as `buffers`).
- `master_params`: *-mixed only: the fp32 parameters the optimizer updates (with torch.amp the
  module's own parameters; under FSDP2 their shard).
- `grads`: in the dtype of the updated parameters (fp32 under *-mixed: autocast's low-precision
  gradients are accumulated into fp32 .grad), as many as exist at the peak moment.
- `logits`: logits, their fp32 copy, cross-entropy's log-softmax and the logits' gradient, as
  train/trainer.py computes them (`F.cross_entropy(logits.float(), ...)`), last stage only.
- `buffers`: FSDP all-gather / reduce-scatter buffers, DDP gradient buckets, optimizer-step
  temporaries, and the recompute buffer of checkpointed blocks (the activations a block rebuilds
  in backward beyond what it kept).

Each constant cites its source. Where trainfit's parallel training (issue 4) is not built yet,
the assumption is stated at the constant and in `_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.config import Config
from trainfit.memory.activations import (
    FP32,
    ActDtypes,
    Terms,
    backward_transient_terms,
    block_terms,
    final_norm_terms,
)
from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.models.params import ParamCounts, param_counts
from trainfit.parallel.dims import ParallelDims, resolve_parallel_dims

MIB = 1024**2

# --- device runtime (reserved_margin; shown apart, never inside the peak)
CUDA_CONTEXT_BYTES = 500 * MIB
"""CUDA context + cuBLAS/cuDNN workspaces outside the caching allocator (300-600 MiB on H100/A100
with torch 2.x, as nvidia-smi shows beside torch.cuda.memory_reserved; an assumption)."""
ALLOCATOR_FRAGMENTATION = 0.08
"""Reserved-but-unallocated fraction of the CUDA caching allocator at the peak (5-10% is typical
in steady-state training memory snapshots; an assumption). 0 on CPU, where glibc's in-use bytes
are the ground truth."""

# --- optimizers
ADAM_STEP_TENSOR_BYTES = 4
"""torch.optim.Adam/AdamW keep `state["step"]` as a 0-dim fp32 tensor per parameter tensor
(torch/optim/adam.py, capturable=False; measured)."""
EIGHT_BIT_BLOCK = 2048
"""bitsandbytes 8-bit Adam: block-wise quantization, one fp32 absmax per 2048 values and state
(Dettmers et al., arXiv 2110.02861)."""
EIGHT_BIT_MIN_SIZE = 4096
"""bitsandbytes keeps 32-bit states for tensors under 4096 elements (min_8bit_size)."""
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adamw-8bit": 2}
"""exp_avg + exp_avg_sq; SGD's momentum_buffer."""

# --- data parallel (torch.nn.parallel.DistributedDataParallel, FSDP2 fully_shard)
DDP_BUCKET_CAP_BYTES = 25 * MIB
"""torch DDP `_DEFAULT_BUCKET_CAP_MB = 25` (the first bucket is 1 MiB)."""
DDP_GRADIENT_AS_BUCKET_VIEW = False
"""torch DDP's default: gradients are copied into flat all-reduce buckets that live as long as
the module, one extra copy of every gradient ("the saved memory size will be equal to the total
gradients size" when True, DDP docs)."""
FSDP_PREFETCH_BLOCKS = 1
"""FSDP2 prefetches the next block's all-gather while the current one computes (implicit
forward prefetch and backward prefetch of one module)."""
FSDP_REDUCE_BYTES_MIXED = 4
"""Reduce-scatter dtype under *-mixed: fp32 (MixedPrecisionPolicy(reduce_dtype=float32), as
torchtitan's default mixed_precision_reduce)."""

# --- loss
LOSS_CHUNK_TOKENS = 1024
"""memory.chunked_loss: tokens per chunk of the fused output-projection + cross-entropy; only one
chunk's logits, fp32 copy, log-softmax and gradient exist at a time, and nothing is saved."""
LOSS_PARALLEL = True
"""With tp > 1 the output projection stays vocab-sharded into the loss (torch's loss_parallel,
as torchtitan does), so the logits and their gradient divide by tp."""


@dataclass(frozen=True)
class MemoryEstimate:
    per_stage: list[MemoryBreakdown]
    """One per pipeline stage (len 1 without pp); each the figures of one rank of that stage."""
    worst_stage: int
    """Index of the stage whose peak is largest."""

    @property
    def worst(self) -> MemoryBreakdown:
        return self.per_stage[self.worst_stage]


@dataclass(frozen=True)
class _Precision:
    param: int
    """Bytes per element of the parameters the optimizer updates (and of their gradients)."""
    state: int
    """Bytes per element of 32-bit optimizer states (they follow the parameter dtype in torch)."""
    compute: int
    mixed: bool
    act: ActDtypes


def _precision(mode: str, fsdp: bool) -> _Precision:
    """precision.py: fp32; *-mixed keep fp32 parameters (the masters) and compute in 16 bits;
    bf16-pure holds everything in bf16. fp8-mixed is counted as bf16-mixed (torchao's Float8Linear
    saves the high-precision matmul inputs; its fp8 casts are transient)."""
    if mode == "fp32":
        return _Precision(4, 4, 4, False, ActDtypes(4, 4, False))
    if mode == "bf16-pure":
        return _Precision(2, 2, 2, False, ActDtypes(2, 2, False))
    # torch.amp autocast (ZeRO 0/1): fp32 residual stream, per-op casts. FSDP2's
    # MixedPrecisionPolicy instead runs the whole module in bf16 (inputs cast once): the
    # activations are those of a bf16 model.
    act = ActDtypes(2, 2, False) if fsdp else ActDtypes(4, 2, True)
    return _Precision(4, 4, 2, True, act)


@dataclass(frozen=True)
class _Layout:
    """What one rank of a pipeline stage holds, in elements (after tp, ep) and counts."""

    blocks: int
    policy_blocks: int
    """Blocks wrapped by the checkpointing policy (every n-th global layer)."""
    in_flight: float
    """Micro-batches whose activations are alive at the stage's peak (pipeline schedule)."""
    head_in_flight: int
    first: bool
    last: bool
    block_params: int
    block_matmul: int
    """Block parameters autocast casts (every Linear's weight and bias; not norms)."""
    block_no_decay: int
    block_mlp_out: int
    """Parameters of the MLP's output projection (its gradient exists at the block's backward peak)."""
    embedding: int
    head: int
    """Final norm + output projection held by this rank (0 extra when tied on one stage)."""
    output_matmul: int
    """Output projection elements the head multiplies with (the tied embedding too)."""
    tensors: int
    """Parameter tensors (one `step` tensor each for Adam)."""
    largest_tensor: int


def _count_multiples(lo: int, hi: int, n: int) -> int:
    """Integers i in [lo, hi) with i % n == 0."""
    return -(-hi // n) - (-(-lo // n))


def _in_flight(cfg: Config, dims: ParallelDims, stage: int) -> tuple[float, int]:
    """Micro-batches of activations alive on pipeline rank `stage` at its peak, and of the head.

    gpipe: all forwards before any backward (all m). 1F1B (Narayanan et al., arXiv 2104.04473):
    rank i keeps p - i. Interleaved 1F1B (Megatron's and torch.distributed.pipelining's warmup):
    rank i runs (v - 1) p + 2 (p - 1 - i) warmup chunk-forwards, so keeps that + 1 chunks of
    L/(pv) layers, which for rank 0 is Korthikanti's L (1 + (p - 1)/(pv)) layers (arXiv
    2205.05198, Sec. 4.2.3). Zero-bubble (ZB-H1, Qi et al., arXiv 2401.10241) matches 1F1B's peak.
    """
    p, v = dims.pp, dims.pp_virtual_stages
    if p == 1:
        return 1.0, 1
    m = cfg.parallel.num_microbatches or max(1, cfg.grad_accum_steps)
    schedule = cfg.parallel.pp_schedule
    if schedule == "gpipe":
        return float(m), m
    if schedule == "interleaved-1f1b":
        chunks = min(m * v, (v - 1) * p + 2 * (p - 1 - stage) + 1)
        return chunks / v, 1
    return float(min(p - stage, m)), 1


def _layout(cfg: Config, dims: ParallelDims, counts: ParamCounts, stage: int) -> _Layout:
    m, tp, ep = cfg.model, dims.tp, dims.ep
    p, v = dims.pp, dims.pp_virtual_stages
    first, last = stage == 0, stage == p - 1
    per_chunk = m.num_layers // (p * v)
    every = cfg.memory.activation_checkpointing != "none"
    policy_blocks = 0
    if every:
        for chunk in range(v):  # rank `stage` runs global chunks chunk * p + stage
            lo = (chunk * p + stage) * per_chunk
            policy_blocks += _count_multiples(lo, lo + per_chunk, cfg.memory.ac_every_n_layers)
    # Tensor parallelism shards every Linear of a block (norm gains stay whole); expert
    # parallelism shards the routed experts, and tp their hidden dim (torchtitan's ETP = tp).
    dense_mlp = counts.mlp - counts.routed_experts
    mlp = dense_mlp // tp + counts.routed_experts // (ep * tp)
    block_matmul = counts.attention // tp + mlp
    block = block_matmul + counts.norms
    biases = 0
    if m.family == "gpt2":
        biases = 4 * m.dim + m.ffn_dim + m.dim
    elif m.qkv_bias:
        biases = m.dim + 2 * m.num_kv_heads * (m.dim // m.num_heads)
    mlp_out = (m.dim * m.ffn_dim if m.family == "gpt2" else mlp // 3) if not m.num_experts else mlp // 3
    vocab_dim = m.vocab_size * m.dim // tp
    embedding = counts.embedding // tp if first else 0
    head = 0
    if last:
        head = counts.final_norm + (vocab_dim if (counts.output or not first) else 0)
    per_block_tensors = {"gpt2": 16}.get(m.family, 9 + (3 if m.qkv_bias else 0))
    if m.num_experts:
        per_block_tensors = 2 + 4 + 3 + (3 if m.num_shared_experts else 0) + (3 if m.qkv_bias else 0)
    blocks = per_chunk * v
    tensors = blocks * per_block_tensors + (2 if m.family == "gpt2" else 1) * first
    tensors += ((2 if m.family == "gpt2" else 1) + (1 if counts.output or not first else 0)) * last
    in_flight, head_in_flight = _in_flight(cfg, dims, stage)
    largest = max(vocab_dim if (first or last) else 0, counts.attention // tp // 4 or 1,
                  (m.expert_ffn_dim if m.num_experts else m.ffn_dim) * m.dim * (m.num_experts // ep or 1) // tp)
    return _Layout(
        blocks=blocks, policy_blocks=policy_blocks, in_flight=in_flight, head_in_flight=head_in_flight,
        first=first, last=last, block_params=block, block_matmul=block_matmul,
        block_no_decay=counts.norms + biases // tp, block_mlp_out=mlp_out,
        embedding=embedding, head=head, output_matmul=vocab_dim if last else 0,
        tensors=tensors, largest_tensor=largest,
    )


def _optimizer_bytes(cfg: Config, prec: _Precision, params: int, tensors: int, small: int) -> int:
    """Optimizer states for `params` elements in `tensors` tensors (`small` elements live in
    tensors too small for 8-bit states)."""
    name = cfg.optimizer.name
    if name == "adamw-8bit":
        quantized = params - small
        return int(quantized * (2 + 2 * FP32 / EIGHT_BIT_BLOCK) + small * 2 * FP32)
    states = OPTIMIZER_STATES[name] * prec.state * params
    return states + (ADAM_STEP_TENSOR_BYTES * tensors if name in ("adam", "adamw") else 0)


def _optimizer_step_temporaries(cfg: Config, prec: _Precision, decay: int, largest: int) -> int:
    """Bytes torch.optim allocates inside step() (CPU, torch 2.13, read and measured):
    foreach Adam/AdamW: `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, one state-sized list
    per parameter group (the largest is the decay group); Adam with L2 weight decay first makes
    `grads = torch._foreach_add(grads, params, alpha=wd)`, deleted before the sqrt; foreach SGD
    with weight decay, the same copy. Single-tensor loops (foreach=False) allocate one tensor's worth; fused kernels
    (CUDA) and bitsandbytes allocate nothing of note."""
    o, name = cfg.optimizer, cfg.optimizer.name
    if name == "adamw-8bit" or (o.fused and cfg.hardware.gpu != "cpu"):
        return 0
    size = decay if o.foreach else largest
    l2_copy = size * prec.param if cfg.training.weight_decay > 0 and name in ("adam", "sgd") else 0
    sqrt = size * prec.state if name in ("adam", "adamw") else 0
    # foreach Adam deletes its L2 gradient copy before taking the square root; the single-tensor
    # loop holds both for one tensor.
    return max(sqrt, l2_copy) if o.foreach else sqrt + l2_copy


def _logits(cfg: Config, prec: _Precision, tokens: int, tp: int) -> tuple[int, int, int]:
    """(saved after the loss, forward peak, backward peak) bytes of logits and cross-entropy.

    trainer._loss: logits (compute dtype) -> .float() (a copy unless already fp32) ->
    cross_entropy = log_softmax (fp32, saved) + nll_loss. Backward starts with nll_loss's
    gradient (fp32 zeros with -1/N) and log_softmax's input gradient while its output is still
    held: 3 fp32 logits-sized tensors (measured)."""
    V = cfg.model.vocab_size // (tp if LOSS_PARALLEL else 1)
    c = prec.act.compute
    fp32_copy = FP32 if c != FP32 else 0
    if cfg.memory.chunked_loss:
        chunk = min(tokens, LOSS_CHUNK_TOKENS)
        return 0, V * tokens * c + V * chunk * (fp32_copy + FP32), 3 * FP32 * V * chunk + c * V * chunk
    return FP32 * V * tokens, V * tokens * (c + fp32_copy + FP32), 3 * FP32 * V * tokens


def _stage_breakdown(cfg: Config, dims: ParallelDims, counts: ParamCounts, stage: int) -> MemoryBreakdown:
    mem, t = cfg.memory, cfg.training
    zero, shards = dims.zero_stage, dims.zero_shards
    offload_params = mem.offload == "optimizer+params"
    offload_optimizer = mem.offload != "none"
    # ZeRO-2/3 and parameter offload run through FSDP2 fully_shard (issue 4); ZeRO-0 is DDP and
    # ZeRO-1 shards only optimizer states (ZeroRedundancyOptimizer) beside whole fp32 params/grads.
    fsdp = zero >= 2 or offload_params
    prec = _precision(cfg.precision.mode, fsdp)
    lay = _layout(cfg, dims, counts, stage)
    act = prec.act

    # ---- model states (elements on this rank before ZeRO sharding)
    n_params = lay.blocks * lay.block_params + lay.embedding + lay.head
    n_no_decay = lay.blocks * lay.block_no_decay + (counts.final_norm if lay.last else 0)
    param_shards = shards if fsdp else 1
    persistent = 0 if offload_params else n_params * prec.param // param_shards
    grads_full = 0 if offload_params else n_params * prec.param // param_shards
    opt_shards = shards if zero >= 1 else 1
    optimizer = 0 if offload_optimizer else _optimizer_bytes(
        cfg, prec, n_params // opt_shards, lay.tensors, n_no_decay // opt_shards)
    opt_temp = 0 if offload_optimizer else _optimizer_step_temporaries(
        cfg, prec, (n_params - n_no_decay) // opt_shards, lay.largest_tensor)

    # ---- per micro-batch activations on this rank
    cp, tp, sp = dims.cp, dims.tp, cfg.parallel.sequence_parallel
    seq = t.seq_len // cp
    tokens = t.micro_batch_size * seq

    def size(terms: Terms) -> int:
        return terms.bytes(tokens, seq, tp, sp)

    policy = mem.activation_checkpointing
    a_none = size(block_terms(cfg.model, act, "none"))
    a_policy = size(block_terms(cfg.model, act, policy)) if policy != "none" else a_none
    a_blocks = (lay.blocks - lay.policy_blocks) * a_none + lay.policy_blocks * a_policy
    a_final = size(final_norm_terms(cfg.model, act)) if lay.last else 0
    transient = size(backward_transient_terms(cfg.model, act))
    # A checkpointed block rebuilds in backward what it did not keep (non-reentrant checkpoint
    # stops at the last tensor backward needs): the recompute buffer. The first block (global
    # layer 0) is always wrapped when a policy is set (recompute.py); the last wrapped when
    # every_n divides the stage's last index.
    rebuild = a_none - a_policy
    last_wrapped = lay.policy_blocks > 0 and ((lay.blocks * (stage + 1) - 1) % mem.ac_every_n_layers == 0
                                             if dims.pp_virtual_stages == 1 else True)
    first_wrapped = lay.policy_blocks > 0 and (lay.blocks * stage) % mem.ac_every_n_layers == 0
    saved_logits, logits_fwd, logits_bwd = _logits(cfg, prec, tokens, tp) if lay.last else (0, 0, 0)

    # ---- 16-bit compute copies (params) and FSDP buffers
    c = prec.compute
    autocast = act.autocast
    cast_block = c * lay.block_matmul if autocast else 0
    cast_head = c * lay.output_matmul if autocast else 0
    none_blocks = lay.blocks - lay.policy_blocks
    unsharded_block = c * lay.block_params
    reduce_bytes = FSDP_REDUCE_BYTES_MIXED if prec.mixed else prec.param
    held_copies = 0
    if fsdp and zero == 2 and not offload_params:  # reshard_after_forward=False: kept fwd -> bwd
        held_copies = c * n_params
    gather_fwd = gather_bwd = reduce_buffer = 0
    if fsdp and (zero == 3 or offload_params):
        gather_fwd = (1 + FSDP_PREFETCH_BLOCKS) * unsharded_block + c * (lay.head if lay.last else 0)
        gather_bwd = (1 + FSDP_PREFETCH_BLOCKS) * unsharded_block
    if fsdp:
        reduce_buffer = reduce_bytes * lay.block_params
    # Module buffers: llama's RoPE cos/sin tables (max_seq_len x head_dim each, fp32; bf16 once
    # precision.prepare_model casts a bf16-pure model), on every pipeline stage.
    module_buffers = 0
    if cfg.model.family == "llama":
        module_buffers = 2 * cfg.model.max_seq_len * (cfg.model.dim // cfg.model.num_heads) * (
            2 if cfg.precision.mode == "bf16-pure" else FP32)
    ddp_buckets = module_buffers
    if not fsdp and dims.dp > 1:
        ddp_buckets += grads_full if not DDP_GRADIENT_AS_BUCKET_VIEW else min(grads_full, DDP_BUCKET_CAP_BYTES)

    # ---- gradients present before this micro-batch's backward (accumulation, pipelining)
    accumulating = (cfg.grad_accum_steps > 1) if dims.pp == 1 else (
        (cfg.parallel.num_microbatches or cfg.grad_accum_steps) > lay.in_flight)
    grads_before = grads_full if accumulating else 0
    grad_scale = prec.param / param_shards
    # The output projection's gradient exists from the start of the backward (a tied embedding's
    # too); each block's backward peaks once its MLP output projection has its gradient (plus,
    # under autocast, that gradient's 16-bit original before the cast to fp32).
    tied_here = lay.first and lay.last and cfg.model.tie_embeddings
    grads_head = int((lay.head + (lay.embedding if tied_here else 0)) * grad_scale) if lay.last else 0
    grads_mlp_out = int(lay.block_mlp_out * (grad_scale + (prec.compute if act.autocast else 0)))
    grads_all_but_first = int((n_params - lay.block_params - (0 if tied_here else lay.embedding)) * grad_scale)

    n_if, h_if = lay.in_flight, lay.head_in_flight
    states = persistent + optimizer
    older = (n_if - 1) * a_blocks + (h_if - 1) * (a_final + saved_logits)  # other micro-batches in flight
    older_casts = (n_if - 1) * (none_blocks * cast_block + cast_head)

    # Candidate peak moments: (phase, params (compute copies), activations, logits, grads, buffers).
    V = cfg.model.vocab_size // (tp if LOSS_PARALLEL else 1)
    logits_tensor = c * V * tokens if (lay.last and not mem.chunked_loss) else 0
    saved_casts = older_casts + none_blocks * cast_block + cast_head
    acts = older + a_blocks + a_final
    older_logits = (h_if - 1) * saved_logits
    buffers_fwd = gather_fwd + ddp_buckets
    buffers_bwd = gather_bwd + ddp_buckets + reduce_buffer
    moments = [
        # End of the model's forward: under autocast, the casts of checkpointed blocks are still
        # in autocast's cache (freed when the autocast region exits, before the loss).
        ("forward", held_copies + older_casts + lay.blocks * cast_block + cast_head, acts,
         older_logits + logits_tensor, grads_before, buffers_fwd),
        ("forward", held_copies + saved_casts, acts, older_logits + logits_fwd, grads_before, buffers_fwd),
        # Backward: the loss gradient; the stage's last block; its first block.
        ("backward", held_copies + saved_casts, acts, older_logits + logits_bwd, grads_before,
         buffers_fwd if lay.last else ddp_buckets),
        ("backward", held_copies + saved_casts - cast_head + (cast_block if last_wrapped else 0),
         older + a_blocks + transient, older_logits, max(grads_before, grads_head + grads_mlp_out),
         (rebuild if last_wrapped else 0) + buffers_bwd),
        ("backward", (c * (lay.block_params + lay.embedding) if held_copies else 0) + older_casts + cast_block,
         older + (a_policy if first_wrapped else a_none) + transient, older_logits,
         max(grads_before, grads_all_but_first) + grads_mlp_out, (rebuild if first_wrapped else 0) + buffers_bwd),
        ("optimizer", 0, 0, 0, grads_full, opt_temp + ddp_buckets),
    ]
    phase_peaks: dict[str, int] = {}
    at, best_total = moments[0], -1
    for moment in moments:
        total = states + int(sum(moment[1:]))
        phase_peaks[moment[0]] = max(phase_peaks.get(moment[0], 0), total)
        if total > best_total:
            at, best_total = moment, total
    phase, copies_at, act_at, logits_at, grads_at, buffers_at = at
    params = int(copies_at) + (0 if prec.mixed else persistent)
    margin = 0 if cfg.hardware.gpu == "cpu" else int(CUDA_CONTEXT_BYTES + ALLOCATOR_FRAGMENTATION * best_total)
    return MemoryBreakdown(
        params=params, master_params=persistent if prec.mixed else 0, grads=int(grads_at),
        optimizer=optimizer, activations=int(act_at), logits=int(logits_at), buffers=int(buffers_at),
        peak=best_total, peak_phase=phase, reserved_margin=margin, phase_peaks=phase_peaks,
    )


def estimate_memory(cfg: Config, dims: ParallelDims | None = None) -> MemoryEstimate:
    """Per-rank memory of one training step of `cfg`, one breakdown per pipeline stage."""
    dims = dims or resolve_parallel_dims(cfg)
    counts = param_counts(cfg.model)
    stages = [_stage_breakdown(cfg, dims, counts, s) for s in range(dims.pp)]
    worst = max(range(len(stages)), key=lambda i: stages[i].peak)
    return MemoryEstimate(per_stage=stages, worst_stage=worst)


def forward_retained_bytes(cfg: Config, dims: ParallelDims | None = None, stage: int = 0) -> int:
    """Bytes one micro-batch's forward and loss leave allocated for the backward on `stage`:
    saved activations, the saved log-probabilities and, with torch.amp, the 16-bit weight copies
    autograd saved. The measurable counterpart of (in use after forward+loss) - (before)."""
    dims = dims or resolve_parallel_dims(cfg)
    counts = param_counts(cfg.model)
    mem, t = cfg.memory, cfg.training
    fsdp = dims.zero_stage >= 2 or mem.offload == "optimizer+params"
    prec = _precision(cfg.precision.mode, fsdp)
    lay = _layout(cfg, dims, counts, stage)
    seq = t.seq_len // dims.cp
    tokens = t.micro_batch_size * seq
    policy = mem.activation_checkpointing

    def size(terms: Terms) -> int:
        return terms.bytes(tokens, seq, dims.tp, cfg.parallel.sequence_parallel)

    a_none = size(block_terms(cfg.model, prec.act, "none"))
    a_policy = size(block_terms(cfg.model, prec.act, policy)) if policy != "none" else a_none
    none_blocks = lay.blocks - lay.policy_blocks
    total = none_blocks * a_none + lay.policy_blocks * a_policy
    if lay.last:
        total += size(final_norm_terms(cfg.model, prec.act)) + _logits(cfg, prec, tokens, dims.tp)[0]
    if prec.act.autocast:
        total += prec.compute * (none_blocks * lay.block_matmul + lay.output_matmul)
    return total


def zero_model_state_bytes(num_params: int, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                           optimizer_bytes: int = 12) -> int:
    """Model-state bytes per rank as the ZeRO paper counts them (Rajbhandari et al., arXiv
    1910.02054, Sec. 5 and Fig. 1): fp16 parameters (2 bytes) and gradients (2 bytes) plus K = 12
    bytes of Adam state (fp32 master copy, momentum, variance) per parameter; stage 1 shards the
    K states over the dp ranks, stage 2 also the gradients, stage 3 also the parameters."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage {stage!r}: choose 0, 1, 2 or 3")
    p = param_bytes / (dp if stage >= 3 else 1)
    g = grad_bytes / (dp if stage >= 2 else 1)
    k = optimizer_bytes / (dp if stage >= 1 else 1)
    return round(num_params * (p + g + k))
