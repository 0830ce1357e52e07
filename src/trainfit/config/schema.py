"""The schema of a trainfit run: one dataclass per section, each field with an attribute docstring.

Imports nothing of trainfit's, so every module (hardware.py, models/) can take its types from here
while loading and validation (trainfit.configure) import those modules: dependencies run one way.
Pure Python, no torch, so that `trainfit estimate` stays instant.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Literal

PrecisionMode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp8-mixed"]
OptimizerName = Literal["adamw", "adam", "sgd", "adamw-8bit", "adafactor"]
LRSchedule = Literal["cosine", "linear", "constant"]
ACPolicy = Literal["none", "selective", "selective-alternate", "full"]
Fp8Scaling = Literal["tensorwise", "rowwise"]
DataFormat = Literal["auto", "text", "chat", "prompt-completion", "alpaca"]
LossOn = Literal["completion", "all"]
Truncation = Literal["cut", "drop"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "flash", "efficient", "cudnn", "math"]


MOE_IMBALANCE = math.inf
"""Default memory.moe_imbalance: the ceiling (a busiest expert taking every token). Our MoE models
(benchmarks/moe_routing.py: several expert counts, top-k, with and without a shared expert) reach a
layer at the ceiling within their first training steps (the figures: benchmarks/README.md), so a
memory estimate that must hold for every step has to assume it."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names field, value and fix."""


def field_error(name: str, value: object, fix: str) -> ConfigError:
    """The one message format: `section.field=value: fix`."""
    return ConfigError(f"{name}={value!r}: {fix}")


QkNorm = Literal["none", "head", "whole"]
NormPlacement = Literal["pre", "post", "sandwich"]
MlpActivation = Literal["silu", "gelu_tanh"]
RopeScalingType = Literal["llama3", "linear", "yarn"]


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Named size (see `trainfit.models.presets`), a path to an HF config.json, or "" to give every
    dimension explicitly. Fields set explicitly below override the preset's values."""
    family: Literal["llama", "gpt2"] | None = None
    """Block family: llama (RMSNorm, RoPE, GQA, SwiGLU; MoE when num_experts > 0) or gpt2."""
    dim: int | None = None
    """Hidden size (d_model)."""
    num_layers: int | None = None
    """Number of transformer blocks."""
    num_heads: int | None = None
    """Attention (query) heads; must divide dim unless head_dim is set."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA); must divide num_heads. Defaults to num_heads."""
    head_dim: int | None = None
    """Width of each attention head; 0 = dim / num_heads. Qwen3 and Mistral Small 3 set it so that
    num_heads x head_dim differs from dim."""
    qk_norm: QkNorm | None = None
    """RMSNorm on the queries and keys before RoPE: none | head (over each head, one gain of head_dim for
    q and one for k: Qwen3) | whole (over all of q's heads and all of k's: OLMo 2)."""
    norm_placement: NormPlacement | None = None
    """Where each branch's norm sits: pre (norm, then attention or MLP, then the residual add: Llama) |
    post (attention or MLP, then norm, then the add; no norm before: OLMo 2) | sandwich (a norm before and
    one after each branch, four per layer: Gemma 2 and 3)."""
    norm_offset: bool | None = None
    """Gemma's RMSNorm: the gain is (1 + w), w stored and initialised at 0, and the product is taken in fp32
    before the cast back to the input's dtype (Llama casts first)."""
    sliding_window: int | None = None
    """0 = full causal attention. W > 0: each query attends its W latest positions, itself included
    (Mistral 7B v0.1: 4096; Phi-3-mini: 2047), in every layer unless sliding_window_pattern says otherwise;
    sequences no longer than W are plain causal attention."""
    sliding_window_pattern: int | None = None
    """With a sliding window: every n-th layer (layers n-1, 2n-1, ... counted from 0) attends the whole
    sequence and the others the window (Gemma 2: 2, Gemma 3: 6); 0 = every layer has the window."""
    query_pre_attn_scalar: float | None = None
    """The queries are scaled by query_pre_attn_scalar^-1/2 before the dot product; 0 = head_dim (the usual
    1 / sqrt(head_dim)). Gemma 3 27B: 168 with head_dim 128."""
    attention_softcap: float | None = None
    """0 = none. c > 0: each attention score s is replaced by c tanh(s / c) before the softmax (Gemma 2: 50),
    which SDPA cannot express: the layers run an eager attention that keeps its [heads, queries, keys]
    scores and probabilities."""
    final_softcap: float | None = None
    """0 = none. c > 0: the logits l are replaced by c tanh(l / c) (Gemma 2: 30)."""
    embedding_scale: bool | None = None
    """Multiply the token embeddings by sqrt(dim), rounded to the parameters' dtype first (Gemma)."""
    mlp_activation: MlpActivation | None = None
    """The gated MLP's activation (llama family): silu (SwiGLU) | gelu_tanh (GeGLU: Gemma)."""
    ffn_dim: int | None = None
    """Hidden size of the dense MLP."""
    vocab_size: int | None = None
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    max_seq_len: int | None = None
    """Longest sequence the model supports (RoPE table / GPT-2 position embeddings)."""
    norm_eps: float | None = None
    """Epsilon of RMSNorm / LayerNorm."""
    rope_theta: float | None = None
    """RoPE base frequency (llama family)."""
    rope_scaling_factor: float | None = None
    """0 = plain RoPE. >= 1: Llama 3.1's frequency-dependent RoPE scaling (HF rope_type "llama3"):
    wavelengths longer than rope_original_max_seq_len / rope_low_freq_factor are stretched by this
    factor, shorter than rope_original_max_seq_len / rope_high_freq_factor kept, those between
    interpolated. Llama 3.1: 8."""
    rope_low_freq_factor: float | None = None
    """Llama 3.1 RoPE scaling: see rope_scaling_factor (Llama 3.1: 1)."""
    rope_high_freq_factor: float | None = None
    """Llama 3.1 RoPE scaling: see rope_scaling_factor (Llama 3.1: 4)."""
    rope_original_max_seq_len: int | None = None
    """Llama 3.1 RoPE scaling: the context the model was pre-trained at before scaling (8192)."""
    rope_scaling_type: RopeScalingType | None = None
    """How rope_scaling_factor scales: llama3 (Llama 3.1's, above) | linear (every frequency divided by the
    factor, positions interpolated: Gemma 3 4B and larger, 8) | yarn (YaRN, models/rope_scaling.py: the
    pairs turning fewer than rope_yarn_beta_slow times over rope_original_max_seq_len divided by the factor,
    those turning more than rope_yarn_beta_fast times kept, a ramp between; cos and sin sharpened by the
    attention factor: gpt-oss, 32 over 4096, DeepSeek-V3, 40 over 4096)."""
    rope_yarn_beta_fast: float | None = None
    """YaRN: the turns over the original context above which a pair keeps its frequency (32)."""
    rope_yarn_beta_slow: float | None = None
    """YaRN: the turns below which a pair is divided by the factor (1)."""
    rope_yarn_truncate: bool | None = None
    """YaRN: the ramp's ends rounded to whole pairs (the released YaRN code's and transformers' default, true;
    gpt-oss: false)."""
    rope_yarn_mscale: float | None = None
    """YaRN: DeepSeek's mscale; with rope_yarn_mscale_all_dim (both non-zero) the attention factor is their
    ratio of 0.1 m ln(factor) + 1; 0 = unset (the factor is 0.1 ln(factor) + 1)."""
    rope_yarn_mscale_all_dim: float | None = None
    """YaRN: DeepSeek's mscale_all_dim (see rope_yarn_mscale); 0 = unset."""
    rope_attention_factor: float | None = None
    """YaRN: what cos and sin are multiplied by, given outright (HF's attention_factor); 0 = derived from the
    factor as rope_yarn_mscale says."""
    rope_local_theta: float | None = None
    """The RoPE base of the sliding-window layers where it differs from rope_theta (Gemma 3: 10000, its
    global layers 1e6); 0 = rope_theta. Set, RoPE scaling applies to the global layers only."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output projection."""
    qkv_bias: bool | None = None
    """Bias on the query/key/value projections (Qwen2 family); GPT-2 has biases everywhere."""
    num_experts: int | None = None
    """Routed experts per MoE layer; 0 means a dense model."""
    experts_per_token: int | None = None
    """Routed experts each token is sent to (top-k)."""
    num_shared_experts: int | None = None
    """Experts every token passes through, beside the routed ones."""
    expert_ffn_dim: int | None = None
    """Hidden size of each expert's MLP; defaults to ffn_dim."""
    moe_dense_layers: int | None = None
    """MoE models: the first n layers have a dense feed-forward of ffn_dim instead (Qwen3-MoE's
    mlp_only_layers when they are the first n; DeepSeek's first_k_dense_replace). 0: none."""
    moe_layer_step: int | None = None
    """MoE models: of the layers after moe_dense_layers, layer i (from 0) is MoE when (i + 1) is a
    multiple of n, the others dense of ffn_dim (Qwen3-MoE's decoder_sparse_step, Llama 4's
    interleave_moe_layer_step). 1: every layer."""
    router_normalize_topk: bool | None = None
    """true: each token's top-k routing weights are renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    norm_topk_prob); false: kept as the softmax over all experts gave them (OLMoE)."""
    router_aux_loss_coef: float | None = None
    """Weight of the load-balancing auxiliary loss added to the training loss (MoE only)."""
    capacity_factor: float | None = None
    """0 = dropless routing (every expert takes every token routed to it, however many). > 0: in
    training, each expert takes at most ceil(capacity_factor x tokens x experts_per_token /
    num_experts) of a micro-batch's tokens (never more than the tokens; Switch Transformer, GShard);
    the pairs over capacity are dropped and pass through the residual only. Kept first: every
    token's first choice before any second choice, then by position in the micro-batch. Experts then
    run on fixed [num_experts, capacity] buffers, so memory no longer depends on the routing."""
    norm_fp32_gain: bool | None = None
    """RMSNorm's gain multiplied in fp32 before the cast back to the input's dtype (gpt-oss; Llama casts first,
    Gemma's (1 + w) gain, model.norm_offset, is multiplied in fp32 too): differs only where the stream is 16-bit
    (precision.mode=bf16-pure)."""
    attention_out_bias: bool | None = None
    """Bias on the attention's output projection (gpt-oss: q, k, v and o all biased, with qkv_bias)."""
    attention_sinks: bool | None = None
    """A learned logit per query head joins each query's softmax as one more key with no value (gpt-oss):
    it takes probability mass from the real keys. No SDPA kernel takes it: the layers run an eager
    attention that keeps its [heads, queries, keys + 1] probabilities."""
    router_bias: bool | None = None
    """Bias on the MoE router's logits (gpt-oss)."""
    expert_bias: bool | None = None
    """Biases on each routed expert's three projections (gpt-oss)."""
    swiglu_limit: float | None = None
    """0 = the experts' plain SwiGLU, silu(w1 x) * w3 x. L > 0: gpt-oss's clamped form: gate w1 x clamped
    to at most L, up w3 x to [-L, L], then (up + 1) * gate * sigmoid(swiglu_alpha * gate) (gpt-oss: 7)."""
    swiglu_alpha: float | None = None
    """The clamped SwiGLU's sigmoid slope (gpt-oss: 1.702); read only with swiglu_limit > 0."""
    hf_model_type: str | None = None
    """The Hugging Face model_type whose weight names and config.json `trainfit export` writes (set from
    the config.json read); "" = the simplest type with the model's features (llama, qwen2 with
    qkv_bias, qwen3 with qk_norm, mixtral or qwen3_moe with experts)."""
    init_from: str = ""
    """A folder of Hugging Face weights (config.json and *.safetensors, sharded index files too; what
    `trainfit export` writes) to start from instead of random weights; "" = random. Without a
    model.preset of its own the model takes the folder's config.json."""


PeftMethod = Literal["none", "lora", "dora", "qlora"]


@dataclass
class PeftConfig:
    method: PeftMethod = "none"
    """none (train every parameter) | lora (Hu et al. 2021: the base frozen, each targeted linear
    W x + (alpha / rank) B A x with A rank x in and B out x rank trained) | dora (Liu et al. 2024:
    LoRA's update applied to W's direction, a trained magnitude per output row) | qlora (Dettmers et
    al. 2023: LoRA on a base whose block linears are stored in 4-bit NormalFloat, computed in bf16;
    needs torchao)."""
    rank: int = 8
    """r: rows of A and columns of B."""
    alpha: float = 16.0
    """Scale of the update, alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (the base path sees the undropped input)."""
    targets: tuple[str, ...] = ("q", "v")
    """Linears that get adapters, per block: q, k, v, o (attention), gate, up, down (MLP); or a group:
    attention (q, k, v, o), mlp (gate, up, down), all-linear. Default q, v (PEFT's and torchtune's
    default for Llama)."""
    train_embeddings: bool = False
    """Train the token embedding in full beside the adapters."""
    train_output: bool = False
    """Train the output projection in full beside the adapters."""


@dataclass
class TrainingConfig:
    steps: int = 300
    """Optimizer steps to run."""
    seq_len: int = 128
    """Tokens per training sequence; must be <= model.max_seq_len."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass on one rank."""
    global_batch_size: int = 0
    """Sequences per optimizer step across all ranks; gradient accumulation =
    global_batch_size / (micro_batch_size x data-parallel degree). 0 = derived: micro_batch_size x
    data-parallel degree (no accumulation), printed when training starts."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine/linear schedule."""
    warmup_steps: int = 30
    """Steps of linear warmup from 0 to lr."""
    lr_schedule: LRSchedule = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms, biases or embeddings of size 1 dims."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1337
    """Seed of the weights, the data order and every random stream."""
    eval_interval: int = 50
    """Compute the validation loss every this many steps (and at the end); 0 disables it."""
    eval_steps: int = 10
    """Validation global batches averaged per evaluation (the same windows whatever the layout)."""
    device: Device = "auto"
    """Where to train: auto picks cuda when available, else cpu. With several GPUs visible, a rank
    takes GPU local_rank modulo their count (one visible GPU per process under per-task binding)."""
    collective_timeout_minutes: float = 30.0
    """How long a rank waits in a collective before the run fails. Other ranks wait at a barrier
    while local rank 0 tokenizes raw text, rank 0 writes a checkpoint or a rank dumps a memory
    snapshot: NCCL's own default (10 minutes) can end a healthy run there."""
    compile: bool = False
    """torch.compile each transformer block (inductor; after activation checkpointing, before FSDP):
    the steps that compile are timed apart ("compile: 31.2 s") and left out of tokens/s. Fused
    pointwise kernels keep fewer tensors than eager: both estimators predict the eager step, which
    overestimates a compiled one's peak (by how much: benchmarks/compile.py); the time
    model prices compile only as fusing fp8-mixed's casts to fp8 (perf/fp8_casts.py). Tested
    with FSDP2 and activation checkpointing; pipeline and context parallelism ran by hand (2 gloo
    ranks, 4 steps: the eager process's losses); not with tensor parallelism (a named error)."""
    attention_backend: AttentionBackend = "auto"
    """The kernel behind every attention (torch's scaled_dot_product_attention backends): auto (torch picks
    per call: flash, else memory-efficient, else math on CUDA; its flash kernel on CPU) | flash (FlashAttention;
    on CPU torch's own flash kernel) | efficient (memory-efficient, CUDA) | cudnn (cuDNN, CUDA) | math (the
    unfused reference: it keeps the [heads, seq, seq] fp32 attention probabilities for backward). A kernel that
    cannot run the run's attention (device, dtype, head dim, mask) stops the run before its first step."""


@dataclass
class PrecisionConfig:
    mode: PrecisionMode = "fp32"
    """fp32 | bf16-mixed (fp32 master weights, bf16 autocast) | fp16-mixed (plus dynamic loss
    scaling, inf/nan steps skipped) | bf16-pure (bf16 weights and optimizer) | fp8-mixed (bf16-mixed
    with torchao float8 linears; the output projection and layers whose dims are not multiples of
    16 stay bf16, listed when training starts)."""
    fp8_scaling: Fp8Scaling = "tensorwise"
    """fp8-mixed only: torchao's float8 recipe. tensorwise: one dynamic scale per tensor (e4m3
    inputs and weights, e5m2 gradients); rowwise: one scale per row (all e4m3, power-of-2 scales),
    more accurate with outliers, slower kernels."""
    fp8_all_gather: bool = False
    """fp8-mixed under FSDP2 (parallel.zero_stage 2 or 3): all-gather the converted linears' weights
    in fp8 (half the bytes of bf16), their scales precomputed after each optimizer step; tensorwise
    only."""


@dataclass
class OptimizerConfig:
    name: OptimizerName = "adamw"
    """adamw | adam | sgd (with momentum) | adamw-8bit (torchao's AdamW8bit: 8-bit block-quantized
    states) | adafactor (torch.optim.Adafactor: factored second moment, no first moment; see
    train/optim.py for how the other fields map onto it)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's beta1, beta2 (on the command line: --optimizer.betas=0.9,0.95)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    fused: bool | None = None
    """adamw / adam: torch's fused kernel (one kernel over all tensors, no temporaries). Unset: fused
    where torch has it for the device (CUDA and CPU; faster than foreach where measured,
    benchmarks/optimizers.py), foreach elsewhere; true forces it, false uses `foreach`."""
    foreach: bool = True
    """Use the multi-tensor (foreach) implementation when not fused (false: a loop over tensors)."""
    grad_accum_dtype: Literal["param", "fp32"] = "param"
    """ZeRO-1 (parallel.zero_stage=1) only: the dtype gradients accumulate across micro-batches and
    are reduce-scattered in. "param": the parameters' (bf16/fp16 under *-mixed): the ZeRO paper's
    4Ψ + 12Ψ/N bytes of model states per rank (Ψ parameters, N ranks). "fp32": Megatron's default
    fp32 main grads, exact accumulation over many micro-batches for 2Ψ more: 6Ψ + 12Ψ/N. No effect
    on other layouts (DDP, FSDP and one process accumulate in the fp32 parameters or reduce in
    fp32) nor under fp32 training."""


PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble",
                           "zbv-zero-bubble", "dualpipev"]


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP / the replicate axis of HSDP)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP/ZeRO axis); -1 derives it: num_gpus / (tp x pp x cp x dp_replicate)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0 replicated (DDP), 1 fp32 master weights and optimizer states sharded (the ZeRO paper's P_os:
    16-bit parameters and gradients whole), 2 + gradients, 3 + parameters (FSDP)."""
    tp: int = 1
    """Tensor-parallel degree."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence under tensor parallelism."""
    sp_recompute_gather: bool = False
    """Under sequence parallelism, a column-parallel group (q/k/v, the MLP's up and gate projections) keeps
    its input's sequence shard for backward and all-gathers it again there (Megatron-LM's behaviour, which
    Korthikanti et al.'s sequence-parallel memory formula assumes), instead of the gathered whole sequence
    torch's plan keeps: 1/tp of those activations for one more all-gather per group in backward. Blocks
    under activation checkpointing already re-gather (selective) or keep only their input (full)."""
    async_tp: bool = False
    """Overlap tensor parallelism's all-gathers and reduce-scatters with the GEMMs beside them: each is
    split into tp chunks, one moving while another multiplies (torch's micro-pipeline TP, an inductor
    pass over symmetric memory; Megatron-Core's tp_comm_overlap does the same with Transformer Engine).
    Needs tp > 1, sequence_parallel, training.compile and CUDA GPUs."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the layers are split over, stage after stage."""
    pp_schedule: PipelineSchedule = "1f1b"
    """gpipe | 1f1b | interleaved-1f1b | looped-bfs | interleaved-zero-bubble (stages r, r + pp, ... per
    rank) | zbv-zero-bubble | dualpipev (two stages per rank in a V: r and 2 pp - 1 - r): torch's
    schedules of those names (torch.distributed.pipelining)."""
    pp_virtual_stages: int = 0
    """Stages per pipeline rank; 0 derives it: 1 for gpipe and 1f1b, 2 for the others (the V schedules
    take exactly 2)."""
    pp_layers_per_stage: tuple[int, ...] = ()
    """Blocks of each stage, first to last (pp x virtual stages entries summing to model.num_layers; the
    first stage holds at least one, a later one may hold none: it passes its input on, the last through the
    head); empty derives a split that balances compute and parameters, the embedding on the first stage and
    the output head and loss on the last (parallel/stage_split.py)."""
    num_microbatches: int = 0
    """Pipeline micro-batches per step and data-parallel rank (>= pp); 0 derives it: the gradient
    accumulation steps, raised to the smallest split of the rank's rows with at least pp."""
    cp: int = 1
    """Context-parallel degree (the sequence split across ranks)."""
    ep: int = 1
    """Expert-parallel degree for MoE (carved out of the data-parallel ranks)."""


@dataclass
class MemoryConfig:
    activation_checkpointing: ACPolicy = "none"
    """none | selective (keep matmul and attention outputs, recompute the rest) | selective-alternate
    (torchtitan's op-level policy: keep attention's and every other matmul's outputs) | full
    (recompute whole blocks from their inputs)."""
    ac_every_n_layers: int = 1
    """Apply the checkpointing policy to every n-th block only (1 = all blocks)."""
    offload: Literal["none", "optimizer", "optimizer+params"] = "none"
    """Keep optimizer states (and parameters) in host memory."""
    chunked_loss: bool = False
    """Project the final hidden states to logits and score them in chunks of loss_chunk_tokens tokens,
    each recomputed in backward, so the whole [tokens, vocabulary] logits never exist (train/loss.py)."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the chunked loss: one chunk's logits (and their fp32 forms and gradient)
    exist at a time, so a smaller chunk lowers the peak and runs more, smaller matmuls."""
    moe_imbalance: float = MOE_IMBALANCE
    """Dropless MoE (model.capacity_factor = 0): the busiest expert's load over the balanced load
    (tokens x experts_per_token / num_experts) at which memory is estimated, capped at the ceiling
    where it takes every token (num_experts / experts_per_token). Only that expert's own tensors
    grow with it (the routed tokens' total is fixed). Default inf, the ceiling: our routers came
    close to it early in training in every configuration measured (benchmarks/moe_routing.py;
    see MOE_IMBALANCE); set a measured value for a trained,
    balanced router, or 1 for perfectly balanced routing. A capacity factor bounds memory without
    this assumption."""


@dataclass
class HardwareConfig:
    gpu: str = "cpu"
    """Device model from the catalog (trainfit.hardware), used for MFU and estimates."""
    num_gpus: int = 1
    """Devices in the job."""
    gpus_per_node: int = 8
    """Devices per node (decides which collectives cross the inter-node link): the GPUs one intra-node link
    joins, so 72 for a GB200 NVL72 rack, whose NVLink domain is the whole rack."""
    peak_tflops: float = 0.0
    """Override the catalog's dense peak TFLOP/s for the run's precision (0 = use the catalog)."""
    memory_gib: float = 0.0
    """Override the catalog's device memory in GiB (0 = use the catalog)."""
    hbm_tbps: float = 0.0
    """Override the catalog's device-memory bandwidth in TB/s (0 = use the catalog)."""
    intra_node_link: str = ""
    """Link between the GPUs of a node, from trainfit.hardware.LINKS: nvlink5 | nvlink4 | nvlink4-h800 | nvlink3 |
    infinity-fabric | pcie6 | pcie5 | pcie4 | loopback; "" = the GPU's usual one (B200/GB200/B300 nvlink5,
    H100/H200 SXM nvlink4, H800 nvlink4-h800, A100 nvlink3, MI300X/MI325X infinity-fabric, H100 PCIe pcie5,
    L40S, L4, RTX 4090 and RTX A6000 pcie4, cpu loopback)."""
    inter_node_link: str = "ib-ndr"
    """Network between nodes, per NIC: ib-ndr (400 Gb/s) | ib-hdr (200 Gb/s) | roce-400 | roce-200 | roce-100."""
    nics_per_node: int = 0
    """Network adapters (NICs) per node: a GPU's share of the network is the NIC bandwidth x nics_per_node /
    gpus_per_node (0 = one NIC per GPU, as on DGX/HGX H100 and A100 nodes)."""
    intra_node_gbps: float = 0.0
    """Override the intra-node bandwidth, GB/s per direction per GPU (0 = the link's figure)."""
    inter_node_gbps: float = 0.0
    """Override the inter-node bandwidth, GB/s per direction per GPU with the NIC share applied (0 = from the
    link and nics_per_node)."""
    intra_node_latency_us: float = 0.0
    """Override the intra-node latency of one collective step, in microseconds (0 = the link's figure)."""
    inter_node_latency_us: float = 0.0
    """Override the inter-node latency of one collective step, in microseconds (0 = the link's figure)."""
    compute_efficiency: float = 0.0
    """Scales the rates the step's kernels run at: on a catalog GPU, each kernel's published achievable
    rate (0 = 1.0: as published; trainfit.perf.gpu_kernels); on a measured profile, its rates (0 = 1.0); on
    the CPU without one, the dense peak (0 = trainfit.hardware.COMPUTE_EFFICIENCY, 0.5). Memory traffic is
    not scaled."""
    comm_efficiency: float = 0.0
    """Fraction of a link's bandwidth that collectives reach (NCCL bus bandwidth / link bandwidth;
    0 = trainfit.hardware.COMM_EFFICIENCY, 0.8)."""
    price_per_gpu_hour: float = 0.0
    """What one device costs per hour, for `trainfit plan --tokens` (0 = trainfit.hardware's indicative
    on-demand price where it has one)."""
    profile: str = ""
    """A hardware profile measured by `trainfit calibrate --out FILE` on the device named by gpu: its
    matmul FLOP/s per dtype (at compute_efficiency 1.0 by default), memory bandwidth and collective
    bandwidth and latency (the intra-node link, comm_efficiency 1.0) replace the catalog's; the
    overrides above still win ("" = the catalog's datasheet figures)."""


@dataclass
class DataConfig:
    path: str = ""
    """A text file, a folder of .txt/.jsonl files, or a folder of prepared token shards;
    "" uses the Shakespeare slice packaged with trainfit."""
    tokenizer: str = "bytes"
    """bytes (256 symbols) | a tokenizer.json path | train (fit a BPE on the corpus)."""
    bpe_vocab_size: int = 4096
    """Vocabulary of the BPE trained when tokenizer=train."""
    val_fraction: float = 0.05
    """Fraction held out for validation: of the tokens (the tail of a text corpus), or of the samples
    (fine-tuning records: every k-th, k = round(1 / val_fraction))."""
    format: DataFormat = "auto"
    """Records' format: auto (each file's, from its first record) | text | chat ({"messages": [...]}) |
    prompt-completion | alpaca (instruction, input, output). Text trains as one token stream; the
    others as samples, through the chat template (data.packing)."""
    chat_template: str = ""
    """The chat template of conversations: "" = the tokenizer's or model.init_from's folder's own
    (chat_template.jinja or tokenizer_config.json) | chatml | llama3 (built-ins) | a Jinja file."""
    chat_template_kwargs: str = ""
    """Options the chat template takes, as a JSON object (e.g. {"enable_thinking": false} for Qwen3's):
    passed to it as transformers' apply_chat_template passes its keyword arguments."""
    truncation: Truncation = "cut"
    """Fine-tuning samples longer than training.seq_len + 1 tokens: cut (their first seq_len + 1 tokens
    train; counted in the log) | drop (left out; counted)."""
    loss_on: LossOn = "completion"
    """What fine-tuning samples train on: completion (the assistant turns, or the completion: the
    prompt and padding are masked) | all (every token of the sample)."""
    packing: bool = True
    """Fine-tuning samples: several whole samples a row, each attending to itself only, its positions from 0
    (true), or one sample a padded row (false). Text trains as one token stream either way."""


@dataclass
class CheckpointConfig:
    dir: str = "runs/default/checkpoints"
    """Where checkpoints are written (one step_XXXXXXXX folder each)."""
    interval: int = 100
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a successful save."""
    resume: str = "auto"
    """auto (latest checkpoint in dir, if any) | never | a checkpoint folder path."""


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    """Where metrics.jsonl (and TensorBoard events) are written."""
    interval: int = 10
    """Log metrics every this many steps."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    measure_memory: bool = True
    """Measure the second step of every run per component at the allocator (and every
    memory_interval steps), its first step watched for what it leaves behind: the measured figures
    of metrics.jsonl and the end-of-run predicted-vs-measured table. false trains every step plain
    (the meter's steps run slower on a CPU, where the allocator is sampled after every operator)."""
    memory_interval: int = 0
    """Measure memory per component every this many steps, besides the second step of every run
    (0 = that one only); a measured step takes up to twice as long as a plain one."""
    traced_estimate: bool = True
    """`trainfit train` also traces the step on fake tensors before training (rank 0), so the
    end-of-run table compares the traced estimate too, not only the analytic one, with the measured
    step; it costs ~0.3 s for the default model, tens of seconds for 70B-class models."""
    progress: bool = True
    """Show a progress bar."""
    profile_steps: str = ""
    """Profile these training steps with torch.profiler on every rank: one step ("3") or a range
    ("3-5"), counted from 1 as the log counts them; "" = off (`trainfit train --profile=STEPS` sets it).
    Writes <logging.dir>/profile/rank<r>.pt.trace.json (Perfetto, chrome://tracing, TensorBoard's
    profiler plugin; on CUDA also a memory snapshot for pytorch.org/memory_viz), summarised by
    `trainfit report --profile <logging.dir>/profile`. Steps 1-2 are the memory meter's (slower)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
"""Section name -> its dataclass, in file order."""
