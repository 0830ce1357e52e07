"""Activation checkpointing policies: what is saved, what is recomputed, and that nothing changes."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from _toy import Net
from trainfit.config import ConfigError
from trainfit.memory.measured import current_allocated_bytes
from trainfit.recompute import apply_activation_checkpointing

aten = torch.ops.aten
NUM_LAYERS, DIM, HEADS, BATCH, SEQ = 4, 64, 4, 16, 64


def make(policy: str, every_n_layers: int = 1) -> Net:
    torch.manual_seed(0)
    model = Net(DIM, NUM_LAYERS, HEADS)
    apply_activation_checkpointing(model, policy, every_n_layers)
    return model


def batch() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def test_unknown_policy_and_bad_frequency_raise():
    with pytest.raises(ConfigError, match="memory.activation_checkpointing='partial'"):
        apply_activation_checkpointing(Net(DIM, NUM_LAYERS, HEADS), "partial")
    with pytest.raises(ConfigError, match="memory.ac_every_n_layers"):
        apply_activation_checkpointing(Net(DIM, NUM_LAYERS, HEADS), "full", every_n_layers=0)


@pytest.mark.parametrize(("policy", "n", "wrapped_ids"), [
    ("none", 1, []), ("full", 1, [0, 1, 2, 3]), ("selective", 2, [0, 2]), ("full", 3, [0, 3]),
])
def test_which_blocks_are_wrapped(policy, n, wrapped_ids):
    model = Net(DIM, NUM_LAYERS, HEADS)
    assert apply_activation_checkpointing(model, policy, n) == len(wrapped_ids)
    assert [i for i, b in enumerate(model.layers) if isinstance(b, CheckpointWrapper)] == wrapped_ids


def test_state_dict_keys_do_not_depend_on_policy():
    plain = make("none")
    keys = list(plain.state_dict())
    for policy in ("selective", "full"):
        assert list(make(policy, every_n_layers=2).state_dict()) == keys
    # Checkpoints load across policies in both directions, strictly.
    full = make("full")
    with torch.no_grad():
        for p in full.parameters():
            p.add_(1.0)
    plain.load_state_dict(full.state_dict())
    torch.testing.assert_close(plain.state_dict(), full.state_dict())
    selective = make("selective")
    selective.load_state_dict(plain.state_dict())
    torch.testing.assert_close(selective.state_dict(), full.state_dict())


def grads(policy: str) -> dict[str, torch.Tensor]:
    model = make(policy)
    x = batch()
    model(x).square().mean().backward()
    # named_parameters() of the root still shows the wrapper level; state_dict() does not.
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()]
    return {"input": x.grad, **{n: p.grad for n, p in zip(names, model.parameters(), strict=True)}}


def test_gradients_identical_across_policies():
    reference = grads("none")
    for policy in ("selective", "selective-alternate", "full"):
        torch.testing.assert_close(grads(policy), reference, rtol=1e-6, atol=1e-6)


def test_distributed_checkpoint_keys_do_not_depend_on_policy():
    """DCP's get_state_dict (what train/checkpoint.py saves) names model and optimizer state alike."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def keys(policy: str) -> tuple[list[str], list[str]]:
        model = make(policy, every_n_layers=2)
        optimizer = torch.optim.AdamW(model.parameters())
        model(batch()).sum().backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return list(model_sd), list(optim_sd["state"])

    reference = keys("none")
    assert reference[0] == reference[1] and reference[0][0] == "layers.0.norm1.weight"
    assert keys("selective") == reference
    assert keys("full") == reference


def hook_saved_bytes(policy: str) -> tuple[int, int]:
    """Bytes of distinct storages autograd saved during forward (not counting parameters)."""
    model = make(policy)
    x = batch()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values()), x.nbytes


def retained_bytes(policy: str) -> tuple[int, int]:
    """What the forward really keeps alive for backward, at the allocator (output excluded)."""
    model = make(policy)
    model(batch()).sum().backward()  # first-call allocations (thread pools, caches) out of the way
    x = batch()
    gc.collect()  # pending garbage freed mid-forward would lower the figure
    before = current_allocated_bytes()
    out = model(x)
    kept = current_allocated_bytes() - before - out.nbytes
    return kept, x.nbytes


def test_saved_tensor_hooks_see_block_inputs_only_under_checkpointing():
    none, _ = hook_saved_bytes("none")
    full, block_input = hook_saved_bytes("full")
    selective, _ = hook_saved_bytes("selective")
    assert full == NUM_LAYERS * block_input  # exactly: each checkpoint saves its block's input
    assert none > 10 * full
    # SAC keeps the matmul outputs in its own storage, out of reach of saved-tensor hooks, so the
    # hooks cannot rank selective against full; the allocator can (next test).
    assert selective == full


def test_selective_keeps_matmul_outputs_full_keeps_block_inputs():
    none, unit = retained_bytes("none")
    selective, _ = retained_bytes("selective")
    full, _ = retained_bytes("full")
    slack = 128 * 1024  # autograd nodes, RNG states, malloc's thread cache: small and constant
    # full: the inputs of blocks 1..L-1 (block 0's input existed before the forward).
    assert abs(full - (NUM_LAYERS - 1) * unit) < slack
    # selective, per block: input + qkv (3) + attention out (1) + proj (1) + fc1 (4) + fc2 (1)
    # units, plus the attention logsumexp (batch x heads x seq floats).
    logsumexp = BATCH * HEADS * SEQ * 4
    expected = NUM_LAYERS * (11 * unit + logsumexp) - unit
    assert abs(selective - expected) < slack
    assert none > 1.3 * selective
    # selective-alternate: qkv and fc1 (the 1st and 3rd matmuls) and attention; proj and fc2 not.
    alternate, _ = retained_bytes("selective-alternate")
    assert abs(alternate - (expected - 2 * NUM_LAYERS * unit)) < slack


def backward_counts(policy: str) -> tuple[int, int, Counter]:
    """Forward FLOPs, backward FLOPs and backward operator counts of one step."""
    model = make(policy)
    with FlopCounterMode(display=False) as forward_flops:
        loss = model(batch()).square().mean()
    ops = OpCounter()
    with FlopCounterMode(display=False) as backward_flops, ops:
        loss.backward()
    return forward_flops.get_total_flops(), backward_flops.get_total_flops(), ops.counts


def test_recompute_flops_and_ops():
    # FlopCounterMode counts the Linear matmuls; it has no formula for the CPU flash-attention op
    # (_scaled_dot_product_flash_attention_for_cpu), so attention is checked by op counts below.
    forward, none_bwd, none_ops = backward_counts("none")
    _, full_bwd, full_ops = backward_counts("full")
    _, selective_bwd, selective_ops = backward_counts("selective")
    _, alternate_bwd, alternate_ops = backward_counts("selective-alternate")
    assert forward == 2 * BATCH * SEQ * DIM * DIM * 12 * NUM_LAYERS  # qkv 3 + proj 1 + mlp 8
    assert none_bwd == 2 * forward
    # full reruns the forward matmuls, except each block's last one (fc2): nothing saved depends
    # on its output, and non-reentrant checkpoint stops recomputing once every saved tensor is back.
    fc2 = 2 * BATCH * SEQ * DIM * 4 * DIM * NUM_LAYERS
    assert full_bwd == 3 * forward - fc2
    assert selective_bwd == 2 * forward  # their outputs were saved: not rerun
    # selective-alternate saves qkv's and fc1's outputs, reruns proj (norm2 saves what follows it)
    # and stops before fc2, as full does.
    proj = 2 * BATCH * SEQ * DIM * DIM * NUM_LAYERS
    assert alternate_bwd == 2 * forward + proj

    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    cheap = (aten.native_layer_norm.default, aten.gelu.default)
    assert none_ops[aten.addmm.default] == 0 and none_ops[sdpa] == 0
    assert all(none_ops[op] == 0 for op in cheap)
    assert full_ops[aten.addmm.default] == 3 * NUM_LAYERS and full_ops[sdpa] == NUM_LAYERS
    assert selective_ops[aten.addmm.default] == 0 and selective_ops[sdpa] == 0
    assert selective_ops[aten.native_layer_norm.default] == 2 * NUM_LAYERS
    assert selective_ops[aten.gelu.default] == NUM_LAYERS
    assert alternate_ops[aten.addmm.default] == NUM_LAYERS and alternate_ops[sdpa] == 0
