"""perf/flops.py: closed forms, and exact agreement with FlopCounterMode on our real models.

FlopCounterMode has no formula for the CPU flash-attention kernel, so under the default SDPA backend
attention counts 0 and the matmul FLOPs are compared exactly; attention is checked apart under the
math backend, which runs QK^T and AV as bmm over the full square (it does not skip the causal half).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from trainfit.config import ModelConfig
from trainfit.models import block_cost, build_model, materialize
from trainfit.models.architecture import describe
from trainfit.models.params import param_counts
from trainfit.models.presets import PRESETS, resolve_model_config
from trainfit.perf import flops
from trainfit.recompute import apply_activation_checkpointing
from trainfit.train.loss import chunked_cross_entropy


def model_config(preset: str, **fields: int) -> ModelConfig:
    return resolve_model_config(ModelConfig(preset=preset, **fields))


def test_model_flops_are_6n_plus_causal_attention() -> None:
    m, s = model_config("llama3-8b"), 8192
    n = flops.matmul_params_per_token(m)
    assert flops.training_flops_per_token(m, s) == 6 * n + 6 * m.num_layers * m.dim * s
    assert flops.attention_flops_per_token(m, s, causal=False) == 2 * flops.attention_flops_per_token(m, s)


def test_gpt2_matches_nanogpt_estimate() -> None:
    # nanoGPT's estimate_mfu: 6N + 12 L H Q T, N = parameters but the position embedding (biases and
    # LayerNorms included, the tied token embedding counted as the output matmul). Ours: matmul weights
    # only, and the causal half of attention.
    m, s = model_config("gpt2"), 1024
    nanogpt_n = 124_439_808 - m.max_seq_len * m.dim
    c = param_counts(m)
    biases_and_norms = m.num_layers * (4 * m.dim + m.ffn_dim + m.dim + c.norms) + c.final_norm
    assert flops.matmul_params_per_token(m) == nanogpt_n - biases_and_norms
    attention = 12 * m.num_layers * m.num_heads * (m.dim // m.num_heads) * s
    assert flops.training_flops_per_token(m, s) == 6 * (nanogpt_n - biases_and_norms) + attention // 2


@pytest.mark.parametrize("preset", [p for p, f in PRESETS.items() if f.get("family", "llama") == "llama"])
def test_matmul_params_are_the_active_weights_but_embeddings_and_norms(preset: str) -> None:
    m = model_config(preset)
    c = param_counts(m)
    arch = describe(m)
    a, moe = arch.attention, arch.layers[-1].moe  # (every MoE preset here has MoE in every layer)
    per_layer = (a.q_dim + 2 * a.kv_dim if a.qkv_bias else 0) + (m.dim if a.out_bias else 0) + \
        (a.num_heads if a.sinks else 0)  # gpt-oss: o_proj biased, the sinks
    if moe is not None:  # gpt-oss: the router's bias, the active experts' biases
        per_layer += (moe.experts if moe.router_bias else 0) + (moe.top_k * (2 * moe.hidden + m.dim) if moe.bias else 0)
    biases = m.num_layers * per_layer
    tied_output = m.dim * m.vocab_size if m.tie_embeddings else 0
    expected = c.active - c.embedding - m.num_layers * c.norms - c.final_norm - biases + tied_output
    assert flops.matmul_params_per_token(m) == expected


def test_hardware_flops_add_flash_backward_and_recomputation() -> None:
    m, s = model_config("llama3-8b"), 4096
    model = flops.training_flops_per_token(m, s)
    attention = flops.attention_flops_per_token(m, s)
    none = flops.hardware_flops_per_token(m, s, "none")
    assert none == model + attention // 2  # backward attention 2.5x instead of 2x the forward
    assert flops.hardware_flops_per_token(m, s, "selective") == none
    block = 2 * block_cost.block_matmul_params(m) - 2 * m.dim * m.ffn_dim + block_cost.block_attention_flops(m, s)
    assert flops.hardware_flops_per_token(m, s, "full") == none + m.num_layers * block
    assert flops.hardware_flops_per_token(m, s, "full", every_n_layers=3) == none + 11 * block  # 0, 3, ..., 30
    # full recomputation costs less than one more forward (1/3): not the output head, nor each w2
    assert 0.2 < (flops.hardware_flops_per_token(m, s, "full") - none) / model < 1 / 3
    # MoE blocks rerun everything (the load-balancing loss needs the router after the experts)
    moe = model_config("mixtral-8x7b")
    assert flops.block_recompute_flops(moe, s, "full") == (2 * block_cost.block_matmul_params(moe),
                                                           block_cost.block_attention_flops(moe, s))


def test_flash_backward_factor_is_torchs_own_accounting() -> None:
    q = k = v = grad = (2, 8, 128, 64)
    forward = flop_counter.sdpa_flop_count(q, k, v)
    backward = flop_counter.sdpa_backward_flop_count(grad, q, k, v)
    assert backward / forward == flops.FLASH_ATTENTION_BWD_FACTOR


def counted_flops(m: ModelConfig, policy: str, every_n_layers: int, math_sdpa: bool, batch: int, seq: int) -> int:
    """FlopCounterMode's total for one forward + backward of the real model on CPU."""
    model = materialize(build_model(m), "cpu")
    apply_activation_checkpointing(model, policy, every_n_layers)
    tokens = torch.randint(0, m.vocab_size, (batch, seq))
    backend = sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()
    with backend, FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("preset", ["debug", "debug-gpt2", "debug-moe"])
def test_flop_counter_on_our_models(preset: str) -> None:
    batch, seq = 2, 16
    tokens = batch * seq
    m = dataclasses.replace(model_config(preset), num_layers=3)
    matmul = 6 * flops.matmul_params_per_token(m)
    for policy, every_n in (("none", 1), ("selective", 1), ("selective-alternate", 1), ("full", 1), ("full", 2)):
        wrapped = 0 if policy == "none" else flops.num_checkpointed_blocks(m.num_layers, every_n)
        recompute_matmul, _ = flops.block_recompute_flops(m, seq, policy)
        # default SDPA backend: the CPU flash kernel counts 0, the matmuls count exactly
        flash = counted_flops(m, policy, every_n, math_sdpa=False, batch=batch, seq=seq)
        if policy == "selective-alternate" and m.num_experts:
            # how many tokens the even-numbered experts (rerunning w1 and w2, odd ones w3) take
            # depends on the real routing: between none and all of them
            low, high = (tokens * (matmul + wrapped * 2 * flops.alternate_recompute_params(m, share))
                         for share in (0.0, 1.0))
            assert low <= flash <= high, (flash, low, high)
            continue
        assert flash == tokens * (matmul + wrapped * recompute_matmul), (policy, every_n)
        if (policy, every_n) not in (("none", 1), ("full", 2)):
            continue
        # math backend: bmm over the full square, forward 1x, backward 2x, recomputed forward 1x
        full_square = flops.attention_flops_per_token(m, seq, causal=False)
        recompute_attention = (wrapped * block_cost.block_attention_flops(m, seq, causal=False)
                               if policy == "full" else 0)
        math = counted_flops(m, policy, every_n, math_sdpa=True, batch=batch, seq=seq)
        assert math - flash == tokens * (3 * full_square + recompute_attention), (policy, every_n)


def test_mfu() -> None:
    assert flops.mfu(tokens_per_s=1000.0, flops_per_token=6e9, peak_flops=1.2e13) == pytest.approx(0.5)


def test_chunked_loss_recompute_matches_flop_counter() -> None:
    """The chunked loss reruns its output projection in backward: 2 x dim x vocab more FLOPs per token."""
    m = model_config("debug")
    tokens, chunk = 48, 16
    hidden = torch.randn(2, tokens // 2, m.dim, requires_grad=True)
    targets = torch.randint(0, m.vocab_size, (2, tokens // 2))
    output = torch.nn.Linear(m.dim, m.vocab_size, bias=False)

    def counted(chunked: bool) -> int:
        with FlopCounterMode(display=False) as counter:
            if chunked:
                loss = chunked_cross_entropy(hidden, targets, output=output, chunk_tokens=chunk)
            else:
                loss = F.cross_entropy(output(hidden).flatten(0, 1), targets.flatten())
            loss.backward()
        return counter.get_total_flops()

    assert counted(True) - counted(False) == tokens * flops.loss_recompute_flops_per_token(m, chunked_loss=True)
    assert flops.loss_recompute_flops_per_token(m, chunked_loss=False) == 0


@pytest.mark.parametrize("args", [("--peft.targets=q,v",), ("--peft.targets=all-linear", "--peft.rank=4"),
                                  ("--peft.method=dora", "--peft.targets=attention"),
                                  ("--peft.targets=q,k,down", "--peft.train_output=true"),
                                  ("--model.preset=debug-moe", "--model.num_shared_experts=1",
                                   "--peft.targets=all-linear")])
def test_adapted_model_flops_match_the_flop_counter(args: tuple[str, ...]) -> None:
    """PEFT: the frozen base computes no weight gradients, nor the first projections' input
    gradients (nothing before them trains); the adapters all three passes (DoRA's per-step norm of
    W + s B A, a batch-independent term, aside); a routed expert's adapters on its top-k tokens only
    (dropless: exactly top-k rows per token, however unbalanced the router)."""
    from trainfit.configure import load_config
    from trainfit.peft.adapters import apply_adapters
    from trainfit.peft.spec import adaptation_of

    cfg = load_config(None, ["--model.preset=debug", "--peft.method=lora", *args])
    batch, seq = 2, 16
    model = materialize(apply_adapters(build_model(cfg.model), cfg.model, cfg.peft), "cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    counted = counter.get_total_flops()
    adaptation = adaptation_of(cfg.model, cfg.peft)
    attention = 3 * flops.attention_flops_per_token(cfg.model, seq)  # the CPU flash kernel counts none of it
    expected = batch * seq * (flops.training_flops_per_token(cfg.model, seq, adaptation) - attention)
    if cfg.peft.method == "dora":  # W + s B A once per adapted linear and forward: 2 out x rank x in each
        expected += cfg.model.num_layers * sum(2 * a.b_params * a.linear.in_features
                                               for a in adapted_linears(cfg))
    assert counted == expected
    full = batch * seq * (flops.training_flops_per_token(cfg.model, seq) - attention)
    assert counted < 0.9 * full  # debug models: rank-8 adapters are large beside dim 64


def adapted_linears(cfg):
    from trainfit.peft.spec import block_adapters

    return block_adapters(cfg.model, cfg.peft)
