"""QLoRA (peft/nf4.py): which block linears NF4 holds and why the rest stay, the NF4 bytes the
estimators count against torchao's tensor, the base a run quantizes (from the seed or HF weights,
the same values LoRA's run starts from), QLoRA's loss against bf16 LoRA's, a checkpoint sampled and
exported merged onto the NF4 base it trained on, and the analytic estimate against the traced step."""

from __future__ import annotations

import pytest
import torch

from _runs import run_config
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.models import build_model, materialize
from trainfit.models.block_spec import block_linears
from trainfit.models.hf import save_hf_weights
from trainfit.models.nf4 import is_nf4, nf4_module
from trainfit.parallel.resolve import build_layout
from trainfit.peft import spec
from trainfit.traced import trace_step
from trainfit.train.trainer import Trainer

WIDE = ("--model.preset=debug", "--model.dim=256", "--model.ffn_dim=512")
"""Blocks whose every linear is a whole number of NF4's 64 x 256-weight blocks (debug's are not)."""
SHORT = ("--training.seq_len=32", "--training.micro_batch_size=4", "--training.global_batch_size=4")
QUIET = ("--logging.measure_memory=false", "--logging.traced_estimate=false")


@pytest.mark.parametrize("shape", [(256, 256), (128, 256), (512, 256), (4096, 14336)])
def test_nf4_bytes_are_torchaos_tensors_bytes(shape: tuple[int, int]) -> None:
    """spec.nf4_bytes (what the estimators count) against the inner tensors of torchao's NF4Tensor."""
    weight = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    nf4 = nf4_module().to_nf4(weight if shape[0] > 1024 else torch.randn(shape, dtype=torch.bfloat16))
    names, _ = nf4.__tensor_flatten__()
    assert spec.nf4_bytes(shape[0] * shape[1]) == sum(getattr(nf4, n).nbytes for n in names)
    assert 0.5156 < spec.nf4_bytes(shape[0] * shape[1]) / (shape[0] * shape[1]) < 0.52 or shape[0] < 1024


def test_what_nf4_cannot_hold_stays_with_its_reason() -> None:
    debug = load_config(None, ["--model.preset=debug", "--peft.method=qlora"])
    layout = build_layout(debug)
    assert layout.adaptation.quantized == ()
    note = spec.qlora_note(debug.model, layout.adaptation)
    assert "no block linear held in NF4" in note and "wq (64 x 64)" in note and "double-quantization" in note
    wide = load_config(None, [*WIDE, "--peft.method=qlora"])
    assert build_layout(wide).adaptation.quantized == ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
    moe = load_config(None, ["--model.preset=debug-moe", "--model.dim=256", "--peft.method=qlora"])
    routed = [linear for linear in block_linears(moe.model) if linear.routed]
    assert routed and all("3-D" in spec.nf4_refusal(linear) for linear in routed)
    wk = next(linear for linear in block_linears(wide.model) if linear.name == "wk")  # 128 x 256: 2 groups
    assert spec.nf4_refusal(wk, shards=2) is None
    assert "4 FSDP shards" in spec.nf4_refusal(wk, shards=4)


def test_the_base_is_lora_s_base_quantized_and_only_adapters_train(tmp_path) -> None:
    """From the seed: each NF4 weight is the quantization of the weight LoRA's run starts from (the same
    values, by name); everything else is that run's exactly; adapters alone train."""
    args = (*WIDE, *SHORT, *QUIET, "--peft.targets=q,v", "--training.steps=1")
    qlora = Trainer(run_config(tmp_path / "q", *args, "--peft.method=qlora"))
    lora = Trainer(run_config(tmp_path / "l", *args, "--peft.method=lora"))
    assert any("peft.method='qlora': wq, wk, wv, wo, w1, w3, w2 held in NF4" in note for note in qlora.notes)
    theirs = dict(lora.model.named_parameters())
    held = 0
    for name, param in qlora.model.named_parameters():
        if is_nf4(param):
            held += 1
            assert not param.requires_grad
            expected = nf4_module().to_nf4(theirs[name].detach().to(torch.bfloat16))
            assert torch.equal(param.get_original_weight(), expected.get_original_weight()), name
        else:
            assert torch.equal(param.detach(), theirs[name].detach()), name
            assert param.requires_grad == spec.is_adapter(name), name
    assert held == 2 * 7


def test_a_base_of_hf_weights_is_quantized_from_them(tmp_path) -> None:
    source = run_config(tmp_path, *WIDE).model
    base = materialize(build_model(source), "cpu", seed=5)
    save_hf_weights(base, source, tmp_path / "hf")
    trainer = Trainer(run_config(tmp_path / "run", f"--model.init_from={tmp_path / 'hf'}", "--peft.method=qlora",
                                 "--training.steps=1", *QUIET, base=SHORT))
    weights = dict(base.named_parameters())
    for name, param in trainer.model.named_parameters():
        if is_nf4(param):
            expected = nf4_module().to_nf4(weights[name].detach().to(torch.bfloat16)).get_original_weight()
            assert torch.equal(param.get_original_weight(), expected), name


@pytest.mark.slow
def test_qlora_loss_stays_within_1_percent_of_bf16_lora(tmp_path) -> None:
    """The same adapters on the NF4 base and on the bf16 base it quantizes: 20 steps, bf16-pure.
    Measured: losses within 0.3% (the base's quantization error moves the logits of a random model
    little); the bound is 1%."""
    args = (*WIDE, *SHORT, *QUIET, "--peft.targets=all-linear", "--precision.mode=bf16-pure", "--training.steps=20",
            "--training.warmup_steps=2", "--training.lr=2e-3", "--training.eval_interval=10", "--training.eval_steps=2")
    lora = Trainer(run_config(tmp_path / "l", *args, "--peft.method=lora")).train()
    qlora = Trainer(run_config(tmp_path / "q", *args, "--peft.method=qlora")).train()
    assert lora.losses[20] < 0.95 * lora.losses[1]  # the adapters learned: the comparison means something
    for step, loss in lora.losses.items():
        assert qlora.losses[step] == pytest.approx(loss, rel=0.01), step
    for step, loss in lora.val_losses.items():
        assert qlora.val_losses[step] == pytest.approx(loss, rel=0.01), step


@pytest.mark.slow
def test_a_qlora_checkpoint_samples_and_merges_onto_its_nf4_base(tmp_path) -> None:
    """load_trained_model rebuilds the NF4 base the adapters trained on (the trainer's logits); the
    merged export is that base dequantized with the adapters folded in (the same logits, to bf16's
    rounding of the merged weights)."""
    transformers = pytest.importorskip("transformers")
    from trainfit.train.sample import export_to_hf, load_trained_model

    cfg = run_config(tmp_path / "run", *WIDE, *QUIET, "--peft.method=qlora", "--peft.targets=all-linear",
                     "--training.steps=3", "--training.lr=1e-2", base=SHORT)
    trainer = Trainer(cfg)
    trainer.train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24))
    with torch.no_grad():
        trained = trainer.model.eval()(tokens)
        model, _, _ = load_trained_model(tmp_path / "run" / "ckpt", torch.device("cpu"))
        assert sum(is_nf4(p) for p in model.parameters()) == 2 * 7
        torch.testing.assert_close(model(tokens), trained, rtol=0, atol=0)
    export_to_hf(str(tmp_path / "run" / "ckpt"), str(tmp_path / "merged"), merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(tokens).logits, trained, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("args", [
    ("--peft.targets=all-linear", "--precision.mode=bf16-pure"),
    ("--precision.mode=bf16-mixed",),
    ("--memory.activation_checkpointing=full", "--training.seq_len=64"),
    ("--hardware.num_gpus=2", "--parallel.zero_stage=3", "--training.global_batch_size=8"),
    ("--hardware.num_gpus=2", "--parallel.zero_stage=0", "--training.global_batch_size=8", "--training.seq_len=64"),
])
def test_analytic_peak_and_params_of_a_qlora_step_are_the_traced_ones(args: tuple[str, ...]) -> None:
    """NF4 weights (resident and gathered), no autocast casts of them, and the dequantization's
    working set at a block's first backward matmul, against the traced step: measured within 5%."""
    cfg = load_config(None, [*WIDE, *SHORT, "--peft.method=qlora", *args])
    analytic, traced = estimate(cfg).worst, trace_step(cfg).worst
    assert analytic.peak == pytest.approx(traced.peak, rel=0.06)
    assert analytic.params + analytic.master_params == pytest.approx(traced.params + traced.master_params, rel=0.05)


@pytest.mark.parametrize(("checkpointing", "passes"), [("none", 2), ("full", 3), ("selective", 2)])
def test_the_time_model_adds_each_dequantization_s_traffic(checkpointing: str, passes: int) -> None:
    """A QLoRA step against LoRA's on the same GPU: the same FLOPs, plus every NF4 weight's eager
    dequantization (perf/timing.py's 33 bytes per weight) in its forward, its input gradient and, fully
    checkpointed, its recompute (selective checkpointing reruns no matmul), at the memory bandwidth."""
    from trainfit.hardware import device_spec
    from trainfit.perf.timing import NF4_DEQUANT_TRAFFIC_BYTES

    args = ["--model.preset=llama3-8b", "--hardware.gpu=RTX-4090", "--training.seq_len=2048",
            "--training.micro_batch_size=1", "--training.global_batch_size=1", "--peft.targets=all-linear",
            f"--memory.activation_checkpointing={checkpointing}", "--precision.mode=bf16-pure"]
    lora, qlora = (estimate(load_config(None, [*args, f"--peft.method={m}"])) for m in ("lora", "qlora"))
    assert qlora.perf.flops == lora.perf.flops
    weights = 32 * sum(linear.in_features * linear.out_features for linear in block_linears(qlora.cfg.model))
    expected = passes * NF4_DEQUANT_TRAFFIC_BYTES * weights / device_spec(qlora.cfg.hardware).hbm_bytes_per_s
    assert qlora.perf.time["nf4_dequant_s"] == pytest.approx(expected, rel=1e-9)
    assert lora.perf.time["nf4_dequant_s"] == 0
    assert qlora.perf.time["compute_s"] - lora.perf.time["compute_s"] == pytest.approx(expected, rel=0.02)


def test_qlora_offloaded_on_one_rank_is_a_named_error_before_training() -> None:
    """FSDP2's one-rank unshard does not run the NF4 tensor's all-gather extension (its three buffers):
    refused before any process group, naming the fix."""
    cfg = load_config(None, [*WIDE, "--peft.method=qlora", "--memory.offload=optimizer", "--parallel.zero_stage=3"])
    reason = build_layout(cfg).untrainable_reason()
    assert reason is not None and "memory.offload='optimizer'" in reason and "2 or more ranks" in reason
    two = load_config(None, [*WIDE, "--peft.method=qlora", "--memory.offload=optimizer", "--parallel.zero_stage=3",
                             "--hardware.num_gpus=2"])
    assert build_layout(two).untrainable_reason() is None


@pytest.mark.slow
def test_qlora_trains_compiled_with_the_chunked_loss_and_accumulation_as_eager(tmp_path) -> None:
    """torch.compile over NF4 linears (inductor fuses the dequantization), with the chunked loss and
    two accumulated micro-batches: the same losses as eager, to bf16's rounding."""
    args = (*WIDE, *QUIET, "--peft.method=qlora", "--peft.targets=all-linear", "--precision.mode=bf16-pure",
            "--memory.chunked_loss=true", "--training.steps=2", "--training.micro_batch_size=2")
    eager = Trainer(run_config(tmp_path / "e", *args)).train()
    compiled = Trainer(run_config(tmp_path / "c", *args, "--training.compile=true")).train()
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=1e-2), step
