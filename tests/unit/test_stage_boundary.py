"""The stage boundary given to torch's PipelineStage as static metadata: the shapes and dtypes that
torch's own metadata inference found on gloo (fp32, bf16 autocast, bf16-pure, FSDP2 bf16 mixed
precision, tp2 + SP: the dtype of the residual stream, the positions each rank holds)."""

from __future__ import annotations

import torch

from trainfit.configure import load_config
from trainfit.parallel.pipeline import stage_boundary
from trainfit.parallel.resolve import build_layout
from trainfit.precision import precision_policy

PP2 = ("--model.preset=debug", "--model.num_layers=4", "--parallel.pp=2", "--training.seq_len=32",
       "--training.micro_batch_size=4", "--training.global_batch_size=8")


def boundary_of(*overrides: str):
    cfg = load_config(None, [*PP2, *overrides])
    return stage_boundary(cfg.model, cfg.training.seq_len, build_layout(cfg), precision_policy(cfg.precision.mode,
                                                                                                 "cpu")), cfg.model


def test_hidden_states_travel_in_the_residual_streams_dtype() -> None:
    fp32, model = boundary_of("--hardware.num_gpus=2")
    assert (fp32.tokens, fp32.hidden, fp32.logits) == ((4, 32), (4, 32, model.dim), (4, 32, model.vocab_size))
    assert fp32.hidden_dtype == fp32.logits_dtype == torch.float32
    autocast, _ = boundary_of("--hardware.num_gpus=2", "--precision.mode=bf16-mixed")
    assert (autocast.hidden_dtype, autocast.logits_dtype) == (torch.float32, torch.bfloat16)  # fp32 residual adds
    pure, _ = boundary_of("--hardware.num_gpus=2", "--precision.mode=bf16-pure")
    assert (pure.hidden_dtype, pure.logits_dtype) == (torch.bfloat16, torch.bfloat16)
    fsdp, _ = boundary_of("--hardware.num_gpus=4", "--parallel.zero_stage=3", "--precision.mode=bf16-mixed",
                          "--training.micro_batch_size=2")
    assert (fsdp.hidden, fsdp.hidden_dtype) == ((2, 32, model.dim), torch.bfloat16)  # FSDP2's compute copies


def test_sequence_and_context_parallel_shard_the_positions() -> None:
    sharded, model = boundary_of("--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                                 "--parallel.cp=2", "--parallel.zero_stage=3")
    assert sharded.tokens == (4, 16)  # the rank's cp chunks
    assert sharded.hidden == (4, 8, model.dim)  # and 1/tp of those under sequence parallelism
    assert sharded.logits == (4, 16, model.vocab_size // 2)  # the vocabulary shard


def test_examples_per_stage() -> None:
    boundary, model = boundary_of("--hardware.num_gpus=2")
    first_in, first_out = boundary.examples(0, 2)
    last_in, last_out = boundary.examples(1, 2)
    assert first_in.dtype == torch.long and not first_in.requires_grad
    assert first_out.shape == last_in.shape == (4, 32, model.dim) and last_in.requires_grad
    assert last_out.shape == (4, 32, model.vocab_size) and last_out.requires_grad  # torch wants outputs to need grad
    assert all(t.device.type == "meta" for t in (first_in, first_out, last_in, last_out))
