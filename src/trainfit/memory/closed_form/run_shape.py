"""What sizes every term of the analytic estimate: the config sections one estimate reads (`Run`), the
dtypes of a precision mode (`Precision`), the attention kernel assumed, and the shape of one micro-batch on a
rank (`MicroBatchShape`). Kept apart so that the modules pricing model states, activations, the loss and the
pipeline read one definition of each. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from trainfit.config import HardwareConfig, ModelConfig, OptimizerConfig, TrainingConfig
from trainfit.hardware import device_type
from trainfit.memory.closed_form.block.activation_terms import FP32, ActDtypes
from trainfit.models.architecture import describe, document_mask_kernel
from trainfit.parallel.layout import Layout
from trainfit.peft.spec import Adaptation
from trainfit.perf.engines import TRAINFIT_ENGINE, Engine


class Run(NamedTuple):
    """The sections one estimate reads (references, never copies)."""

    model: ModelConfig
    layout: Layout
    training: TrainingConfig
    hardware: HardwareConfig
    optimizer: OptimizerConfig
    engine: Engine = TRAINFIT_ENGINE
    """Whose engine runs the step (perf/engines.py): where engines differ, the estimate follows it."""


@dataclass(frozen=True)
class Precision:
    param: int
    """Bytes per element of the parameters the optimizer updates, and of their gradients."""
    compute: int
    mixed: bool
    act: ActDtypes


def precision_of(mode: str, low_precision_model: bool) -> Precision:
    """precision.py's modes. fp8-mixed's dtypes are bf16-mixed's (torchao's Float8Linear saves its bf16
    input and its high-precision weight, never their fp8 casts); what its float8 linears change is
    priced apart (RankLayout.block_float8, step_peak._float8_backward_bytes). `low_precision_model`: under *-mixed
    the module's parameters are in the 16-bit dtype (FSDP2's MixedPrecisionPolicy, ZeRO-1)."""
    if mode == "fp32":
        return Precision(4, 4, False, ActDtypes(4, 4, False))
    if mode == "bf16-pure":
        return Precision(2, 2, False, ActDtypes(2, 2, False))
    # torch.amp (one process, DDP): fp32 residual stream, per-op casts. FSDP2's MixedPrecisionPolicy
    # and ZeRO-1 run the module itself in bf16 (autocast off): the activations are a bf16 model's.
    return Precision(4, 2, True, ActDtypes(2, 2, False) if low_precision_model else ActDtypes(4, 2, True))


def assumed_attention_kernel(model: ModelConfig, layout: Layout, training: TrainingConfig,
                             hardware: HardwareConfig) -> str:
    """"fused" or "math": the SDPA kernel the estimate assumes (training.attention_backend). math
    when asked; a named fused kernel as asked (the trainer stops before training if it cannot run).
    auto follows torch's choice (aten/src/ATen/native/transformers): on CPU its flash kernel takes
    every dense float input (sdp_utils_cpp.cpp); on CUDA (cuda/sdp_utils.cpp) flash takes fp16/bf16
    with head dim <= 256 and no explicit mask (context parallelism passes one), the memory-efficient
    kernel fp32 too and masks, with head dim a multiple of 8 in 16 bits, 4 in fp32 (sm80 and later),
    and only what neither takes falls back to math. Packed fine-tuning rows run FlexAttention on CUDA
    (models/architecture.document_mask_kernel), and elsewhere SDPA with an explicit mask."""
    backend = training.attention_backend
    packed = layout.rows is not None and layout.rows.packed
    if packed and document_mask_kernel(device_type(hardware)) == "flex":
        return "fused"  # FlexAttention under the rows' block mask, whatever the backend (it keeps what flash keeps)
    if backend != "auto":
        return "math" if backend == "math" else "fused"
    if hardware.gpu == "cpu":
        return "fused"
    arch = describe(model)
    head_dim = arch.attention.head_dim
    half = layout.precision != "fp32"
    if half and layout.cp == 1 and not packed and not arch.masked_windows(training.seq_len) and head_dim <= 256:
        return "fused"
    return "fused" if head_dim % (8 if half else 4) == 0 else "math"


class MicroBatchShape(NamedTuple):
    """What sizes a micro-batch's activations on a rank, besides the model and the dtypes."""

    tokens: int
    """Of the micro-batch on the rank (its local sequences)."""
    seq: int
    """The local sequence length."""
    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    policy: str
    """memory.activation_checkpointing."""
    moe_imbalance: float
    chunked_loss: bool
    loss_chunk_tokens: int
    rope_table_bytes: int
    adaptation: Adaptation | None = None
    """PEFT's adapters (Layout.adaptation): what a block saves through its frozen base."""
    scored_share: float = 1.0
    """Fine-tuning samples: of the micro-batch's tokens, the share whose target trains, the rows the chunked
    loss keeps (sample_rows.SampleRows.scored_share)."""
    document_mask_kernel: str = ""
    """Packed fine-tuning rows: how attention keeps to each sample (models/architecture.document_mask_kernel);
    "": rows of one sequence."""
    regathers: bool = False
    """parallel.sp_recompute_gather under sequence parallelism (Layout.regathers): unwrapped blocks keep their
    column groups' input shards, not the gathered inputs (block/activations.regathered_terms)."""
    layers: str = "trainfit"
    """Whose layers and loss save the activations (perf/engines.Engine.layers): trainfit's, or Transformer
    Engine's and Megatron-Core's (block/te_layer.py)."""
    fp8_linears: bool = False
    """fp8-mixed: the linears run in fp8 (what Transformer Engine's keep for backward depends on it)."""


def rope_table_bytes(run: Run) -> int:
    """Bytes per element of Llama's RoPE tables: fp32, bf16 once a bf16-pure model is cast."""
    return 2 if run.layout.precision == "bf16-pure" else FP32
