"""Training FLOPs per token, model and hardware, and MFU, in closed form from the model config. Torch-free.

Model FLOPs follow Kaplan et al. 2020 / PaLM (Chowdhery et al. 2022, appendix B): a matmul with
N weights costs 2N FLOPs per token forward and 4N backward, so 6N per token; attention adds
QK^T and AV, 2 x 2*s*d per token per layer forward (here halved: causal masking skips the upper
triangle, as flash attention does), and twice that backward. Embedding lookups are not matmuls and
cost nothing; the output projection is a matmul even when tied to the embedding. MoE blocks count
what a token passes through: router, shared experts and its top-k routed experts. MFU divides model
FLOPs only (PaLM's convention), so that recomputation never looks like progress.

Hardware FLOPs are what the GPUs execute: model FLOPs plus
- the fused attention kernel's backward: FlashAttention recomputes the score matrix QK^T in
  backward, 5 matmuls against the forward's 2, i.e. 2.5x the forward instead of the 2x of model
  FLOPs (Dao 2023, FlashAttention-2, section 3.1; torch.utils.flop_counter counts the fused
  kernels' backward the same way);
- activation-checkpointing recomputation, per policy of trainfit.recompute:
  none: 0. selective: 0 -- matmul and fused-attention outputs are saved, only elementwise ops
  (norms, activations, RoPE; ~0 matmul FLOPs) rerun. full: each wrapped block reruns its forward --
  matmuls and attention -- except its last matmul: non-reentrant checkpoint stops once every tensor
  backward needs is back, and nothing saves the MLP down projection's output. In a MoE block the
  load-balancing loss is computed after the experts from saved router outputs, so recomputation runs
  to the end of the block and nothing is skipped. selective-alternate: the matmuls whose outputs
  it does not keep (the even-numbered ones in forward order, `alternate_recompute_params`), but a
  dense block's last, as full. Every-n-layers wraps ceil(L / n) blocks;
- the chunked loss (memory.chunked_loss, train/loss.py): each chunk of the output projection and
  cross-entropy is checkpointed, so backward reruns the projection once, 2 x dim x vocab per token.
The per-block counts (matmul weights, attention FLOPs) are models/block_cost.py's, which the
pipeline's stage split reads too. Checked against torch.utils.flop_counter.FlopCounterMode on our
models (tests/estimator/test_flops.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from trainfit.config import ModelConfig
from trainfit.models.architecture import config_key, describe, kind_of_layers, layer_kinds
from trainfit.models.block_cost import block_attention_flops, block_matmul_params, head_matmul_params
from trainfit.models.block_spec import block_linears
from trainfit.models.checkpoint_policy import odd_expert_share, shared_experts_first_matmul
from trainfit.parallel.stage_split import checkpointed
from trainfit.peft.spec import Adaptation, adapter_flop_params

FWD_BWD_FACTOR = 3  # backward = 2x forward (grad wrt inputs + grad wrt weights)
# Matmuls in a flash-attention backward per matmul of its forward: 5 / 2 (see the module docstring).
FLASH_ATTENTION_BWD_FACTOR = 2.5




def matmul_params_per_token(m: ModelConfig) -> int:
    """Weights each token multiplies through (MoE: router + shared + top-k routed experts only), each block
    its own kind's (architecture.layer_kinds)."""
    return _over_layers(m, block_matmul_params) + head_matmul_params(m)


def _over_layers(m: ModelConfig, per_block: Callable[[ModelConfig], int]) -> int:
    """A per-block count summed over the layers, each of its kind (dense or MoE)."""
    kinds, of = layer_kinds(m), kind_of_layers(m)
    return sum(of.count(k) * per_block(kind) for k, kind in enumerate(kinds))



def attention_flops_per_token(m: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Forward FLOPs of QK^T and AV per token, all blocks (causal: average context seq_len / 2)."""
    return m.num_layers * block_attention_flops(m, seq_len, causal=causal)


def adapter_params_per_token(m: ModelConfig, adaptation: Adaptation | None) -> int:
    """PEFT's adapter weights each token multiplies through, all blocks (peft/spec.py: A and B; of a
    routed expert weight's, its top-k experts')."""
    if adaptation is None:
        return 0
    return _over_layers(m, lambda kind: adapter_flop_params(kind, adaptation))


def training_flops_per_token(m: ModelConfig, seq_len: int, adaptation: Adaptation | None = None) -> int:
    """Model FLOPs of forward + backward per token (no recomputation counted: that is MFU's convention).
    PEFT (`adaptation`): the frozen base's matmuls compute no weight gradients (2N forward, 2N backward
    for the inputs' gradients; the output projection's too unless peft.train_output), the adapters'
    A and B all three passes."""
    return _training_flops_per_token(config_key(m), seq_len, adaptation)


@functools.lru_cache(maxsize=1024)
def _training_flops_per_token(key: tuple, seq_len: int, adaptation: Adaptation | None) -> int:
    """training_flops_per_token, once per config (the planner asks for each of thousands of layouts)."""
    m = ModelConfig(*key)
    forward = 2 * matmul_params_per_token(m) + attention_flops_per_token(m, seq_len)
    if adaptation is None:
        return FWD_BWD_FACTOR * forward
    frozen = matmul_params_per_token(m) - (head_matmul_params(m) if adaptation.train_output else 0)
    return (FWD_BWD_FACTOR * (forward + 2 * adapter_params_per_token(m, adaptation)) - 2 * frozen
            - first_block_input_grad_params(m, adaptation) * 2)


def first_block_input_grad_params(m: ModelConfig, adaptation: Adaptation) -> int:
    """Weights of the first block's column-parallel attention projections (wq, wk, wv, and the A of
    their adapters), whose input's gradient PEFT never computes when the embedding is frozen (nothing
    before them trains). When no
    attention projection of it is adapted, its whole attention backward is skipped too (not counted)."""
    if adaptation.train_embeddings:
        return 0
    first = ("wq", "wk", "wv")
    return sum(linear.in_features * (linear.out_features + adaptation.rank * (linear.name in adaptation.targets))
               for linear in block_linears(layer_kinds(m)[kind_of_layers(m)[0]]) if linear.name in first)


def skipped_recompute_params(m: ModelConfig) -> int:
    """Weights of the block's last matmul, which full checkpointing never reruns (0 for MoE blocks)."""
    return 0 if m.num_experts else m.dim * m.ffn_dim


def num_checkpointed_blocks(num_layers: int, every_n_layers: int) -> int:
    """Blocks of the whole model that checkpointing wraps (parallel/stage_split.checkpointed: i % n
    == 0, which holds for ceil(num_layers / n) of blocks 0 .. num_layers - 1)."""
    return (num_layers + every_n_layers - 1) // every_n_layers


def alternate_recompute_params(m: ModelConfig, even_share: float | None = None, ep: int = 1) -> float:
    """Weights per token whose matmuls selective-alternate reruns in backward (trainfit.recompute):
    wk and wo; Llama's w3 (w1 and w2 kept), not GPT-2's fc2 (the block's last, skipped as under full).
    MoE (the router is kept): dropless expert e's w1, w3, w2 are matmuls 6 + 3e to 8 + 3e, so
    even-numbered experts rerun w1 and w2, odd-numbered ones w3, weighted by `even_share`, the share
    of routed tokens on even-numbered experts (default: balanced routing, their share of the
    experts); with a capacity factor the batched w1 and w2; the shared experts' w3, or w1 and w2,
    by the parity of their first matmul. The parity counts a rank's matmuls: under expert
    parallelism its num_experts / ep experts (models/checkpoint_policy.py's odd_expert_share and
    shared_experts_first_matmul, which the memory estimate reads too)."""
    a = describe(m).block
    attention = m.dim * (a.attention.kv_dim + a.attention.q_dim)  # wk, wo
    if a.mlp is not None and not a.mlp.gated:  # GPT-2's fc2 is the 6th matmul
        return attention
    if not m.num_experts:
        return attention + m.dim * m.ffn_dim  # w3
    local, expert = m.num_experts // ep, m.dim * m.expert_ffn_dim  # one weight of one expert
    capacity = bool(m.capacity_factor)
    if capacity:
        routed = 2.0
    else:
        even = 1 - odd_expert_share(local) if even_share is None else even_share
        routed = even * 2 + (1 - even)
    shared = m.num_shared_experts * (1 if shared_experts_first_matmul(local, capacity) % 2 else 2)
    return attention + (m.experts_per_token * routed + shared) * expert


def block_recompute_flops(m: ModelConfig, seq_len: int, policy: str, ep: int = 1) -> tuple[int, int]:
    """(matmul, attention) FLOPs per token that one wrapped block reruns in backward (`ep`: the
    expert-parallel degree, which decides selective-alternate's parity of a rank's experts)."""
    return _block_recompute_flops(config_key(m), seq_len, policy, ep)


@functools.lru_cache(maxsize=1024)
def _block_recompute_flops(key: tuple, seq_len: int, policy: str, ep: int) -> tuple[int, int]:
    """block_recompute_flops, once per config and option (the time model asks for each layout)."""
    m = ModelConfig(*key)
    if policy == "selective-alternate":
        return int(2 * alternate_recompute_params(m, ep=ep)), 0
    if policy != "full":
        return 0, 0
    return 2 * (block_matmul_params(m) - skipped_recompute_params(m)), block_attention_flops(m, seq_len)


def recompute_flops_per_token(m: ModelConfig, seq_len: int, policy: str, every_n_layers: int = 1,
                              ep: int = 1) -> int:
    """Extra forward FLOPs per token that activation checkpointing reruns during backward."""
    return _recompute_flops_per_token(config_key(m), seq_len, policy, every_n_layers, ep)


@functools.lru_cache(maxsize=1024)
def _recompute_flops_per_token(key: tuple, seq_len: int, policy: str, every_n_layers: int, ep: int) -> int:
    """recompute_flops_per_token, once per config and option (a loop over the layers, asked per layout)."""
    m = ModelConfig(*key)
    kinds, of = layer_kinds(m), kind_of_layers(m)
    wrapped = [of[i] for i in range(m.num_layers) if checkpointed(i, every_n_layers)]  # their kinds
    return sum(wrapped.count(k) * sum(block_recompute_flops(kind, seq_len, policy, ep)) for k, kind in enumerate(kinds))


def loss_recompute_flops_per_token(m: ModelConfig, chunked_loss: bool) -> int:
    """Forward FLOPs per token the chunked loss reruns in backward: its output projection."""
    return 2 * head_matmul_params(m) if chunked_loss else 0


def attention_backward_factor(m: ModelConfig, eager_softcap: bool) -> float:
    """The attention backward's FLOPs over its forward's: a fused kernel's 2.5 (module docstring; so is
    FlexAttention's, on CUDA); the eager soft-capped attention's (Gemma 2, `eager_softcap`: on the CPU) 2,
    the gradients of its two products from what it saved."""
    a = describe(m).attention
    return 2.0 if eager_softcap and (a.softcap or a.sinks) else FLASH_ATTENTION_BWD_FACTOR


def flash_backward_extra_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """What the fused attention backward executes beyond the 2x-forward of model FLOPs."""
    return int((attention_backward_factor(m, eager_softcap=False) - 2) * attention_flops_per_token(m, seq_len))


def hardware_flops_per_token(m: ModelConfig, seq_len: int, policy: str = "none", every_n_layers: int = 1, *,
                             chunked_loss: bool = False, ep: int = 1, adaptation: Adaptation | None = None) -> int:
    """FLOPs the devices execute per token: model FLOPs + fused-attention backward + recomputation
    (activation checkpointing's, and the chunked loss's output projection)."""
    return _hardware_flops_per_token(config_key(m), seq_len, policy, every_n_layers, chunked_loss, ep, adaptation)


@functools.lru_cache(maxsize=1024)
def _hardware_flops_per_token(key: tuple, seq_len: int, policy: str, every_n_layers: int, chunked_loss: bool,
                              ep: int, adaptation: Adaptation | None) -> int:
    """hardware_flops_per_token, once per config and option (asked per layout)."""
    m = ModelConfig(*key)
    return (training_flops_per_token(m, seq_len, adaptation) + flash_backward_extra_flops_per_token(m, seq_len)
            + recompute_flops_per_token(m, seq_len, policy, every_n_layers, ep)
            + loss_recompute_flops_per_token(m, chunked_loss))


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the device's dense peak."""
    return tokens_per_s * flops_per_token / peak_flops
