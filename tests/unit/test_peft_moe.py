"""LoRA on an MoE's experts (peft/adapters.py's ExpertLoRA, models/moe.py's low-rank updates): which
weights gate, up and down adapt there, the stacked adapters' sizes, the adapted model starting as the
base in both routing forms, only adapters training, merging, the export, and both estimators' terms
(models states under expert parallelism, the routed rows' saved tensors) against the traced step."""

from __future__ import annotations

import pytest
import torch

from _runs import run_config
from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.models import build_model, materialize
from trainfit.peft import spec
from trainfit.peft.adapters import ExpertLoRA, apply_adapters
from trainfit.peft.export import merge_adapters
from trainfit.traced import trace_step
from trainfit.train.trainer import Trainer

MOE = ("--model.preset=debug-moe", "--model.num_shared_experts=1")
SMALL = ("--training.seq_len=32", "--training.micro_batch_size=4", "--training.global_batch_size=4")


def adapted(*args: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(base, adapted, config) debug MoE models from one seed."""
    cfg = load_config(None, [*MOE, "--peft.method=lora", *args])
    base = materialize(build_model(cfg.model), "cpu", 0)
    model = materialize(apply_adapters(build_model(cfg.model), cfg.model, cfg.peft), "cpu", 0)
    return base, model, cfg


@pytest.mark.parametrize(("targets", "names"), [
    ("mlp", ["experts_w1", "experts_w3", "experts_w2", "shared_w1", "shared_w3", "shared_w2"]),
    ("down", ["experts_w2", "shared_w2"]),
    ("q,v,gate", ["wq", "wv", "experts_w1", "shared_w1"]),
])
def test_gate_up_and_down_adapt_every_expert_but_never_the_router(targets: str, names: list[str]) -> None:
    cfg = load_config(None, [*MOE, "--peft.method=lora", f"--peft.targets={targets}"])
    assert spec.target_names(cfg.model, cfg.peft) == names
    m, rank = cfg.model, cfg.peft.rank
    for adapter in spec.block_adapters(cfg.model, cfg.peft):
        copies = m.num_experts if adapter.linear.routed else 1
        assert adapter.params == copies * rank * (adapter.linear.in_features + adapter.linear.out_features)
    adaptation = spec.adaptation_of(cfg.model, cfg.peft)
    assert spec.adapter_params(m, adaptation, ep=2) == spec.adapter_params(m, adaptation) - \
        spec.routed_adapter_params(m, adaptation) // 2
    # a token multiplies through its top-k experts' adapters only
    routed = spec.routed_adapter_params(m, adaptation)
    assert spec.adapter_flop_params(m, adaptation) == \
        spec.adapter_params(m, adaptation) - routed + routed * m.experts_per_token // m.num_experts


def test_dora_on_routed_experts_is_a_named_error() -> None:
    with pytest.raises(ConfigError, match="peft.targets='mlp': DoRA's magnitude on routed experts"):
        load_config(None, [*MOE, "--peft.method=dora", "--peft.targets=mlp"])
    load_config(None, [*MOE, "--peft.method=dora", "--peft.targets=attention"])  # attention: built


@pytest.mark.parametrize("capacity_factor", ["0", "1.25"])
def test_the_adapted_moe_starts_as_the_base_trains_only_adapters_and_merges(capacity_factor: str) -> None:
    base, model, cfg = adapted("--peft.targets=all-linear", f"--model.capacity_factor={capacity_factor}")
    experts = model.layers[0].feed_forward.experts
    assert set(experts.adapters) == {"w1", "w2", "w3"} and isinstance(experts.adapters["w1"], ExpertLoRA)
    assert experts.adapters["w2"].lora_a.shape == (cfg.model.num_experts, cfg.peft.rank, cfg.model.expert_ffn_dim)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    base.train(), model.train()
    torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)  # B = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model(tokens).sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in model.named_parameters() if spec.is_adapter(n)}
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trained if ".experts.adapters." in n)
    model.eval()
    with torch.no_grad():
        before = model(tokens)
        assert (before - base.eval()(tokens)).abs().max() > 1e-3  # the adapters change the experts
        merge_adapters(model)
        torch.testing.assert_close(model(tokens), before, rtol=1e-5, atol=1e-5)


def test_a_trained_moe_adapter_exports_merged_and_refuses_peft_format(tmp_path) -> None:
    """export --merge folds the routed experts' adapters into their weights: the exported HF weights give
    the trained model's logits; PEFT's format (dense llama only) is a named error."""
    from trainfit.models.hf import load_hf_weights
    from trainfit.train.sample import export_to_hf, load_trained_model

    mixtral = (*MOE, "--model.num_shared_experts=0")  # HF has no shared experts for Mixtral
    cfg = run_config(tmp_path / "run", *mixtral, "--peft.method=lora", "--peft.targets=all-linear",
                     "--training.steps=3", "--training.lr=1e-2", "--logging.measure_memory=false",
                     "--logging.traced_estimate=false",
                     base=SMALL)
    Trainer(cfg).train()
    ckpt = tmp_path / "run" / "ckpt"
    ours, _, _ = load_trained_model(ckpt, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"model.num_experts=4: adapters export in PEFT's format"):
        export_to_hf(str(ckpt), str(tmp_path / "adapter"))
    export_to_hf(str(ckpt), str(tmp_path / "merged"), merge=True)
    plain = load_config(None, [*mixtral]).model
    exported = materialize(build_model(plain), "cpu")
    load_hf_weights(exported, plain, tmp_path / "merged")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens), ours(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args", [
    ("--peft.targets=all-linear",),
    ("--peft.targets=all-linear", "--precision.mode=bf16-mixed"),
    ("--peft.targets=all-linear", "--model.capacity_factor=1.25"),
    ("--peft.targets=all-linear", "--peft.dropout=0.1"),
    ("--peft.targets=all-linear", "--memory.activation_checkpointing=selective"),
    ("--peft.targets=all-linear", "--memory.activation_checkpointing=full"),
    ("--peft.targets=all-linear", "--hardware.num_gpus=2", "--parallel.zero_stage=3", "--training.global_batch_size=8"),
    ("--peft.targets=all-linear", "--hardware.num_gpus=2", "--parallel.ep=2", "--parallel.zero_stage=3",
     "--training.global_batch_size=8"),
])
def test_analytic_estimate_of_adapted_experts_is_the_traced_step(args: tuple[str, ...]) -> None:
    """The routed rows' saved tensors under adapters (memory/closed_form/block/adapter_activations.py) and the experts'
    adapters' states, split with their experts, against the traced step (benchmarks/README.md has the
    measured gaps): peak and activations within 8%, the optimizer states exact."""
    cfg = load_config(None, [*MOE, *SMALL, "--peft.method=lora", *args])
    analytic, traced = estimate(cfg).worst, trace_step(cfg).worst
    assert analytic.peak == pytest.approx(traced.peak, rel=0.08)
    assert analytic.activations == pytest.approx(traced.activations, rel=0.08)
    assert analytic.optimizer == pytest.approx(traced.optimizer, rel=0.01)
