"""PEFT (peft/): which linears a config adapts, what trains, the adapters' behaviour at the start and
under training, a base loaded from HF weights, the named errors, and the analytic estimate's model
states against the traced step."""

from __future__ import annotations

import pytest
import torch

from _runs import assert_peft_loads_adapters, run_config
from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.models import build_model, materialize
from trainfit.models.hf import save_hf_weights
from trainfit.parallel.resolve import build_layout
from trainfit.peft import spec
from trainfit.peft.adapters import LoRALinear, apply_adapters
from trainfit.traced import trace_step
from trainfit.train.trainer import Trainer

QWEN3 = ("--model.qk_norm=head", "--model.head_dim=24")
GEMMA3 = ("--model.norm_placement=sandwich", "--model.norm_offset=true", "--model.mlp_activation=gelu_tanh",
          "--model.embedding_scale=true", *QWEN3, "--model.query_pre_attn_scalar=20", "--model.sliding_window=8",
          "--model.sliding_window_pattern=2", "--model.rope_local_theta=100", "--model.tie_embeddings=true")
"""Gemma 3's block (tests/_dist.py's), tied as Gemma's, 8 of the 24-32 positions in a window."""
"""Qwen3's attention on the debug model: QK-norm, heads (4 x 24) wider than the model (64)."""

MIB = 2**20


def adapted(*args: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base, adapted) debug models from the same seed."""
    cfg = load_config(None, ["--model.preset=debug", *args])
    base = materialize(build_model(cfg.model), "cpu", seed)
    model = materialize(apply_adapters(build_model(cfg.model), cfg.model, cfg.peft), "cpu", seed)
    return base, model


@pytest.mark.parametrize(("preset", "targets", "names"), [
    ("debug", "q,v", ["wq", "wv"]),
    ("debug", "attention", ["wq", "wk", "wv", "wo"]),
    ("debug", "mlp", ["w1", "w3", "w2"]),
    ("debug", "all-linear", ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]),
    ("debug-gpt2", "all-linear", ["wq", "wk", "wv", "wo", "w1", "w2"]),  # no gate in GPT-2
    ("debug-gpt2", "up,down", ["w1", "w2"]),
])
def test_targets_name_block_linears(preset: str, targets: str, names: list[str]) -> None:
    cfg = load_config(None, [f"--model.preset={preset}", "--peft.method=lora", f"--peft.targets={targets}"])
    assert spec.target_names(cfg.model, cfg.peft) == names
    adapters = spec.block_adapters(cfg.model, cfg.peft)
    assert [a.linear.name for a in adapters] == names
    assert all(a.params == 8 * (a.linear.in_features + a.linear.out_features) for a in adapters)


@pytest.mark.parametrize(("args", "message"), [
    (("--peft.rank=0",), "peft.rank=0: must be >= 1"),
    (("--peft.alpha=0",), "peft.alpha=0.0: must be > 0"),
    (("--peft.dropout=1",), "peft.dropout=1.0: must be in [0, 1)"),
    (("--peft.targets=q,gate_proj",), "'gate_proj' is no linear of a block of this model"),
    (("--model.preset=debug-moe", "--peft.targets=mlp", "--peft.method=dora"), "DoRA's magnitude on routed experts"),
    (("--model.init_from=/nonexistent",), "model.init_from='/nonexistent': must be a folder holding config.json"),
])
def test_bad_peft_settings_are_named_errors(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, ["--model.preset=debug", "--peft.method=lora", *args])


@pytest.mark.parametrize(("args", "field"), [
    (("--hardware.num_gpus=2", "--parallel.tp=2", "--parallel.zero_stage=3"), "parallel.tp=2"),
    (("--hardware.num_gpus=2", "--parallel.zero_stage=1", "--training.global_batch_size=32"), "zero_stage=1"),
    (("--precision.mode=fp8-mixed",), "fp8-mixed"),
])
def test_layouts_adapters_are_not_built_for_are_refused_before_training(args: tuple[str, ...], field: str) -> None:
    layout = build_layout(load_config(None, ["--model.preset=debug", "--peft.method=lora", *args]))
    reason = layout.untrainable_reason()
    assert reason is not None and reason.startswith("peft.method='lora'") and field in reason


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_the_adapted_model_starts_as_the_base_and_only_adapters_train(method: str) -> None:
    base, model = adapted(f"--peft.method={method}", "--peft.targets=all-linear")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(spec.is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 2 * 7 + (2 * 7 if method == "dora" else 0)  # 2 blocks x 7 linears
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), base(tokens), rtol=1e-6, atol=1e-6)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert not torch.allclose(model(tokens), base(tokens))


def test_dora_magnitude_starts_as_the_weights_row_norms() -> None:
    _, model = adapted("--peft.method=dora", "--peft.targets=q")
    wq = model.layers[0].attention.wq
    assert isinstance(wq, LoRALinear) and wq.lora_magnitude is not None
    torch.testing.assert_close(wq.lora_magnitude, torch.linalg.vector_norm(wq.weight, dim=1))


def test_a_run_starts_from_hf_weights_and_trains_its_adapters(tmp_path) -> None:
    """model.init_from: the folder's config.json is the model, its weights the base, adapters at zero."""
    source = run_config(tmp_path, "--model.preset=debug").model
    base = materialize(build_model(source), "cpu", seed=7)
    save_hf_weights(base, source, tmp_path / "hf")
    cfg = run_config(tmp_path / "run", f"--model.init_from={tmp_path / 'hf'}", "--peft.method=lora",
                     "--training.steps=2", "--logging.measure_memory=false", "--logging.traced_estimate=false",
                     base=("--training.seq_len=32", "--training.micro_batch_size=4", "--training.global_batch_size=4"))
    assert cfg.model.dim == source.dim and cfg.model.preset.endswith("config.json")
    trainer = Trainer(cfg)
    loaded = {n: p for n, p in trainer.model.named_parameters() if not spec.is_adapter(n)}
    expected = dict(base.named_parameters())
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[n].detach(), expected[n].detach()) for n in expected)
    result = trainer.train()
    assert sorted(result.losses) == [1, 2]
    assert all(torch.equal(p.detach(), expected[n].detach()) for n, p in trainer.model.named_parameters()
               if not spec.is_adapter(n))


@pytest.mark.parametrize("args", [
    ("--peft.method=lora", "--peft.targets=all-linear"),
    ("--peft.method=dora", "--peft.targets=q,v", "--peft.rank=16"),
    ("--peft.method=lora", "--peft.train_output=true", "--precision.mode=bf16-mixed"),
])
def test_analytic_model_states_of_an_adapted_run_are_the_traced_ones(args: tuple[str, ...]) -> None:
    """Frozen base resident, gradients and optimizer states of what trains only: the traced step's."""
    cfg = load_config(None, ["--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=4",
                             "--training.global_batch_size=4", *args])
    analytic, traced = estimate(cfg).worst, trace_step(cfg).worst
    # under autocast "params" are the weights' 16-bit casts, which a frozen base's backward frees as it
    # passes them (the analytic estimate counts them whole): the states the optimizer holds decide here
    components = ("master_params", "optimizer") if "bf16-mixed" in " ".join(args) else ("params", "grads", "optimizer")
    for component in components:
        assert getattr(analytic, component) == pytest.approx(getattr(traced, component), rel=0.02, abs=4096), component
    full = estimate(load_config(None, ["--model.preset=debug", "--training.seq_len=32",
                                       "--training.micro_batch_size=4", "--training.global_batch_size=4"])).worst
    assert analytic.optimizer < full.optimizer / 3


@pytest.mark.parametrize("args", [
    ("--peft.method=lora", "--peft.targets=all-linear"),
    ("--peft.method=dora", "--peft.targets=q,v,down", "--peft.rank=4"),
    ("--peft.method=lora", "--peft.train_output=true"),
    ("--peft.method=lora", "--peft.targets=all-linear", *QWEN3),
    ("--peft.method=lora", "--peft.targets=attention", "--model.norm_placement=post", "--model.qk_norm=whole"),
    ("--peft.method=lora", "--peft.targets=all-linear", *GEMMA3),
])
def test_exported_adapters_load_in_peft_with_the_same_logits(tmp_path, args: tuple[str, ...]) -> None:
    """Train an adapter on a base of HF weights, export it in PEFT's format: transformers' model of the
    base with peft.PeftModel.from_pretrained gives trainfit's logits (fp32, 1e-5); --merge's weights
    alone give them too."""
    import transformers

    from trainfit.train.sample import export_to_hf

    source = run_config(tmp_path, "--model.preset=debug", *(a for a in args if a.startswith("--model."))).model
    save_hf_weights(materialize(build_model(source), "cpu", seed=3), source, tmp_path / "base")
    cfg = run_config(tmp_path / "run", f"--model.init_from={tmp_path / 'base'}", *args, "--training.steps=4",
                     "--training.lr=1e-2", "--logging.measure_memory=false", "--logging.traced_estimate=false",
                     base=("--training.seq_len=32", "--training.micro_batch_size=4", "--training.global_batch_size=4"))
    Trainer(cfg).train()
    ckpt = tmp_path / "run" / "ckpt"
    tokens, ours = assert_peft_loads_adapters(ckpt, tmp_path / "base", source.vocab_size, tmp_path / "adapter")
    export_to_hf(str(ckpt), str(tmp_path / "merged"), merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args", [
    ("--peft.targets=all-linear",),
    ("--peft.targets=q,v",),
    ("--peft.method=dora", "--peft.targets=q,v,down", "--peft.rank=16"),
    ("--precision.mode=bf16-mixed",),
    ("--precision.mode=bf16-mixed", "--peft.targets=all-linear"),
    ("--peft.dropout=0.1", "--peft.targets=attention"),
    ("--memory.activation_checkpointing=full",),
    ("--model.preset=debug-gpt2", "--peft.targets=all-linear"),
    ("--hardware.num_gpus=2", "--parallel.zero_stage=3", "--training.global_batch_size=8"),
    ("--model.num_layers=6", "--peft.targets=mlp"),
    ("--peft.targets=all-linear", *QWEN3),
    ("--precision.mode=bf16-mixed", *QWEN3),
    ("--precision.mode=bf16-mixed", "--peft.targets=all-linear", *GEMMA3),
])
def test_analytic_peak_of_an_adapted_step_is_within_10_percent_of_the_traced(args: tuple[str, ...]) -> None:
    """What autograd keeps through a frozen base (memory/closed_form/block/adapter_activations.py) against the
    traced step: measured within 6% on these (counting a full fine-tuning's activations put the peak 11% to 30%
    high)."""
    cfg = load_config(None, ["--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=4",
                             "--training.global_batch_size=4", "--peft.method=lora", *args])
    analytic, traced = estimate(cfg).worst, trace_step(cfg).worst
    assert analytic.peak == pytest.approx(traced.peak, rel=0.10)
    assert analytic.activations == pytest.approx(traced.activations, rel=0.12)


def test_a_full_fine_tune_that_does_not_fit_is_offered_lora_and_qlora_as_changes_of_method() -> None:
    from trainfit.plan.fixes import method_changes

    args = ["--model.preset=llama3-8b", "--hardware.gpu=RTX-4090", "--training.micro_batch_size=1",
            "--training.seq_len=2048", "--precision.mode=bf16-pure"]
    cfg = load_config(None, args)
    assert not estimate(cfg).fits
    lora, qlora = method_changes(cfg)
    assert lora.changes[0] == "peft.method=lora peft.targets=all-linear" and lora.note == "adapters on a frozen base"
    assert qlora.changes[0] == "peft.method=qlora peft.targets=all-linear" and "NF4" in qlora.note
    for fix in (lora, qlora):
        assert fix.candidate.memory_bytes <= 24 * 2**30 and estimate(fix.candidate.cfg).fits
    assert len(lora.changes) == 2 and len(qlora.changes) == 1  # LoRA also checkpoints; NF4's base fits as is
    assert method_changes(load_config(None, [*args, "--peft.method=lora"])) == []
    # Llama 3 70B on one 80 GB GPU: only the NF4 base fits
    big = load_config(None, ["--model.preset=llama3-70b", "--hardware.gpu=H100-SXM-80GB", *args[2:],
                             "--memory.activation_checkpointing=full"])
    assert [fix.candidate.cfg.peft.method for fix in method_changes(big)] == ["qlora"]


def test_a_change_of_method_is_searched_with_checkpointing_precision_and_the_chunked_loss() -> None:
    """Llama 3 8B on one RTX 4090 at the model's defaults (8,192 tokens, bf16-mixed): every full fine-tune
    that fits offloads the optimizer to the host; LoRA fits only with full checkpointing, bf16 weights
    and the chunked loss together, and is faster than every one of them, so it is offered."""
    from trainfit.plan.fixes import KNOBS, _knob_changes, fewest_changes, method_changes
    from trainfit.plan.space import Space, replace_sections, with_global_batch

    cfg, _ = with_global_batch(load_config(None, ["--model.preset=llama3-8b", "--hardware.gpu=RTX-4090"]))
    fixes = fewest_changes(cfg)
    assert fixes and all(f.candidate.cfg.memory.offload != "none" for f in fixes)
    methods = method_changes(cfg, fixes)
    lora = next(f for f in methods if f.candidate.cfg.peft.method == "lora")
    assert {"memory.activation_checkpointing=full", "memory.chunked_loss=true", "precision.mode=bf16-pure"} <= \
        set(lora.changes)
    assert lora.candidate.tokens_per_second > max(f.candidate.tokens_per_second for f in fixes)
    assert estimate(lora.candidate.cfg).fits
    # the fastest of every setting of the three that fits (by brute force over the same settings)
    lora_cfg = replace_sections(cfg, peft={"method": "lora", "targets": ("all-linear",)})
    fitting = []
    for knob in _knob_changes(cfg, Space.of(cfg, frozenset(), (cfg.precision.mode,))):
        fields: dict = {}
        for _, sections in knob:
            for section, values in sections.items():
                fields.setdefault(section, {}).update(values)
        est = estimate(replace_sections(lora_cfg, **fields))
        if est.fits:
            fitting.append(est.perf.time["tokens_per_second"])
    assert fitting and lora.candidate.tokens_per_second == pytest.approx(max(fitting))
    assert {key.split(".")[0] for key in KNOBS} == {"memory", "precision"}
    # a change of method slower than a fix is not offered: a fix that is faster trains every weight
    assert method_changes(cfg, [lora]) == []  # (LoRA's own speed, and QLoRA's below it)


def test_qlora_is_not_offered_where_torchao_is_missing(monkeypatch) -> None:
    from trainfit.configure import validate
    from trainfit.plan.fixes import method_changes

    cfg = load_config(None, ["--model.preset=llama3-70b", "--hardware.gpu=H100-SXM-80GB",
                             "--training.micro_batch_size=1", "--training.seq_len=2048"])
    assert [f.candidate.cfg.peft.method for f in method_changes(cfg)] == ["qlora"]
    monkeypatch.setattr(validate, "qlora_available", lambda: False)
    assert method_changes(cfg) == []


def test_checkpoints_hold_the_adapters_resume_exactly_and_refuse_another_base(tmp_path) -> None:
    """A fine-tuned checkpoint holds what trains (not the base), resumes to the uninterrupted run's
    losses, and is refused on another base (model.init_from's weights changed)."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainfit.train.checkpoint import CheckpointError

    source = run_config(tmp_path, "--model.preset=debug").model
    save_hf_weights(materialize(build_model(source), "cpu", seed=3), source, tmp_path / "base")
    short = ("--training.seq_len=32", "--training.micro_batch_size=4", "--training.global_batch_size=4")

    def trained(name: str, steps: int, *extra: str):
        cfg = run_config(tmp_path / name, f"--model.init_from={tmp_path / 'base'}", "--peft.method=lora",
                         f"--training.steps={steps}", "--logging.measure_memory=false",
                         "--logging.traced_estimate=false", *extra, base=short)
        return Trainer(cfg).train()

    whole = trained("whole", 4)
    trained("parts", 2)
    resumed = trained("parts", 4)
    assert resumed.started_at == 2 and resumed.losses[4] == pytest.approx(whole.losses[4], rel=1e-6)
    saved = FileSystemReader(str(resumed.checkpoint / "dcp")).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights and all(spec.is_adapter(k) for k in weights)
    save_hf_weights(materialize(build_model(source), "cpu", seed=4), source, tmp_path / "base")  # another base
    with pytest.raises(CheckpointError, match="trained on another base"):
        trained("parts", 6)


def test_dropout_keeps_a_bool_mask_on_cuda_and_a_noise_tensor_on_the_cpu() -> None:
    """torch's fused native_dropout (CUDA) keeps a bool mask; on the CPU dropout multiplies by a noise
    tensor of its input's dtype and keeps that (read here off autograd's saved tensors). The analytic
    terms follow the device: a q, v adapter's dropout on the block input, in fp32, keeps 3 more bytes
    per element on the CPU."""
    from trainfit.memory.closed_form.block.activation_terms import ActDtypes
    from trainfit.memory.closed_form.block.adapter_activations import adapter_terms

    saved: list[torch.dtype] = []
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        torch.nn.functional.dropout(x, 0.1, training=True)
    assert saved == [torch.float32]
    cfg = load_config(None, ["--model.preset=debug", "--peft.method=lora", "--peft.dropout=0.1"])
    adaptation = spec.adaptation_of(cfg.model, cfg.peft)
    cpu, cuda = (adapter_terms(cfg.model, ActDtypes(4, 4, False, dropout_noise=noise), adaptation)
                 for noise in (True, False))
    assert cpu.gathered - cuda.gathered == 2 * (4 - 1) * cfg.model.dim


@pytest.mark.parametrize("targets", ["all-linear", "up,down"])
def test_gpt2_adapters_are_refused_in_peft_format_naming_why(targets: str) -> None:
    """GPT-2's checkpoint fuses q, k and v into c_attn and stores its Conv1D weights transposed, so PEFT
    lays its adapters out otherwise: the export names the linear and the merged export as the fix."""
    from trainfit.peft.export import adapter_tensors

    cfg = load_config(None, ["--model.preset=debug-gpt2", "--peft.method=lora", f"--peft.targets={targets}"])
    model = materialize(apply_adapters(build_model(cfg.model), cfg.model, cfg.peft), "cpu", 0)
    with pytest.raises(ConfigError, match="stored fused with other linears or transposed.*--merge"):
        adapter_tensors(model, cfg.model, cfg.peft)
