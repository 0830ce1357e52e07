"""trainfit's analytic estimate against published tensor/sequence/context-parallel training runs.

Every configuration of published_parallel_sources.md (beside this script: cited measurements compiled from
public sources) that reports a per-GPU memory figure and/or a throughput figure is a row of CONFIGS, with its
citation in SOURCES. A row trainfit can express is built as a config (`build_config`) and estimated. A row it cannot
express, or whose unpublished details would decide the prediction, is listed with the reason instead of a
number; none is dropped. Nothing is tuned to the published numbers: each setting comes from the source, from
the framework's default config at the cited commit, or is an assumption that the row's notes name (NOTES).

Memory. torchtitan logs `max_reserved` (torch.cuda.memory_stats()["reserved_bytes.all.peak"], in
torchtitan/metrics.py at 9dec370): the caching allocator's pool, which holds the tensors alive at the peak
plus the allocator's slack. It excludes the CUDA context and NCCL's buffers, which live outside the pool.
trainfit's analytic `peak` is the bytes allocated at the step's peak, and its `reserved_margin` is
CUDA_CONTEXT_BYTES + ALLOCATOR_FRAGMENTATION x peak + NCCL's buffers (memory/closed_form/comm_buffers.py). So a
"reserved" figure is compared with peak x (1 + ALLOCATOR_FRAGMENTATION), and an "allocated" one with the
peak itself. Sources that do not say which statistic they report are not compared. Pipeline rows use the
worst stage, since the published figures are the maximum over pipeline ranks.

Throughput is compared in the source's own unit: tokens/s per GPU, iteration time, or model TFLOP/s and MFU.
For TFLOP/s and MFU, the source's FLOP convention is applied to trainfit's predicted tokens/s: Megatron-LM's
`num_floating_point_operations`, with non-causal attention, as Megatron-LM r0.8.0, MegaScale and NeMo 24.03
count. trainfit's step time is the sum of three parts (perf/timing.py): compute at hardware.compute_efficiency
(0.5) of the dense peak, communication it does not overlap, and the pipeline bubble.

    python benchmarks/published_parallel.py [--only SUBSTRING ...] [--check] [--record "REASON"]

The errors are recorded (published_record.py, published_record.json) and the suite holds every change
to them (tests/estimator/test_published_record.py); --check applies that gate here, --record re-records
a deliberate change with its reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfit.config import Config
from trainfit.configure import load_config
from trainfit.estimate import Estimate, estimate
from trainfit.hardware import device_spec
from trainfit.memory import ALLOCATOR_FRAGMENTATION
from trainfit.parallel.schedules import bubble_fraction
from trainfit.perf import flops as F
from trainfit.perf.engines import MEGATRON_CORE, TRAINFIT_ENGINE, Engine
from trainfit.perf.host_costs import NO_ENGINE_HOST

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_record as record  # noqa: E402 (beside this script)

GIB = 1024**3
GB = 1e9
GAP = 0.10
"""Rows with an error above this get their predicted breakdown printed."""


UNMEASURED = Engine("unmeasured", NO_ENGINE_HOST, source="trainfit's engine, its kernels' launches alone")
"""A source whose engine trainfit does not describe: priced as trainfit's engine, host side its launches."""


@dataclass(frozen=True)
class Source:
    short: str
    citation: str
    """Repository, file, table and commit, or paper and section, as published_parallel_sources.md gives them."""
    engine: Engine = UNMEASURED
    """Whose engine ran them (perf/engines.py): torchtitan's DTensor, FSDP2 and torch.distributed.pipelining
    are trainfit's own; Megatron-LM, NeMo and Megatron-Bridge run Megatron-Core (Transformer Engine's modules
    dispatch no per-op framework code); the rest priced as trainfit's engine without its host side."""


SOURCES: dict[str, Source] = {
    "tt-2412": Source("torchtitan bench 2024-12", "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
                      "(added in 820504e20d1149fbf0b98c567af24c4b0433b22d, 2025-06-13; same content in "
                      "docs/performance.md at d4c86e3758a84cf23e2e879ab3c995cba9d5e410); torch 1963fc8, torchao "
                      "eab345c, torchtitan 9dec370; H100 96GB HBM2e, 500 W, Grand Teton, 400 Gb/s RDMA per GPU",
                      engine=TRAINFIT_ENGINE),
    "tt-paper": Source("TorchTitan paper", "TorchTitan, arXiv 2410.06511 (ICLR 2025 text, arXiv version uncertain), "
                       "Sec. 3.2, Tables 3-6; read as a full-text conversion (code-index file id 66536731633); "
                       "H100 with 95 GiB", engine=TRAINFIT_ENGINE),
    "hf-ulysses": Source("HF Ulysses blog", "https://huggingface.co/blog/ulysses-sp, Benchmarks section (published "
                         "2026-03-09; code-index file id 69464313388); 4 x H100 80GB"),
    "alst": Source("ALST", "Arctic Long Sequence Training, arXiv 2506.13996 abstract and the Snowflake engineering "
                   "blog (tables not read)"),
    "llama3": Source("Llama 3 paper", "The Llama 3 Herd of Models, arXiv 2407.21783 (v3, 2024-11-23), Sec. 3.3.2, "
                     "Table 4 (code-index ids 70888892482, 39822971701, 34692787445, 70974299245); H100 80GB HBM3 "
                     "700 W, RoCE 400 Gbps"),
    "korthikanti": Source("Korthikanti 2022", "Reducing Activation Recomputation in Large Transformer Models, arXiv "
                          "2205.05198, Tables 3, 4, 5 and Sec. 6.1-6.3 (code-index id 69442322288); Selene DGX "
                          "A100 80GB, 8 x 200 Gb/s HDR InfiniBand per node", engine=MEGATRON_CORE),
    "megatron": Source("Megatron-LM README", "NVIDIA/Megatron-LM README.md and images/model_table.png (added in "
                       "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, unchanged at "
                       "d98e8a64ddf34856e74b24714e3bedb2f5a39553), weak-scaling table, Megatron-Core r0.8.0, H100",
                       engine=MEGATRON_CORE),
    "megascale": Source("MegaScale", "MegaScale, arXiv 2402.15627 / NSDI'24, Tables 1-3 and Figure 9 data labels "
                        "(code-index id 61225413316); NVIDIA Ampere GPUs, 8 x 200G NICs per server; baseline "
                        "Megatron-LM commit 285068c8", engine=MEGATRON_CORE),
    "tt-async": Source("torchtitan AsyncTP 2025-06", "pytorch/torchtitan "
                       "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (tables from "
                       "8b6770a14abddec23a7ea1b2dc61a2a532874a34; file added by PR #1299, "
                       "2887250bbd9103d0bc997ea2efb3a525b5e5dbc0); torch 38410cf9; H100 96GB HBM2e, 500 W",
                       engine=TRAINFIT_ENGINE),
    "tt-2408": Source("torchtitan docs 2024-08", "pytorch/torchtitan docs/performance.md at "
                      "4d88a8a44fe439f73f564b83d60b29a906ef3507 (PR #554, fixed by #556); 128 x H100 94GB "
                      "(HBM2e, lower-TDP SXM)", engine=TRAINFIT_ENGINE),
    "nemo-2407": Source("NeMo 24.07 perf", "NVIDIA/NeMo docs/source/performance/performance_summary.md at "
                        "070a0bb168d405d653b9734c0017cf5078e77c0d; DGX-H100, FP8", engine=MEGATRON_CORE),
    "nemo-2412": Source("NeMo 24.12 docs", "docs.nvidia.com NeMo user-guide/24.12 copy of the performance summary "
                        "(container version not visible); DGX-H100, FP8", engine=MEGATRON_CORE),
    "nemo-long": Source("NeMo long-seq perf", "NVIDIA/NeMo docs/source/performance/performance_long_sequence.md at "
                        "9421f21af3bc554cd5656caac4dff863b20e8c65 (H100 table also at "
                        "0aa267117ae5f1ff9f8d8308ed3d1ba1ce939f82); FP8", engine=MEGATRON_CORE),
    "bridge": Source("Megatron-Bridge perf", "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at "
                     "00b7660be0254ac6f95f44164ddd0c3e9cc798ed and docs/performance-summary-archive.md at "
                     "0a25f911b2ed6c6905a539504fdb8e5b40e3438b; recipe "
                     "scripts/performance/configs/llama/llama31_workload_base_configs.py",
                     engine=MEGATRON_CORE),
    "automodel": Source("NeMo AutoModel", "NVIDIA-NeMo/Automodel docs/performance-summary.md at "
                        "01926a5c443b7979463c73341bf64adf79de638e", engine=TRAINFIT_ENGINE),
    "mlm-1059": Source("Megatron-LM #1059", "NVIDIA/Megatron-LM issue #1059 (user report, A800, 32 x 8 GPUs)",
                       engine=MEGATRON_CORE),
    "trainy": Source("Trainy H200", "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
                     "(invocation: torchtitan/models/llama3/train_configs/llama3_8b.toml at torchtitan e7c0cae, "
                     "--training.local_batch_size=2, compile, float8 with FSDP float8 all-gather); 8 x H200 per host, "
                     "400 Gb/s per GPU", engine=TRAINFIT_ENGINE),
}

NOTES: dict[str, str] = {
    # assumptions and approximations of estimated rows
    "seq?": "seq 8192 from torchtitan's train_configs at the cited commit [inferred]",
    "compile": "torch.compile: training.compile, which the estimates price only where it changes fp8-mixed: "
               "its casts to fp8 fused (perf/fp8_casts.py's traffic, memory/closed_form/analytic.py's backward "
               "temporaries)",
    "fp8": "Float8 linears: trainfit's fp8-mixed (block linears at the fp8 peak plus torchao's casts to fp8; memory "
           "bf16-mixed's, less the float8 linears' bf16 weight copies, plus their backward's casts)",
    "async": "AsyncTP: parallel.async_tp (torch's micro-pipeline TP: each TP collective split over its GEMMs)",
    "tp-overlap": "Transformer Engine's TP communication overlap, priced as parallel.async_tp: NeMo's performance "
                  "recipes set tp_comm_overlap=True (NVIDIA/NeMo nemo/collections/llm/recipes/llama3_70b.py, "
                  "pretrain_recipe_performance) and Megatron-Bridge enables it by default [inferred for each row]",
    "sdpa-fa2": "attention as FlashAttention-2 (training.attention_backend=flash): torch's SDPA on an H100 picks "
                "FlashAttention-2 from 2.5.1 (cuDNN's kernel made opt-in, pytorch/pytorch#138522) until cuDNN "
                "above 9.15 ships with it (2.11); torchtitan's runs used 2024-2025 nightlies",
    "compile?": "compiled [inferred]: torchtitan's float8 module of the time says Float8 'is intended to be ran under "
                "torch.compile for competitive performance', and AsyncTP is an inductor pass",
    "tps?": "tokens/s per GPU [uncertain]",
    "405L": "126 layers modelled as 128 (pp x v must divide them): each rank holds the busiest rank's layers",
    "ttpp": "torchtitan under PP: microbatches = pp (its default); FSDP keeps parameters unsharded "
            "(reshard_after_forward=False) = ZeRO-2",
    "v2": "interleaved with 2 stages per rank (torchtitan's default for looped schedules at 9dec370)",
    "gbs?": "global batch = local batch x FSDP degree [inferred]",
    "op-sac": "torchtitan's op-level SAC ('selective', 'op'): trainfit's selective-alternate (its input, attention "
              "and every other matmul's output kept)",
    "loss": "e7c0cae compiles the loss with the model; trainfit counts the eager loss's fp32 logits copies",
    "fp8-ag": "FSDP Float8 all-gather: precision.fp8_all_gather, whose casts the time model prices but not its "
              "traffic (it times bf16 gathers)",
    "korth": "GPT, tied embeddings, learned positions, vocab 51200; fp16 or bf16 not stated (same A100 peak)",
    "present": "SP + trainfit's selective (saves matmul and attention outputs; Megatron recomputes the "
               "attention core)",
    "full-noSP": "full recompute without SP, as the paper's baseline",
    "1f1b?": "1F1B [inferred: m=3 virtual stages is stated for 175B and 530B only]",
    "no-overlap": "the paper's DP all-reduce is not overlapped; trainfit hides DDP's behind the backward",
    "megatron": "micro-batch 1, bf16, no recompute, distributed optimizer (ZeRO-1), SP with TP [assumed; not "
                "stated]; TP-comm, grad-reduce and param-gather overlap not modelled",
    "untied": "GPT with untied embeddings: 12h^2 L + 2Vh matches the model names [inferred]",
    "megascale": "Megatron-LM baseline: micro-batch 1, bf16, SP + selective recompute, ZeRO-1, A100 SXM 80GB, "
                 "tied embeddings [assumed; not stated]",
    "nemo": "distributed optimizer (ZeRO-1), SP with TP, no recompute [assumed; not stated]; PP and DP "
            "communication overlap not modelled (TP's: tp-overlap)",
    "te": "Transformer Engine's FP8 fuses its casts (amax, cast and transpose in one kernel): priced as fused casts "
          "(training.compile's price of torchao's casts, one read and one fp8 write per cast); its fp8 copy of a "
          "weight kept across a step's micro-batches (is_first_microbatch) is not modelled",
    "gpt3": "GPT-3 shapes, GPT-2 BPE vocab 50257 (NeMo-Framework-Launcher gpt3 configs; padding ignored)",
    "long": "micro-batch 1, 1F1B, no recompute [assumed]; NeMo 24.03.01's TFLOP/s taken as Megatron's non-causal "
            "formula [assumed]",
    "mb405": "126 layers modelled as 128 (Megatron splits them unevenly): 2 per virtual stage",
    # reasons a row is not estimated
    "pp?": "pipeline schedule, virtual stages and micro-batch size not published, and they set the bubble",
    "llama3-bubble": "with micro-batch 1 (32 micro-batches), v = 8..1 gives a bubble of "
                     f"{bubble_fraction('interleaved-1f1b', 16, 32, 8):.0%}-"
                     f"{bubble_fraction('interleaved-1f1b', 16, 32, 1):.0%}",
    "llama3-layers": "126 layers over 16 stages are uneven; the 131K stage's activation checkpointing not stated",
    "qwen3": "Qwen3-4B: head_dim 128 != dim/heads (2560/32) and QK-norm, while trainfit derives head_dim = "
             "dim/heads; Ulysses all-to-all SP is not trainfit's all-gather-KV cp",
    "alst": "fit/no-fit claim relying on activation-checkpoint offload to CPU and tiled MLP/loss, which trainfit "
            "does not model",
    "megascale-model": "MegaScale's modified model (parallel block, sliding-window attention, LAMB) is not "
                       "trainfit's",
    "nemotron": "squared-ReLU 2-matrix MLP with GQA (8 groups): trainfit's gpt2 family counts MHA parameters "
                "(models/params.py), its llama family a gated 3-matrix MLP",
    "blackwell": "B200/GB200/GB300 are not in trainfit's hardware catalog",
    "dup": "identical to the torchtitan benchmark's Tables 2 and 6: compared in those rows",
    "range": "a range over the 1D rows (without Float8), compared there as tokens/s",
    "layer": "per-layer forward/backward times of one layer; trainfit predicts whole steps",
    "no-cp-layout": "layouts not published ('the most performant ... configurations without CP')",
    "lora": "LoRA fine-tuning; trainfit estimates full training only",
    "anecdote": "no batch, sequence length or recompute given; A800 not in the catalog",
}


@dataclass(frozen=True)
class Published:
    """One published configuration and what it reports. Empty `overrides` means not estimated, with
    the reason in `notes`."""

    name: str
    source: str
    """Key of SOURCES."""
    table: str
    memory: float | None = None
    """Per-GPU memory as published, in `memory_unit`."""
    memory_unit: str = "GiB"
    memory_stat: str = ""
    """reserved (torch's caching-allocator pool, as torchtitan logs it) | allocated | "" (not stated)."""
    throughput: float | None = None
    metric: str = "tok/s/GPU"
    """tok/s/GPU | step s | MFU % (Megatron) | TFLOP/s (Megatron) | MFU % (paper): the source's unit (metric_value)."""
    overrides: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """Keys of NOTES: the assumptions of an estimated row, or why a row is not estimated."""


# ---------------------------------------------------------------- config builders


class Hardware(NamedTuple):
    """A catalog device, the network between nodes, and the device memory in GiB (0 = the catalog's)."""

    gpu: str
    link: str
    memory_gib: float = 0.0
    hbm_tbps: float = 0.0
    """The device's memory bandwidth where the hosts' parts differ from the catalog's (0 = the catalog's)."""
    compute_efficiency: float = 0.0
    """hardware.compute_efficiency: what the hosts' kernels reach of the catalog part's achievable rates
    (0 = all of them)."""


H100, A100, H200 = "H100-SXM-80GB", "A100-SXM-80GB", "H200-141GB"
GRAND_TETON_EFFICIENCY = 0.60
GRAND_TETON = Hardware(H100, "roce-400", 95.0, 2.4, GRAND_TETON_EFFICIENCY)
GRAND_TETON_EFFICIENCY_FLAG = "--hardware.compute_efficiency"
"""The override that carries it (on Grand Teton rows only: published_split.fit_grand_teton reads it)."""
"""Meta's H100 96GB HBM2e hosts: 95 GiB as the torchtitan paper states it, HBM2e at 2.4 TB/s as torchtitan's
benchmark states it, 400 Gb/s RDMA per GPU. Their compute is the one figure fitted to published runs:
the doc puts their peak between the H100 SXM's and NVL's and caps them at 500 W (the SXM's is 700 W),
and no achievable matmul rate is published for them, so their kernels run at GRAND_TETON_EFFICIENCY of
the H100 SXM's, the value that zeroes the median signed error of the 9 torchtitan rows of the fitting
half (published_split.json; the rule is published_split.fit_grand_teton). The held-out half's 28 rows
judge it (benchmarks/README.md)."""
DGX_H100 = Hardware(H100, "ib-ndr")
HGX_H200 = Hardware(H200, "ib-ndr")
SELENE = Hardware(A100, "ib-hdr")
MEGASCALE_A100 = Hardware(A100, "roce-200")


def llama(preset: str, seq: int, layers: int = 0) -> list[str]:
    """A Llama preset with a RoPE table `seq` long (torchtitan sets max_seq_len = seq_len); `layers`
    replaces 405B's 126 layers, which no pipeline of 8 or 16 stages divides evenly (NOTES "405L")."""
    depth = [f"--model.num_layers={layers}"] if layers else []
    return [f"--model.preset={preset}", f"--model.max_seq_len={seq}", *depth]


def gpt(dim: int, layers: int, heads: int, vocab: int, seq: int, tied: bool) -> list[str]:
    """A GPT-style model (LayerNorm, learned positions, 4h GELU MLP): trainfit's gpt2 family with explicit sizes."""
    return ["--model.preset=", "--model.family=gpt2", f"--model.dim={dim}", f"--model.num_layers={layers}",
            f"--model.num_heads={heads}", f"--model.ffn_dim={4 * dim}", f"--model.vocab_size={vocab}",
            f"--model.max_seq_len={seq}", f"--model.tie_embeddings={str(tied).lower()}"]


def run(model: list[str], hw: Hardware, *, gpus: int, seq: int, mbs: int, gbs: int, tp: int = 1, cp: int = 1,
        pp: int = 1, vpp: int = 1, zero: int = 3, precision: str = "bf16-mixed", ac: str = "full",
        sp: bool | None = None, compiled: bool = False, async_tp: bool = False, attention: str = "auto"
        ) -> tuple[str, ...]:
    """Overrides of one layout. Sequence parallelism follows tp unless `sp` says otherwise: torchtitan
    bundles them, and Megatron's TP-comm overlap needs SP. vpp > 1 is the interleaved 1F1B schedule.
    `compiled`: the source ran torch.compile (training.compile; NOTES "compile"). `async_tp`: its
    TP collectives overlapped their GEMMs (parallel.async_tp; NOTES "async", "tp-overlap").
    `attention`: the kernel its attention ran (training.attention_backend; NOTES "sdpa-fa2")."""
    out = [*model, f"--hardware.gpu={hw.gpu}", f"--hardware.num_gpus={gpus}", "--hardware.gpus_per_node=8",
           f"--hardware.inter_node_link={hw.link}", f"--training.seq_len={seq}", f"--training.micro_batch_size={mbs}",
           f"--training.global_batch_size={gbs}", f"--parallel.tp={tp}",
           f"--parallel.sequence_parallel={str(tp > 1 if sp is None else sp).lower()}", f"--parallel.cp={cp}",
           f"--parallel.pp={pp}", f"--parallel.pp_virtual_stages={vpp}",
           f"--parallel.pp_schedule={'interleaved-1f1b' if vpp > 1 else '1f1b'}", f"--parallel.zero_stage={zero}",
           f"--precision.mode={precision}", f"--memory.activation_checkpointing={ac}",
           f"--training.compile={str(compiled).lower()}", f"--training.attention_backend={attention}",
           *(["--parallel.async_tp=true"] if async_tp and tp > 1 else [])]
    memory = [f"--hardware.memory_gib={hw.memory_gib}"] if hw.memory_gib else []
    memory += [f"--hardware.hbm_tbps={hw.hbm_tbps}"] if hw.hbm_tbps else []
    memory += [f"--hardware.compute_efficiency={hw.compute_efficiency}"] if hw.compute_efficiency else []
    return (*out, *memory, *even_split(model, pp * vpp))


def even_split(model: list[str], stages: int) -> list[str]:
    """Megatron and torchtitan split the blocks evenly over the stages when they divide (trainfit's
    default balances the embedding and the head too, parallel/stage_split.py): the published runs'
    split, pinned."""
    layers = load_config(None, model).model.num_layers
    if stages == 1 or layers % stages:
        return []
    return ["--parallel.pp_layers_per_stage=" + ",".join([str(layers // stages)] * stages)]


def when(condition: bool, *keys: str) -> tuple[str, ...]:
    """`keys` if the condition holds: the notes that apply to some variants of a row family."""
    return keys if condition else ()


def build_config(row: Published) -> Config:
    """The validated trainfit config of an expressible row. Megatron-Core's sequence parallelism saves the
    sequence shard and all-gathers it again in backward (parallel.sp_recompute_gather; Korthikanti et al.
    Sec. 4.2.2): its rows re-gather wherever they are sequence-parallel."""
    if not row.overrides:
        raise ValueError(f"{row.name}: not estimated ({', '.join(row.notes)})")
    regather = ["--parallel.sp_recompute_gather=true"] if SOURCES[row.source].engine is MEGATRON_CORE and \
        "--parallel.sequence_parallel=true" in row.overrides else []
    return load_config(None, [*row.overrides, *regather])


# ---------------------------------------------------------------- the published configurations


def torchtitan_2d_3d_rows() -> list[Published]:
    """Llama 3.1 70B 2D and 405B 3D (benchmark Tables 4-5, paper Tables 3-4): FSDP + TP (+ PP), Float8."""
    rows = []
    for src, table, results in (("tt-2412", "T4", ((71.9, 829), (67.6, 876))),
                                ("tt-paper", "T3", ((70.3, 897), (67.7, 1010)))):
        for (mem, tps), variant in zip(results, ("2D", "2D+AsyncTP"), strict=True):
            rows.append(Published(
                f"{src} 70B {variant} FSDP32 TP8", src, table, mem, memory_stat="reserved", throughput=tps,
                overrides=run(llama("llama3.1-70b", 8192), GRAND_TETON, gpus=256, seq=8192, mbs=16, gbs=512, tp=8,
                              precision="fp8-mixed", compiled=True, async_tp="Async" in variant, attention="flash"),
                notes=("seq?", "fp8", "compile", *when("Async" in variant, "async"), "sdpa-fa2")))
    for src, table, fsdp, pp, results in (("tt-2412", "T5", 8, 8, (("1F1B", 82.5, 100), ("Interleaved", 72.7, 128))),
                                          ("tt-paper", "T4", 4, 16, (("1F1B", 78.0, 100), ("Interleaved", 80.3, 130)))):
        for schedule, mem, tps in results:
            vpp = 2 if schedule == "Interleaved" else 1
            rows.append(Published(
                f"{src} 405B 3D FSDP{fsdp} TP8 PP{pp} {schedule}", src, table, mem, memory_stat="reserved",
                throughput=tps,
                overrides=run(llama("llama3.1-405b", 8192, layers=128), GRAND_TETON, gpus=8 * pp * fsdp, seq=8192,
                              mbs=32 // pp, gbs=32 * fsdp, tp=8, pp=pp, vpp=vpp, zero=2, precision="fp8-mixed",
                              compiled=True, async_tp=True, attention="flash"),
                notes=("seq?", "405L", "ttpp", *when(vpp > 1, "v2"), "fp8", "async", "compile", "sdpa-fa2")))
    return rows


def torchtitan_long_context_rows() -> list[Published]:
    """Context parallelism: 405B 4D (Table 6) and 8B FSDP + CP (Table 2), full AC, Float8."""
    rows = []
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9), (2, 4, 131072, 31, 77.1),
                                    (1, 8, 262144, 16, 84.9)):
        rows.append(Published(
            f"tt-2412 405B 4D FSDP{fsdp} CP{cp} {seq // 1024}K", "tt-2412", "T6", mem, memory_stat="reserved",
            throughput=tps,
            overrides=run(llama("llama3.1-405b", seq, layers=128), GRAND_TETON, gpus=512, seq=seq, mbs=1,
                          gbs=8 * fsdp, tp=8, cp=cp, pp=8, zero=2, precision="fp8-mixed", compiled=True,
                          async_tp=True, attention="flash"),
            notes=("gbs?", "405L", "ttpp", "fp8", "async", "compile", "sdpa-fa2")))
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                                    (1, 8, 262144, 548, 84.5)):
        rows.append(Published(
            f"tt-2412 8B FSDP{fsdp} CP{cp} {seq // 1024}K", "tt-2412", "T2", mem, memory_stat="reserved",
            throughput=tps,
            overrides=run(llama("llama3.1-8b", seq), GRAND_TETON, gpus=8, seq=seq, mbs=1, gbs=fsdp, cp=cp,
                          precision="fp8-mixed", compiled=True, attention="flash"),
            notes=("fp8", "compile", "sdpa-fa2")))
    rows.append(Published("tt-paper T5-T6 (8B FSDP+CP, 405B 4D)", "tt-paper", "T5, T6", notes=("dup",)))
    return rows


def torchtitan_other_rows() -> list[Published]:
    """The 1D 8B baselines, the 2025-06 AsyncTP benchmark, the 2024-08 405B docs and Trainy's H200 runs."""
    rows = [Published("tt 1D 8B MFU 33-39% (paper: 33-42%)", "tt-2412", "text", notes=("range",))]
    for gpus, results in ((8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                          (128, ((5605, 67.0), (6514, 62.0), (8380, 61.8)))):
        for (tps, mem), variant in zip(results, ("FSDP", "+compile", "+compile+Float8"), strict=True):
            float8 = "Float8" in variant
            rows.append(Published(
                f"tt-2412 8B 1D {gpus} GPUs {variant}", "tt-2412", "T1" if gpus == 8 else "T3", mem,
                memory_stat="reserved", throughput=tps,
                overrides=run(llama("llama3.1-8b", 8192), GRAND_TETON, gpus=gpus, seq=8192, mbs=2, gbs=2 * gpus,
                              ac="selective-alternate", precision="fp8-mixed" if float8 else "bf16-mixed",
                              compiled="compile" in variant, attention="flash"),
                notes=("seq?", "op-sac", *when(float8, "fp8"), *when("compile" in variant, "compile"), "sdpa-fa2")))
    for model, gpus, lbs, ac, results in (
            ("70B", 256, 16, "full", (("bf16", 597.3, 652.4), ("fp8 tensorwise", 809.8, 942.4),
                                      ("fp8 rowwise", 599.6, 624.8))),
            ("8B", 64, 12, "selective-alternate", (("bf16", 4378, 4809.4), ("fp8 tensorwise", 5078.1, 5570.1),
                                         ("fp8 rowwise", 3708.5, 3914.9)))):
        for precision, vanilla, async_tp in results:
            for variant, tps in (("vanilla TP", vanilla), ("AsyncTP", async_tp)):
                rows.append(Published(
                    f"tt-async {model} FSDP{gpus // 8} TP8 {precision} {variant}", "tt-async", model, throughput=tps,
                    overrides=(*run(llama(f"llama3.1-{model.lower()}", 8192), GRAND_TETON, gpus=gpus, seq=8192,
                                    mbs=lbs, gbs=lbs * gpus // 8, tp=8, ac=ac,
                                    precision="bf16-mixed" if precision == "bf16" else "fp8-mixed", compiled=True,
                                    async_tp=variant == "AsyncTP", attention="flash"),
                               *when("rowwise" in precision, "--precision.fp8_scaling=rowwise")),
                    notes=("seq?", "tps?", *when(ac != "full", "op-sac"), *when(precision != "bf16", "fp8"),
                           *when(variant == "AsyncTP", "async"), "compile", "sdpa-fa2")))
    for variant, tps in (("bf16", 109), ("Float8", 177), ("Float8+AsyncTP", 185)):
        rows.append(Published(
            f"tt-2408 405B FSDP16 TP8 {variant}", "tt-2408", "performance.md", throughput=tps,
            overrides=run(llama("llama3.1-405b", 8192), GRAND_TETON, gpus=128, seq=8192, mbs=2, gbs=32, tp=8,
                          precision="bf16-mixed" if variant == "bf16" else "fp8-mixed", compiled=variant != "bf16",
                          async_tp="Async" in variant, attention="flash"),
            notes=("seq?", *when(variant != "bf16", "fp8", "compile?"), *when("Async" in variant, "async"),
                   "sdpa-fa2")))
    for gpus, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97)):
        rows.append(Published(
            f"trainy 8B FSDP{gpus} H200 compile+Float8", "trainy", "results", mem, memory_stat="reserved",
            throughput=tps,
            overrides=(*run(llama("llama3.1-8b", 8192), HGX_H200, gpus=gpus, seq=8192, mbs=2, gbs=2 * gpus,
                            ac="selective-alternate", precision="fp8-mixed", compiled=True, attention="flash"),
                       "--precision.fp8_all_gather=true"),
            notes=("op-sac", "loss", "fp8", "fp8-ag", "compile", "sdpa-fa2")))
    return rows


def not_expressible_rows() -> list[Published]:
    """Qwen3-4B with Ulysses SP, ALST's capacity claims and the Llama 3 paper's Table 4."""
    rows = [Published(f"hf-ulysses Qwen3-4B {name}", "hf-ulysses", "Benchmarks", mem, memory_unit="GB",
                      throughput=tps, notes=("qwen3",))
            for name, mem, tps in (("DP=4 8K", 22.4, None), ("1 GPU 8K", None, 3633), ("SP=4 8K", 22.8, 3933),
                                   ("SP=4 32K", 35.0, 7733), ("SP=4 64K", 50.5, 13396), ("SP=4 96K", 66.0, None),
                                   ("SP=4 128K (OOM)", None, None))]
    rows += [Published(f"alst Llama-3.1-8B {claim}", "alst", "abstract", notes=("alst",))
             for claim in ("500K on 1 H100", "3.7M on 8 H100", "15M on 32 H100")]
    rows += [Published(f"llama3 405B TP8 CP{cp} PP16 DP{dp} {seq // 1024}K", "llama3", "T4", throughput=mfu,
                       metric="MFU % (paper)", notes=("pp?", "llama3-bubble", "llama3-layers"))
             for cp, dp, seq, mfu in ((1, 64, 8192, 43.0), (1, 128, 8192, 41.0), (16, 8, 131072, 38.0))]
    return rows



def korthikanti_rows() -> list[Published]:
    """Table 5 end-to-end iteration times (no data parallelism) and Sec. 6.3's 530B with 8-way DP."""
    models = {"22B": (6144, 48, 64, 1, 1, 4, 4), "175B": (12288, 96, 96, 8, 3, 64, 1),
              "530B": (20480, 105, 128, 35, 3, 280, 1), "1T": (25600, 128, 160, 64, 1, 512, 1)}
    seconds = {"22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83), "1T": (94.42, 71.49)}
    rows = []
    for name, (dim, layers, heads, pp, vpp, gbs, mbs) in models.items():
        model = gpt(dim, layers, heads, 51200, 2048, tied=True)
        for variant, time_s, ac, sp in (("full recompute", seconds[name][0], "full", False),
                                        ("SP+selective", seconds[name][1], "selective", True)):
            rows.append(Published(
                f"korthikanti {name} TP8 PP{pp} {variant}", "korthikanti", "T5", throughput=time_s, metric="step s",
                overrides=run(model, SELENE, gpus=8 * pp, seq=2048, mbs=mbs, gbs=gbs, tp=8, pp=pp, vpp=vpp, zero=0,
                              ac=ac, sp=sp),
                notes=("korth", "present" if sp else "full-noSP", *when(name == "1T", "1f1b?"))))
    rows.append(Published(
        "korthikanti 530B TP8 PP35 DP8 SP+selective", "korthikanti", "Sec. 6.3", throughput=39.15, metric="step s",
        overrides=run(gpt(20480, 105, 128, 51200, 2048, tied=True), SELENE, gpus=2240, seq=2048, mbs=1, gbs=2240,
                      tp=8, pp=35, vpp=3, zero=0, ac="selective"),
        notes=("korth", "present", "no-overlap")))
    rows.append(Published("korthikanti 22B single-layer timings (5 variants)", "korthikanti", "T4", notes=("layer",)))
    return rows


def megatron_rows() -> list[Published]:
    """Megatron-LM README weak scaling (Megatron-Core r0.8.0, H100, seq 4096, vocab 131072, DP 48)."""
    rows = []
    for name, heads, dim, layers, tp, pp, gpus, batch, tflops in (
            ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
            ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
            ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
            ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
            ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9)):
        overrides = () if pp > 1 else run(gpt(dim, layers, heads, 131072, 4096, tied=False), DGX_H100, gpus=gpus,
                                          seq=4096, mbs=1, gbs=batch, tp=tp, zero=1, ac="none")
        rows.append(Published(f"megatron {name} TP{tp} PP{pp} DP48", "megatron", "model_table.png", throughput=tflops,
                              metric="TFLOP/s (Megatron)", overrides=overrides,
                              notes=("pp?",) if pp > 1 else ("untied", "megatron")))
    return rows


def megascale_rows() -> list[Published]:
    """MegaScale's Megatron-LM baseline (Tables 2-3, Figure 9); MegaScale's own rows are a different model."""
    m175, m530 = gpt(12288, 96, 128, 64000, 2048, tied=True), gpt(20480, 105, 160, 64000, 2048, tied=True)

    def baseline(model: list[str], gpus: int, gbs: int, pp: int, vpp: int) -> tuple[str, ...]:
        return run(model, MEGASCALE_A100, gpus=gpus, seq=2048, mbs=1, gbs=gbs, tp=8, pp=pp, vpp=vpp, zero=1,
                   ac="selective")

    rows = []
    for batch, results in ((768, ((256, 40.0, 32.0), (512, 21.2, 16.5), (768, 15.2, 11.5), (1024, 11.9, 8.9))),
                           (6144, ((3072, 29.02, 23.66), (6144, 14.78, 12.21), (8192, 12.24, 9.56),
                                   (12288, 8.57, 6.34)))):
        for gpus, megatron_s, megascale_s in results:
            rows.append(Published(f"megascale 175B Megatron-LM {gpus} GPUs batch {batch}", "megascale", "T2",
                                  throughput=megatron_s, metric="step s", overrides=baseline(m175, gpus, batch, 8, 6),
                                  notes=("megascale",)))
            rows.append(Published(f"megascale 175B MegaScale {gpus} GPUs batch {batch}", "megascale", "T2",
                                  throughput=megascale_s, metric="step s", notes=("megascale-model",)))
    rows.append(Published("megascale 175B Megatron-LM 256 GPUs batch 256", "megascale", "T3", throughput=47.7,
                          metric="MFU % (Megatron)", overrides=baseline(m175, 256, 256, 8, 6), notes=("megascale",)))
    rows.append(Published("megascale 175B MegaScale 256 GPUs all optimizations", "megascale", "T3", throughput=65.3,
                          metric="MFU % (Megatron)", notes=("megascale-model",)))
    for gpus, megatron_mfu, megascale_mfu in ((2240, 49.20, 54.30), (4480, 48.80, 54.10), (11200, 48.20, 54.30)):
        rows.append(Published(f"megascale 530B Megatron-LM {gpus} GPUs", "megascale", "Fig. 9", throughput=megatron_mfu,
                              metric="MFU % (Megatron)", overrides=baseline(m530, gpus, gpus, 35, 3),
                              notes=("megascale",)))
        rows.append(Published(f"megascale 530B MegaScale {gpus} GPUs", "megascale", "Fig. 9", throughput=megascale_mfu,
                              metric="MFU % (Megatron)", notes=("megascale-model",)))
    return rows


def nemo_summary_rows() -> list[Published]:
    """NeMo 24.07's performance summary and its 24.12 copy (DGX-H100, FP8)."""
    gpt175 = gpt(12288, 96, 96, 50257, 2048, tied=True)
    layouts = {  # model, gpus, gbs, mbs, seq, tp, pp, cp, vp
        "LLAMA3-8B CP2": (llama("llama3-8b", 8192), 8, 128, 1, 8192, 1, 1, 2, 1),
        "LLAMA3-70B TP4 PP4 CP2 VP5": (llama("llama3-70b", 8192), 64, 128, 1, 8192, 4, 4, 2, 5),
        "LLAMA2-70B TP4 PP4 VP20": (llama("llama2-70b", 4096), 64, 128, 1, 4096, 4, 4, 1, 20),
        "GPT3-175B 128 GPUs TP4 PP8 VP6": (gpt175, 128, 256, 1, 2048, 4, 8, 1, 6),
        "GPT3-175B 512 GPUs TP4 PP8 VP6": (gpt175, 512, 2048, 2, 2048, 4, 8, 1, 6),
        "GPT3-20B TP2": (gpt(6144, 44, 48, 50257, 2048, tied=True), 64, 256, 2, 2048, 2, 1, 1, 1),
    }
    results = {"nemo-2407": (12036, 1533, 1707, 726, 782, 5851), "nemo-2412": (12273, 1524, 1728, 716, 825, None)}
    nemotron = {"nemo-2407": 322, "nemo-2412": 326}  # the 24.12 copy has no GPT3-20B row
    rows = []
    for src, values in results.items():
        for (name, (model, gpus, gbs, mbs, seq, tp, pp, cp, vp)), tps in zip(layouts.items(), values, strict=True):
            if tps is not None:
                rows.append(Published(
                    f"{src} {name}", src, "summary", throughput=tps,
                    overrides=run(model, DGX_H100, gpus=gpus, seq=seq, mbs=mbs, gbs=gbs, tp=tp, pp=pp, cp=cp, vpp=vp,
                                  zero=1, ac="none", precision="fp8-mixed", compiled=True, async_tp=True),
                    notes=("nemo", "fp8", "te", *when(tp > 1, "tp-overlap"), *when("GPT3" in name, "gpt3"))))
        rows.append(Published(f"{src} Nemotron-340B TP8 PP8 VP12", src, "summary", throughput=nemotron[src],
                              notes=("nemotron",)))
    return rows


def nemo_other_rows() -> list[Published]:
    """NeMo's long-sequence CP scaling, Megatron-Bridge's H100 rows, AutoModel and an anecdotal issue."""
    rows = []
    for seq_k, gpus, batch, tp, pp, dp, cp, tflops in (
            (4, 4, 1024, 1, 1, 4, 1, 768), (8, 8, 512, 1, 2, 4, 1, 730), (16, 16, 256, 2, 1, 8, 1, 660),
            (32, 32, 128, 2, 1, 8, 2, 610), (64, 64, 64, 4, 1, 8, 2, 574), (128, 128, 32, 4, 1, 8, 4, 555),
            (256, 256, 16, 4, 1, 8, 8, 549), (512, 512, 8, 8, 1, 4, 16, 549), (1024, 1024, 4, 8, 1, 4, 32, 536)):
        seq = seq_k * 1024
        rows.append(Published(
            f"nemo-long LLAMA2-7B {seq_k}K TP{tp} PP{pp} DP{dp} CP{cp}", "nemo-long", "H100 with CP", throughput=tflops,
            metric="TFLOP/s (Megatron)",
            overrides=run(llama("llama2-7b", seq), DGX_H100, gpus=gpus, seq=seq, mbs=1, gbs=batch, tp=tp, pp=pp,
                          cp=cp, zero=1, ac="none", precision="fp8-mixed", compiled=True, async_tp=True),
            notes=("long", "nemo", "fp8", "te", *when(tp > 1, "tp-overlap"))))
    rows.append(Published("nemo-long LLAMA2-7B without CP (9 rows)", "nemo-long", "H100 without CP",
                          notes=("no-cp-layout",)))
    rows.append(Published("nemo-long LLAMA3-8B B200 (8 rows)", "nemo-long", "B200", notes=("blackwell",)))
    for release, gbs70, tps70, gbs405, tps405, precision in (("25.11", 128, 1602, 512, 292, "FP8-CS"),
                                                            ("25.09", 128, 1619, 512, 302, "FP8?"),
                                                            ("26.02", 256, 1621, 1536, 311, "FP8")):
        rows.append(Published(
            f"bridge {release} LLAMA3-70B TP4 PP8 VP5 {precision}", "bridge", release, throughput=tps70,
            overrides=run(llama("llama3-70b", 8192), DGX_H100, gpus=64, seq=8192, mbs=1, gbs=gbs70, tp=4, pp=8, vpp=5,
                          zero=1, ac="none", precision="fp8-mixed", compiled=True, async_tp=True),
            notes=("nemo", "fp8", "te", "tp-overlap")))
        rows.append(Published(
            f"bridge {release} LLAMA3.1-405B TP8 PP8 CP2 VP8 {precision}", "bridge", release, throughput=tps405,
            overrides=run(llama("llama3.1-405b", 8192, layers=128), DGX_H100, gpus=1024, seq=8192, mbs=1,
                          gbs=gbs405, tp=8, pp=8, cp=2, vpp=8, zero=1, ac="none", precision="fp8-mixed", compiled=True,
                          async_tp=True),
            notes=("nemo", "fp8", "te", "tp-overlap", "mb405")))
    rows.append(Published("bridge 405B B200/GB200/GB300 (3 rows)", "bridge", "25.11", notes=("blackwell",)))
    rows.append(Published("automodel Llama3 70B LoRA TP2 PP4 VP10", "automodel", "summary", throughput=608.42,
                          notes=("lora",)))
    rows.append(Published("mlm-1059 32B TP8 / 70B TP8 PP2 (A800)", "mlm-1059", "issue", notes=("anecdote",)))
    return rows


CONFIGS: list[Published] = [*torchtitan_2d_3d_rows(), *torchtitan_long_context_rows(), *torchtitan_other_rows(),
                            *not_expressible_rows(), *korthikanti_rows(), *megatron_rows(), *megascale_rows(),
                            *nemo_summary_rows(), *nemo_other_rows()]


# ---------------------------------------------------------------- predictions in the sources' units


def megatron_flops_per_token(cfg: Config) -> float:
    """Megatron-LM's num_floating_point_operations (r0.8.0 training.py) per token: 12 L h^2 [(1 + g/a + s/h) q/h
    + (ffn/h) x 1.5 if gated + V / (2 L h)], attention counted non-causal."""
    m, s = cfg.model, cfg.training.seq_len
    h, L = m.dim, m.num_layers
    gated = 1.5 if m.family == "llama" else 1.0
    attention = 1 + m.num_kv_heads / m.num_heads + s / h
    return 12 * L * h * h * (attention + m.ffn_dim / h * gated + m.vocab_size / (2 * L * h))


def metric_value(row: Published, est: Estimate) -> float:
    """trainfit's prediction in the row's unit. MFU uses the dense bf16 peak, as MegaScale's (A100, 312 TFLOP/s)."""
    per_gpu = est.perf.time["tokens_per_second"] / est.layout.world_size
    if row.metric == "tok/s/GPU":
        return per_gpu
    if row.metric == "step s":
        return est.perf.time["step_time_s"]
    flops = per_gpu * megatron_flops_per_token(est.cfg)
    if row.metric == "TFLOP/s (Megatron)":
        return flops / 1e12
    if row.metric == "MFU % (Megatron)":
        return 100 * flops / device_spec(est.cfg.hardware).peak_flops["bf16"]
    raise ValueError(f"{row.name}: no prediction for metric {row.metric!r}")


def memory_value(row: Published, est: Estimate) -> float:
    """The worst stage's peak as the published statistic, in the published unit."""
    peak = est.worst.peak * (1 + ALLOCATOR_FRAGMENTATION if row.memory_stat == "reserved" else 1)
    return peak / (GIB if row.memory_unit == "GiB" else GB)


@dataclass(frozen=True)
class Result:
    """A row's estimate and its figures in the published units (None where nothing is compared)."""

    row: Published
    est: Estimate
    memory: float | None
    throughput: float | None

    def memory_error(self) -> float | None:
        return None if self.memory is None else self.memory / self.row.memory - 1

    def throughput_error(self) -> float | None:
        return None if self.throughput is None else self.throughput / self.row.throughput - 1

    def published_step_s(self) -> float:
        """The step time the published throughput implies on trainfit's own step (every other unit is
        proportional to 1 / step time)."""
        t = self.est.perf.time["step_time_s"]
        return self.row.throughput if self.row.metric == "step s" else t * self.throughput / self.row.throughput


def predict(row: Published) -> Result:
    est = estimate(build_config(row), engine=SOURCES[row.source].engine)
    memory = memory_value(row, est) if row.memory is not None and row.memory_stat else None
    throughput = metric_value(row, est) if row.throughput is not None else None
    return Result(row, est, memory, throughput)


def errors_of(results: list[Result]) -> record.Errors:
    """Each row's signed errors in percentage points, by metric, where compared, and its fit call (the
    record's form)."""
    return {r.row.name: {**{metric: 100 * e for metric, e in (("memory", r.memory_error()),
                                                                ("throughput", r.throughput_error())) if e is not None},
                         record.FITS: float(r.est.fits)}
            for r in results}


def current_errors() -> record.Errors:
    """errors_of every estimated row of CONFIGS: what the record holds."""
    return errors_of([predict(row) for row in CONFIGS if row.overrides])


def attention_share(cfg: Config) -> float:
    """Attention's share of the hardware FLOPs (fused backward and full recomputation included): the part
    trainfit runs at the bf16 peak under fp8, and the part context parallelism splits into chunks."""
    m, s, mem = cfg.model, cfg.training.seq_len, cfg.memory
    rerun = F.block_recompute_flops(m, s, mem.activation_checkpointing)[1]
    attention = (F.attention_flops_per_token(m, s) * (1 + F.FLASH_ATTENTION_BWD_FACTOR)
                 + rerun * F.num_checkpointed_blocks(m.num_layers, mem.ac_every_n_layers))
    return attention / F.hardware_flops_per_token(m, s, mem.activation_checkpointing, mem.ac_every_n_layers)


# ---------------------------------------------------------------- printing


def _percent(x: float | None) -> str:
    if x is None:
        return ""
    style = "green" if abs(x) <= GAP else "yellow" if abs(x) <= 2 * GAP else "red"
    return f"[{style}]{x:+.0%}[/{style}]"


def _published_memory(row: Published) -> str:
    return "" if row.memory is None else f"{row.memory:g} {row.memory_unit} {row.memory_stat or '(stat?)'}"


def _published_throughput(row: Published) -> str:
    return "" if row.throughput is None else f"{row.throughput:g} {row.metric}"


def _table(rows: list[Published], results: dict[str, Result]) -> Table:
    table = Table(title="trainfit analytic estimate vs published TP/SP/CP training runs (per GPU)")
    for header in ("configuration", "source", "published memory", "predicted peak\n(allocated GiB)",
                   "predicted as\npublished stat", "error", "published throughput", "predicted", "error", "notes"):
        table.add_column(header, justify="left" if header in ("configuration", "source", "notes") else "right")
    for row in rows:
        source, notes = escape(f"{SOURCES[row.source].short} {row.table}"), ", ".join(row.notes)
        r = results.get(row.name)
        if r is None:
            table.add_row(escape(row.name), source, _published_memory(row), "-", "", "", _published_throughput(row),
                          "-", "", f"[dim]not estimated: {notes}[/dim]")
            continue
        table.add_row(escape(row.name), source, _published_memory(row), f"{r.est.worst.peak / GIB:.1f}",
                      "" if r.memory is None else f"{r.memory:.1f}", _percent(r.memory_error()),
                      _published_throughput(row), "" if r.throughput is None else f"{r.throughput:.4g}",
                      _percent(r.throughput_error()), notes)
    return table


def _breakdown(r: Result) -> str:
    """The estimator's components behind a large gap: memory at the peak and the step's time parts."""
    w, t, lay = r.est.worst, r.est.perf.time, r.est.layout
    memory = ", ".join(f"{name} {value / GIB:.1f}" for name, value in w.components().items() if value >= GIB / 20)
    comm = ", ".join(f"{kind} {s:.2f}" for kind, s in t["exposed_comm_by_kind_s"].items() if s >= 5e-3)
    lines = [f"[bold]{escape(r.row.name)}[/bold] ({lay.precision}, AC {lay.activation_checkpointing}, "
             f"{lay.num_microbatches} micro-batches, dp {lay.dp}, zero {lay.zero_stage})"]
    if r.memory_error() is not None:
        lines.append(f"  memory GiB, stage {r.est.memory.worst_stage} at {w.peak_phase}: {memory}; peak "
                     f"{w.peak / GIB:.1f}")
    if r.throughput_error() is not None:
        lines.append(f"  time s: step {t['step_time_s']:.3f} = compute {t['compute_s']:.3f} + exposed comm "
                     f"{t['exposed_comm_s']:.3f} ({comm or 'none'}) + bubble {t['bubble_s']:.3f} "
                     f"({t['bubble_fraction']:.1%}); published implies a step of {r.published_step_s():.3f}; "
                     f"attention {attention_share(r.est.cfg):.0%} of the FLOPs")
    return "\n".join(lines)


def _summary(results: list[Result]) -> str:
    lines = []
    for label, errors in (("memory", [r.memory_error() for r in results]),
                          ("throughput", [r.throughput_error() for r in results])):
        known = [abs(e) for e in errors if e is not None]
        if known:
            lines.append(f"{label}: {len(known)} rows compared, median |error| {statistics.median(known):.0%}, "
                         f"{sum(e <= GAP for e in known)} within {GAP:.0%}")
    for label, subset in (("with a published memory figure", [r for r in results if r.memory is not None]),
                          ("all", results)):
        right, total, wrong = fits_calls(subset)
        lines.append(f"fits, runs {label}: {right} of {total} called right (each ran: the estimate's peak plus its "
                     f"reserved margin within the device)" + (f"; not: {', '.join(wrong)}" if wrong else ""))
    return "\n".join(lines)


def fits_calls(results: list[Result]) -> tuple[int, int, list[str]]:
    """(runs called right, runs, names called wrong): every estimated published run trained, so each is
    called right when the estimate says it fits its device (the peak plus the reserved margin). A run of
    another engine can fit where trainfit's own step of the layout does not (Megatron's pipeline sends
    into transient buffers; trainfit's stages keep one per micro-batch): those calls are trainfit's."""
    wrong = [r.row.name for r in results if not r.est.fits]
    return len(results) - len(wrong), len(results), wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these")
    parser.add_argument("--check", action="store_true", help="exit 1 if the errors break the published record's "
                        "gate (published_record.py), as the suite does")
    parser.add_argument("--record", metavar="REASON", help="re-record every row's errors, with the reason for "
                        "the change (published_record.json)")
    args = parser.parse_args()
    if args.only and (args.check or args.record is not None):
        parser.error("--check and --record take every row: leave out --only")
    rows = [row for row in CONFIGS if not args.only or any(s in row.name for s in args.only)]
    results = {row.name: predict(row) for row in rows if row.overrides}
    console = Console(width=None if sys.stdout.isatty() else 250)
    console.print(_table(rows, results))
    console.print(f"Memory: 'reserved' = analytic peak x (1 + ALLOCATOR_FRAGMENTATION = {ALLOCATOR_FRAGMENTATION}); "
                  "the CUDA context (CUDA_CONTEXT_BYTES) and NCCL's buffers lie outside torch's reserved pool and "
                  "are not added. "
                  "Pipeline rows: the worst stage. TFLOP/s and MFU: Megatron's formula on the predicted tokens/s.")
    console.print(_summary(list(results.values())))
    console.print("\n[bold]Notes[/bold]")
    for key in dict.fromkeys(key for row in rows for key in row.notes):
        console.print(f"  {escape(key)}: {escape(NOTES[key])}")
    console.print(f"\n[bold]Rows with |error| > {GAP:.0%}: the predicted breakdown[/bold]")
    for r in results.values():
        if any(e is not None and abs(e) > GAP for e in (r.memory_error(), r.throughput_error())):
            console.print(_breakdown(r))
    if args.check or args.record is not None:
        errors = errors_of(list(results.values()))
        if record.RECORD.exists():
            recorded = record.read()
            found = record.problems(recorded, errors)
            console.print("\n" + escape(record.message(found, recorded) if found else
                                         f"The published record of {recorded['recorded']} holds."))
        else:
            found = [f"no record yet ({record.RECORD.name})"]
            console.print(f"\n{found[0]}")
        if args.record is not None:
            record.write(record.make_record(errors, args.record, date.today().isoformat()))
            console.print(f"Re-recorded in {record.RECORD.name}: {escape(args.record)}")
        elif found:
            sys.exit(1)


if __name__ == "__main__":
    main()
