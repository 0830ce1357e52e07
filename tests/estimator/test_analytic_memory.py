"""The analytic memory model on its own: published closed forms, parallel layouts, invariants.

Pure arithmetic, no torch: every test here runs in milliseconds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from korthikanti import korthikanti_layer_bytes

from _analytic import memory_of as estimate_memory
from _analytic import retained_of as forward_retained_bytes
from _analytic import states_of as model_states
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.memory import COMPONENTS, PHASES, margin
from trainfit.memory.closed_form.analytic import zero_model_state_bytes
from trainfit.memory.closed_form.block.activation_terms import FP32, ActDtypes
from trainfit.memory.closed_form.block.activations import block_terms
from trainfit.memory.closed_form.run_shape import Run
from trainfit.models.params import param_counts
from trainfit.parallel.resolve import build_layout

GB = 1e9
MIB = 2**20


def cfg_of(*overrides: str):
    return load_config(None, list(overrides))


def test_the_analytic_path_imports_no_torch():
    code = ("import sys, trainfit.memory.closed_form.analytic as a, trainfit.configure as c\n"
            "import trainfit.parallel.resolve as l\n"
            "cfg = c.load_config(None, ['--model.preset=llama3-8b', '--hardware.num_gpus=8',\n"
            "    '--parallel.zero_stage=3', '--training.micro_batch_size=1', '--training.global_batch_size=8'])\n"
            "a.estimate_memory(cfg.model, l.build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- ZeRO (arXiv 1910.02054)


def test_zero_paper_model_state_figures():
    # Mixed-precision Adam: 2 (fp16 params) + 2 (fp16 grads) + K = 12 (fp32 master, momentum,
    # variance) = 16 bytes per parameter (Sec. 3.1).
    assert zero_model_state_bytes(1, 0, 1) == 16
    # Fig. 1: 7.5B parameters on 64 GPUs, stages 0 (baseline), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p).
    figures = [zero_model_state_bytes(7_500_000_000, stage, 64) / GB for stage in range(4)]
    assert figures == pytest.approx([120, 31.4, 16.6, 1.875], rel=0.003)
    # Sec. 3.1: GPT-2 (1.5B) needs 24 GB of model states in mixed-precision Adam.
    assert zero_model_state_bytes(1_500_000_000, 0, 1) / GB == pytest.approx(24)
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        zero_model_state_bytes(1, 4, 8)


def _bf16_adamw_on_64(stage: int):
    return cfg_of("--model.preset=llama2-7b", "--hardware.num_gpus=64", f"--parallel.zero_stage={stage}",
                  "--precision.mode=bf16-mixed", "--optimizer.name=adamw", "--training.micro_batch_size=1",
                  "--training.global_batch_size=64")


def test_estimate_reproduces_the_zero_paper_where_the_layouts_agree():
    """bf16-mixed AdamW over 64 ranks, every model state once the optimizer is about to step
    (`model_states`). Stage 0 (DDP) keeps fp32 parameters (the masters), fp32 gradients and two
    fp32 states: 4 + 4 + 8 = 16 bytes per parameter, the paper's total (it splits them 2 + 2 + 12);
    stage 3 (FSDP2) shards all of it: 16/N. Stage 1 (parallel/zero.py) is the paper's P_os, 2Ψ bf16
    parameters + 2Ψ bf16 gradients + 12Ψ/N (fp32 master, momentum, variance), and at that moment
    also its master shard's fp32 gradient (4Ψ/N, cast from the reduced bf16 shard). Stage 2 is FSDP2
    with reshard_after_forward=False: its resident states are ZeRO-3's, and from each block's
    forward to its backward it holds the block's bf16 copy (2 bytes, the paper's fp16 parameters),
    while its gradient shards are fp32 (4/N where the paper has 2/N fp16)."""
    psi = param_counts(_bf16_adamw_on_64(0).model).total
    by_stage = {s: model_states(_bf16_adamw_on_64(s)).model_states for s in range(4)}
    assert by_stage[0] == pytest.approx(zero_model_state_bytes(psi, 0, 64), rel=0.01)
    assert by_stage[3] == pytest.approx(zero_model_state_bytes(psi, 3, 64), rel=0.01)
    assert by_stage[1] == pytest.approx(zero_model_state_bytes(psi, 1, 64) + 4 * psi / 64, rel=0.001)
    assert by_stage[2] == by_stage[3]
    zero2 = estimate_memory(_bf16_adamw_on_64(2)).worst  # its peak: the forward's end or the backward
    assert zero2.peak_phase != "optimizer" and zero2.params == 2 * psi
    assert zero2.params + zero2.master_params + zero2.optimizer == pytest.approx(psi * (2 + 12 / 64), rel=0.001)
    assert psi * (2 + 16 / 64) == pytest.approx(zero_model_state_bytes(psi, 2, 64), rel=0.02)
    # Where the stage-0 states live at a backward peak: fp32 masters, and (torch.amp) the bf16
    # copies of every matmul weight that autocast made and autograd saved, reported as params.
    peak = estimate_memory(load_config(None, ["--model.preset=llama2-7b", "--hardware.num_gpus=64",
                                              "--precision.mode=bf16-mixed", "--training.seq_len=4096",
                                              "--training.micro_batch_size=4", "--training.global_batch_size=256"]
                                       )).worst
    assert peak.peak_phase == "backward" and peak.master_params == 4 * psi
    matmul_weights = psi - param_counts(_bf16_adamw_on_64(0).model).embedding
    assert peak.params == pytest.approx(2 * matmul_weights, rel=0.001)


def test_llama2_7b_on_64_ranks_fp16_mixed_holds_each_stages_form_at_the_peak():
    """`trainfit estimate`'s model states (params + master_params + grads + optimizer at the peak)
    follow parallel/data_parallel.py's table of forms. ZeRO-1 is the paper's 4Ψ + 12Ψ/N
    (28.2 GB; 41.0 GB when it was ZeroRedundancyOptimizer over DDP: fp32 parameters 4Ψ, autocast's
    bf16 copies ~2Ψ, states 8Ψ/N, no gradient yet at its peak), 6Ψ + 12Ψ/N with fp32 gradient
    accumulation (Megatron's main grads); ZeRO-2 holds 2Ψ + 16Ψ/N once its gradient shards exist
    (here from gradient accumulation's first micro-batch on: the paper's 2Ψ + 14Ψ/N, with fp32
    gradient shards)."""
    base = ("--model.preset=llama2-7b", "--hardware.num_gpus=64", "--precision.mode=fp16-mixed",
            "--training.micro_batch_size=16", "--training.global_batch_size=1024")
    psi, n = param_counts(cfg_of(*base).model).total, 64

    def worst(*extra: str):
        return estimate(cfg_of(*base, *extra)).worst

    zero1 = worst("--parallel.zero_stage=1")
    assert zero1.model_states == pytest.approx(psi * (4 + 12 / n), rel=1e-4)  # + AdamW's 4-byte step counters
    assert zero1.model_states / GB == pytest.approx(28.2, abs=0.05)
    assert zero1.model_states == pytest.approx(zero_model_state_bytes(psi, 1, n), rel=1e-4)
    assert (zero1.params, zero1.grads, zero1.master_params) == (2 * psi, 2 * psi, 4 * psi // n)
    fp32_grads = worst("--parallel.zero_stage=1", "--optimizer.grad_accum_dtype=fp32")
    assert fp32_grads.model_states == pytest.approx(psi * (6 + 12 / n), rel=1e-4)
    zero2 = worst("--parallel.zero_stage=2", "--training.global_batch_size=2048")  # 2 micro-batches
    assert zero2.model_states == pytest.approx(psi * (2 + 16 / n), rel=1e-4)
    assert zero2.grads == 4 * psi // n and zero2.params == 2 * psi

def test_zero_stages_and_hsdp_shard_what_they_promise():
    def states(*extra: str):
        return model_states(cfg_of("--model.preset=llama2-7b", "--hardware.num_gpus=8",
                                   "--training.micro_batch_size=1", "--training.global_batch_size=8", *extra))

    s0, s1, s2, s3 = (states(f"--parallel.zero_stage={s}") for s in range(4))
    assert s1.optimizer == pytest.approx(s0.optimizer / 8, rel=0.01) and s1.grads == s0.grads
    assert s2.grads == pytest.approx(s0.grads / 8, rel=0.01) and s2.params == s3.params
    assert s3.params == pytest.approx(s0.params / 8, rel=0.01)
    hsdp = states("--parallel.zero_stage=3", "--parallel.dp_replicate=2")  # dp_shard = 4
    assert hsdp.params == pytest.approx(s0.params / 4, rel=0.01)
    offloaded = estimate_memory(cfg_of("--model.preset=llama2-7b", "--hardware.num_gpus=8",
                                       "--parallel.zero_stage=3", "--memory.offload=optimizer",
                                       "--training.micro_batch_size=1", "--training.global_batch_size=8")).worst
    assert offloaded.optimizer == offloaded.params == offloaded.master_params == 0
    assert offloaded.buffers > 0  # the gathered blocks still compute on the device


# ---------------------------------------------------------------- Korthikanti et al. (arXiv 2205.05198)


def test_korthikanti_closed_forms():
    s, b, h, a, t = 2048, 4, 12288, 96, 8  # GPT-3 175B's layer
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 * sbh / t)
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * sbh
    assert korthikanti_layer_bytes(s, b, h, a, t, True, "full") == 2 * sbh / t


def test_our_gpt2_block_is_korthikantis_block_with_flash_attention_and_no_dropout():
    """Our GPT-2 block in 16 bits keeps exactly Korthikanti's 34 sbh minus the two 1-byte dropout
    masks (we have no dropout); fused attention replaces the 5as^2b attention core by a fp32
    logsumexp per head and token, and LayerNorm keeps its mean and rstd (2 per token each)."""
    m = cfg_of("--model.preset=gpt2-medium").model
    s, b, h, a = 1024, 2, m.dim, m.num_heads
    bf16 = ActDtypes(stream=2, compute=2, autocast=False)
    ours = block_terms(m, bf16, "none").bytes(tokens=s * b, seq_len=s)
    paper_without_core = korthikanti_layer_bytes(s, b, h, a, recompute="selective")
    assert ours == paper_without_core - 2 * s * b * h + s * b * (4 * a + 2 * 2 * 2)
    assert block_terms(m, bf16, "full").bytes(tokens=s * b, seq_len=s) == korthikanti_layer_bytes(
        s, b, h, a, recompute="full")
    # Tensor + sequence parallelism divides everything but the all-gathered inputs of the
    # column-parallel matmuls, which torch's DTensor plans save whole (Megatron re-gathers them).
    t = 4
    # Tensor parallelism alone divides what Korthikanti's 24/t term holds (and our per-head logsumexp).
    tp_only = block_terms(m, bf16, "none").bytes(tokens=s * b, seq_len=s, tp=t)
    assert tp_only == pytest.approx(korthikanti_layer_bytes(s, b, h, a, t, recompute="selective")
                                    - 2 * s * b * h + s * b * (4 * a / t + 2 * 2 * 2), abs=1)
    sharded = block_terms(m, bf16, "none").bytes(tokens=s * b, seq_len=s, tp=t, sequence_parallel=True)
    gathered = 2 * 2 * s * b * h  # the two LayerNorm outputs, 16-bit
    assert sharded == pytest.approx((ours - gathered) / t + gathered, abs=1)


# ---------------------------------------------------------------- layouts and invariants


def test_every_breakdown_adds_up_and_names_its_phase():
    for overrides in (
        (),
        ("--precision.mode=bf16-mixed", "--memory.activation_checkpointing=full"),
        ("--model.preset=llama3-8b", "--hardware.num_gpus=16", "--parallel.tp=2", "--parallel.pp=2",
         "--parallel.zero_stage=3", "--hardware.gpu=H100-SXM-80GB", "--training.global_batch_size=64"),
        ("--model.preset=mixtral-8x7b", "--hardware.num_gpus=16", "--parallel.ep=8", "--parallel.zero_stage=2",
         "--precision.mode=bf16-pure", "--memory.activation_checkpointing=selective",
         "--training.micro_batch_size=1", "--training.global_batch_size=16"),
    ):
        for b in estimate_memory(cfg_of(*overrides)).per_stage:
            assert b.peak == sum(b.components().values())
            assert set(b.phase_peaks) == set(PHASES) and b.peak == max(b.phase_peaks.values())
            assert b.peak_phase in PHASES and all(getattr(b, c) >= 0 for c in COMPONENTS)


def test_reserved_margin_only_on_gpus():
    assert estimate_memory(cfg_of()).worst.reserved_margin == 0
    gpu = estimate_memory(cfg_of("--hardware.gpu=H100-SXM-80GB")).worst
    assert gpu.reserved_margin == int(margin.CUDA_CONTEXT_BYTES + margin.ALLOCATOR_FRAGMENTATION * gpu.peak)


def test_pipeline_stages_hold_their_layers_and_in_flight_micro_batches():
    base = ("--model.preset=llama3-8b", "--hardware.num_gpus=4", "--parallel.pp=4", "--training.seq_len=2048",
            "--training.micro_batch_size=1", "--training.global_batch_size=16", "--precision.mode=bf16-mixed",
            "--parallel.pp_layers_per_stage=8,8,8,8")  # even: the in-flight micro-batches alone differ
    one_f_one_b = estimate_memory(cfg_of(*base))
    # 1F1B: rank i keeps p - i micro-batches; the first stage is the worst.
    assert one_f_one_b.worst_stage == 0
    acts = [b.activations for b in one_f_one_b.per_stage]
    assert acts[0] > acts[1] > acts[2]
    assert acts[0] / acts[2] == pytest.approx(4 / 2, rel=0.1)
    gpipe_cfg = cfg_of(*base, "--parallel.pp_schedule=gpipe")
    gpipe_run = Run(gpipe_cfg.model, build_layout(gpipe_cfg), gpipe_cfg.training, gpipe_cfg.hardware,
                    gpipe_cfg.optimizer)
    assert gpipe_run.layout.micro_batches_in_flight(0) == (16.0, 16)  # all 16 micro-batches
    assert estimate_memory(gpipe_cfg).per_stage[0].activations > 3.5 * acts[0]
    # Embeddings on the first stage, the output projection on the last.
    states = [model_states(cfg_of(*base), stage=i) for i in range(4)]
    counts = param_counts(cfg_of(*base).model)
    assert sum(s.master_params for s in states) == 4 * counts.total
    assert states[3].master_params - states[1].master_params == 4 * (counts.output + counts.final_norm)
    # Interleaved 1F1B: rank 0 keeps L (1 + (p - 1)/(pv)) layers' worth (Korthikanti Sec. 4.2.3).
    cfg = cfg_of(*base, "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=2",
                 "--parallel.num_microbatches=16", "--parallel.pp_layers_per_stage=" + ",".join(["4"] * 8))
    run = Run(cfg.model, build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer)
    in_flight, _ = run.layout.micro_batches_in_flight(0)
    assert in_flight * (32 / 4) == pytest.approx(32 * (1 + 3 / 8))


def test_tensor_context_and_expert_parallelism_divide_what_they_shard():
    def worst(*extra: str):
        return estimate_memory(cfg_of("--model.preset=llama3-8b", "--training.seq_len=4096",
                                      "--training.micro_batch_size=1", *extra)).worst

    dense, tp = worst("--hardware.num_gpus=1"), worst("--hardware.num_gpus=4", "--parallel.tp=4",
                                                      "--training.global_batch_size=1")
    assert tp.params == pytest.approx(dense.params / 4, rel=0.01)
    one = ("--training.micro_batch_size=1", "--training.global_batch_size=1")
    with_sp = forward_retained_bytes(cfg_of("--model.preset=llama3-8b", "--hardware.num_gpus=4", "--parallel.tp=4",
                                            "--parallel.sequence_parallel=true", *one))
    without_sp = forward_retained_bytes(cfg_of("--model.preset=llama3-8b", "--hardware.num_gpus=4",
                                               "--parallel.tp=4", *one))
    assert with_sp < without_sp < forward_retained_bytes(cfg_of("--model.preset=llama3-8b", *one))
    cp = forward_retained_bytes(cfg_of("--model.preset=llama3-8b", "--hardware.num_gpus=2", "--parallel.cp=2",
                                       "--training.seq_len=4096", "--training.micro_batch_size=1",
                                       "--training.global_batch_size=1"))
    full = forward_retained_bytes(cfg_of("--model.preset=llama3-8b", "--training.seq_len=4096",
                                         "--training.micro_batch_size=1"))
    # Half of everything, but the attention's k and v, saved whole-sequence (cp times a rank's own),
    # the chunks' merged output and the RoPE rows of the rank's positions (fp32, llama3-8b: 32
    # layers, q 4096 and k/v 1024 wide, head 128; 2048 local tokens).
    layers, local = 32, 2048
    assert cp - full / 2 == layers * local * FP32 * (2 * 1024 * (2 - 1) + 4096) + local * 2 * 128 * FP32
    moe = ("--model.preset=mixtral-8x7b", "--hardware.num_gpus=8", "--parallel.zero_stage=0",
           "--training.micro_batch_size=1", "--training.global_batch_size=8")
    counts = param_counts(cfg_of(*moe).model)
    ep1, ep8 = model_states(cfg_of(*moe)), model_states(cfg_of(*moe, "--parallel.ep=8"))
    assert ep1.params - ep8.params == 4 * counts.num_layers * counts.routed_experts * 7 // 8


def test_checkpointing_chunked_loss_and_precision_move_the_peak_the_right_way():
    def peak(*extra: str) -> int:
        return estimate_memory(cfg_of("--model.preset=llama3-8b", "--training.seq_len=4096",  # 8 micro-batches
                                      "--training.micro_batch_size=2", "--training.global_batch_size=16",
                                      *extra)).worst.peak

    assert peak() > peak("--memory.activation_checkpointing=selective") > peak("--memory.activation_checkpointing=full")
    assert peak("--memory.activation_checkpointing=full", "--memory.ac_every_n_layers=2") > peak(
        "--memory.activation_checkpointing=full")
    assert peak("--memory.chunked_loss=true") < peak()
    assert peak("--precision.mode=bf16-pure") < peak("--precision.mode=bf16-mixed") < peak()
    # A large vocabulary on a small model: the peak is the start of the backward, which holds
    # log_softmax's output and two fp32 logits-sized gradients.
    big_vocab = estimate_memory(cfg_of("--model.preset=debug", "--model.vocab_size=128256")).worst
    assert big_vocab.peak_phase == "backward" and big_vocab.logits == 3 * 4 * 16 * 128 * 128256


@pytest.mark.parametrize(("mode", "cast"), [("fp32", 0), ("bf16-mixed", 2)])
def test_a_chunked_loss_of_one_chunk_moves_the_hidden_states_and_saves_nothing(mode: str, cast: int) -> None:
    """One chunk of the whole micro-batch (8 x 256 tokens): its logits are all the logits. The final
    norm's output becomes the loss's (the chunk's checkpointed input), and so does the output
    projection's compute-dtype copy of it under autocast (recomputed in backward). In fp32 that output
    was the projection's saved input already: the peak stays. Under autocast the projection saved
    only the copy, and the fp32 output is new: the peak grows by it. The measured step (trainfit
    measure) moves the same bytes."""
    shape = ("--model.preset=debug", "--model.dim=128", "--model.vocab_size=4096", "--model.max_seq_len=256",
             "--training.seq_len=256", "--training.micro_batch_size=8", f"--precision.mode={mode}")
    whole = estimate_memory(cfg_of(*shape)).worst
    one = estimate_memory(cfg_of(*shape, "--memory.chunked_loss=true", "--memory.loss_chunk_tokens=2048")).worst
    hidden = 8 * 256 * 128 * FP32  # the residual stream stays fp32 under autocast
    assert one.peak_phase == whole.peak_phase == "backward"
    assert one.logits - whole.logits == hidden + 8 * 256 * 128 * cast
    assert whole.activations - one.activations == hidden * (mode == "fp32") + 8 * 256 * 128 * cast
    assert one.peak - whole.peak == (0 if mode == "fp32" else hidden)


@pytest.mark.parametrize(("compiled", "cast"), [(False, 9), (True, 1)])
def test_float8_backward_is_counted_on_the_ranks_shards(compiled: bool, cast: int) -> None:
    """llama3.1-8b at tp 8 with SP and 2 FSDP shards, full checkpointing, 2 x 8192 tokens (the loss chunked away): the
    fp8-mixed peak is the MLP's output linear's backward (w2) as the recompute ends, the recompute's end in
    bf16-mixed but for the float8 backward's own tensors, counted on the rank's shard of w2 (14336 / 8 =
    1792 -> 4096 features), beside its incoming gradient (the all-gathered one, as bf16-mixed has it).
    Eager, the second output-gradient cast runs at 9 bytes per element (fp32 upcast, scaled product and
    clamp, fp8 bits) beside the first cast's fp8 bits, the weight's and the bf16 input gradient; compiled,
    a cast is one fused kernel writing fp8 only, and the input's cast is the largest moment.
    The bf16-mixed peak is later, at w1's backward (step_peak's first linears): above the recompute's end
    by the MLP's three unsharded weight gradients and, per row, w1's output gradient, the partial sum of
    the input gradient (w3's) and w1's own, less the branch's gradient and SwiGLU's four tensors freed."""
    shape = ("--model.preset=llama3.1-8b", "--hardware.num_gpus=16", "--parallel.tp=8",
             "--parallel.sequence_parallel=true", "--parallel.zero_stage=3", "--training.seq_len=8192",
             "--model.max_seq_len=8192", "--training.micro_batch_size=2", "--training.global_batch_size=4",
             "--memory.activation_checkpointing=full", "--memory.chunked_loss=true",
             f"--training.compile={str(compiled).lower()}")
    bf16, fp8 = (estimate_memory(cfg_of(*shape, f"--precision.mode={mode}")).worst
                 for mode in ("bf16-mixed", "fp8-mixed"))
    rows, k, n = 2 * 8192, 14336 // 8, 4096
    second_grad_cast = rows * (n + 2 * k + cast * n)  # G8, the input gradient, the cast running
    input_cast = rows * (2 * n + 2 * k + cast * k)  # both G8s, the input gradient, the cast running
    # w1, w2, w3's gradients; per row w1's output gradient, the partial sum and w1's input gradient,
    # less the branch's gradient and SwiGLU's four tensors (all bf16)
    w1_moment = 2 * 3 * k * n + rows * (2 * k + 2 * n + 2 * n - 2 * n - 4 * 2 * k)
    assert fp8.peak - bf16.peak == max(second_grad_cast, input_cast) + k * n - w1_moment  # + the weight's fp8 bits

def test_optimizers_and_their_step_temporaries():
    def states(name: str, *extra: str):
        return model_states(cfg_of("--model.preset=llama3-8b", f"--optimizer.name={name}", *extra))

    psi = param_counts(cfg_of("--model.preset=llama3-8b").model).total
    assert states("adamw").optimizer == pytest.approx(8 * psi, rel=1e-4)  # + one fp32 `step` per tensor
    assert states("sgd").optimizer == 4 * psi
    assert states("adamw-8bit").optimizer == pytest.approx((2 + 2 * 4 / 256) * psi, rel=1e-3)  # codes + scales
    assert states("adamw", "--precision.mode=bf16-pure").optimizer == pytest.approx(4 * psi, rel=1e-4)
    # foreach AdamW's sqrt list vs the fused kernel (the default on GPU and CPU) that allocates nothing.
    foreach = estimate_memory(cfg_of("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB",
                                     "--optimizer.fused=false")).worst
    fused = estimate_memory(cfg_of("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB")).worst
    assert foreach.phase_peaks["optimizer"] - fused.phase_peaks["optimizer"] == pytest.approx(4 * psi, rel=0.01)


TINY_SHAPES = [(256, 256), (128, 256), (128, 256), (256, 256), (768, 256), (256, 768), (768, 256)]
"""The tiny preset's block matrices (wq wk wv wo w1 w2 w3; dim 256, 2 KV heads of 64, ffn 768)."""


def test_adamw_8bit_states_tensor_by_tensor():
    """torchao's AdamW8bit: per matrix uint8 codes + an fp32 scale per 256 values + a 1 KiB code
    table, for each of its two states; 1-D norms keep plain fp32 states; a 4-byte step per tensor."""
    cfg = cfg_of("--model.preset=tiny", "--optimizer.name=adamw-8bit")
    matrices = TINY_SHAPES * 4 + [(256, 256)] * 2  # 4 blocks, embedding, output
    eight_bit = sum(2 * (r * c + 4 * r * c // 256 + 1024) for r, c in matrices)
    norms, tensors = 256 * (2 * 4 + 1), 9 * 4 + 3
    assert model_states(cfg).optimizer == eight_bit + 2 * 4 * norms + 4 * tensors
    # Under ZeRO-3 on 2 ranks every matrix's shard still quantizes (half its rows).
    z3 = cfg_of("--model.preset=tiny", "--optimizer.name=adamw-8bit", "--parallel.zero_stage=3",
                "--hardware.num_gpus=2")
    halves = sum(2 * (r * c // 2 + 4 * r * c // 512 + 1024) for r, c in matrices)
    assert model_states(z3).optimizer == halves + 2 * 4 * norms // 2 + 4 * tensors
    # A matrix under torchao's 4096 values keeps plain states (dim 32: the attention's 32 x 32 and
    # 16 x 32); the feed-forward's 128 x 32 (4096 values) and the 256 x 32 embedding and output quantize.
    small = cfg_of("--model.preset=tiny", "--model.dim=32", "--model.num_heads=2", "--model.num_kv_heads=1",
                   "--model.ffn_dim=128", "--model.vocab_size=256", "--optimizer.name=adamw-8bit")
    plain = 4 * 2 * 4 * (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32)
    quantized = sum(2 * (n + 4 * n // 256 + 1024) for n in [128 * 32] * 3 * 4 + [256 * 32] * 2)
    assert model_states(small).optimizer == plain + quantized + 2 * 4 * 32 * 9 + 4 * tensors


def test_adafactor_factored_states_and_temporaries():
    """torch.optim.Adafactor: a row and a column vector per matrix, a whole variance per vector, a
    step per tensor; its foreach step holds the matrices' `row_var @ col_var` estimates at once."""
    cfg = cfg_of("--model.preset=tiny", "--optimizer.name=adafactor")
    matrices = TINY_SHAPES * 4 + [(256, 256)] * 2
    norms, tensors = 256 * 9, 9 * 4 + 3
    assert model_states(cfg).optimizer == 4 * sum(r + c for r, c in matrices) + 4 * norms + 4 * tensors
    bf16 = cfg_of("--model.preset=tiny", "--optimizer.name=adafactor", "--precision.mode=bf16-pure")
    assert model_states(bf16).optimizer == 2 * sum(r + c for r, c in matrices) + 2 * norms + 4 * tensors
    foreach = estimate_memory(cfg).worst.phase_peaks["optimizer"]
    loop = estimate_memory(cfg_of("--model.preset=tiny", "--optimizer.name=adafactor",
                                  "--optimizer.foreach=false")).worst.phase_peaks["optimizer"]
    assert foreach - loop == 4 * (sum(r * c for r, c in matrices) - 768 * 256)


def test_llama3_405b_on_16384_gpus():
    """The Llama 3 paper's 8K-token layout on 16,384 H100s (Table 4: tp 8, pp 16, dp 128), full
    checkpointing, fits. pp 2 x cp 2 does not under torch's pipelining: FSDP accumulates each
    stage's gradients unsharded in fp32 until the step's one reduce-scatter (stage.py
    backward_maybe_with_nosync), 4 bytes for each of a rank's 405B / (8 x 2) parameters."""
    common = ("--model.preset=llama3.1-405b", "--hardware.num_gpus=16384", "--hardware.gpu=H100-SXM-80GB",
              "--parallel.tp=8", "--parallel.sequence_parallel=true", "--parallel.zero_stage=3",
              "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
              "--training.global_batch_size=2048", "--memory.activation_checkpointing=full")
    paper = estimate_memory(cfg_of(*common, "--parallel.pp=16"))  # its speed: benchmarks/estimate_speed.py
    assert len(paper.per_stage) == 16 and paper.worst.peak + paper.worst.reserved_margin < 80 * GB
    cfg = cfg_of(*common, "--parallel.pp=2", "--parallel.cp=2", "--parallel.pp_schedule=interleaved-1f1b",
                 "--parallel.pp_virtual_stages=7")
    two_stages = estimate_memory(cfg).worst
    assert two_stages.buffers > 4 * param_counts(cfg.model).total / 16
    assert two_stages.peak > 80 * GB


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_moe_imbalance_grows_only_the_busiest_experts_transients(policy: str):
    """Dropless: the peak grows with memory.moe_imbalance up to the ceiling (every token on one
    expert), the saved activations do not (the routed total is fixed); a capacity factor fixes the
    experts' shapes, so the imbalance has no effect there. Wide experts (8 x dim), so the busiest
    expert's own gradients outweigh the routing-independent moments."""
    base = ["--model.preset=debug-moe", "--model.num_shared_experts=0", "--model.dim=128",
            "--model.expert_ffn_dim=1024", "--model.max_seq_len=1024", "--training.seq_len=1024",
            "--training.micro_batch_size=8", "--training.global_batch_size=8", "--precision.mode=bf16-mixed",
            "--model.experts_per_token=1", "--model.num_experts=8", f"--memory.activation_checkpointing={policy}"]

    def at(imbalance: str, *extra: str) -> tuple[int, int]:
        cfg = cfg_of(*base, f"--memory.moe_imbalance={imbalance}", *extra)
        return estimate_memory(cfg).worst.peak, forward_retained_bytes(cfg)

    dropless = [at(x) for x in ("1", "2", "4", "8", "inf")]
    peaks = [peak for peak, _ in dropless]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert peaks[-2] == peaks[-1]  # top-1 of 8: the ceiling is 8
    assert len({retained for _, retained in dropless}) == 1
    assert len({at(x, "--model.capacity_factor=1.25") for x in ("1", "inf")}) == 1


def test_expert_states_are_divided_by_ep_and_edp():
    """parallel/expert.py: ep splits the routed experts, FSDP2 shards each rank's over the edp ranks
    (dp_shard x cp / ep): expert states end divided by dp_shard x cp as without ep, the dense ones
    too. Without ZeRO (an estimate only: training refuses it) ep alone divides them."""
    moe = ("--model.preset=mixtral-8x7b", "--hardware.num_gpus=16", "--training.micro_batch_size=1",
           "--training.global_batch_size=16")
    counts = param_counts(cfg_of(*moe).model)
    experts = counts.num_layers * counts.routed_experts
    for stage, shards in ((3, 16), (0, 1)):
        ep1 = model_states(cfg_of(*moe, f"--parallel.zero_stage={stage}"))
        ep8 = model_states(cfg_of(*moe, f"--parallel.zero_stage={stage}", "--parallel.ep=8"))
        assert ep1.params == pytest.approx(4 * counts.total / shards, rel=1e-6)  # fp32
        assert ep1.params - ep8.params == (0 if shards > 1 else 4 * experts * 7 // 8)
