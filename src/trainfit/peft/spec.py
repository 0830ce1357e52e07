"""What parameter-efficient fine-tuning does to a model, described once and torch-free: which of a
block's linears (models/block_spec.py) get adapters, the adapters' shapes, and which parameters
train. The trainer (peft/adapters.py) builds from it; the estimators count from it.

LoRA (Hu et al. 2021) leaves each targeted linear's weight W (out x in) frozen and adds
(alpha / rank) B A x, A rank x in and B out x rank trained (B starts at zero, so the adapted model
starts as the base). DoRA (Liu et al. 2024) applies the same update to W's direction and trains a
magnitude m per output row: m (W + s B A) / ||W + s B A||_row. Everything else is frozen unless
peft.train_embeddings / train_output say otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from trainfit.config import ConfigError, ModelConfig, PeftConfig
from trainfit.models.architecture import describe
from trainfit.models.block_spec import BlockLinear, block_linears

TARGETS: dict[bool, dict[str, str]] = {  # on an MoE block, gate/up/down adapt routed and shared experts
    True: {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"},
    False: {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"},
}
"""PEFT's target names (q_proj, gate_proj, ...) -> the block linears' short names, for a gated MLP (a gate
w1 beside the up projection w3) and an ungated one (GPT-2's: up w1, down w2)."""
GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("q", "k", "v", "o"),
    "mlp": ("gate", "up", "down"),
    "all-linear": ("q", "k", "v", "o", "gate", "up", "down"),
}
"""Target groups; a group takes the members the block has (GPT-2 has no gate)."""
ADAPTER_SUFFIXES = ("lora_a", "lora_b", "lora_magnitude")
"""Names of the adapter parameters on an adapted linear (peft/adapters.py registers them)."""


@dataclass(frozen=True)
class Adaptation:
    """A run's PEFT as the Layout carries it (hashable, resolved): what the estimators read."""

    method: str
    """lora | dora | qlora."""
    rank: int
    targets: tuple[str, ...]
    """The adapted block linears' short names (models/block_spec.py), in block order."""
    dropout: bool
    train_embeddings: bool
    train_output: bool
    quantized: tuple[str, ...] = ()
    """QLoRA: the block linears (short names) whose frozen weights are held in NF4."""

    @property
    def dora(self) -> bool:
        return self.method == "dora"


def adaptation_of(model: ModelConfig, peft: PeftConfig, shards: int = 1) -> Adaptation | None:
    """The Layout's Adaptation of a config whose parameters FSDP splits over `shards` ranks (1 when
    none does), None without PEFT (ConfigError for unknown targets)."""
    if not enabled(peft):
        return None
    quantized = tuple(linear.name for linear in block_linears(model)
                      if peft.method == "qlora" and nf4_refusal(linear, shards) is None)
    return Adaptation(peft.method, peft.rank, tuple(target_names(model, peft)), peft.dropout > 0,
                      peft.train_embeddings, peft.train_output, quantized)


NF4_BLOCK = 64
"""Weights that share one absmax scale (QLoRA's block size; torchao's NF4Tensor block_size)."""
NF4_SCALER_BLOCK = 256
"""Scales that share one double-quantization factor (NF4Tensor's scaler_block_size)."""
NF4_CODEBOOK = 16
"""The 16 NormalFloat levels, a small table each NF4 tensor keeps in its dtype."""
NF4_DTYPE_BYTES = 2
"""QLoRA computes in bf16: each NF4 tensor is quantized from, and dequantizes to, bf16 (its factors,
mean and table are bf16 too)."""


def nf4_bytes(numel: int) -> int:
    """Bytes of `numel` weights held as torchao's NF4Tensor: two 4-bit codes per byte, an int8 scale
    per NF4_BLOCK weights, a bf16 factor per NF4_SCALER_BLOCK scales, the scales' mean and the
    codebook (~0.516 bytes per weight)."""
    return (numel // 2 + numel // NF4_BLOCK + NF4_DTYPE_BYTES * (numel // (NF4_BLOCK * NF4_SCALER_BLOCK))
            + NF4_DTYPE_BYTES * (1 + NF4_CODEBOOK))


def nf4_refusal(linear: BlockLinear, shards: int = 1) -> str | None:
    """Why QLoRA leaves this block linear's weight in the model's dtype, or None: NF4 holds it. The
    NF4 tensor is 2-D, quantizes whole double-quantization blocks (64 x 256 weights), and is split
    by FSDP into equal row slices, each of whole such blocks."""
    if linear.routed:
        return "a routed expert's weights are one 3-D tensor; the NF4 tensor is 2-D"
    numel = linear.in_features * linear.out_features
    group = NF4_BLOCK * NF4_SCALER_BLOCK
    if numel % group:
        return f"not a whole number of NF4's {NF4_BLOCK} x {NF4_SCALER_BLOCK}-weight double-quantization blocks"
    if shards > 1 and (linear.out_features % shards or numel % (group * shards)):
        return (f"not {shards} FSDP shards of whole {NF4_BLOCK} x {NF4_SCALER_BLOCK}-weight "
                "double-quantization blocks")
    return None


def qlora_note(model: ModelConfig, adaptation: Adaptation, shards: int = 1) -> str:
    """What a QLoRA run holds in NF4, and the block linears it leaves in the model's dtype with the
    reason: the note the run prints."""
    kept: dict[str, list[str]] = {}
    for linear in block_linears(model):
        if (reason := nf4_refusal(linear, shards)) is not None:
            kept.setdefault(reason, []).append(f"{linear.name} ({linear.out_features} x {linear.in_features})")
    held = ", ".join(adaptation.quantized) or "no block linear"
    return (f"peft.method='qlora': {held} held in NF4"
            + "".join(f"; left in the model's dtype, {reason}: {', '.join(names)}" for reason, names in kept.items())
            + "; embeddings, norms and the output projection stay in the model's dtype")


class Adapter(NamedTuple):
    """One adapted linear of a block: the base linear and its adapter's parameter counts (a routed
    expert weight's: one adapter per expert, stacked like the weights, `linear.copies` of them)."""

    linear: BlockLinear
    a_params: int
    """copies x rank x in_features."""
    b_params: int
    """copies x out_features x rank."""
    magnitude_params: int
    """DoRA: out_features; LoRA: 0."""

    @property
    def params(self) -> int:
        return self.a_params + self.b_params + self.magnitude_params


def enabled(peft: PeftConfig) -> bool:
    return peft.method != "none"


def target_names(model: ModelConfig, peft: PeftConfig) -> list[str]:
    """The block linears' short names peft.targets adapts (in block order), or a ConfigError naming the
    field, the value and the fix."""
    # the feed-forward's gate beside its up projection (SwiGLU, GeGLU, the routed experts'), or none (GPT-2)
    ours = TARGETS[all(layer.mlp is None or layer.mlp.gated for layer in describe(model).layers)]
    wanted: list[str] = []
    for target in peft.targets:
        if target in GROUPS:
            wanted += [t for t in GROUPS[target] if t in ours]
        elif target in ours:
            wanted.append(target)
        else:
            known = ", ".join([*ours, *GROUPS])
            raise ConfigError(f"peft.targets={','.join(peft.targets)!r}: {target!r} is no linear of a "
                              f"block of this model; use some of {known}")
    names = {ours[t] for t in wanted}
    chosen = [linear for linear in block_linears(model) if base_name(linear.name) in names]
    if peft.method == "dora" and any(linear.routed for linear in chosen):
        raise ConfigError(f"peft.targets={','.join(peft.targets)!r}: DoRA's magnitude on routed experts is not "
                          "built (its row norms would rebuild every expert's whole weight each step); use "
                          "peft.method=lora or qlora, or target the attention (q, k, v, o)")
    return [linear.name for linear in chosen]


def base_name(name: str) -> str:
    """A block linear's dense counterpart (models/block_spec.py): an MoE's routed and shared experts'
    w1, w3, w2 are what gate, up and down adapt there; the router is never adapted."""
    return name.removeprefix("experts_").removeprefix("shared_")


def block_adapters(model: ModelConfig, peft: PeftConfig) -> list[Adapter]:
    """Each adapted linear of one block, with its adapter's parameter counts; [] without PEFT."""
    if not enabled(peft):
        return []
    names = set(target_names(model, peft))
    dora = peft.method == "dora"
    return [Adapter(linear, linear.copies * peft.rank * linear.in_features,
                    linear.copies * linear.out_features * peft.rank, linear.out_features if dora else 0)
            for linear in block_linears(model) if linear.name in names]


def adapter_params_per_block(model: ModelConfig, peft: PeftConfig) -> int:
    """Trainable adapter parameters of one block."""
    return sum(a.params for a in block_adapters(model, peft))


def is_adapter(name: str) -> bool:
    """Whether a parameter name (in the plain model) is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def trains(name: str, peft: PeftConfig) -> bool:
    """Whether the parameter of this name (in the plain model) trains under `peft`: every one without
    PEFT; else the adapters, and the embedding or output projection where asked."""
    if not enabled(peft) or is_adapter(name):
        return True
    return (peft.train_embeddings and name.startswith("tok_embeddings.")) or \
        (peft.train_output and name.startswith("output."))


def _held_copies(linear: BlockLinear, ep: int) -> int:
    """Adapters a rank holds for this linear: a routed expert weight's num_experts / ep, else 1."""
    return linear.copies // ep if linear.routed else 1


def adapter_params(model: ModelConfig, adaptation: Adaptation, ep: int = 1) -> int:
    """A block's adapter parameters under a Layout's Adaptation, on one of `ep` expert-parallel ranks
    (the estimators' count: routed experts' adapters are split with their experts)."""
    names = set(adaptation.targets)
    return sum(_held_copies(linear, ep) * adaptation.rank * (linear.in_features + linear.out_features)
               + linear.out_features * adaptation.dora for linear in block_linears(model) if linear.name in names)


def routed_adapter_params(model: ModelConfig, adaptation: Adaptation, ep: int = 1) -> int:
    """Of adapter_params: the routed experts' adapters, which expert parallelism splits and FSDP2
    shards with their experts (over the edp ranks)."""
    return adapter_params_of(model, adaptation, [linear.name for linear in block_linears(model) if linear.routed], ep)


def adapter_params_of(model: ModelConfig, adaptation: Adaptation, names: list[str], ep: int = 1) -> int:
    """Of adapter_params: the A and B of the adapters on the block linears `names` (those adapted)."""
    return sum(_held_copies(linear, ep) * adaptation.rank * (linear.in_features + linear.out_features)
               for linear in block_linears(model) if linear.name in names and linear.name in adaptation.targets)


def adapter_flop_params(model: ModelConfig, adaptation: Adaptation) -> int:
    """Adapter weights (A and B, no magnitudes) one token multiplies through in a block: a routed
    expert weight's adapters by the token's share of them (top-k of the experts), like its weights."""
    names = set(adaptation.targets)
    return round(sum(linear.copies * linear.token_share * adaptation.rank * (linear.in_features + linear.out_features)
                     for linear in block_linears(model) if linear.name in names))


def adapter_magnitudes(model: ModelConfig, adaptation: Adaptation) -> int:
    """Of adapter_params: DoRA's magnitudes (1-D, one per output row; 0 under LoRA)."""
    names = set(adaptation.targets)
    return sum(linear.out_features for linear in block_linears(model) if linear.name in names) * adaptation.dora


def adapter_matrices(model: ModelConfig, adaptation: Adaptation, ep: int = 1) -> list[tuple[int, int]]:
    """The 2-D adapter matrices of one block on one of `ep` ranks, (rank, in) and (out, rank) per
    adapted linear (a routed weight's stacked adapters: one pair per held expert, as factored
    optimizers treat a 3-D tensor's leading dimension): what per-tensor optimizers (adamw-8bit,
    adafactor) size their states by."""
    names = set(adaptation.targets)
    return [shape for linear in block_linears(model) if linear.name in names
            for shape in ((adaptation.rank, linear.in_features), (linear.out_features, adaptation.rank))
            for _ in range(_held_copies(linear, ep))]


def adapter_tensor_sizes(model: ModelConfig, adaptation: Adaptation, ep: int = 1) -> list[int]:
    """Elements of each A and B tensor of one block on one of `ep` ranks (a routed weight's adapters
    are one stacked tensor each, like the weight)."""
    names = set(adaptation.targets)
    return [_held_copies(linear, ep) * adaptation.rank * features for linear in block_linears(model)
            if linear.name in names for features in (linear.in_features, linear.out_features)]


BASE_SAMPLE_BYTES = 1 << 20
"""Bytes of each weight file's data read, at its start, middle and end, into the base's identity."""


def base_identity(init_from: str, seed: int) -> dict[str, str]:
    """What identifies the frozen base an adapter was trained on: the HF weights it started from (a
    digest of config.json, each safetensors file's header and size, and samples of its data, enough to
    tell two bases apart without reading gigabytes), or the seed its random base was drawn from."""
    import hashlib
    from pathlib import Path

    if not init_from:
        return {"seed": str(seed)}
    folder = Path(init_from)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header))
            for offset in (8 + header, max(8 + header, size // 2), max(8 + header, size - BASE_SAMPLE_BYTES)):
                f.seek(offset)
                digest.update(f.read(BASE_SAMPLE_BYTES))
    return {"init_from": str(folder), "digest": digest.hexdigest()}
