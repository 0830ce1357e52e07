"""trainfit's analytic estimate against published LoRA / QLoRA / DoRA fine-tuning runs.

Every configuration of published_finetune_sources.md (beside this script: measurements read in torchtune,
LitGPT, HF PEFT, fms-acceleration, Unsloth and the QLoRA paper at cited commits) is a row of CONFIGS, with its
citation in SOURCES. A row trainfit can express is built as a config (`build_config`) and estimated; a row it
cannot express is listed with the reason instead of a number, and none is dropped. QLoRA rows go through
`peft.method=qlora` like the others: where trainfit refuses a config (ConfigError), the row shows the refusal.
Nothing is tuned to the published numbers: each setting comes from the run's config file or the framework's
defaults at the cited commit, or is an assumption that the row's notes name (NOTES).

Memory. An "allocated" figure (torch.cuda.max_memory_allocated: LitGPT's "Memory used", fms-acceleration's
sum of HF Trainer's memory-tracker deltas, torchtune's peak allocated) or an "active" one (torchtune's
active_bytes.all.peak) is compared with trainfit's analytic peak, the bytes allocated at the step's peak. A
"reserved" figure (torch.cuda.max_memory_reserved: torchtune's tutorials, HF PEFT's method comparison) is
compared with peak x (1 + ALLOCATOR_FRAGMENTATION), as published_parallel.py does; the CUDA context and NCCL's
buffers lie outside torch's pool and are not added. A figure whose statistic the source does not state is shown
beside the prediction but not compared. A "bound" row's own setting is an upper bound (the longest sequence
is capped, not known): its estimate bounds the step's peak from above, so it is reported apart, never in the
median. Throughput is compared where the source gives tokens/s per device on a stated device
(fms-acceleration); trainfit's step time is compute at hardware.compute_efficiency plus exposed communication.

Explanations. Where a framework holds memory that trainfit's run does not (found in the framework's code at the
cited versions: EXPLANATIONS), the row lists the quantified terms (`explain`) and the table shows an "explained"
figure: trainfit's analytic peak plus those terms, as the published statistic. It is an explanation of the gap,
not trainfit's estimate, which the "predicted" columns show unchanged; the summary gives both medians.

    python benchmarks/published_finetune.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfit.config import Config, ConfigError
from trainfit.configure import load_config
from trainfit.estimate import Estimate, estimate
from trainfit.memory import ALLOCATOR_FRAGMENTATION
from trainfit.memory.traced import CachingAllocator
from trainfit.peft.spec import nf4_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_parallel import GAP, GB, GIB, Source  # noqa: E402 (beside this script: the same row vocabulary)

SOURCES: dict[str, Source] = {
    "tt-lora-tut": Source("torchtune LoRA tutorial", "pytorch/torchtune docs/source/tutorials/lora_finetune.rst at "
                          "ff594c23113891c99050f730c6be0aeacf511b2f (PR #702); config "
                          "recipes/configs/llama2/7B_lora_single_device.yaml at that commit"),
    "tt-qlora-tut": Source("torchtune QLoRA tutorial", "pytorch/torchtune docs/source/tutorials/qlora_finetune.rst at "
                           "0914d5cfb5a34bf14a72e36b9ddebc64904763d1 (PR #693); config "
                           "recipes/configs/llama2/7B_qlora_single_device.yaml at that commit"),
    "tt-llama3": Source("torchtune Llama3 README", "pytorch/torchtune README.md at "
                        "20747cd87ba803d514d5d3d57e90fcfb059ecf56 (PR #793); configs "
                        "recipes/configs/llama3/8B_{lora,qlora}_single_device.yaml at that commit"),
    "tt-775": Source("torchtune README 2024-04", "pytorch/torchtune README.md at "
                     "fef3ed10dc9efe9e35b118e4397e84c680c0a737 (PR #775); configs recipes/configs/llama2/ there"),
    "tt-955": Source("torchtune README 2024-05", "pytorch/torchtune README.md at "
                     "0217d44c2e1e372b34628767745c1f6538086a81 (PR #955); configs recipes/configs/llama2/ there"),
    "tt-1664": Source("torchtune README 2024-09", "pytorch/torchtune README.md at "
                      "30b8519e86d2094879576e16ab1f8d21a6f6f9f7 (PR #1664); configs recipes/configs/llama3_1/ there"),
    "tt-flags": Source("torchtune README 2024-11", "pytorch/torchtune README.md 'Optimization flags' at "
                       "1814feb17a9038e1a8053ce93111bd26774a8db6 (PR #2003)"),
    "lit-2023": Source("LitGPT resource tables", "Lightning-AI/litgpt tutorials/resource-tables.md (added in "
                       "0cc02afa1dca7434418cf612690da13d38d294fd; runs at lit-gpt 8641822, finetune/lora.py "
                       "there); A100-SXM4-40GB, PyTorch 2.1.0, bitsandbytes 0.41.1"),
    "lit-hub": Source("LitGPT config hub", "Lightning-AI/litgpt config_hub/finetune/README.md and the YAMLs at "
                      "00af8b0d9b43eaa3f8c812e3e8bd53ef38cbb49d; litgpt/finetune/lora.py there; 1 x A10G"),
    "peft-mmqa": Source("PEFT method comparison", "huggingface/peft method_comparison/MetaMathQA/results/*.json at "
                        "51c2ff666b142d004c12609c9686cf17ca055751 (run.py, utils.py, "
                        "default_training_params.json); NVIDIA L40S, torch 2.13, transformers 5.13.1"),
    "fms": Source("fms-acceleration bench", "foundation-model-stack/fms-acceleration "
                  "scripts/benchmarks/refs/a100_80gb.csv at 24bdadb228e2d55bc0c69deec034b86a73da6917 "
                  "(benchmark.py, scenarios.yaml, defaults.yaml, accelerate.yaml there); A100 80GB, torch 2.4.1, "
                  "transformers 4.48.1, peft 0.13.2, bitsandbytes 0.43.3"),
    "hf-31629": Source("transformers packing PR", "huggingface/transformers pull request #31629 (merged; "
                       "DataCollatorWithFlattening, FlashAttention-2 over position_ids), description, 'Example "
                       "Result 1', 2024-06-26; the same runs in foundation-model-stack/fms-acceleration pull "
                       "request #63 (per-device batch 4, gradient accumulation 2, 8 devices)"),
    "unsloth": Source("Unsloth README", "unslothai/unsloth README.md 'Context length benchmarks' at "
                      "e3162dc5bf88bf4c2b598c74cbcaba0706c4067b"),
    "qlora-paper": Source("QLoRA paper", "Dettmers et al. 2023, arXiv 2305.14314, Sec. 2 and Appendix G"),
}

NOTES: dict[str, str] = {
    # settings and assumptions of estimated rows
    "bf16": "bf16-pure: the framework holds bf16 weights, adapters and AdamW states (torchtune dtype=bf16, "
            "LitGPT bf16-true, HF torch_dtype=bfloat16)",
    "peft-fp32": "HF PEFT keeps adapters in fp32 (autocast_adapter_dtype=True) and casts each adapter's input to "
                 "fp32 (LoRA Linear.forward), an fp32 copy per adapter that autograd keeps and trainfit does not "
                 "count (recomputed under checkpointing)",
    "gpu?": "device not stated: A100-SXM-80GB assumed (the memory estimate does not depend on it)",
    "tt-512": "sequence 512: alpaca_cleaned_dataset's default max_seq_len cap, batches padded to their longest; "
              "the reserved pool keeps the largest batch, which reaches the cap [inferred]",
    "tt-drop": "LoRA dropout 0.05: the torchtune builder's default at the commit (the YAML does not set it)",
    "out-lora": "LoRA on the output projection (apply_lora_to_output, lora_head) is not expressible: modelled "
                "without it (its adapter is rank x (dim + vocab) parameters plus rank-wide activations)",
    "approx": "published as an approximate figure ('~')",
    "dq": "NF4 with double quantization (8-bit block scales): modelled as trainfit's qlora storage",
    "nf4": "NF4 without double quantization (fp32 block scales, 0.5 bit per weight more than double-quantized): "
           "modelled as trainfit's qlora storage",
    "lit-1304": "sequence 1304: the longest Llama 2 Alpaca sample, forced into the first micro-batch "
                "(finetune/lora.py get_batch); a micro-batch pads to its longest",
    "lit-512": "sequence 512: Alpaca2k capped at max_seq_length 512, batches padded to their longest; a batch "
               "reaches the cap [inferred]",
    "lit-qkv": "LitGPT's fused QKV LoRA applies one dropout to the input of its q, k, v adapters together; "
               "trainfit counts a dropped copy per adapter",
    "lit-head": "LitGPT runs the head in 128-token chunks and chunks the cross-entropy (all chunks' logits kept): "
                "trainfit counts its own unchunked loss",
    "lit-qhead": "Lightning's BitsandbytesPrecision converts every nn.Linear, the output head included "
                 "[inferred]; trainfit's qlora keeps the head in bf16",
    "paged": "bitsandbytes paged AdamW: the adapters' states in CUDA managed memory, outside torch's allocator",
    "lit-fsdp": "several GPUs: Fabric's FSDPStrategy (FSDP1 full shard, Block wrapping, every Block "
                "checkpointed): ZeRO-3 with full recomputation",
    "fsdp1-grad": "FSDP1 holds each Block's frozen and LoRA weights in one flat parameter and then allocates the "
                  "gradient of the whole flat parameter ('gradient memory usage will be higher than expected', "
                  "quoted in Lightning-AI/litgpt PR #1538); trainfit counts the adapters' gradients only",
    "peft-mmqa": "HF PEFT harness: batch 4 bucketed by length, no checkpointing, SDPA, AdamW; the figure is "
                 "max_memory_reserved over the whole run (training and evaluation's generation at batch 50)",
    "bound768": "sequence 768 is the tokenizer cap (max_seq_length); samples are at most 1,300 characters and "
                "average 210 tokens, so the longest batch is shorter: the estimate is an upper bound",
    "fms": "HF SFTTrainer: packed to 4096 tokens, gradient checkpointing, FlashAttention-2, no accumulation",
    "fms-fsdp": "2 GPUs: accelerate FSDP1 FULL_SHARD, transformer-block wrapping, no mixed precision: ZeRO-3",
    "bnb": "bitsandbytes NF4, double quantization, bf16 compute; embeddings, norms and head stay bf16 (HF)",
    "moe": "Mixtral: trainfit's memory.moe_imbalance default (a busiest expert at the ceiling)",
    "stat?": "statistic not stated: the prediction is shown, not compared",
    "seq?": "'Seq Length' read as every sequence that long [assumed; the config's dataset caps and pads]",
    "tt-fsdp": "torchtune's distributed LoRA recipe: FSDP full shard (ZeRO-3)",
    "a100-80": "8 x A100: the 80 GB part assumed",
    "compile": "torch.compile (training.compile)",
    "packed": "packed to 2048 tokens, batch 2, compile, per the README note; the YAML's activation "
              "checkpointing (on)",
    "runnable": "tokens/s not compared: 'Runnable On' names a device the run fits, and the figures exceed that "
                "device's dense bf16 peak for this model, so where (and per what) they were measured is unknown",
    "1664-ac": "the 4090 and A6000 rows share one config yet differ 2x: a per-device setting is unpublished",
    "tt3-init": "not the explained figure: the init's allocated peak, replayed as for ao01-init (Meta's bf16 "
                "checkpoint), is 10.1 GB; the recipe resets the peak counters after init, so a training log's "
                "'peak allocated' is the step's",
    "lit-first": "the previous micro-batch's 4-bit inputs (bnb-input-prev) are not added: lit-2023 forces the "
                 "longest sample into the first micro-batch, which has no previous graph",
    "bnb-head": "not quantified: bnb dequantizes the 4-bit head (to fp16, Lightning quantizes from .half(), then "
                "a bf16 copy: 4 B per head weight) in every 128-token chunk, at the forward's end with every "
                "activation held (0.5 GB at a 32k vocabulary, 2.1 GB at Llama 3's 128k); trainfit's own "
                "dequantization and unchunked loss stand at other moments",
    "fsdp-qlora": "no QLoRA term: with FSDP (fsdp_cpu_ram_efficient_loading) the 4-bit weights load on cpu/meta, "
                  "so trl's SFTTrainer skips prepare_model_for_kbit_training ('is_sharded_qlora'); the gap is "
                  "the LoRA FSDP rows' own",
    # reasons a row is not estimated
    "dup": "same configuration and figure as another row: compared there",
    "act-offload": "activation offloading to CPU (enable_activation_offloading), which trainfit does not model",
    "lit-families": "not a family trainfit expresses: phi-1.5 (parallel attention and MLP, partial rotary), "
                    "StableLM Alpha (GPT-NeoX: parallel residual, partial rotary)",
    "hub-families": "not a family trainfit expresses: Gemma/Gemma 2 (GeGLU, 256K vocabulary, soft-capping), "
                    "Phi-2/Phi-3, Falcon (parallel block, multi-query), StableLM Alpha",
    "kernels": "the framework's own fused kernels or GPTQ quantization, which trainfit does not model",
    "frontier": "the longest context that fits (a fit frontier), not a memory figure; Unsloth's own kernels and "
                "offloaded checkpointing, the HF column's checkpointing not stated",
    "paper": "5,048 MB is the 4-bit 7B base model, a component; the training peaks are in an image only",
    "lengths": "a packed (or batch-longest padded) fine-tuning run on a 20K-sample subset of OrcaMath: its "
               "memory and throughput follow the samples' lengths, which the source does not publish (nor does "
               "any source found; the data cannot be read here), and its memory statistic is not stated",
}


@dataclass(frozen=True)
class Published:
    """One published configuration and what it reports. Empty `overrides` means not estimated, with the
    reason in `notes`."""

    name: str
    source: str
    """Key of SOURCES."""
    table: str
    memory: float | None = None
    """Per-GPU memory as published, in `memory_unit`."""
    memory_unit: str = "GB"
    memory_stat: str = ""
    """allocated | active | reserved | "" (not stated)."""
    throughput: float | None = None
    """Tokens/s per GPU."""
    overrides: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """Keys of NOTES: the settings and assumptions of an estimated row, or why a row is not estimated."""
    bound: bool = False
    """A setting is an upper bound of the run's (the longest sequence): the estimate bounds the published
    figure from above and stays out of the median."""
    explain: tuple[str, ...] = ()
    """Keys of EXPLANATIONS: what the framework holds that trainfit's run does not, quantified."""

    @property
    def method(self) -> str:
        """The row's peft.method, or "" where not estimated."""
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("--peft.method=")), "")


# ---------------------------------------------------------------- config builders

A100_80, A100_40, A10G, L40S = "A100-SXM-80GB", "A100-40GB", "A10G", "L40S"
RTX4090, A6000 = "RTX-4090", "RTX-A6000"


def preset(name: str, seq: int) -> list[str]:
    """A trainfit preset with a RoPE table `seq` long."""
    return [f"--model.preset={name}", f"--model.max_seq_len={seq}"]


def llama_dims(seq: int, *, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
               tied: bool) -> list[str]:
    """A Llama-family model without a trainfit preset, from its HF config.json sizes."""
    return ["--model.preset=", "--model.family=llama", f"--model.dim={dim}", f"--model.num_layers={layers}",
            f"--model.num_heads={heads}", f"--model.num_kv_heads={kv_heads}", f"--model.ffn_dim={ffn}",
            f"--model.vocab_size={vocab}", f"--model.max_seq_len={seq}", f"--model.tie_embeddings={str(tied).lower()}"]


LLAMA32_1B = dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True)
LLAMA32_3B = dict(dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, tied=True)
TINYLLAMA = dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, tied=False)
"""meta-llama/Llama-3.2-1B, Llama-3.2-3B and TinyLlama/TinyLlama-1.1B config.json."""


def adapter(method: str, rank: int, alpha: float, targets: str, dropout: float = 0.0) -> list[str]:
    """peft.*: method lora | dora | qlora on `targets` (q,k,v,o,gate,up,down or attention, mlp, all-linear)."""
    return [f"--peft.method={method}", f"--peft.rank={rank}", f"--peft.alpha={alpha}", f"--peft.targets={targets}",
            f"--peft.dropout={dropout}"]


def run(model: list[str], peft: list[str], gpu: str, *, seq: int, mbs: int, gpus: int = 1, ac: str = "none",
        compiled: bool = False, attention: str = "auto") -> tuple[str, ...]:
    """Overrides of one run: bf16-pure AdamW, no accumulation (it changes no peak of a LoRA step), ZeRO-3
    (FSDP full shard) on several GPUs."""
    out = [*model, *peft, f"--hardware.gpu={gpu}", f"--hardware.num_gpus={gpus}", f"--training.seq_len={seq}",
           f"--training.micro_batch_size={mbs}", f"--training.global_batch_size={mbs * gpus}",
           "--precision.mode=bf16-pure", "--optimizer.name=adamw", f"--memory.activation_checkpointing={ac}",
           f"--training.compile={str(compiled).lower()}", f"--training.attention_backend={attention}"]
    return (*out, *(["--parallel.zero_stage=3"] if gpus > 1 else []))


def build_config(row: Published) -> Config:
    """The validated trainfit config of an expressible row (ConfigError where trainfit refuses it)."""
    if not row.overrides:
        raise ValueError(f"{row.name}: not estimated ({', '.join(row.notes)})")
    return load_config(None, list(row.overrides))


# ---------------------------------------------------------------- explanations: what the frameworks hold beside


@dataclass(frozen=True)
class Explanation:
    """A memory term of the framework's run that trainfit's run does not hold, read in the framework's code."""

    note: str
    """What it is, where it is in the cited code, and how it is counted."""
    term: Callable[[Published, Config, Estimate], float]
    """Bytes per GPU at the step's peak, beside trainfit's analytic peak (negative: the framework holds less)."""
    floor: bool = False
    """The term is the published statistic's own peak outside the training step (model init), in bytes of that
    statistic: the explained figure is the larger of it and the explained step."""


def _dims(cfg: Config) -> tuple[int, int, int, int, int]:
    """dim, ffn, layers, vocabulary and the k/v projections' width of the model."""
    m = cfg.model
    return m.dim, m.ffn_dim, m.num_layers, m.vocab_size, m.num_kv_heads * (m.dim // m.num_heads)


def _tokens(cfg: Config) -> int:
    return cfg.training.micro_batch_size * cfg.training.seq_len


def _block_linears(cfg: Config) -> list[int]:
    """Weights of a dense block's q, k, v, o, w1, w3, w2 (all NF4 in these QLoRA rows)."""
    d, f, _, _, kv = _dims(cfg)
    return [d * d, d * kv, d * kv, d * d, d * f, d * f, d * f]


def bnb_4bit_bytes(n: int, double_quant: bool) -> int:
    """bitsandbytes' 4-bit weight (blocksize 64): packed codes, an fp32 absmax per block, or with double
    quantization an 8-bit absmax per block and an fp32 factor per 256 of them (functional.quantize_4bit)."""
    blocks = n // 64
    return n // 2 + (blocks + 4 * (blocks // 256) if double_quant else 4 * blocks)


def _bnb_saved_inputs(row: Published, cfg: Config, est: Estimate) -> float:
    """LitGPT under bitsandbytes <= 0.43.1 (lit-2023: 0.41.1, lit-hub: pinned 0.42.0): MatMul4Bit.forward keeps
    `ctx.tensors = (A, B)`, every 4-bit linear's input, whenever it needs grad. Those no other op saves: the
    attention norm's output (the q,v adapters save their dropout's copy; block 0's input needs no grad), the MLP
    norm's output (fc_1, fc_2), the SwiGLU product (proj) and the final norm's output (the 4-bit head); the
    attention projection's input is a view of SDPA's saved output."""
    d, f, L, _, _ = _dims(cfg)
    return 2 * _tokens(cfg) * ((L - 1) * (2 * d + f) + (d + f) + d)


def _bnb_storage(row: Published, cfg: Config, est: Estimate) -> float:
    """bitsandbytes' 4-bit storage less trainfit's NF4 (spec.nf4_bytes) for the block linears, and the head,
    which Lightning's BitsandbytesPrecision quantizes too (trainfit holds it in bf16, or tied: not at all)."""
    dq = "dq" in row.notes
    d, _, L, V, _ = _dims(cfg)
    blocks = L * sum(bnb_4bit_bytes(n, dq) - nf4_bytes(n) for n in _block_linears(cfg))
    return blocks + bnb_4bit_bytes(V * d, dq) - (0 if cfg.model.tie_embeddings else 2 * V * d)


def _lit_untied_head(row: Published, cfg: Config, est: Estimate) -> float:
    d, _, _, V, _ = _dims(cfg)
    return 2 * V * d if cfg.model.tie_embeddings and row.method != "qlora" else 0


def _tt_logits(row: Published, cfg: Config, est: Estimate) -> float:
    return 4 * cfg.training.micro_batch_size * (cfg.training.seq_len - 1) * cfg.model.vocab_size


def _tt_rope(max_seq_len: int) -> Callable[[Published, Config, Estimate], float]:
    def term(row: Published, cfg: Config, est: Estimate) -> float:
        return cfg.model.num_layers * max_seq_len * (cfg.model.dim // cfg.model.num_heads) * 4
    return term


def _ao01_factor(row: Published, cfg: Config, est: Estimate) -> float:
    return cfg.model.num_layers * sum(2 * (n // 64) - 2 * (n // (64 * 256)) for n in _block_linears(cfg))


def _kbit_residual(row: Published, cfg: Config, est: Estimate) -> float:
    return 2 * (cfg.model.num_layers - 1) * _tokens(cfg) * cfg.model.dim


def _kbit_mlp(row: Published, cfg: Config, est: Estimate) -> float:
    m = cfg.model
    ffn, routed = ((m.expert_ffn_dim or m.ffn_dim), m.experts_per_token) if m.num_experts else (m.ffn_dim, 1)
    return 6 * ffn * _tokens(cfg) * routed


def _expert_bytes_saved(cfg: Config) -> int:
    """A block's routed experts in bf16 less in 4-bit (bnb's double-quantized size is trainfit's NF4's)."""
    m = cfg.model
    n = m.dim * (m.expert_ffn_dim or m.ffn_dim)
    return m.num_experts * 3 * (2 * n - nf4_bytes(n))


def _hf_experts(row: Published, cfg: Config, est: Estimate) -> float:
    return -cfg.model.num_layers * _expert_bytes_saved(cfg) / cfg.hardware.num_gpus


def _hf_experts_gathered(row: Published, cfg: Config, est: Estimate) -> float:
    m = cfg.model
    attention = sum(nf4_bytes(n) for n in _block_linears(cfg)[:4])
    gathered = attention + m.num_experts * 3 * 2 * m.dim * (m.expert_ffn_dim or m.ffn_dim)
    return -est.worst.components()["buffers"] * _expert_bytes_saved(cfg) / gathered


def torchtune_init_reserved(cfg: Config, max_seq_len: int, checkpoint_fp16: bool, rank: int = 8) -> CachingAllocator:
    """Replay, through trainfit's caching-allocator model, the CUDA allocations of torchtune's QLoRA model
    init at its April 2024 commits with torchao 0.1 (pyproject `torchao==0.1`):

    - the builder makes one layer on the GPU in bf16: each LoRALinear makes an nn.Linear and `to_nf4`s its
      weight (torchtune/modules/peft/lora.py); TransformerDecoder then deep-copies it num_layers times
      (`_get_clones`), and torchtune's NF4 `clone` is `to_nf4(get_original_weight())`
      (torchtune/utils/_register_nf4_dispatch_ops.py); the prototype layer is freed when the builder returns;
    - `load_state_dict` copies each checkpoint tensor into its NF4 weight with `to_nf4(src.to(device))`
      (the same file), the HF .bin's fp16 cast to bf16 first (`to_nf4`: `tensor.to(torch.bfloat16)`);
    - torchao 0.1's `NF4Tensor.from_tensor` quantizes the whole tensor at once: `quantize_tensor_nearest`
      materializes `(value.unsqueeze(-1) - nf4).abs()`, 16 bf16 differences per weight, twice (32 B each),
      beside the input and `blocks / scales` (68 B per weight in all), and keeps `quantization_factor` as a
      strided view of a bf16 tensor with one entry per 64 weights (made contiguous only in torchao 0.3,
      pytorch/ao#298); `get_original_weight` holds 14 B per weight (int64 codes, their lookups, the scaled
      halves, the stacked result).
    Tensors of a few bytes (codebooks, means) are left out."""
    alloc, ids = CachingAllocator(), itertools.count()

    def malloc(nbytes: float) -> int:
        key = next(ids)
        alloc.malloc(key, int(nbytes))
        return key

    def free(*keys: int) -> None:
        for key in keys:
            alloc.free(key)

    def to_nf4(n: int) -> list[int]:
        """from_tensor on a bf16 input of n weights already held: the NF4 tensor's own allocations."""
        b, s = n // 64, n // (64 * 256)
        a1, v1, i1 = malloc(2 * n), malloc(2 * b), malloc(8 * b)  # get_block_absmax: abs, max
        free(a1, i1)
        v2 = malloc(2 * b)  # scalers - mean
        free(v1)
        a2, sa, si = malloc(2 * b), malloc(2 * s), malloc(8 * s)
        free(a2, si)
        t1, factor = malloc(2 * b), malloc(2 * b)  # 256 / (2 * expanded absmax): kept (a strided view)
        free(t1)
        q1, q2 = malloc(2 * b), malloc(2 * b)  # * factor, round
        free(q1)
        q3 = malloc(2 * b)  # clamp
        free(q2)
        scalers = malloc(b)  # int8
        free(q3, v2, sa)
        a3, s3, i3 = malloc(2 * n), malloc(2 * b), malloc(8 * b)  # get_block_absmax again
        free(a3, i3)
        scaled = malloc(2 * n)
        diff, absdiff = malloc(32 * n), malloc(32 * n)
        free(diff)
        values, nearest = malloc(2 * n), malloc(8 * n)  # min(dim=-1)
        free(values, absdiff)
        high, combined = malloc(4 * n), malloc(4 * n)  # codes[::2] << 4 | codes[1::2]
        free(high)
        data = malloc(n // 2)  # .to(uint8)
        free(combined, nearest, scaled, s3)
        return [factor, scalers, data]

    def dequantize(n: int) -> int:
        """get_original_weight: the bf16 result."""
        keys = []
        for _ in range(2):  # >> 4 and & 0b1111, each .to(long)
            tmp = malloc(n // 2)
            keys.append(malloc(4 * n))
            free(tmp)
        keys += [malloc(n), malloc(n)]  # nf4[codes]
        tmp = malloc(n // 32)
        keys.append(malloc(n // 32))  # dequantized scalers
        free(tmp)
        for _ in range(2):  # halves * repeated scalers
            tmp = malloc(n)
            keys.append(malloc(n))
            free(tmp)
        out = malloc(2 * n)  # stack
        free(*keys)
        return out

    d, _, L, V, _ = _dims(cfg)
    head_dim = d // cfg.model.num_heads
    linears = _block_linears(cfg)

    def layer(clone: bool) -> list[list[int]]:
        held = []
        for n in linears:
            source = dequantize(n) if clone else malloc(2 * n)  # clone's dequantization / nn.Linear's weight
            held.append(to_nf4(n))
            free(source)
            held.append([malloc(2 * rank * d), malloc(2 * rank * (n // d))])  # lora_a, lora_b
        held.append([malloc(4 * max_seq_len * head_dim), malloc(2 * d), malloc(2 * d)])  # RoPE cache, norms
        return held

    prototype = layer(clone=False)
    malloc(2 * V * d), malloc(2 * V * d)  # tok_embeddings, output (bf16)
    layers = [layer(clone=True) for _ in range(L)]
    malloc(2 * d)
    for keys in prototype:
        free(*keys)
    for held in layers:
        for i, n in enumerate(linears):
            staged = [malloc(2 * n)] + ([malloc(2 * n)] if checkpoint_fp16 else [])  # .to(device), bf16 cast
            new = to_nf4(n)
            free(*staged, *held[2 * i])
            held[2 * i] = new
    return alloc


def _tt_init_floor(max_seq_len: int, checkpoint_fp16: bool) -> Callable[[Published, Config, Estimate], float]:
    def term(row: Published, cfg: Config, est: Estimate) -> float:
        return torchtune_init_reserved(cfg, max_seq_len, checkpoint_fp16).peak_reserved
    return term


EXPLANATIONS: dict[str, Explanation] = {
    "tt-logits": Explanation(
        "torchtune's recipe keeps `logits = logits[..., :-1, :].contiguous()` (fp32: TransformerDecoder returns "
        "`self.output(h).float()`) bound until the next step's forward, i.e. through the whole backward: 4 B x "
        "batch x (seq - 1) x vocab beside the loss's own (recipes/lora_finetune_single_device.py, "
        "torchtune/modules/transformer.py at the cited commits)", _tt_logits),
    "tt-rope": Explanation(
        "torchtune deep-copies each layer with its RotaryPositionalEmbeddings cache, fp32 (max_seq_len, "
        "head_dim / 2, 2) with the builder's max_seq_len 4096: L x 4096 x head_dim x 4 B (trainfit keeps one "
        "table at the run's length)", _tt_rope(4096)),
    "ao01-factor": Explanation(
        "torchao 0.1 (torchtune's pin, `torchao==0.1`): NF4Tensor keeps `quantization_factor` as a strided view "
        "of a bf16 tensor with one entry per 64-weight block, not per 64 x 256 (`.contiguous()` came with "
        "pytorch/ao#298, torchao 0.3): + (2 / 64 - 2 / 16384) B per NF4 weight", _ao01_factor),
    "ao01-init": Explanation(
        "the published reserved figure is the caching allocator's pool from model init, not the step: "
        "torchtune's recipe resets only the peak counters after init (utils.memory_stats_log) and never empties "
        "the cache, and the tutorial gives 9.13 GB reserved at init against 9.29 GB in training. Replaying the "
        "init's allocations (torchtune_init_reserved: torchao 0.1's to_nf4 holds 68 B per weight of the "
        "largest linear, made 2 + 32 times: builder, deep copies, checkpoint load) through trainfit's "
        "caching-allocator model gives the init's reserved peak; the explained figure is the larger of it and "
        "the explained step", _tt_init_floor(4096, checkpoint_fp16=True), floor=True),
    "bnb-input": Explanation(_bnb_saved_inputs.__doc__ or "", _bnb_saved_inputs),
    "bnb-input-prev": Explanation(
        "upper bound: bnb's `ctx.tensors` is a plain attribute, which autograd's release after backward does "
        "not free, and LitGPT's loop keeps `logits` (the head chunks, holding the graph) until the next "
        "forward returns, so the previous micro-batch's 4-bit inputs stay alive through this forward: "
        "counted as long as this one (bitsandbytes removed the saving in 0.43.2, PR #1270 'fix QLoRA mem "
        "bug: delete useless buffered activation')", _bnb_saved_inputs),
    "bnb-storage": Explanation(_bnb_storage.__doc__ or "", _bnb_storage),
    "lit-untied": Explanation(
        "LitGPT (at 00af8b0) has no tied head: convert_hf_checkpoint copies `transformer.wte.weight` into "
        "`lm_head.weight` and finetune/lora.py rejects train.tie_embeddings, so Llama 3.2 holds a separate bf16 "
        "head (2 B x vocab x dim) that the row's tied config leaves out", _lit_untied_head),
    "kbit-residual": Explanation(
        "one GPU: trl 0.13's SFTTrainer calls peft's prepare_model_for_kbit_training on a 4-bit model (casts "
        "every non-4-bit parameter to fp32) and then peft_module_casting_to_bf16 (embeddings and head back to "
        "bf16, norms kept fp32): an fp32 RMSNorm weight times its bf16 input is fp32, bnb's Linear4bit returns "
        "`out.to(inp_dtype)`, so the MLP's output and, from block 1 on, the residual stream are fp32; the "
        "checkpointed block inputs of blocks 1..L-1 are 2 B per element larger (fms-acceleration's bnb plugin "
        "warns of this 'extraneous dtype casting'; fms-hf-tuning 2.5.0 passes peft_config to SFTTrainer)",
        _kbit_residual),
    "kbit-mlp": Explanation(
        "the same fp32 stream in the recomputed block: gate, up and SiLU outputs saved in fp32 (bnb casts only "
        "its own input to bf16): + 3 x 2 B x ffn per token (x experts per token under MoE)", _kbit_mlp),
    "hf-experts": Explanation(
        "HF Mixtral (transformers 4.48) holds each expert's w1, w2, w3 as nn.Linear, which bitsandbytes "
        "quantizes; trainfit's qlora leaves routed experts in bf16 (its NF4 is 2-D, its experts one 3-D tensor: "
        "peft/spec.py nf4_refusal): - L x experts x 3 x (2 - 0.52) B per expert weight, over the FSDP shards",
        _hf_experts),
    "hf-experts-gathered": Explanation(
        "FSDP: the blocks gathered at the peak (trainfit's `buffers`) hold those experts in 4-bit too (bnb "
        "quant_storage bf16): buffers x the experts' share of a gathered block's saving (approximate: all "
        "buffers counted as gathered blocks)", _hf_experts_gathered),
}


# ---------------------------------------------------------------- the published configurations


def torchtune_rows() -> list[Published]:
    """torchtune's tutorials and READMEs, April-November 2024."""
    rows = []
    qv7 = preset("llama2-7b", 512)
    for targets, rank, alpha, mem in (("q,v", 8, 16, 15.57), ("all-linear", 8, 16, 15.87), ("q,v", 64, 128, 15.86),
                                      ("all-linear", 64, 128, 17.04)):
        label = "Q and V" if targets == "q,v" else "all layers"
        rows.append(Published(
            f"tt Llama2-7B LoRA {label} r{rank}", "tt-lora-tut", "table", mem, memory_stat="reserved",
            overrides=run(qv7, adapter("lora", rank, alpha, targets, 0.05), A100_80, seq=512, mbs=2, ac="full"),
            notes=("tt-512", "tt-drop", "bf16", "gpu?", *(("out-lora",) if targets == "all-linear" else ())),
            explain=("tt-logits", "tt-rope")))
    qlora7 = adapter("qlora", 8, 16, "attention,mlp", 0.05)
    rows.append(Published("tt Llama2-7B QLoRA attn+mlp r8", "tt-qlora-tut", "table", 9.29, memory_stat="reserved",
                          overrides=run(qv7, qlora7, A100_80, seq=512, mbs=2, ac="full"),
                          notes=("tt-512", "tt-drop", "dq", "bf16", "gpu?"),
                          explain=("tt-logits", "tt-rope", "ao01-factor", "ao01-init")))
    rows.append(Published("tt Llama2-7B LoRA (QLoRA tutorial's LoRA row)", "tt-qlora-tut", "table", 15.57,
                          memory_stat="reserved", notes=("dup",)))
    l3 = preset("llama3-8b", 512)
    rows.append(Published("tt Llama3-8B LoRA q,v r8", "tt-llama3", "README", 19.0, memory_stat="allocated",
                          overrides=run(l3, adapter("lora", 8, 16, "q,v", 0.05), A100_80, seq=512, mbs=2, ac="full"),
                          notes=("approx", "tt-512", "tt-drop", "bf16", "gpu?"), explain=("tt-logits", "tt-rope")))
    rows.append(Published("tt Llama3-8B QLoRA attn+mlp r8", "tt-llama3", "README", 9.0, memory_stat="allocated",
                          overrides=run(l3, adapter("qlora", 8, 16, "attention,mlp", 0.05), A100_80, seq=512, mbs=2,
                                        ac="full"),
                          notes=("approx", "tt-512", "tt-drop", "dq", "bf16", "gpu?", "tt3-init"),
                          explain=("tt-logits", "tt-rope", "ao01-factor")))
    rows.append(Published("tt-775 Llama2-7B LoRA 1x4090", "tt-775", "README", 17.18,
                          overrides=run(qv7, adapter("lora", 8, 16, "q,v", 0.05), RTX4090, seq=512, mbs=2, ac="full"),
                          notes=("stat?", "tt-512", "tt-drop", "bf16")))
    rows.append(Published("tt-775 Llama2-7B LoRA 2x4090", "tt-775", "README", 20.95,
                          overrides=run(qv7, adapter("lora", 8, 16, "q,v", 0.05), RTX4090, seq=512, mbs=2, gpus=2),
                          notes=("stat?", "tt-512", "tt-drop", "tt-fsdp", "bf16")))
    rows.append(Published("tt-775 Llama2-7B QLoRA 1x4090 (= QLoRA tutorial)", "tt-775", "README", 9.29,
                          notes=("dup",)))
    s2k = preset("llama2-7b", 2048)
    for name, peft, gpus, ac, compiled, mem in (
            ("QLoRA 1x4090", adapter("qlora", 8, 16, "attention,mlp", 0.05), 1, "full", True, 12.3),
            ("LoRA 1x4090", adapter("lora", 8, 16, "q,v", 0.05), 1, "full", False, 21.3),
            ("LoRA 2x4090", adapter("lora", 8, 16, "q,v", 0.05), 2, "none", False, 16.2)):
        rows.append(Published(f"tt-955 Llama2-7B {name} bs4 s2048", "tt-955", "README", mem,
                              overrides=run(s2k, peft, RTX4090, seq=2048, mbs=4, gpus=gpus, ac=ac, compiled=compiled),
                              notes=("stat?", "seq?", "tt-drop", "bf16", *(("compile",) if compiled else ()),
                                     *(("tt-fsdp",) if gpus > 1 else ()))))
    rows.append(Published("tt-955 Llama2-70B LoRA 8xA100 bs4 s4096", "tt-955", "README", 26.4,
                          overrides=run(preset("llama2-70b", 4096), adapter("lora", 16, 32, "q,k,v", 0.05), A100_80,
                                        seq=4096, mbs=4, gpus=8, ac="full"),
                          notes=("stat?", "seq?", "tt-drop", "tt-fsdp", "a100-80", "bf16")))
    s31 = preset("llama3.1-8b", 2048)
    for name, peft, gpu, mem in (("LoRA 1x4090", adapter("lora", 8, 16, "q,v"), RTX4090, 16.2),
                                 ("LoRA 1xA6000", adapter("lora", 8, 16, "q,v"), A6000, 30.3),
                                 ("QLoRA 1x4090", adapter("qlora", 8, 16, "attention,mlp"), RTX4090, 7.4)):
        rows.append(Published(f"tt-1664 Llama3.1-8B {name}", "tt-1664", "README", mem, "GiB",
                              overrides=run(s31, peft, gpu, seq=2048, mbs=2, ac="full", compiled=True),
                              notes=("stat?", "packed", "1664-ac", "runnable", "bf16")))
    rows.append(Published("tt-1664 Llama3.1-70B LoRA 8xA100", "tt-1664", "README", 27.6, "GiB",
                          overrides=run(preset("llama3.1-70b", 2048), adapter("lora", 16, 32, "q,k,v"), A100_80,
                                        seq=2048, mbs=2, gpus=8, ac="full", compiled=True),
                          notes=("stat?", "packed", "tt-fsdp", "a100-80", "runnable", "bf16")))
    rows.append(Published("tt-1664 Llama3.1-405B QLoRA 8xA100", "tt-1664", "README", 44.8, "GB",
                          overrides=run(preset("llama3.1-405b", 2048), adapter("qlora", 16, 32, "attention,mlp"),
                                        A100_80, seq=2048, mbs=2, gpus=8, ac="full", compiled=True),
                          notes=("stat?", "packed", "tt-fsdp", "a100-80", "runnable", "bf16")))
    for name, mem in (("LoRA", 8.5), ("QLoRA", 4.6)):
        rows.append(Published(f"tt-flags Llama3.2-3B {name} A100", "tt-flags", "flags", mem, "GiB",
                              memory_stat="active", notes=("act-offload",)))
    return rows


def litgpt_rows() -> list[Published]:
    """LitGPT's resource tables (2023, A100 40GB) and config hub table (2024, A10G)."""
    rows = []
    for model, mbs, quant, mem in (("7b", 1, "", 21.30), ("7b", 1, "nf4", 14.14), ("7b", 1, "nf4-dq", 13.84),
                                   ("7b", 2, "", 29.07), ("13b", 1, "", 38.12), ("13b", 1, "nf4", 23.14),
                                   ("13b", 1, "nf4-dq", 22.55)):
        method = "qlora" if quant else "lora"
        quant_notes = (("dq" if quant.endswith("dq") else "nf4"), "lit-qhead", "paged", "lit-first",
                       "bnb-head") if quant else ()
        rows.append(Published(
            f"lit-2023 Llama2-{model.upper()} {quant or 'LoRA'} mbs{mbs}", "lit-2023", "1 GPU", mem,
            memory_stat="allocated",
            overrides=run(preset(f"llama2-{model}", 1304), adapter(method, 8, 16, "q,v", 0.05), A100_40, seq=1304,
                          mbs=mbs),
            notes=("lit-1304", "lit-head", "lit-qkv", *quant_notes, "bf16"),
            explain=("bnb-input", "bnb-storage") if quant else ()))
    for model, gpus, mbs, mem in (("7b", 2, 1, 22.18), ("7b", 2, 2, 22.47), ("7b", 2, 4, 23.39), ("13b", 4, 1, 35.57)):
        rows.append(Published(
            f"lit-2023 Llama2-{model.upper()} LoRA {gpus}xA100 mbs{mbs}", "lit-2023", "multi-GPU", mem,
            memory_stat="allocated",
            overrides=run(preset(f"llama2-{model}", 1304), adapter("lora", 8, 16, "q,v", 0.05), A100_40, seq=1304,
                          mbs=mbs, gpus=gpus, ac="full"),
            notes=("lit-1304", "lit-fsdp", "fsdp1-grad", "lit-head", "lit-qkv", "bf16")))
    rows.append(Published("lit-2023 phi-1.5 / StableLM Alpha (15 rows)", "lit-2023", "all", notes=("lit-families",)))
    models = {"llama-2-7b": preset("llama2-7b", 512), "llama-3-8b": preset("llama3-8b", 512),
              "llama-3.2-1b": llama_dims(512, **LLAMA32_1B), "llama-3.2-3b": llama_dims(512, **LLAMA32_3B),
              "mistral-7b": preset("mistral-7b", 512), "tiny-llama": llama_dims(512, **TINYLLAMA)}
    for config, mbs, mem in (("llama-2-7b/lora", 2, 19.77), ("llama-2-7b/qlora", 2, 13.68),
                             ("llama-3-8b/lora", 1, 19.73), ("llama-3-8b/qlora", 2, 17.41),
                             ("llama-3.2-1b/lora", 1, 4.49), ("llama-3.2-1b/qlora", 2, 5.53),
                             ("llama-3.2-3b/lora", 1, 9.67), ("llama-3.2-3b/qlora", 2, 10.30),
                             ("mistral-7b/lora", 2, 20.66), ("mistral-7b/qlora", 2, 14.29),
                             ("tiny-llama/lora", 8, 13.50), ("tiny-llama/qlora", 8, 16.24)):
        model, method = config.split("/")
        tiny = model == "tiny-llama"
        rows.append(Published(
            f"lit-hub {config}", "lit-hub", "1xA10G", mem, memory_stat="allocated",
            overrides=run(models[model], adapter(method, 32, 16, "all-linear" if tiny else "q,v", 0.05), A10G,
                          seq=512, mbs=mbs),
            notes=("lit-512", "lit-head", "lit-qkv", *(("nf4", "lit-qhead", "paged") if method == "qlora" else ()),
                   *(("out-lora",) if tiny else ()), "bf16", *(("bnb-head",) if method == "qlora" else ())),
            explain=(("bnb-input", "bnb-input-prev", "bnb-storage") if method == "qlora"
                     else ("lit-untied",) if model.startswith("llama-3.2") else ())))
    rows.append(Published("lit-hub llama-3.1-8b/{lora,qlora} (= llama-3-8b)", "lit-hub", "1xA10G", 19.73,
                          memory_stat="allocated", notes=("dup",)))
    rows.append(Published("lit-hub mistral-7b-v0.2/{lora,qlora} (= mistral-7b)", "lit-hub", "1xA10G", 20.66,
                          memory_stat="allocated", notes=("dup",)))
    rows.append(Published("lit-hub Gemma/Phi/Falcon/StableLM (16 rows)", "lit-hub", "1xA10G",
                          notes=("hub-families",)))
    return rows


def peft_rows() -> list[Published]:
    """HF PEFT's MetaMathQA method comparison on Llama-3.2-3B (L40S): max_memory_reserved in bytes."""
    rows = []
    for experiment, method, rank, targets, reserved in (
            ("rank32", "lora", 32, "q,v", 22_292_725_760), ("rank64", "lora", 64, "q,v", 22_552_772_608),
            ("rank10-target-mlp", "lora", 10, "mlp", 24_698_159_104),
            ("rank32-dora", "dora", 32, "q,v", 24_532_484_096)):
        rows.append(Published(
            f"peft Llama3.2-3B {method} {experiment}", "peft-mmqa", f"lora/llama-3.2-3B-{experiment}",
            reserved / GIB, "GiB", memory_stat="reserved", bound=True,
            overrides=run(llama_dims(768, **LLAMA32_3B), adapter(method, rank, 2 * rank, targets), L40S, seq=768,
                          mbs=4),
            notes=("peft-mmqa", "bound768", "bf16", "peft-fp32")))
    return rows


def fms_explain(model: str, method: str, gpus: int) -> tuple[str, ...]:
    """A bnb QLoRA run's terms: Mixtral's 4-bit experts; on one GPU trl's fp32 casts."""
    if method != "qlora":
        return ()
    experts = (("hf-experts", *(("hf-experts-gathered",) if gpus > 1 else ())) if model.startswith("mixtral")
               else ())
    return (*experts, *(("kbit-residual", "kbit-mlp") if gpus == 1 else ()))


def fms_rows() -> list[Published]:
    """fms-acceleration's A100 80GB reference: HF Trainer peak allocated (bytes), tokens/s per device."""
    rows = []
    for model, method, gpus, mbs, peak, tps in (
            ("mistral-7b", "lora", 1, 4, 26_704_571_904, 3324.155),
            ("mistral-7b", "lora", 1, 8, 38_742_912_512, 3353.809),
            ("mistral-7b", "lora", 2, 2, 15_144_870_400, 2946.306),
            ("mistral-7b", "lora", 2, 4, 21_959_827_968, 3168.613),
            ("mistral-7b", "qlora", 1, 4, 20_669_338_112, 2903.78),
            ("mistral-7b", "qlora", 1, 8, 37_002_646_016, 2987.456),
            ("mistral-7b", "qlora", 2, 2, 9_424_594_432, 2949.205),
            ("mistral-7b", "qlora", 2, 4, 15_970_067_968, 3398.665),
            ("llama2-70b", "qlora", 2, 2, 46_685_287_936, 433.53),
            ("mixtral-8x7b", "lora", 2, 2, 57_554_708_992, 1571.223),
            ("mixtral-8x7b", "lora", 2, 4, 64_851_605_504, 1834.376),
            ("mixtral-8x7b", "qlora", 1, 4, 42_794_268_160, 1528.07),
            ("mixtral-8x7b", "qlora", 1, 8, 60_545_920_512, 1690.27),
            ("mixtral-8x7b", "qlora", 2, 2, 21_129_981_952, 1579.814),
            ("mixtral-8x7b", "qlora", 2, 4, 28_146_350_592, 1880.667)):
        rows.append(Published(
            f"fms {model} {method} {gpus}xA100 bs{mbs}", "fms", "a100_80gb.csv", peak / GIB, "GiB",
            memory_stat="allocated", throughput=tps,
            overrides=run(preset(model, 4096), adapter(method, 16, 16, "attention", 0.1), A100_80, seq=4096, mbs=mbs,
                          gpus=gpus, ac="full", attention="flash"),
            notes=("fms", *(("fms-fsdp",) if gpus > 1 else ()), *(("bnb",) if method == "qlora" else ()),
                   *(("moe",) if model.startswith("mixtral") else ()), "bf16", "peft-fp32",
                   *(("fsdp-qlora",) if method == "qlora" and gpus > 1 else ())),
            explain=fms_explain(model, method, gpus)))
    rows.append(Published("fms accelerated-peft / foak / GPTQ rows", "fms", "a100_80gb.csv", notes=("kernels",)))
    return rows


def other_rows() -> list[Published]:
    packed = [Published(f"hf-31629 {model} full FSDP 8xA100 OrcaMath-20K {mode}", "hf-31629", "Example Result 1",
                        memory, "MB", throughput=tokens, notes=("lengths",))
              for model, mode, memory, tokens in (("Llama2-7B", "padded", 22305, 1269),
                                                  ("Llama2-7B", "packed", 20950, 1746),
                                                  ("Mistral-7B", "padded", 23603, 1216),
                                                  ("Mistral-7B", "packed", 22409, 1658))]
    return [*packed,Published("unsloth Llama3.1-8B / Llama3.3-70B QLoRA context frontier", "unsloth", "README",
                      notes=("frontier",)),
            Published("QLoRA paper LLaMA 7B-65B footprints", "qlora-paper", "Sec. 2, App. G", notes=("paper",))]


CONFIGS: list[Published] = [*torchtune_rows(), *litgpt_rows(), *peft_rows(), *fms_rows(), *other_rows()]


# ---------------------------------------------------------------- predictions in the sources' units


@dataclass(frozen=True)
class Result:
    """A row's estimate, or trainfit's refusal of its config."""

    row: Published
    est: Estimate | None
    refusal: str = ""

    def peak(self) -> float | None:
        """The worst stage's analytic peak in the published unit."""
        if self.est is None:
            return None
        return self.est.worst.peak / (GIB if self.row.memory_unit == "GiB" else GB)

    def memory(self) -> float | None:
        """The peak as the published statistic (None where the statistic is not stated)."""
        peak = self.peak()
        if peak is None or self.row.memory is None or not self.row.memory_stat:
            return None
        return peak * (1 + ALLOCATOR_FRAGMENTATION if self.row.memory_stat == "reserved" else 1)

    def memory_error(self) -> float | None:
        memory = self.memory()
        return None if memory is None else memory / self.row.memory - 1

    def terms(self) -> list[tuple[str, float]]:
        """The row's explanation terms (EXPLANATIONS key, bytes per GPU)."""
        if self.est is None:
            return []
        cfg = build_config(self.row)
        return [(key, EXPLANATIONS[key].term(self.row, cfg, self.est)) for key in self.row.explain]

    def explained(self) -> float | None:
        """trainfit's analytic peak plus the framework's quantified terms, as the published statistic (None
        without explanation terms or a compared statistic). An explanation, not trainfit's estimate."""
        if self.memory() is None or not self.row.explain:
            return None
        unit = GIB if self.row.memory_unit == "GiB" else GB
        terms = self.terms()
        peak = (self.est.worst.peak + sum(b for key, b in terms if not EXPLANATIONS[key].floor)) / unit
        stat = peak * (1 + ALLOCATOR_FRAGMENTATION if self.row.memory_stat == "reserved" else 1)
        return max([stat] + [b / unit for key, b in terms if EXPLANATIONS[key].floor])

    def explained_error(self) -> float | None:
        explained = self.explained()
        return None if explained is None else explained / self.row.memory - 1

    def error_with_explanation(self) -> float | None:
        """The explained figure's error where the row has one, else the prediction's."""
        explained = self.explained_error()
        return self.memory_error() if explained is None else explained

    def throughput(self) -> float | None:
        if self.est is None or self.row.throughput is None:
            return None
        return self.est.perf.time["tokens_per_second"] / self.est.layout.world_size

    def throughput_error(self) -> float | None:
        tps = self.throughput()
        return None if tps is None else tps / self.row.throughput - 1


def predict(row: Published) -> Result:
    try:
        return Result(row, estimate(build_config(row)))
    except ConfigError as e:
        return Result(row, None, str(e))


# ---------------------------------------------------------------- printing


def _percent(x: float | None, bound: bool = False) -> str:
    if x is None:
        return ""
    if bound:
        style = "red" if x < 0 else "dim"
        return f"[{style}]{x:+.0%} (bound)[/{style}]"
    style = "green" if abs(x) <= GAP else "yellow" if abs(x) <= 2 * GAP else "red"
    return f"[{style}]{x:+.0%}[/{style}]"


def _published_memory(row: Published) -> str:
    return "" if row.memory is None else f"{row.memory:.2f} {row.memory_unit} {row.memory_stat or '(stat?)'}"


def _table(rows: list[Published], results: dict[str, Result]) -> Table:
    table = Table(title="trainfit analytic estimate vs published LoRA / QLoRA / DoRA fine-tuning runs (per GPU)")
    for header in ("configuration", "source", "published memory", "predicted peak\n(allocated)",
                   "predicted as\npublished stat", "error", "explained\n(+ framework\nterms)", "error",
                   "published\ntok/s/GPU", "predicted", "error", "notes (x: explanation terms)"):
        table.add_column(header, justify="left" if header in ("configuration", "source") or
                         header.startswith("notes") else "right")
    for row in rows:
        source = escape(f"{SOURCES[row.source].short} {row.table}")
        notes = ", ".join([*row.notes, *(f"x:{key}" for key in row.explain)])
        published_tps = "" if row.throughput is None else f"{row.throughput:g}"
        r = results.get(row.name)
        if r is None or r.est is None:
            reason = f"trainfit refuses: {r.refusal}" if r is not None else notes
            table.add_row(escape(row.name), source, _published_memory(row), "-", "", "", "", "", published_tps,
                          "-", "", f"[dim]not estimated: {escape(reason)}[/dim]")
            continue
        memory, tps, explained = r.memory(), r.throughput(), r.explained()
        table.add_row(escape(row.name), source, _published_memory(row), f"{r.peak():.2f} {row.memory_unit}",
                      "" if memory is None else f"{memory:.2f}", _percent(r.memory_error(), row.bound),
                      "" if explained is None else f"{explained:.2f}", _percent(r.explained_error(), row.bound),
                      published_tps, "" if tps is None else f"{tps:.0f}", _percent(r.throughput_error()),
                      escape(notes))
    return table


def _explanations(results: dict[str, Result]) -> str:
    """Each explained row's terms, in the published unit."""
    lines = []
    for r in results.values():
        if r.explained() is None:
            continue
        unit = GIB if r.row.memory_unit == "GiB" else GB
        terms = ", ".join(f"{key} {'>= ' if EXPLANATIONS[key].floor else '+' if b >= 0 else ''}{b / unit:.2f}"
                          for key, b in r.terms())
        lines.append(f"  {escape(r.row.name)}: predicted {r.memory():.2f}, {terms} {r.row.memory_unit} -> "
                     f"explained {r.explained():.2f} ({r.explained_error():+.1%}) against {r.row.memory:.2f}")
    return "\n".join(lines)


def _breakdown(r: Result) -> str:
    """The estimator's components behind a large gap."""
    w, lay = r.est.worst, r.est.layout
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in w.components().items() if value >= GIB / 50)
    lines = [f"[bold]{escape(r.row.name)}[/bold] ({lay.precision}, AC {lay.activation_checkpointing}, "
             f"dp {lay.dp}, zero {lay.zero_stage})"]
    if r.memory_error() is not None:
        lines.append(f"  memory GiB at {w.peak_phase}: {parts}; peak {w.peak / GIB:.2f}")
    if r.throughput_error() is not None:
        t = r.est.perf.time
        implied = t["step_time_s"] * r.throughput() / r.row.throughput
        lines.append(f"  time s: step {t['step_time_s']:.3f} = compute {t['compute_s']:.3f} + exposed comm "
                     f"{t['exposed_comm_s']:.3f}; the published tokens/s imply {implied:.3f}")
    return "\n".join(lines)


def _median_line(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label}: none compared"
    known = [abs(e) for e in errors]
    return (f"{label}: {len(known)} rows compared, median |error| {statistics.median(known):.0%}, median signed "
            f"{statistics.median(errors):+.0%}, {sum(e <= GAP for e in known)} within {GAP:.0%}")


def _summary(rows: list[Published], results: dict[str, Result]) -> str:
    estimated = [r for r in results.values() if r.est is not None]
    compared = [r for r in estimated if r.memory_error() is not None and not r.row.bound]
    lines = [_median_line("memory", [r.memory_error() for r in compared])]
    for method in ("lora", "dora", "qlora"):
        subset = [r.memory_error() for r in compared if r.row.method == method]
        if subset:
            lines.append("  " + _median_line(method, subset))
    explained = [r for r in compared if r.explained() is not None]
    lines.append(f"with the explanations ({len(explained)} rows take trainfit's estimate + the quantified framework "
                 "terms; the others their prediction; not a change to trainfit's estimate):")
    lines.append("  " + _median_line("memory", [r.error_with_explanation() for r in compared]))
    for method in ("lora", "dora", "qlora"):
        subset = [r.error_with_explanation() for r in compared if r.row.method == method]
        if subset:
            lines.append("    " + _median_line(method, subset))
    bounds = [r for r in estimated if r.row.bound and r.memory_error() is not None]
    if bounds:
        below = [r.row.name for r in bounds if r.memory_error() < 0]
        lines.append(f"bound rows: the estimate at the capped sequence is below the published figure in {len(below)} "
                     f"of {len(bounds)} (trainfit under-predicts those for certain)"
                     + (f": {', '.join(below)}" if below else ""))
    lines.append(_median_line("throughput", [r.throughput_error() for r in estimated
                                             if r.throughput_error() is not None]))
    refused = [r.row.name for r in results.values() if r.est is None]
    unknown = [r.row.name for r in estimated if r.row.memory is not None and not r.row.memory_stat]
    listed = [row.name for row in rows if not row.overrides]
    lines.append(f"not compared: {len(unknown)} with the statistic not stated, {len(refused)} refused by trainfit, "
                 f"{len(listed)} not expressible or duplicates")
    misses = [r.row.name for r in compared if not r.est.fits]
    lines.append(f"fits: {len(compared) - len(misses)} of the {len(compared)} compared runs (all trained) fit their "
                 "device with the reserved margin" + (f"; not: {', '.join(misses)}" if misses else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these")
    args = parser.parse_args()
    rows = [row for row in CONFIGS if not args.only or any(s in row.name for s in args.only)]
    results = {row.name: predict(row) for row in rows if row.overrides}
    console = Console(width=None if sys.stdout.isatty() else 250)
    console.print(_table(rows, results))
    console.print(f"Memory: 'reserved' = analytic peak x (1 + ALLOCATOR_FRAGMENTATION = {ALLOCATOR_FRAGMENTATION}); "
                  "'allocated' and 'active' = the analytic peak. Units as published (GB = 1e9 bytes).")
    console.print(_summary(rows, results))
    console.print("\n[bold]Notes[/bold]")
    for key in dict.fromkeys(key for row in rows for key in row.notes):
        console.print(f"  {escape(key)}: {escape(NOTES[key])}")
    console.print("\n[bold]Explanations: what the framework holds that trainfit's run does not[/bold]")
    for key in dict.fromkeys(key for row in rows for key in row.explain):
        console.print(f"  x:{escape(key)}: {escape(' '.join(EXPLANATIONS[key].note.split()))}")
    console.print(_explanations(results))
    console.print("\n[bold]Sources[/bold]")
    for key in dict.fromkeys(row.source for row in rows):
        console.print(f"  {escape(key)}: {escape(SOURCES[key].citation)}")
    console.print(f"\n[bold]Rows with |error| > {GAP:.0%}: the predicted breakdown[/bold]")
    for r in results.values():
        if r.est is not None and any(e is not None and abs(e) > GAP for e in (r.memory_error(), r.throughput_error())):
            console.print(_breakdown(r))


if __name__ == "__main__":
    main()
