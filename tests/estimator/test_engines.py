"""Another engine's behaviours (perf/engines.py), each against trainfit's own on the same layout: Megatron-Core's
pipeline buffers allocated per op, and its re-gather overlapped with the input-gradient GEMMs. Everything else in
the estimate stays trainfit's."""

from __future__ import annotations

import dataclasses

import pytest

from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.memory.closed_form import SharedSizes
from trainfit.memory.closed_form.pipeline_held import pipeline_held
from trainfit.memory.closed_form.rank_layout import layout_common, rank_layout
from trainfit.memory.closed_form.run_shape import Run
from trainfit.models.params import param_counts
from trainfit.parallel.resolve import build_layout
from trainfit.perf import kernels as K
from trainfit.perf.engines import MEGATRON_CORE, TRAINFIT_ENGINE
from trainfit.perf.timing import Rates, _compute_seconds, _overlapped, _rank_flops, timed_collectives

H100_PP4 = ("--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed", "--model.preset=llama3-8b",
            "--hardware.num_gpus=16", "--parallel.tp=4", "--parallel.sequence_parallel=true", "--parallel.pp=4",
            "--parallel.zero_stage=1", "--training.seq_len=4096", "--training.micro_batch_size=1")


PER_OP = dataclasses.replace(TRAINFIT_ENGINE, name="trainfit with per-op buffers", pipeline_buffers="per_op")
"""Megatron-Core's pipeline buffers alone, everything else trainfit's."""


def _boundary(cfg) -> int:
    layout = build_layout(cfg)
    run = Run(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer)
    return layout_common(run, SharedSizes(cfg.model)).micro_batch.boundary


@pytest.mark.parametrize("micro_batches", [8, 32])
def test_per_op_pipeline_buffers_hold_one_tensor_per_direction(micro_batches: int) -> None:
    """torch's stage keeps a receive slot per micro-batch (2 m boundaries on a middle stage) and its sends;
    Megatron-Core's p2p holds one received gradient, one sent input gradient and one arriving input,
    whatever m: the difference is the buffers alone, and the model states and activations are the same."""
    cfg = load_config(None, [*H100_PP4, f"--training.global_batch_size={micro_batches * 4}"])
    ours, megatron = estimate(cfg).memory, estimate(cfg, engine=PER_OP).memory
    boundary = _boundary(cfg)
    layout = build_layout(cfg)
    for stage in range(4):
        place = layout.rank_placement(stage)
        a, b = ours.per_stage[stage], megatron.per_stage[stage]
        assert b.buffers < a.buffers
        assert {k: v for k, v in a.components().items() if k != "buffers"} == \
            {k: v for k, v in b.components().items() if k != "buffers"}
        # a middle stage's torch slots alone: one input and one output gradient per micro-batch
        if 0 < stage < 3:
            assert a.buffers - b.buffers >= 2 * micro_batches * boundary - 3 * boundary
        run = Run(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer, PER_OP)
        common = layout_common(run, SharedSizes(cfg.model))
        held = pipeline_held(run, rank_layout(run, common, place), place, common.micro_batch, 0, 0)
        assert held.slots == 0
        assert held.sent == boundary * (min(1, place.sends_next) + 2 * min(1, place.sends_prev))


def test_per_op_buffers_do_not_grow_with_the_micro_batches() -> None:
    few, many = (estimate(load_config(None, [*H100_PP4, f"--training.global_batch_size={m * 4}"]),
                          engine=PER_OP).memory for m in (8, 32))
    assert [s.buffers for s in few.per_stage] == [s.buffers for s in many.per_stage]
    ours_few, ours_many = (estimate(load_config(None, [*H100_PP4, f"--training.global_batch_size={m * 4}"])).memory
                           for m in (8, 32))
    assert all(b.buffers > a.buffers for a, b in zip(ours_few.per_stage[1:], ours_many.per_stage[1:], strict=True))


def test_megatron_re_gathers_beside_the_input_gradient_gemms() -> None:
    """Under parallel.sp_recompute_gather each re-gather leaves max(0, C - G) exposed on Megatron-Core, G its
    group's dgrad GEMMs (as many FLOPs as their forward); trainfit's hook-driven re-gather stays exposed; the
    engines agree on every other call."""
    cfg = load_config(None, [*H100_PP4, "--parallel.pp=1", "--hardware.num_gpus=4", "--training.global_batch_size=8",
                             "--parallel.sp_recompute_gather=true"])
    layout = build_layout(cfg)
    assert layout.regathers
    rates = {e.name: Rates.of(cfg.hardware, e) for e in (TRAINFIT_ENGINE, MEGATRON_CORE)}
    timed = timed_collectives(cfg.model, layout, cfg.training, rates["trainfit"])
    flops = _rank_flops(cfg.model, layout, cfg.training, "cuda")
    rate = _compute_seconds(cfg.model, layout, cfg.training, rates["trainfit"], flops).matmul_flops_per_s
    ours = _overlapped(timed, cfg.model, layout, cfg.training, rates["trainfit"], rate)
    megatron = _overlapped(timed, cfg.model, layout, cfg.training, rates["megatron-core"], rate)
    gemms = {g.name: g for g in K.block_gemms(cfg.model, layout)}
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    regathers = 0
    for (c, one), (_, mine), (_, theirs) in zip(timed, ours, megatron, strict=True):
        assert mine == one
        if c.tensor == "regathered":
            regathers += 1
            assert set(c.overlaps) in ({"wq", "wk", "wv"}, {"w1", "w3"})
            g = sum(2 * tokens * gemms[n].share * gemms[n].k * gemms[n].n for n in c.overlaps) / rate
            assert theirs == pytest.approx(max(0.0, one - g), rel=1e-6)
            assert theirs < one
        else:
            assert theirs == one
    assert regathers == 2
    step = {name: estimate(cfg, engine=e).perf.time for name, e in
            (("trainfit", TRAINFIT_ENGINE), ("megatron-core", MEGATRON_CORE))}
    assert step["megatron-core"]["exposed_comm_s"] < step["trainfit"]["exposed_comm_s"]


def _model(*args: str):
    return load_config(None, ["--hardware.gpu=H100-SXM-80GB", *args]).model


def test_transformer_engine_layer_closed_forms() -> None:
    """A Llama layer of TE modules keeps (8h + 4q + 4kv + 6f + 4a + 8) bytes per token in bf16 and
    (6h + 5q + 4kv + 5f + 4a + 8) under fp8 (block/te_layer.py's table); a GPT layer (LayerNorm, 4h GELU MLP)
    in bf16 keeps 32h + 4a + 16: Korthikanti et al.'s 34 sbh less its two 1-byte dropout masks, the norms'
    statistics beside."""
    from trainfit.memory.closed_form.block.te_layer import te_layer_terms
    llama = _model("--model.preset=llama3-8b")
    h, q, kv, f, a = 4096, 4096, 1024, 14336, 32
    bf16, fp8 = te_layer_terms(llama, fp8=False), te_layer_terms(llama, fp8=True)
    assert bf16.seq + bf16.tp == 8 * h + 4 * q + 4 * kv + 6 * f + 4 * a + 8
    assert fp8.seq + fp8.tp == 6 * h + 5 * q + 4 * kv + 5 * f + 4 * a + 8
    # under sequence parallelism every term is the shard's; without it the norms' are whole
    tokens, tp = 4096, 4
    assert bf16.bytes(tokens, tokens, tp, sequence_parallel=True) == tokens * (bf16.seq + bf16.tp) // tp
    assert bf16.bytes(tokens, tokens, tp, sequence_parallel=False) == tokens * (bf16.seq + bf16.tp / tp)
    gpt = _model("--model.preset=", "--model.family=gpt2", "--model.dim=2048", "--model.num_layers=2",
                 "--model.num_heads=16", "--model.ffn_dim=8192", "--model.vocab_size=1024", "--model.max_seq_len=1024")
    terms = te_layer_terms(gpt, fp8=False)
    assert terms.seq + terms.tp == 32 * 2048 + 4 * 16 + 16
    moe = _model("--model.preset=qwen3-30b-a3b")
    assert te_layer_terms(moe, fp8=False) is None  # not described: trainfit's own estimate


def test_megatron_estimates_keep_less_than_trainfits_blocks_on_the_same_layout() -> None:
    """The TE layer and Megatron's loss replace trainfit's blocks' and loss's saved bytes (tp 4, SP, bf16):
    activations and logits drop, the model states stay."""
    cfg = load_config(None, [*H100_PP4, "--parallel.pp=1", "--hardware.num_gpus=4", "--training.global_batch_size=8",
                             "--parallel.sp_recompute_gather=true"])
    ours, megatron = estimate(cfg).memory.worst, estimate(cfg, engine=MEGATRON_CORE).memory.worst
    assert megatron.activations < ours.activations and megatron.logits < ours.logits
    assert (megatron.params, megatron.grads, megatron.optimizer) == (ours.params, ours.grads, ours.optimizer)


MASTER_WEIGHTS = dataclasses.replace(TRAINFIT_ENGINE, name="trainfit with master weights", ddp_master_weights=True)
"""An engine whose ZeRO-0 keeps fp32 master weights and gradient buffers beside a 16-bit module, alone."""

DDP_8B = ("--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed", "--model.preset=llama3-8b",
          "--hardware.num_gpus=4", "--parallel.zero_stage=0", "--optimizer.grad_accum_dtype=fp32",
          "--training.seq_len=2048", "--training.micro_batch_size=1", "--training.global_batch_size=8")


@pytest.mark.parametrize("gpus", [1, 4])
def test_master_weights_ddp_holds_zero1_states_on_one_shard(gpus: int) -> None:
    """nanotron's and Megatron-Core's ZeRO-0 under bf16: bf16 parameters (2), fp32 masters (4), fp32 gradient
    buffers (4) and AdamW's moments (8) per parameter, ZeRO-1's states sharded over one rank, where trainfit's
    autocast keeps fp32 parameters. Its module runs in bf16: no autocast, a 16-bit residual stream, fewer
    activation bytes; DDP's all-reduce stays the only data-parallel collective."""
    cfg = load_config(None, [*DDP_8B, f"--hardware.num_gpus={gpus}"])
    ours, theirs = estimate(cfg), estimate(cfg, engine=MASTER_WEIGHTS)
    assert not ours.layout.ddp_master_weights and theirs.layout.ddp_master_weights
    assert ours.layout.autocast and not theirs.layout.autocast and theirs.layout.stream_bytes == 2
    counts = param_counts(cfg.model)
    n = counts.embedding + counts.blocks + counts.final_norm + counts.output
    b = theirs.memory.per_stage[0]
    assert (b.params, b.master_params, b.grads) == (2 * n, 4 * n, 4 * n)
    assert 0 <= b.optimizer - 8 * n < 4096  # AdamW's moments, and a step counter per tensor
    assert b.activations < ours.memory.per_stage[0].activations
    # the same collectives: DDP's all-reduce of the gradients (none on one rank), no parameter all-gather
    kinds = {(c.kind, c.tensor) for c, _ in theirs.perf.collectives if c.tensor.startswith("bucket")}
    assert kinds == ({("all_reduce", "bucket_grads")} if gpus > 1 else set())
    assert kinds == {(c.kind, c.tensor) for c, _ in ours.perf.collectives if c.tensor.startswith("bucket")}


def test_master_weights_leave_other_data_parallel_engines_alone() -> None:
    """ZeRO-1 and FSDP runs are estimated the same whether or not the engine keeps master weights under ZeRO-0."""
    for stage in (1, 3):
        cfg = load_config(None, [*DDP_8B, f"--parallel.zero_stage={stage}"])
        assert estimate(cfg).memory.per_stage[0] == estimate(cfg, engine=MASTER_WEIGHTS).memory.per_stage[0]
        assert estimate(cfg).perf.time["step_time_s"] == estimate(cfg, engine=MASTER_WEIGHTS).perf.time["step_time_s"]


def test_zero1_all_reducing_its_gradients_moves_twice_the_reduce_scatters_bytes() -> None:
    """nanotron's ZeRO-1 all-reduces the whole gradient buffers after the backward (Engine.zero1_grad_reduce):
    the same buckets as trainfit's reduce-scatter, a ring all-reduce's two passes over them; the parameters'
    all-gather and the memory stay as they are."""
    engine = dataclasses.replace(TRAINFIT_ENGINE, name="trainfit with an all-reducing ZeRO-1",
                                 zero1_grad_reduce="all_reduce")
    cfg = load_config(None, [*DDP_8B, "--hardware.num_gpus=8", "--parallel.zero_stage=1"])
    ours, theirs = estimate(cfg), estimate(cfg, engine=engine)
    grads = {e: {c.kind: (c, s) for c, s in est.perf.collectives if c.tensor == "bucket_grads"}
             for e, est in (("ours", ours), ("theirs", theirs))}
    assert set(grads["ours"]) == {"reduce_scatter"} and set(grads["theirs"]) == {"all_reduce"}
    (rs, rs_s), (ar, ar_s) = grads["ours"]["reduce_scatter"], grads["theirs"]["all_reduce"]
    assert rs.nbytes == ar.nbytes and rs.count == ar.count
    assert 1.5 * rs_s < ar_s <= 2.05 * rs_s  # two passes over the bytes; the per-call latency is not doubled
    assert ours.memory.per_stage[0] == theirs.memory.per_stage[0]
    params = [[(c.kind, c.nbytes) for c, _ in est.perf.collectives if c.tensor == "bucket_params"]
              for est in (ours, theirs)]
    assert params[0] == params[1] and params[0]
