"""The estimator accuracy grid, shared by tests/estimator/test_accuracy.py and
benchmarks/estimator_accuracy.py: configurations on 1, 2 and 4 CPU processes, each measured
(memory/measured/attribution.py), traced (traced.py) and estimated (memory/closed_form/analytic.py).

Ground truth on CPU: the live tensors of a real step, counted per component at every aten
operator, and beside them glibc's in-use bytes read at the same moments. The estimators are held
to the tensors' peak; the allocator keeps that honest: its peak above the tensors' (non_tensor:
autograd's graph objects, tensor headers, gloo and DTensor bookkeeping, a tensor the meter missed)
must stay under NON_TENSOR_TOLERANCE of the peak, except in 16-bit dropless MoE steps, where
oneDNN (on CPUs where it runs 16-bit matmuls) caches a primitive per new expert shape mid-step;
there it is recorded, not bounded (benchmarks/README.md has the figures). Models are sized for
peaks of 10-60 MiB (tensor-parallel rows with checkpointing, whose steps are small, for 20 MiB or
more): large against that overhead, small enough that a 4-rank step costs a few seconds on 2 cores.

Several ranks: one start of processes per world size (forked from the session's fork server,
tests/_ranks.py) joins a gloo world once and measures all of that world's rows in sequence (each
rank measures itself and writes one JSON file per row); the trace and the analytic estimate run in
the calling process, which has no process group (the tracer brings its own fake one).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from _analytic import memory_of, retained_of, states_of
from _ranks import start_ranks
from _runs import run_config
from trainfit.config import Config
from trainfit.memory import COMPONENTS, MemoryBreakdown
from trainfit.memory.measured import Measurement
from trainfit.parallel.schedules import SCHEDULES
from trainfit.traced import trace_step
from trainfit.train.data import prepare_data
from trainfit.train.trainer import measure_step

MiB = 2**20
TRACED_PEAK_TOLERANCE = 0.03
"""Traced peak against the measured one (relative)."""
ANALYTIC_TOLERANCE = 0.10
"""Analytic peak, forward-retained bytes and model states against the measured ones (relative)."""
MOE_TRACED_BOUNDS = (-0.03, 0.10)
"""MoE rows, traced peak against the measured one: dropless routing is estimated at
memory.moe_imbalance, a busiest expert above what the real router reaches, and in its worst place;
the estimate may exceed the step by that margin, never fall short by more than the dense rows'."""
MOE_ANALYTIC_BOUNDS = (-0.05, 0.15)
"""MoE rows, analytic peak against the measured one (as MOE_TRACED_BOUNDS)."""
SPLIT_BACKWARD_ANALYTIC_BOUNDS = (-ANALYTIC_TOLERANCE, 0.12)
"""Zero-bubble pipeline rows (input and weight gradients apart), analytic peak against the measured
one: the analytic estimate counts the in-flight activations and what the weight pass keeps at their
largest, in its own moments (so their components are not checked against the trace either,
_stage_problems); on interleaved zero-bubble's last rank that is more than 10% above the tensors the
step holds (benchmarks/README.md). Above, not below: the lower bound is the dense rows'."""
NON_TENSOR_TOLERANCE = 0.03
"""A measured step's non_tensor bytes against its (tensors') peak, outside 16-bit dropless MoE rows."""
COMPONENT_TOLERANCE = 0.10
"""Analytic against traced, per component: a fraction of the traced component..."""
COMPONENT_FLOOR = 0.01
"""...or of the traced peak, whichever is larger (a component under a tenth of the peak is held to
1% of the peak: 10% of a 0.2 MiB component is noise the peak does not feel)."""
PIPELINE_COMPONENT_FLOOR = 0.02
"""Pipeline stages: 2% of the traced peak. torch's schedules hold stage outputs and input gradients
(each 0.4-1.5% of these peaks) in send lists and ops whose lifetimes the analytic estimate counts
at its own peak moment; one of them more or less moves a component, not the peak."""

_SHAPE = ["--model.dim=128", "--model.vocab_size=512", "--model.max_seq_len=256", "--training.seq_len=256",
          "--training.micro_batch_size=4", "--training.global_batch_size=4"]
LLAMA = ["--model.preset=debug", "--model.ffn_dim=384", *_SHAPE]
"""2 blocks, grouped-query attention (4 heads, 2 KV heads), SwiGLU."""
MHA = [*LLAMA, "--model.num_layers=3", "--model.num_kv_heads=4"]
"""3 blocks, multi-head attention."""
TIED = [*LLAMA, "--model.vocab_size=2048", "--model.tie_embeddings=true"]
"""A tied, wider vocabulary: the logits matter."""
TIED_WIDE_VOCABULARY = ["--model.preset=", "--model.family=llama", "--model.dim=192", "--model.num_layers=4",
                        "--model.num_heads=4", "--model.num_kv_heads=4", "--model.ffn_dim=576",
                        "--model.vocab_size=5000", "--model.max_seq_len=128", "--model.tie_embeddings=true",
                        "--training.seq_len=128"]
"""4 blocks of dim 192, a tied vocabulary of 5,000 rows (24 MiB of fp32 states beside 5 MiB of activations)."""
MOE = ["--model.preset=debug-moe", "--model.expert_ffn_dim=128", *_SHAPE]
"""4 routed experts (top 2) + 1 shared."""


def moe(experts: int, top_k: int, shared: int = 0, capacity_factor: float = 0.0) -> list[str]:
    """MOE with `experts` routed experts, `top_k` per token, `shared` shared ones, and a capacity
    factor (0: dropless)."""
    return [*MOE, f"--model.num_experts={experts}", f"--model.experts_per_token={top_k}",
            f"--model.num_shared_experts={shared}", f"--model.capacity_factor={capacity_factor}"]


GPT2 = ["--model.preset=debug-gpt2", "--model.ffn_dim=512", *_SHAPE]
"""LayerNorm, biases, GELU, tied output."""
TINY = ["--model.preset=tiny", "--training.seq_len=32", "--optimizer.fused=false"]
"""4 wider blocks (dim 256) on short sequences, foreach Adam/AdamW: the optimizer step (its foreach
temporaries) holds the peak (fused AdamW, the default elsewhere, has none)."""


@dataclass(frozen=True)
class Row:
    name: str
    world: int
    """Processes (gloo ranks), hardware.num_gpus."""
    overrides: tuple[str, ...]


def _row(name: str, world: int, shape: list[str], *extra: str, micro: int = 4, accum: int = 1) -> Row:
    """`shape` on `world` ranks, micro-batches of `micro` sequences, `accum` of them per step (on
    data-parallel ranks only: tp and cp ranks share theirs)."""
    global_batch = micro * accum * world if accum > 1 else 0  # 0: derived, micro x data-parallel ranks
    batch = (f"--training.micro_batch_size={micro}", f"--training.global_batch_size={global_batch}",
             f"--hardware.num_gpus={world}")
    return Row(name if world == 1 else f"x{world}-{name}", world, (*shape, *batch, *extra))


BF16_MIXED, FP16_MIXED, BF16_PURE = ("--precision.mode=bf16-mixed", "--precision.mode=fp16-mixed",
                                     "--precision.mode=bf16-pure")
SELECTIVE, FULL = "--memory.activation_checkpointing=selective", "--memory.activation_checkpointing=full"
ALTERNATE = "--memory.activation_checkpointing=selective-alternate"
SGD, ADAM = "--optimizer.name=sgd", "--optimizer.name=adam"
Z0, Z1, Z2, Z3 = (f"--parallel.zero_stage={stage}" for stage in range(4))

TP2, TP4, CP2, CP4 = "--parallel.tp=2", "--parallel.tp=4", "--parallel.cp=2", "--parallel.cp=4"
SP = "--parallel.sequence_parallel=true"

MODEL_PARALLEL_GRID: list[Row] = [
    # two ranks: tensor parallelism with and without sequence parallelism, context parallelism
    _row("llama-tp2-fp32", 2, LLAMA, TP2),
    _row("llama-tp2-sp-fp32", 2, LLAMA, TP2, SP),
    _row("llama-tp2-sp-bf16-mixed", 2, LLAMA, TP2, SP, BF16_MIXED),
    _row("llama-tp2-bf16-pure-full", 2, LLAMA, TP2, BF16_PURE, FULL, micro=16),
    _row("llama-tp2-sp-selective", 2, LLAMA, TP2, SP, SELECTIVE),
    _row("llama-tp2-sp-bf16-mixed-full", 2, LLAMA, TP2, SP, BF16_MIXED, FULL, micro=16),
    _row("tied-tp2-sp-bf16-pure-sgd", 2, TIED, TP2, SP, BF16_PURE, SGD),
    _row("gpt2-tp2-sp-fp32", 2, GPT2, TP2, SP),
    _row("gpt2-tp2-bf16-mixed-selective", 2, GPT2, TP2, BF16_MIXED, SELECTIVE),
    _row("moe-tp2-sp-fp32", 2, MOE, TP2, SP),
    _row("moe-tp2-bf16-mixed-full", 2, MOE, TP2, BF16_MIXED, FULL),
    _row("llama-cp2-fp32", 2, LLAMA, CP2),
    _row("llama-cp2-z3-bf16-mixed", 2, LLAMA, CP2, Z3, BF16_MIXED),
    _row("llama-cp2-z1-fp16-mixed-selective", 2, LLAMA, CP2, Z1, FP16_MIXED, SELECTIVE),
    _row("llama-cp2-z2-full", 2, LLAMA, CP2, Z2, FULL),
    _row("gpt2-cp2-z3-fp32", 2, GPT2, CP2, Z3),
    _row("moe-cp2-z3-bf16-mixed", 2, MOE, CP2, Z3, BF16_MIXED),
    _row("llama-tp2-sp-bf16-mixed-alternate", 2, LLAMA, TP2, SP, BF16_MIXED, ALTERNATE),
    _row("gpt2-cp2-z2-alternate", 2, GPT2, CP2, Z2, ALTERNATE),
    # four ranks: tp4, tp2 x dp2 (FSDP), cp2 x tp2, cp2 x dp2, cp4
    _row("mha-tp4-sp-fp32", 4, MHA, TP4, SP),
    _row("llama-tp2-z3-fp32", 4, LLAMA, TP2, Z3),
    _row("llama-tp2-sp-z2-bf16-mixed", 4, LLAMA, TP2, SP, Z2, BF16_MIXED),
    _row("llama-tp2-sp-z3-bf16-mixed-full", 4, LLAMA, TP2, SP, Z3, BF16_MIXED, FULL, micro=16),
    _row("gpt2-tp2-z3-bf16-mixed-selective", 4, GPT2, TP2, Z3, BF16_MIXED, SELECTIVE),
    _row("moe-tp2-sp-z3-bf16-mixed", 4, MOE, TP2, SP, Z3, BF16_MIXED),
    _row("llama-cp2-tp2-sp-z3-fp32", 4, LLAMA, CP2, TP2, SP, Z3),
    _row("llama-cp2-z3-bf16-mixed-selective", 4, LLAMA, CP2, Z3, BF16_MIXED, SELECTIVE),
    _row("llama-cp2-z1-bf16-mixed", 4, LLAMA, CP2, Z1, BF16_MIXED),
    _row("llama-cp4-z3-fp32", 4, LLAMA, CP4, Z3),
    _row("moe-cp2-tp2-z3-bf16-mixed-alternate", 4, MOE, CP2, TP2, Z3, BF16_MIXED, ALTERNATE, micro=16),
]
"""Tensor, sequence and context parallel configurations, part of GRID."""

MOE_GRID: list[Row] = [
    # dropless (estimated at the default memory.moe_imbalance): top-1 with full checkpointing in 16
    # bits is where balanced-routing estimates fell short; every policy and precision, 4-16 experts
    _row("moe-top1-e4-bf16-mixed-full", 1, moe(4, 1), BF16_MIXED, FULL),
    _row("moe-top1-e8-fp16-mixed-full", 1, moe(8, 1), FP16_MIXED, FULL),
    _row("moe-top1-e8-fp32", 1, moe(8, 1)),
    _row("moe-top1-e16-fp32-full", 1, moe(16, 1), FULL),
    _row("moe-top2-e4-shared-fp32-selective", 1, moe(4, 2, 1), SELECTIVE),
    _row("moe-top2-e8-bf16-mixed-selective", 1, moe(8, 2), BF16_MIXED, SELECTIVE),
    _row("moe-top2-e4-shared-fp32-alternate", 1, moe(4, 2, 1), ALTERNATE),
    _row("moe-top1-e5-shared-bf16-mixed-alternate", 1, moe(5, 1, 1), BF16_MIXED, ALTERNATE),
    _row("moe-top2-e16-shared-fp16-mixed", 1, moe(16, 2, 1), FP16_MIXED),
    # capacity factor: fixed [experts, capacity] buffers, estimated exactly (0.5 drops half the pairs)
    _row("moe-cf1.25-top1-e8-bf16-mixed-full", 1, moe(8, 1, 0, 1.25), BF16_MIXED, FULL),
    _row("moe-cf1-top2-e4-shared-fp32", 1, moe(4, 2, 1, 1.0)),
    _row("moe-cf1.25-top2-e4-shared-bf16-mixed-alternate", 1, moe(4, 2, 1, 1.25), BF16_MIXED, ALTERNATE),
    _row("moe-cf1.5-top2-e16-fp16-mixed-selective", 1, moe(16, 2, 0, 1.5), FP16_MIXED, SELECTIVE),
    _row("moe-cf0.5-top1-e4-fp32", 1, moe(4, 1, 0, 0.5)),
    # two ranks: FSDP2 (bf16 compute copies) and ZeRO-1
    _row("moe-top1-e8-z3-bf16-mixed-full", 2, moe(8, 1), Z3, BF16_MIXED, FULL),
    _row("moe-cf1.25-top2-e4-shared-z1-fp32-selective", 2, moe(4, 2, 1, 1.25), Z1, SELECTIVE),
]
"""MoE configurations, part of GRID (their peaks held to MOE_*_BOUNDS)."""

EP2 = "--parallel.ep=2"
ROUTED_AS_MEASURED = "--memory.moe_imbalance=1.3"
"""Dropless expert parallelism: the busiest rank receives rows by the routing of the step (memory/
traced.py); these rows estimate it at the imbalance their router reached there (rank 0 of
moe-ep2-z3-fp32-routed kept 1.29x its balanced expert rows, from its activations over the balanced
ones), so that what is checked is the model of the step, not the routing's ceiling (the default,
inf: +16% on that row)."""

EXPERT_PARALLEL_GRID: list[Row] = [
    # capacity factor: every rank's buffers are fixed, estimated exactly
    _row("moe-cf1-ep2-z3-fp32", 2, moe(4, 2, 1, 1.0), EP2, Z3),
    _row("moe-cf1.25-ep2-z2-bf16-mixed-full", 2, moe(4, 2, 1, 1.25), EP2, Z2, BF16_MIXED, FULL),
    _row("moe-cf1-e8-ep2-z3-bf16-mixed-selective", 2, moe(8, 2, 1, 1.0), EP2, Z3, BF16_MIXED, SELECTIVE),
    _row("moe-cf1-ep2-z3-fp32", 4, moe(4, 2, 1, 1.0), EP2, Z3),  # ep2 x edp2
    # dropless: the busiest rank's step (busiest_rank_traced)
    _row("moe-ep2-z3-fp32-routed", 2, MOE, EP2, Z3, ROUTED_AS_MEASURED),
    # micro-batches of 6: a 42 MiB peak, where gloo's all-to-all extras under load stay under 3%
    _row("moe-top2-e4-ep2-z3-selective-routed", 2, moe(4, 2, 0), EP2, Z3, SELECTIVE, ROUTED_AS_MEASURED, micro=6),
    _row("moe-top1-e8-shared-ep2-z2-alternate-routed", 2, moe(8, 1, 1), EP2, Z2, ALTERNATE, ROUTED_AS_MEASURED),
    # four expert ranks of two experts each: the busiest receives more (its measured step: 1.5x)
    _row("moe-e8-ep4-z3-bf16-mixed-routed", 4, moe(8, 2, 1), "--parallel.ep=4", Z3, BF16_MIXED,
         "--memory.moe_imbalance=1.5"),
]
"""Expert-parallel configurations (parallel/expert.py), part of GRID (MoE bounds)."""

PP2 = ("--parallel.pp=2", "--model.num_layers=4")
"""Two pipeline ranks of two Llama blocks each (default split: stage_split.balanced_split)."""
SCHEDULE = {name: f"--parallel.pp_schedule={name}" for name in (
    "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")}


def _pp_row(name: str, world: int, shape: list[str], *extra: str, micro: int, m: int, dp: int = 1) -> Row:
    """A pipeline row: `m` micro-batches of `micro` sequences per step on each of `dp` data-parallel
    ranks (the pipeline's micro-batches: Layout.num_microbatches)."""
    return _row(name, world, shape, *extra, f"--training.global_batch_size={micro * m * dp}", micro=micro)


PIPELINE_GRID: list[Row] = [
    # two ranks, m = 4 micro-batches of 2 (8 rows per step): every schedule
    *(_pp_row(f"llama-pp2-{name}", 2, LLAMA, *PP2, flag, micro=2, m=4) for name, flag in SCHEDULE.items()),
    # precision, checkpointing, micro-batch count, uneven stages, other models
    _pp_row("llama-pp2-1f1b-bf16-mixed", 2, LLAMA, *PP2, BF16_MIXED, micro=2, m=4),
    _pp_row("llama-pp2-1f1b-full", 2, LLAMA, *PP2, FULL, micro=2, m=4),
    _pp_row("llama-pp2-interleaved-1f1b-bf16-pure-selective", 2, LLAMA, *PP2, SCHEDULE["interleaved-1f1b"], BF16_PURE,
            SELECTIVE, micro=4, m=4),
    _pp_row("llama-pp2-gpipe-m8-fp16-mixed", 2, LLAMA, *PP2, SCHEDULE["gpipe"], FP16_MIXED, micro=1, m=8),
    _pp_row("llama-pp2-1f1b-3-1", 2, LLAMA, *PP2, "--parallel.pp_layers_per_stage=3,1", micro=2, m=4),
    _pp_row("gpt2-pp2-zbv", 2, GPT2, *PP2, "--model.tie_embeddings=false", SCHEDULE["zbv-zero-bubble"], micro=2,
            m=4),
    _pp_row("moe-pp2-1f1b-cf1", 2, moe(4, 2, 1, 1.0), *PP2, micro=2, m=4),
    # four ranks: pp4 uneven, pp2 x FSDP, pp2 x tp2, pp2 x ep2
    _pp_row("llama-pp4-1f1b-1-2-2-1", 4, LLAMA, "--parallel.pp=4", "--model.num_layers=6",
            "--parallel.pp_layers_per_stage=1,2,2,1", micro=1, m=4),
    _pp_row("llama-pp2-z3-bf16-mixed", 4, LLAMA, *PP2, Z3, BF16_MIXED, micro=2, m=2, dp=2),
    _pp_row("llama-pp2-z2-zbv", 4, LLAMA, *PP2, Z2, SCHEDULE["zbv-zero-bubble"], micro=1, m=4, dp=2),
    _pp_row("llama-pp2-tp2-sp", 4, LLAMA, *PP2, TP2, SP, micro=8, m=4),  # 20 MiB or more (the tp rows' rule)
    _pp_row("moe-pp2-ep2-z3-cf1", 4, moe(4, 2, 1, 1.0), *PP2, EP2, Z3, micro=2, m=2, dp=2),
]
"""Pipeline-parallel configurations (parallel/pipeline.py), part of GRID: each pipeline stage's
traced and analytic estimates against its first rank's measured step."""

CHUNKED = ("--memory.chunked_loss=true", "--memory.loss_chunk_tokens=256")
"""memory.chunked_loss in chunks of 256 tokens: a quarter of the grid's 1,024-token micro-batches."""
WIDE_VOCABULARY = [*LLAMA, "--model.vocab_size=4096"]
"""The Llama shape with 8x the vocabulary: logits near the size of the blocks' activations."""

CHUNKED_LOSS_GRID: list[Row] = [
    _row("llama-v4096-chunked-fp32", 1, WIDE_VOCABULARY, *CHUNKED),
    _row("llama-v4096-chunked-bf16-mixed-full", 1, WIDE_VOCABULARY, *CHUNKED, BF16_MIXED, FULL),
    _row("tied-chunked-bf16-pure-selective", 1, TIED, *CHUNKED, BF16_PURE, SELECTIVE),
    _row("gpt2-chunked-fp16-mixed", 1, GPT2, *CHUNKED, FP16_MIXED),
    _row("llama-v4096-chunked-z3-bf16-mixed", 2, WIDE_VOCABULARY, *CHUNKED, Z3, BF16_MIXED),
    _row("llama-v4096-chunked-tp2-sp", 2, WIDE_VOCABULARY, *CHUNKED, TP2, SP),
    _pp_row("llama-v4096-chunked-pp2-1f1b", 2, WIDE_VOCABULARY, *CHUNKED, *PP2, micro=2, m=4),
]
"""The chunked loss (train/loss.py) on every layout it composes with, part of GRID."""

FP8 = "--precision.mode=fp8-mixed"
ROWWISE, FP8_ALL_GATHER = "--precision.fp8_scaling=rowwise", "--precision.fp8_all_gather=true"
WIDE_MLP = ["--model.preset=debug", "--model.dim=16", "--model.num_heads=2", "--model.num_kv_heads=2",
            "--model.ffn_dim=2048", "--model.vocab_size=512", "--model.max_seq_len=192", "--training.seq_len=192"]
"""The fp8 rows' model: 2 narrow blocks (width 16, 2 heads of 8) with a 2048-wide SwiGLU, every
linear's dims multiples of 16, on 192-token sequences: the w2 backward, where float8's transient
casts are largest, holds the peak, and the fp8 terms (those casts, the bf16 weight copies autocast
no longer makes) are a large share of it. Narrow blocks move much memory for little GEMM work: a
CPU without fp8 hardware runs the fp8 matmuls orders of magnitude slower than bf16, and every test
stays within tests/_fp8_flops.BUDGET_FLOPS of them (this module's world-1 rows together: one test
of test_accuracy.py measures them all)."""

FP8_GRID: list[Row] = [
    # torchao float8 linears (every block linear; the output projection stays bf16), one sequence per rank
    _row("wide-mlp-fp8-tensorwise", 1, WIDE_MLP, FP8, micro=1),
    _row("wide-mlp-fp8-rowwise-selective", 1, WIDE_MLP, FP8, ROWWISE, SELECTIVE, micro=1),
    # full checkpointing keeps little but the blocks' inputs: the loss's log-probabilities over a wider
    # vocabulary make what the forward retains large enough to measure
    _row("wide-mlp-v2048-fp8-full", 1, WIDE_MLP, "--model.vocab_size=2048", FP8, FULL, micro=1),
    _row("wide-mlp-z3-fp8-all-gather", 2, WIDE_MLP, Z3, FP8, FP8_ALL_GATHER, micro=1),
]
"""fp8-mixed configurations (trainfit/float8.py), part of GRID."""

ADAFACTOR, ADAMW_8BIT = "--optimizer.name=adafactor", "--optimizer.name=adamw-8bit"
OPTIMIZER_GRID: list[Row] = [
    # TINY, where the optimizer step holds the peak: factored and 8-bit states, their step temporaries
    _row("tiny-adafactor-seq32-micro2", 1, TINY, ADAFACTOR, micro=2),
    # (seq 64 x 4: the backward holds the peak; at seq 32 x 2 it ties the step's within 1%, where the
    # analytic backward moment misses the first block's transients by 0.44 MiB and picks the step)
    _row("tiny-adamw-8bit-seq64-micro4", 1, TINY, ADAMW_8BIT, "--training.seq_len=64", micro=4),
    _row("tiny-z0-adafactor-bf16-mixed-seq32-micro2", 2, TINY, Z0, ADAFACTOR, BF16_MIXED, micro=2),
    _row("tiny-z1-adamw-8bit-seq32-micro2", 2, TINY, Z1, ADAMW_8BIT, micro=2),
]
"""Adafactor and adamw-8bit configurations (train/optim.py), part of GRID. Adafactor needs whole
parameters: data parallelism is DDP's (ZeRO-0). adamw-8bit under FSDP2 (ZeRO-2, bf16-mixed) is not
here yet: its measured backward peaks 2.5 MiB (10%) above the trace, not explained so far."""

MATH, FLASH = "--training.attention_backend=math", "--training.attention_backend=flash"

ATTENTION_GRID: list[Row] = [
    _row("llama-math-fp32", 1, LLAMA, MATH),
    _row("llama-math-bf16-mixed", 1, LLAMA, MATH, BF16_MIXED),
    _row("mha-math-alternate", 1, MHA, MATH, ALTERNATE),
    _row("gpt2-math-fp16-mixed", 1, GPT2, MATH, FP16_MIXED),
    _row("llama-math-tp2-sp-bf16-mixed", 2, LLAMA, MATH, TP2, SP, BF16_MIXED),
    _row("llama-flash-bf16-pure", 1, LLAMA, FLASH, BF16_PURE),
]
"""training.attention_backend: the math kernel (its fp32 probabilities, [heads, seq, seq] per sequence, saved
for backward) and the flash kernel named explicitly, part of GRID."""

LORA, DORA, QLORA = "--peft.method=lora", "--peft.method=dora", "--peft.method=qlora"
WIDE = [*LLAMA, "--model.dim=256", "--model.ffn_dim=512"]
"""2 blocks of dim 256: every linear a whole number of NF4's 64 x 256-weight blocks (QLoRA)."""
ALL_LINEAR, MLP_TARGETS = "--peft.targets=all-linear", "--peft.targets=mlp"

PEFT_GRID: list[Row] = [
    # adapters on a frozen base (peft/): methods, targets, ranks, precisions, checkpointing, FSDP2 and DDP
    _row("llama-lora-qv", 1, LLAMA, LORA),
    _row("llama-lora-all-linear", 1, LLAMA, LORA, ALL_LINEAR),
    _row("llama-lora-all-linear-r64", 1, LLAMA, LORA, ALL_LINEAR, "--peft.rank=64"),
    _row("llama-lora-mlp-bf16-mixed", 1, LLAMA, LORA, MLP_TARGETS, BF16_MIXED),
    _row("llama-lora-bf16-pure", 1, LLAMA, LORA, ALL_LINEAR, BF16_PURE),
    _row("llama-lora-dropout-attention", 1, LLAMA, LORA, "--peft.targets=attention", "--peft.dropout=0.1"),
    _row("llama-lora-full", 1, LLAMA, LORA, ALL_LINEAR, FULL),
    _row("llama-lora-selective", 1, LLAMA, LORA, SELECTIVE),
    _row("llama-lora-train-output", 1, LLAMA, LORA, "--peft.train_output=true"),
    _row("llama-dora-qv", 1, LLAMA, DORA),
    _row("llama-dora-all-linear-bf16-mixed", 1, LLAMA, DORA, ALL_LINEAR, BF16_MIXED),
    _row("mha-lora-accumulation", 1, MHA, LORA, ALL_LINEAR, micro=2, accum=2),
    _row("gpt2-lora-all-linear", 1, GPT2, LORA, ALL_LINEAR),
    _row("moe-lora-attention", 1, MOE, LORA, "--peft.targets=attention"),
    # adapters on every expert (routed: stacked per expert; shared) and the attention
    _row("moe-lora-all-linear-shared", 1, moe(4, 2, 1), LORA, ALL_LINEAR),
    _row("moe-lora-mlp-bf16-mixed", 1, MOE, LORA, MLP_TARGETS, BF16_MIXED),
    _row("moe-lora-cf1.25-dropout", 1, moe(4, 2, 1, 1.25), LORA, ALL_LINEAR, "--peft.dropout=0.1"),
    _row("moe-lora-top1-e8-selective", 1, moe(8, 1), LORA, ALL_LINEAR, SELECTIVE),
    _row("moe-lora-z3-bf16-mixed", 2, MOE, LORA, ALL_LINEAR, Z3, BF16_MIXED),
    _row("moe-lora-cf1-ep2-z3", 2, moe(4, 2, 1, 1.0), LORA, ALL_LINEAR, EP2, Z3),
    _row("llama-lora-z3-bf16-mixed", 2, LLAMA, LORA, ALL_LINEAR, Z3, BF16_MIXED),
    _row("llama-lora-z0-fp32", 2, LLAMA, LORA, ALL_LINEAR, Z0),
    _row("llama-dora-z2", 2, LLAMA, DORA, Z2),
    # QLoRA: the base's block linears in NF4 (peft/nf4.py), on blocks wide enough to hold whole NF4 blocks
    _row("wide-qlora-qv-bf16-pure", 1, WIDE, QLORA, BF16_PURE),
    _row("wide-qlora-all-linear-bf16-mixed", 1, WIDE, QLORA, ALL_LINEAR, BF16_MIXED),
    _row("wide-qlora-all-linear-bf16-mixed-seq64", 1, WIDE, QLORA, ALL_LINEAR, BF16_MIXED, "--training.seq_len=64"),
    _row("wide-qlora-qv-bf16-pure-seq128-full", 1, WIDE, QLORA, BF16_PURE, FULL, "--training.seq_len=128"),
    _row("wide-qlora-z0-seq128-full", 2, WIDE, QLORA, Z0, BF16_MIXED, FULL, "--training.seq_len=128"),
    _row("wide-qlora-fp32-full", 1, WIDE, QLORA, ALL_LINEAR, FULL),
    _row("wide-qlora-z3-bf16-pure", 2, WIDE, QLORA, ALL_LINEAR, Z3, BF16_PURE),
    _row("wide-qlora-z2-bf16-mixed", 2, WIDE, QLORA, Z2, BF16_MIXED),
    _row("wide-qlora-z0-bf16-pure", 2, WIDE, QLORA, ALL_LINEAR, Z0, BF16_PURE),
]
"""PEFT configurations (LoRA, DoRA, QLoRA; LoRA on an MoE's routed and shared experts), part of GRID. Not
here yet, each with its peak within 7% but
a component off: FSDP2 with full checkpointing under PEFT (the analytic buffers read 1.06 MiB below the
traced and measured ones at the backward peak); QLoRA under selective checkpointing (+3%: 0.5 MiB more
activations at the MLP's backward, the size of w1's and w3's outputs); ZeRO-2 in fp32 under LoRA or
QLoRA (-7% and +5%: the forward's buffers and gathered parameters); QLoRA accumulating gradients (its
peak within 0.1%, but the allocator holds 3-6% above the tensors' peak, the meter's bound). None
explained so far."""

QK_NORM = ("--model.qk_norm=head", "--model.head_dim=48")
"""Qwen3's attention: RMSNorm over each head of q and k, and 4 heads of 48 (wider than dim 128)."""
QWEN3 = [*LLAMA, *QK_NORM]
WINDOW = "--model.sliding_window=64"
POST_NORM = "--model.norm_placement=post"
OLMO2 = [*LLAMA, POST_NORM, "--model.qk_norm=whole"]
QWEN3_MOE = [*moe(4, 2, 0, 1.0), *QK_NORM]
"""Qwen3-MoE's block: QK-norm, 4 routed experts (top 2, no shared one), capacity factor 1."""
MIXED_MOE = [*QWEN3_MOE, "--model.num_layers=4", "--model.moe_dense_layers=1", "--model.moe_layer_step=2"]
"""Qwen3-MoE's block among dense ones: the first layer dense, then every second routed (dense, MoE,
dense, MoE; mlp_only_layers [0], decoder_sparse_step 2)."""
GEMMA3 = [*LLAMA, "--model.num_layers=3", "--model.norm_placement=sandwich", "--model.norm_offset=true",
          "--model.mlp_activation=gelu_tanh", "--model.embedding_scale=true", *QK_NORM,
          "--model.query_pre_attn_scalar=32", WINDOW, "--model.sliding_window_pattern=3",
          "--model.rope_local_theta=1000"]
"""Gemma 3's block: four (1 + w) norms, GeGLU, QK-norm, scaled embeddings and queries; two layers with a
window of 64 (their own RoPE base) to one global."""
GEMMA2 = [*LLAMA, "--model.num_layers=3", "--model.norm_placement=sandwich", "--model.norm_offset=true",
          "--model.mlp_activation=gelu_tanh", "--model.embedding_scale=true", "--model.query_pre_attn_scalar=32",
          WINDOW, "--model.sliding_window_pattern=2", "--model.attention_softcap=50", "--model.final_softcap=30"]
"""Gemma 2's block: Gemma 3's without QK-norm, windowed and global layers alternating, soft-capped scores
(an eager attention) and logits."""
GPT_OSS = [*moe(4, 2), "--model.norm_fp32_gain=true", "--model.attention_sinks=true", "--model.qkv_bias=true",
           "--model.attention_out_bias=true", "--model.router_bias=true", "--model.expert_bias=true",
           "--model.swiglu_limit=7", WINDOW, "--model.sliding_window_pattern=2"]
"""gpt-oss's block: RMSNorm's gain in fp32, attention sinks (an eager attention on every device), biases on q, k,
v, o, the router and the experts, the clamped SwiGLU, windowed and global layers alternating."""
ARCHITECTURE_GRID: list[Row] = [
    _row("qwen3-fp32", 1, QWEN3),
    _row("qwen3-bf16-mixed", 1, QWEN3, BF16_MIXED),
    _row("qwen3-bf16-pure-selective", 1, QWEN3, BF16_PURE, SELECTIVE),
    _row("qwen3-bf16-mixed-alternate", 1, QWEN3, BF16_MIXED, ALTERNATE),
    _row("qwen3-bf16-mixed-full", 1, QWEN3, BF16_MIXED, FULL),
    _row("qwen3-fp32-selective", 1, QWEN3, SELECTIVE),
    _row("qwen3-lora-all-linear-bf16-mixed", 1, QWEN3, LORA, ALL_LINEAR, BF16_MIXED),
    _row("qwen3-moe-fp32", 1, QWEN3_MOE),
    # OLMoE's block: QK-norm over all heads, the top-k routing weights not renormalised (dropless)
    _row("olmoe-fp32", 1, [*moe(4, 2), "--model.qk_norm=whole", "--model.router_normalize_topk=false"]),
    _row("mixed-moe-fp32", 1, MIXED_MOE),
    _row("mixed-moe-bf16-pure-selective", 1, MIXED_MOE, BF16_PURE, SELECTIVE),
    _row("mixed-moe-bf16-mixed-full", 1, MIXED_MOE, BF16_MIXED, FULL),
    _row("mixed-moe-z3-bf16-mixed", 2, MIXED_MOE, Z3, BF16_MIXED),
    _row("mixed-moe-ep2-z3-fp32", 2, MIXED_MOE, EP2, Z3),
    _row("mixed-moe-tp2-sp-fp32", 2, MIXED_MOE, TP2, SP, micro=8),
    _row("mixed-moe-pp2-fp32", 2, MIXED_MOE, "--parallel.pp=2", micro=2),
    _row("qwen3-z3-bf16-mixed", 2, QWEN3, Z3, BF16_MIXED),
    _row("qwen3-tp2-sp-fp32", 2, QWEN3, TP2, SP, micro=8),
    # a sliding window of 64 of the 256 positions: SDPA with the window's mask
    _row("window-fp32", 1, LLAMA, WINDOW),
    _row("window-bf16-mixed-selective", 1, LLAMA, WINDOW, BF16_MIXED, SELECTIVE),
    _row("window-bf16-pure-full", 1, QWEN3, WINDOW, BF16_PURE, FULL),
    _row("window-math-bf16-mixed", 1, LLAMA, WINDOW, MATH, BF16_MIXED),
    _row("window-z2-fp32", 2, LLAMA, WINDOW, Z2),
    # OLMo 2's block: a norm after each branch, QK-norm over all heads
    _row("olmo2-fp32", 1, OLMO2),
    _row("olmo2-bf16-mixed", 1, OLMO2, BF16_MIXED),
    _row("olmo2-bf16-pure-full", 1, OLMO2, BF16_PURE, FULL),
    _row("olmo2-lora-all-linear-bf16-mixed", 1, OLMO2, LORA, ALL_LINEAR, BF16_MIXED),
    _row("olmo2-z3-bf16-mixed", 2, OLMO2, Z3, BF16_MIXED),
    _row("post-norm-tp2-sp-fp32", 2, QWEN3, POST_NORM, TP2, SP, micro=8),
    _row("gpt-oss-fp32", 1, GPT_OSS),
    _row("gpt-oss-bf16-mixed", 1, GPT_OSS, BF16_MIXED),
    _row("gpt-oss-bf16-mixed-full", 1, GPT_OSS, BF16_MIXED, FULL),
    _row("gpt-oss-bf16-pure", 1, GPT_OSS, BF16_PURE),
    _row("gpt-oss-fp32-selective", 1, GPT_OSS, SELECTIVE),
    _row("gpt-oss-lora-all-linear-bf16-mixed", 1, GPT_OSS, LORA, ALL_LINEAR, BF16_MIXED),
    _row("gpt-oss-z3-bf16-mixed", 2, GPT_OSS, Z3, BF16_MIXED),
    # capacity buffers under expert parallelism (fixed; dropless, each rank's rows are the step's routing)
    _row("gpt-oss-cf1-ep2-z3-fp32", 2, GPT_OSS, "--model.capacity_factor=1.0", EP2, Z3),
    # Gemma 3's and Gemma 2's blocks (the selective policies' rows: the window and QK-norm rows' above)
    *(row for name, shape in (("gemma3", GEMMA3), ("gemma2", GEMMA2)) for row in (
        _row(f"{name}-fp32", 1, shape),
        _row(f"{name}-bf16-mixed", 1, shape, BF16_MIXED),
        _row(f"{name}-bf16-pure", 1, shape, BF16_PURE),
        _row(f"{name}-bf16-mixed-full", 1, shape, BF16_MIXED, FULL),
        _row(f"{name}-lora-all-linear-bf16-mixed", 1, shape, LORA, ALL_LINEAR, BF16_MIXED),
        _row(f"{name}-z3-bf16-mixed", 2, shape, Z3, BF16_MIXED),
        _row(f"{name}-tp2-sp-fp32", 2, shape, TP2, SP, micro=8))),
]
"""The architecture description's features (models/architecture.py) beyond Llama's: QK-norm, a head
width other than dim / heads, a sliding window, norms after the branches; part of GRID. Not here yet:
post-norm blocks under the selective policies, their peak within 6% but the backward's buffers 0.5-1.5
MiB (12-37% of that component) off: the recompute's released tensors are modelled on a pre-norm
block's; Gemma 2's soft-capped (eager) attention under selective checkpointing in bf16-mixed, its peak
2.2% low and the backward's buffers 2.4 MiB (14%) low: the recompute's largest moment is inside the
soft-capped softmax (its fp32 copy of the masked scores, its fp32 output, the capped and the masked scores
in bf16, each [heads, queries, keys]), where the estimate takes the recompute's end."""

CHAT_RECORDS = Path(__file__).resolve().parents[1] / "data" / "chat" / "uneven.jsonl"


def prepared_chat_data() -> Path:
    """CHAT_RECORDS prepared (`trainfit prepare-data`: what the estimates read the samples' lengths from), once
    per version of the file, shared by processes (a concurrent preparation's folder is kept)."""
    digest = hashlib.sha256(CHAT_RECORDS.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"trainfit-test-chat-{digest}"
    if not (out / "manifest.json").is_file():
        prepare_data(str(CHAT_RECORDS), str(out), chat_template="chatml", replace=False)
    return out


CHAT_DATA = (f"--data.path={prepared_chat_data()}",)
"""96 conversations of uneven length (their samples 70 to 330 byte tokens through ChatML: one to three a row of
256, some cut), trained on the answers only, prepared."""
PADDED = "--data.packing=false"
PACKED_GRID: list[Row] = [
    _row("packed-llama-fp32", 1, LLAMA, *CHAT_DATA),
    _row("packed-llama-bf16-mixed", 1, LLAMA, *CHAT_DATA, BF16_MIXED),
    _row("packed-llama-selective", 1, LLAMA, *CHAT_DATA, SELECTIVE),
    _row("packed-llama-bf16-mixed-full", 1, LLAMA, *CHAT_DATA, BF16_MIXED, FULL),
    _row("padded-llama-fp32", 1, LLAMA, *CHAT_DATA, PADDED),
    _row("padded-llama-bf16-mixed-selective", 1, LLAMA, *CHAT_DATA, PADDED, BF16_MIXED, SELECTIVE),
    _row("packed-qwen3-bf16-mixed", 1, QWEN3, *CHAT_DATA, BF16_MIXED),
    _row("packed-gemma3-bf16-mixed", 1, GEMMA3, *CHAT_DATA, BF16_MIXED),
    _row("packed-gpt2-fp16-mixed", 1, GPT2, *CHAT_DATA, FP16_MIXED),
    _row("packed-llama-lora-bf16-mixed", 1, LLAMA, *CHAT_DATA, LORA, BF16_MIXED),
    _row("packed-llama-v4096-chunked-bf16-mixed", 1, WIDE_VOCABULARY, *CHAT_DATA, *CHUNKED, BF16_MIXED),
    _row("packed-llama-z3-bf16-mixed", 2, LLAMA, *CHAT_DATA, Z3, BF16_MIXED),
    _row("packed-llama-tp2-sp-fp32", 2, LLAMA, *CHAT_DATA, TP2, SP, micro=8),
    _row("padded-llama-z1-fp32", 2, LLAMA, *CHAT_DATA, PADDED, Z1),
]
"""Fine-tuning samples (data.packing, train/packing.py): packed rows' document masks (one per window, [B, 1,
T, T] on the CPU), their RoPE rows of every token's own position, and padded rows of one sample, each trained
on the answers only; part of GRID. Not here yet: Gemma 2's soft-capped (eager, on the CPU) attention over
packed rows, its peak within 0.1% but in the last block's forward (the scores [heads, queries, keys] beside
the masks, which that attention keeps nothing of), a moment the estimate does not model."""

GRID: list[Row] = [
    # one process: precision x optimizer x checkpointing x batch shape x model
    _row("llama-fp32", 1, LLAMA),
    _row("llama-bf16-mixed", 1, LLAMA, BF16_MIXED),
    _row("llama-fp16-mixed", 1, LLAMA, FP16_MIXED),
    _row("llama-bf16-pure", 1, LLAMA, BF16_PURE),
    _row("llama-selective", 1, LLAMA, SELECTIVE),
    _row("llama-alternate", 1, LLAMA, ALTERNATE),
    _row("llama-bf16-mixed-alternate", 1, LLAMA, BF16_MIXED, ALTERNATE),
    _row("llama-full", 1, LLAMA, FULL),
    _row("llama-bf16-mixed-full", 1, LLAMA, BF16_MIXED, FULL),
    _row("llama-fp16-mixed-selective-sgd", 1, LLAMA, FP16_MIXED, SELECTIVE, SGD),
    _row("llama-adam", 1, LLAMA, ADAM),
    _row("llama-bf16-pure-full-sgd", 1, LLAMA, BF16_PURE, FULL, SGD),
    _row("llama-accumulation", 1, LLAMA, micro=2, accum=2),
    _row("llama-seq64-micro8", 1, LLAMA, "--training.seq_len=64", micro=8),
    _row("llama-3-layers-full-every-2", 1, LLAMA, "--model.num_layers=3", FULL, "--memory.ac_every_n_layers=2"),
    _row("mha-seq128-micro8", 1, MHA, "--training.seq_len=128", micro=8),
    _row("mha-bf16-mixed-adam-selective-every-2", 1, MHA, BF16_MIXED, ADAM, SELECTIVE,
         "--memory.ac_every_n_layers=2"),
    _row("tied-fp32", 1, TIED),
    _row("tied-bf16-mixed-selective-sgd", 1, TIED, BF16_MIXED, SELECTIVE, SGD),
    # a random configuration's peak (issue 44's): the embedding's backward, every gradient made, its own
    # gradient summed into the tied output projection's
    _row("tied-v5000-selective-micro1", 1, TIED_WIDE_VOCABULARY, SELECTIVE, micro=1),
    _row("tied-v5000-z0-selective-micro1", 2, TIED_WIDE_VOCABULARY, SELECTIVE, Z0, micro=1),
    _row("moe-fp32", 1, MOE),
    _row("moe-bf16-mixed", 1, MOE, BF16_MIXED),
    _row("moe-bf16-pure-selective", 1, MOE, BF16_PURE, SELECTIVE),
    _row("moe-full-sgd", 1, MOE, FULL, SGD),
    _row("gpt2-fp32", 1, GPT2),
    _row("gpt2-bf16-mixed-selective", 1, GPT2, BF16_MIXED, SELECTIVE),
    _row("gpt2-fp16-mixed-alternate", 1, GPT2, FP16_MIXED, ALTERNATE),
    _row("gpt2-fp16-mixed-full", 1, GPT2, FP16_MIXED, FULL),
    _row("tiny-seq32-micro2", 1, TINY, micro=2),
    _row("tiny-bf16-mixed-adam-seq32-micro2", 1, TINY, BF16_MIXED, ADAM, micro=2),
    # two ranks: DDP, ZeRO-1 (parallel/zero.py), ZeRO-2 and ZeRO-3 (FSDP2)
    _row("llama-z0-fp32", 2, LLAMA, Z0),
    _row("llama-z0-bf16-mixed-selective", 2, LLAMA, Z0, BF16_MIXED, SELECTIVE),
    _row("llama-z1-fp32", 2, LLAMA, Z1),
    _row("llama-z1-fp16-mixed-full", 2, LLAMA, Z1, FP16_MIXED, FULL),
    _row("llama-z2-fp32", 2, LLAMA, Z2),
    _row("llama-z2-bf16-mixed-selective", 2, LLAMA, Z2, BF16_MIXED, SELECTIVE),
    _row("llama-z2-accumulation", 2, LLAMA, Z2, micro=2, accum=2),
    _row("llama-z3-fp32", 2, LLAMA, Z3),
    _row("llama-z3-bf16-mixed-full", 2, LLAMA, Z3, BF16_MIXED, FULL),
    _row("llama-z3-bf16-pure-sgd", 2, LLAMA, Z3, BF16_PURE, SGD),
    _row("moe-z3-bf16-mixed", 2, MOE, Z3, BF16_MIXED),
    _row("tiny-z1-seq32-micro2", 2, TINY, Z1, micro=2),
    _row("llama-z1-bf16-mixed-fp32-grads-accumulation", 2, LLAMA, Z1, BF16_MIXED, "--optimizer.grad_accum_dtype=fp32",
         micro=2, accum=2),
    _row("llama-z1-bf16-pure-sgd", 2, LLAMA, Z1, BF16_PURE, SGD),
    # four ranks, and HSDP (2 replicas x 2 shards)
    _row("llama-z0-bf16-mixed", 4, LLAMA, Z0, BF16_MIXED),
    _row("llama-z1-fp32", 4, LLAMA, Z1),
    _row("mha-z1-adam-accumulation", 4, MHA, Z1, ADAM, micro=2, accum=2),
    _row("llama-z2-fp16-mixed", 4, LLAMA, Z2, FP16_MIXED),
    _row("llama-z3-fp32-selective", 4, LLAMA, Z3, SELECTIVE),
    _row("llama-z3-bf16-mixed-full", 4, LLAMA, Z3, BF16_MIXED, FULL),
    _row("llama-hsdp-2x2-bf16-mixed", 4, LLAMA, Z3, "--parallel.dp_replicate=2", BF16_MIXED),
    _row("llama-hsdp-2x2-z1-fp16-mixed", 4, LLAMA, Z1, "--parallel.dp_replicate=2", FP16_MIXED),
    _row("moe-z2-fp32", 4, MOE, Z2),
    _row("gpt2-z3-bf16-mixed", 4, GPT2, Z3, BF16_MIXED),
    _row("tiny-z1-bf16-mixed-seq32-micro2", 4, TINY, Z1, BF16_MIXED, micro=2),
    *OPTIMIZER_GRID,
    *MOE_GRID,
    *FP8_GRID,
    *MODEL_PARALLEL_GRID,
    *EXPERT_PARALLEL_GRID,
    *PIPELINE_GRID,
    *CHUNKED_LOSS_GRID,
    *ATTENTION_GRID,
    *PEFT_GRID,
    *ARCHITECTURE_GRID,
    *PACKED_GRID,
]


def is_moe(row: Row) -> bool:
    return any(o.startswith("--model.preset=debug-moe") for o in row.overrides)


def _option(row: Row, name: str) -> str | None:
    """The value the row gives `--name` (the last one), or None."""
    values = [o.split("=", 1)[1] for o in row.overrides if o.startswith(f"--{name}=")]
    return values[-1] if values else None


def dropless(row: Row) -> bool:
    """An MoE model without a capacity factor: its experts' row counts change every step."""
    return is_moe(row) and not float(_option(row, "model.capacity_factor") or 0)


def busiest_rank_traced(row: Row) -> bool:
    """Dropless expert parallelism: the trace is of the busiest rank of an expert group, which the
    others' steps stay under (they receive fewer rows)."""
    return dropless(row) and _option(row, "parallel.ep") is not None


def per_shape_library_cache(row: Row) -> bool:
    """A dropless MoE model in 16 (or 8) bits: new matmul shapes every step, for which oneDNN builds
    and caches a primitive (with weight reorders) mid-step, on CPUs where it runs those matmuls;
    the measured non_tensor then holds it, beyond what NON_TENSOR_TOLERANCE bounds."""
    return dropless(row) and (_option(row, "precision.mode") or "fp32") != "fp32"


def splits_backward(row: Row) -> bool:
    """A zero-bubble pipeline schedule (input and weight gradients apart)."""
    return any(SCHEDULE[name] in row.overrides for name, s in SCHEDULES.items() if s.split_backward)


def peak_bounds(row: Row) -> tuple[tuple[float, float], tuple[float, float]]:
    """(traced, analytic) bounds of the peak's relative error against the measured one."""
    if is_moe(row):
        return MOE_TRACED_BOUNDS, MOE_ANALYTIC_BOUNDS
    traced = (-TRACED_PEAK_TOLERANCE, TRACED_PEAK_TOLERANCE)
    return traced, SPLIT_BACKWARD_ANALYTIC_BOUNDS if splits_backward(row) else (-ANALYTIC_TOLERANCE, ANALYTIC_TOLERANCE)


def row_config(row: Row, tmp: Path) -> Config:
    """The row's run on CPU from scratch, writing only under `tmp` (its rows give their whole shape)."""
    return run_config(tmp / row.name, "--training.device=cpu", "--checkpoint.resume=never", *row.overrides, base=())


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny CPU steps gain nothing from a second intra-op thread, and on a shared 2-core machine
    its spin-waiting costs several times the work (memory figures do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- the three sources


@dataclass(frozen=True)
class RankFigures:
    """One rank's measured step."""

    breakdown: MemoryBreakdown
    forward_retained: int
    state_bytes: dict[str, int]

    @property
    def peak(self) -> int:
        return self.breakdown.peak


@dataclass(frozen=True)
class Measured:
    ranks: list[RankFigures]

    @property
    def breakdown(self) -> MemoryBreakdown:
        """Rank 0's components, peak and peak phase."""
        return self.ranks[0].breakdown


@dataclass(frozen=True)
class Analytic:
    per_stage: list[MemoryBreakdown]
    forward_retained: int
    """Pipeline rank 0's."""
    model_states: list[int]
    """Per pipeline stage."""

    @property
    def breakdown(self) -> MemoryBreakdown:
        """Pipeline rank 0's."""
        return self.per_stage[0]


def trace(row: Row, tmp: Path) -> list[MemoryBreakdown]:
    """The traced step of every pipeline rank (one without pipeline parallelism), each as the first
    rank of its stage (fake tensors, fake process group: call with no process group)."""
    return trace_step(row_config(row, tmp)).per_stage


def analytic(row: Row, tmp: Path) -> Analytic:
    cfg = row_config(row, tmp)
    stages = memory_of(cfg).per_stage
    return Analytic(stages, retained_of(cfg), [states_of(cfg, stage=s).model_states for s in range(len(stages))])


def _figures(m: Measurement) -> dict:
    return {"breakdown": m.breakdown.as_dict(), "forward_retained": m.forward_retained, "state_bytes": m.state_bytes}


def _measured(per_rank: list[dict]) -> Measured:
    return Measured([RankFigures(MemoryBreakdown(**r["breakdown"]), r["forward_retained"], r["state_bytes"])
                     for r in per_rank])


def _measure_each(rows: list[Row], tmp: Path, progress: bool) -> Iterator[tuple[Row, Measurement]]:
    """This process's measurements of `rows`, after one discarded measurement: the first step of a
    process allocates for good (imports, thread pools, library tables) and would count it."""
    with single_thread():
        measure_step(row_config(rows[0], tmp / "warm-up"))
        for i, row in enumerate(rows, 1):
            if progress:
                print(f"measuring {row.name} ({i}/{len(rows)} of the {row.world}-process rows)", file=sys.stderr,
                      flush=True)
            yield row, measure_step(row_config(row, tmp))


def join_world(rank: int, world: int, rendezvous: Path) -> None:
    """Join a `world`-rank gloo world (a started rank) through `rendezvous`, a file that must not exist
    yet, in a folder every rank sees. A file, not a TCP port picked in advance: another process
    (a concurrent test session) could take that port before rank 0 listens on it. Trainers adopt
    the initialized group."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _rank(rank: int, world: int, rows: list[Row], out: str, progress: bool) -> None:
    """One gloo rank: joins the world once, then every Trainer of `rows` runs in it; writes its
    figures of each row to OUT/ROW.rankN.json."""
    join_world(rank, world, Path(out, "rendezvous"))
    try:
        for row, m in _measure_each(rows, Path(out), progress and rank == 0):
            Path(out, f"{row.name}.rank{rank}.json").write_text(json.dumps(_figures(m)))
    finally:
        dist.destroy_process_group()


def _measure_ranks(rows: list[Row], world: int, tmp: Path, progress: bool) -> dict[str, Measured]:
    tmp.mkdir(parents=True, exist_ok=True)
    start_ranks(_rank, world, world, rows, str(tmp), progress)
    return {row.name: _measured([json.loads((tmp / f"{row.name}.rank{r}.json").read_text()) for r in range(world)])
            for row in rows}


def measure_rows(rows: list[Row], tmp: Path, *, progress: bool = False) -> dict[str, Measured]:
    """Measure `rows`, by name: one-process rows in this process, the others in one start of ranks per
    world size (`progress`: name each row on stderr as its measurement starts)."""
    out: dict[str, Measured] = {}
    for world in sorted({row.world for row in rows}):
        group = [row for row in rows if row.world == world]
        if world == 1:
            out |= {row.name: _measured([_figures(m)]) for row, m in _measure_each(group, tmp, progress)}
        else:
            out |= _measure_ranks(group, world, tmp / f"x{world}", progress)
    return out


def component_gaps(predicted: MemoryBreakdown, reference: MemoryBreakdown, floor_share: float = COMPONENT_FLOOR
                   ) -> dict[str, tuple[int, int]]:
    """Per component: (predicted - reference, the allowed absolute difference), in bytes."""
    floor = floor_share * reference.peak
    return {name: (getattr(predicted, name) - getattr(reference, name),
                   int(max(COMPONENT_TOLERANCE * getattr(reference, name), floor))) for name in COMPONENTS}


# ---------------------------------------------------------------- the checks


def _within(what: str, value: int, reference: int, bounds: tuple[float, float], against: str = "measured"
            ) -> str | None:
    """None, or why `value` / `reference` - 1 is outside `bounds` (in MiB, and the relative error)."""
    error = value / reference - 1
    low, high = bounds
    if low <= error <= high:
        return None
    allowed = f"{high:.0%}" if low == -high else f"{low:+.0%} to {high:+.0%}"
    return f"{what}: {value / MiB:.2f} MiB vs {against} {reference / MiB:.2f} MiB ({error:+.1%}, allowed {allowed})"


def _symmetric(tolerance: float) -> tuple[float, float]:
    return -tolerance, tolerance


def problems(row: Row, measured: Measured, traced: list[MemoryBreakdown], estimate: Analytic) -> list[str]:
    """Everything wrong with a row's estimates (see tests/estimator/test_accuracy.py), per pipeline
    stage: each stage's estimates against its ranks (pp is the mesh's outermost axis, so stage s
    holds ranks s * world / pp onwards)."""
    found: list[str | None] = []
    per_stage = row.world // len(traced)
    for stage, (stage_traced, stage_analytic, states) in enumerate(
            zip(traced, estimate.per_stage, estimate.model_states, strict=True)):
        ranks = measured.ranks[stage * per_stage:(stage + 1) * per_stage]
        label = f"stage {stage}: " if len(traced) > 1 else ""
        found += [f"{label}{p}" for p in _stage_problems(row, ranks, stage_traced, stage_analytic, states) if p]
    if len(traced) == 1:  # a pipeline's first forward is not followed by its own loss and backward
        # dropless expert parallelism: the estimate is the busiest rank's, as for the peak
        ranks = measured.ranks if busiest_rank_traced(row) else measured.ranks[:1]
        found.append(_within("analytic forward_retained_bytes", estimate.forward_retained,
                             max(r.forward_retained for r in ranks), _symmetric(ANALYTIC_TOLERANCE)))
    return [p for p in found if p]


def _stage_problems(row: Row, ranks: list[RankFigures], traced: MemoryBreakdown, estimate: MemoryBreakdown,
                    model_states: int) -> list[str | None]:
    traced_bounds, analytic_bounds = peak_bounds(row)
    flipped = (-traced_bounds[1], -traced_bounds[0])  # a rank's peak against the traced one
    floor_share = PIPELINE_COMPONENT_FLOOR if row in PIPELINE_GRID else COMPONENT_FLOOR
    first = ranks[0]
    if busiest_rank_traced(row):  # the estimates are the busiest rank's; no rank may exceed them
        first = max(ranks, key=lambda figures: figures.peak)
        flipped = (-1.0, flipped[1])
    return [
        _within("traced peak", traced.peak, first.peak, traced_bounds),
        *(_within(f"rank {rank}'s measured peak", figures.peak, traced.peak, flipped, "traced")
          for rank, figures in enumerate(ranks)),
        None if traced.peak_phase == first.breakdown.peak_phase else
        f"peak phase: traced {traced.peak_phase}, measured {first.breakdown.peak_phase}",
        _within("analytic peak", estimate.peak, first.peak, analytic_bounds),
        _within("analytic model_states", model_states, sum(first.state_bytes.values()),
                _symmetric(ANALYTIC_TOLERANCE)),
        *(None if per_shape_library_cache(row) or figures.breakdown.non_tensor <= NON_TENSOR_TOLERANCE * figures.peak
          else f"rank {rank}'s non_tensor: {figures.breakdown.non_tensor / MiB:.2f} MiB outside tensors at a "
               f"{figures.peak / MiB:.2f} MiB peak (allowed {NON_TENSOR_TOLERANCE:.0%}): a tensor the meter missed?"
          for rank, figures in enumerate(ranks)),
        # Split backward: the analytic estimate counts what the weight pass holds (sent tensors,
        # pending gradients) at their largest, in its own moments, while the traced peak may fall
        # on another micro-batch's pass; components then differ by up to 2 MiB (5% of the peak).
        *(f"analytic {name}: {(getattr(traced, name) + gap) / MiB:.2f} MiB vs traced "
          f"{getattr(traced, name) / MiB:.2f} MiB (off by {gap / MiB:+.2f} MiB, allowed {allowed / MiB:.2f})"
          for name, (gap, allowed) in component_gaps(estimate, traced, floor_share).items()
          if abs(gap) > allowed and not splits_backward(row)),
    ]
