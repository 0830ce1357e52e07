"""Every field checked on its own, after the model is filled from its preset; errors name field,
value and fix. How the fields combine with the world (degrees, batch split) is
parallel/resolve.py's `build_layout`.

This layer imports the model presets and the hardware catalog; they import only the schema.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from pathlib import Path

from trainfit.config.schema import Config, ModelConfig, field_error
from trainfit.hardware import validate_hardware
from trainfit.models.architecture import describe
from trainfit.models.presets import resolve_model_config
from trainfit.peft.spec import target_names


def resolve_and_validate(cfg: Config) -> None:
    """Check hardware (catalog names, overrides), fill the model from its preset, then check every
    other field; in place, raising the first ConfigError."""
    _validate_finite(cfg)
    validate_hardware(cfg.hardware)
    _init_from_preset(cfg.model)
    resolve_model_config(cfg.model)
    _validate_model(cfg.model)
    _validate_rest(cfg)
    _validate_training(cfg)


INFINITY_ALLOWED = {"memory.moe_imbalance"}
"""Float fields where inf means something (the ceiling); every other float must be finite."""


def _validate_finite(cfg: Config) -> None:
    """No NaN anywhere, no infinity where it means nothing (lr=inf would train on garbage)."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            name, value = f"{section.name}.{f.name}", getattr(getattr(cfg, section.name), f.name)
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, float) and math.isnan(v):
                    raise field_error(name, value, "must be a number, not NaN")
                if isinstance(v, float) and math.isinf(v) and name not in INFINITY_ALLOWED:
                    raise field_error(name, value, "must be a finite number")


def _validate_model(m: ModelConfig) -> None:
    for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        value = getattr(m, name)
        if value is None or value < 1:
            raise field_error(f"model.{name}", value, "must be a positive integer (set it, or pick a model.preset)")
    if m.head_dim is None or m.head_dim < 0:
        raise field_error("model.head_dim", m.head_dim, "must be a positive integer, or 0 for dim / num_heads")
    if not m.head_dim and m.dim % m.num_heads:
        raise field_error("model.num_heads", m.num_heads, f"must divide model.dim={m.dim} (or set model.head_dim)")
    if m.num_heads % m.num_kv_heads:
        raise field_error("model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads={m.num_heads}")
    if m.sliding_window is None or m.sliding_window < 0:
        raise field_error("model.sliding_window", m.sliding_window, "must be 0 (full causal attention) or a "
                          "positive number of positions")
    for name, what in (("sliding_window_pattern", "0 (every layer windowed) or n (every n-th layer global)"),
                       ("query_pre_attn_scalar", "0 (head_dim) or the positive number the query scale is 1/sqrt of"),
                       ("rope_local_theta", "0 (rope_theta) or the windowed layers' positive RoPE base"),
                       ("attention_softcap", "0 (none) or the positive cap c of c tanh(s / c), Gemma 2's 50"),
                       ("final_softcap", "0 (none) or the positive cap c of c tanh(l / c), Gemma 2's 30")):
        if getattr(m, name) is None or getattr(m, name) < 0:
            raise field_error(f"model.{name}", getattr(m, name), f"must be {what}")
    attention = describe(m).attention
    if m.family == "gpt2":  # the features GPT-2's module tree (models/gpt2.py) does not have
        for name, value, fix in (("num_kv_heads", m.num_kv_heads, m.num_heads), ("head_dim", m.head_dim, 0),
                                 ("qk_norm", m.qk_norm, "none"), ("sliding_window", m.sliding_window, 0),
                                 ("norm_placement", m.norm_placement, "pre"), ("norm_offset", m.norm_offset, False),
                                 ("embedding_scale", m.embedding_scale, False),
                                 ("mlp_activation", m.mlp_activation, "silu"),
                                 ("query_pre_attn_scalar", m.query_pre_attn_scalar, 0.0),
                                 ("sliding_window_pattern", m.sliding_window_pattern, 0),
                                 ("rope_local_theta", m.rope_local_theta, 0.0),
                                 ("attention_softcap", m.attention_softcap, 0.0),
                                 ("final_softcap", m.final_softcap, 0.0),
                                 ("num_experts", m.num_experts, 0),  # its MLP is dense
                                 ("attention_sinks", m.attention_sinks, False),
                                 ("rope_scaling_factor", m.rope_scaling_factor, 0.0)):  # learned positions
            if value != fix:
                raise field_error(f"model.{name}", value, f"model.family=gpt2 does not have it: set it to {fix}")
    if attention.rope and attention.head_dim % 2:
        raise field_error("model.head_dim" if m.head_dim else "model.num_heads", m.head_dim or m.num_heads,
                          f"the head width {attention.head_dim} must be even for RoPE")
    if m.num_experts:
        if not 1 <= m.experts_per_token <= m.num_experts:
            raise field_error("model.experts_per_token", m.experts_per_token,
                  f"must be between 1 and model.num_experts={m.num_experts}")
        if not 0 <= m.moe_dense_layers < m.num_layers:
            raise field_error("model.moe_dense_layers", m.moe_dense_layers,
                              f"must be between 0 and model.num_layers - 1 = {m.num_layers - 1}")
        if not 1 <= m.moe_layer_step <= m.num_layers:
            raise field_error("model.moe_layer_step", m.moe_layer_step,
                              f"must be between 1 (every layer MoE) and model.num_layers = {m.num_layers}")
        if not m.swiglu_limit >= 0:  # NaN too
            raise field_error("model.swiglu_limit", m.swiglu_limit,
                              "must be 0 (plain SwiGLU) or gpt-oss's positive clamp of the experts' gate and up (7)")
        if m.swiglu_limit and not m.swiglu_alpha > 0:
            raise field_error("model.swiglu_alpha", m.swiglu_alpha, "must be > 0 (gpt-oss: 1.702)")
        if (m.moe_dense_layers or m.moe_layer_step > 1) and m.ffn_dim < 1:
            raise field_error("model.ffn_dim", m.ffn_dim, "the dense layers of an MoE model need their width: set it")
    elif m.router_bias or m.expert_bias or m.swiglu_limit:
        name, value = next((f, getattr(m, f)) for f in ("router_bias", "expert_bias", "swiglu_limit") if getattr(m, f))
        raise field_error(f"model.{name}", value, "only the routed experts of an MoE model (model.num_experts > 0) "
                                                  "have it: unset it")
    elif (m.moe_dense_layers, m.moe_layer_step) != (0, 1):
        name, value, fix = (("model.moe_dense_layers", m.moe_dense_layers, 0) if m.moe_dense_layers
                            else ("model.moe_layer_step", m.moe_layer_step, 1))
        raise field_error(name, value, f"a dense model (model.num_experts=0) has no MoE layers to place: "
                                       f"set it to {fix}")
    if m.norm_eps <= 0:
        raise field_error("model.norm_eps", m.norm_eps, "must be > 0")
    _validate_rope_scaling(m)
    if not m.capacity_factor >= 0:  # NaN too
        raise field_error("model.capacity_factor", m.capacity_factor,
                          "must be >= 0 (0 = dropless routing; e.g. 1.25 caps each expert at 1.25x its balanced share)")


def _validate_rope_scaling(m: ModelConfig) -> None:
    if m.rope_scaling_factor == 0:
        return
    if not m.rope_scaling_factor >= 1:
        raise field_error("model.rope_scaling_factor", m.rope_scaling_factor,
                          "must be 0 (plain RoPE) or >= 1 (Llama 3.1 scaling's factor is 8, gpt-oss's YaRN 32)")
    if m.rope_scaling_type == "linear":
        return
    if m.rope_scaling_type == "yarn":
        if not 0 < m.rope_yarn_beta_slow <= m.rope_yarn_beta_fast:
            raise field_error("model.rope_yarn_beta_fast", m.rope_yarn_beta_fast,
                              f"must be at least model.rope_yarn_beta_slow={m.rope_yarn_beta_slow} > 0 "
                              "(YaRN: 32 and 1)")
        if m.rope_original_max_seq_len < 1:
            raise field_error("model.rope_original_max_seq_len", m.rope_original_max_seq_len,
                              "must be a positive integer: the context YaRN stretches (gpt-oss: 4096)")
        return
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise field_error("model.rope_high_freq_factor", m.rope_high_freq_factor,
                          f"must be above model.rope_low_freq_factor={m.rope_low_freq_factor} > 0 (Llama 3.1: 4 and 1)")
    if m.rope_original_max_seq_len < 1:
        raise field_error("model.rope_original_max_seq_len", m.rope_original_max_seq_len,
                          "must be a positive integer (Llama 3.1: 8192)")


def _validate_training(cfg: Config) -> None:
    t = cfg.training
    for name in ("steps", "seq_len", "micro_batch_size", "eval_steps"):
        if getattr(t, name) < 1:
            raise field_error(f"training.{name}", getattr(t, name), "must be >= 1")
    for name in ("warmup_steps", "eval_interval", "global_batch_size"):
        if getattr(t, name) < 0:
            raise field_error(f"training.{name}", getattr(t, name), "must be >= 0")
    if t.seq_len > cfg.model.max_seq_len:
        raise field_error("training.seq_len", t.seq_len, f"must be <= model.max_seq_len={cfg.model.max_seq_len}")
    if t.lr <= 0:
        raise field_error("training.lr", t.lr, "must be > 0")
    if not 0 <= t.min_lr <= t.lr:
        raise field_error("training.min_lr", t.min_lr, f"must be between 0 and training.lr={t.lr}")
    if t.weight_decay < 0:
        raise field_error("training.weight_decay", t.weight_decay, "must be >= 0")
    if t.grad_clip < 0:
        raise field_error("training.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    if t.collective_timeout_minutes <= 0:
        raise field_error("training.collective_timeout_minutes", t.collective_timeout_minutes,
                          "must be > 0 (the default, 30, outlasts a large checkpoint's write)")
    if not 0 <= t.seed < 2**63:
        raise field_error("training.seed", t.seed, "must be between 0 and 2**63 - 1 (torch's generator seed range)")
    if t.warmup_steps >= t.steps:
        warnings.warn(f"training.warmup_steps={t.warmup_steps} >= training.steps={t.steps}: the learning rate never "
                      "reaches training.lr; lower warmup_steps (e.g. to a tenth of steps)", stacklevel=3)


def _init_from_preset(m: ModelConfig) -> None:
    """model.init_from names a folder of HF weights; without a model.preset of its own (the default
    'tiny'), the model is the folder's config.json."""
    if not m.init_from:
        return
    folder = Path(m.init_from)
    if not (folder / "config.json").is_file() or not (any(folder.glob("*.safetensors"))
                                                        or (folder / "model.safetensors.index.json").is_file()):
        raise field_error("model.init_from", m.init_from, "must be a folder holding config.json and *.safetensors "
                          "(Hugging Face weights, as `trainfit export` writes them)")
    if m.preset == ModelConfig.preset:  # the dataclass default: no preset was chosen
        m.preset = str(folder / "config.json")


def qlora_available() -> bool:
    """Whether QLoRA can train here: its NF4 base is torchao's tensor."""
    return importlib.util.find_spec("torchao") is not None


def _validate_peft(cfg: Config) -> None:
    pe = cfg.peft
    if pe.method == "none":
        return
    if pe.method == "qlora" and not qlora_available():
        raise field_error("peft.method", pe.method, "QLoRA's NF4 base is torchao's NF4 tensor: pip install torchao")
    if pe.rank < 1:
        raise field_error("peft.rank", pe.rank, "must be >= 1")
    if pe.alpha <= 0:
        raise field_error("peft.alpha", pe.alpha, "must be > 0")
    if not 0 <= pe.dropout < 1:
        raise field_error("peft.dropout", pe.dropout, "must be in [0, 1)")
    if not pe.targets:
        raise field_error("peft.targets", "", "name at least one linear: q, k, v, o, gate, up, down, attention, "
                          "mlp or all-linear")
    target_names(cfg.model, pe)  # its ConfigError names an unknown target


def _validate_rest(cfg: Config) -> None:
    _validate_peft(cfg)
    o = cfg.optimizer
    if not all(0 <= b < 1 for b in o.betas):
        raise field_error("optimizer.betas", o.betas, "each beta must be in [0, 1)")
    if o.eps <= 0:
        raise field_error("optimizer.eps", o.eps, "must be > 0")
    if not 0 <= o.momentum < 1:
        raise field_error("optimizer.momentum", o.momentum, "must be in [0, 1)")
    pr = cfg.precision
    if pr.fp8_all_gather and pr.fp8_scaling == "rowwise":
        raise field_error("precision.fp8_all_gather", True, "torchao's float8 all-gather casts weights with one "
                          "scale per tensor; set precision.fp8_scaling='tensorwise' or fp8_all_gather=false")
    p = cfg.parallel
    for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
        if getattr(p, name) < 1:
            raise field_error(f"parallel.{name}", getattr(p, name), "must be >= 1")
    if p.pp_virtual_stages < 0:
        raise field_error("parallel.pp_virtual_stages", p.pp_virtual_stages, "must be >= 1, or 0 to derive it")
    if any(n < 1 for n in p.pp_layers_per_stage[:1]) or any(n < 0 for n in p.pp_layers_per_stage[1:]):
        raise field_error("parallel.pp_layers_per_stage", list(p.pp_layers_per_stage),
                          "the first stage (the embedding's) needs at least one block, the others at least 0 (a stage "
                          "without blocks passes its input on, the last one through the head)")
    if p.dp_shard < 1 and p.dp_shard != -1:
        raise field_error("parallel.dp_shard", p.dp_shard, "must be >= 1, or -1 to derive it from hardware.num_gpus")
    if p.num_microbatches < 0:
        raise field_error("parallel.num_microbatches", p.num_microbatches, "must be >= 0 (0 derives it)")
    if not cfg.memory.moe_imbalance >= 1:  # NaN too
        raise field_error("memory.moe_imbalance", cfg.memory.moe_imbalance,
                          "must be >= 1 (the busiest expert's load over the balanced load; 1 = perfectly balanced)")
    if cfg.memory.loss_chunk_tokens < 1:
        raise field_error("memory.loss_chunk_tokens", cfg.memory.loss_chunk_tokens,
                          "must be >= 1 (tokens per chunk of the chunked loss; 1024 is the default)")
    if cfg.memory.ac_every_n_layers < 1:
        raise field_error("memory.ac_every_n_layers", cfg.memory.ac_every_n_layers, "must be >= 1")
    if not 0 < cfg.data.val_fraction < 1:
        raise field_error("data.val_fraction", cfg.data.val_fraction, "must be between 0 and 1 (exclusive)")
    if cfg.data.bpe_vocab_size < 257:
        raise field_error("data.bpe_vocab_size", cfg.data.bpe_vocab_size, "must be > 256 (the byte alphabet)")
    if cfg.checkpoint.interval < 0:
        raise field_error("checkpoint.interval", cfg.checkpoint.interval, "must be >= 0 (0 saves only at the end)")
    if cfg.checkpoint.keep_last < 1:
        raise field_error("checkpoint.keep_last", cfg.checkpoint.keep_last, "must be >= 1")
    if cfg.logging.interval < 1:
        raise field_error("logging.interval", cfg.logging.interval, "must be >= 1")
    if cfg.logging.memory_interval < 0:
        raise field_error("logging.memory_interval", cfg.logging.memory_interval,
                          "must be >= 0 (0 measures the second step only)")
    if cfg.logging.memory_interval and not cfg.logging.measure_memory:
        raise field_error("logging.memory_interval", cfg.logging.memory_interval,
                          "measures memory, which logging.measure_memory=false turns off; set one of them")
    profile_window(cfg.logging.profile_steps, cfg.training.steps)


def profile_window(steps: str, num_steps: int) -> tuple[int, int] | None:
    """(first, last) training step to profile, both counted from 1, from `logging.profile_steps`
    ("3" or "3-5"); None when it is empty."""
    if not steps:
        return None
    first, _, last = steps.partition("-")
    fix = (f"give one step (3) or a range (3-5) within 1..training.steps={num_steps} "
           "(--profile=STEPS on `trainfit train`)")
    if not (first.isdecimal() and (last.isdecimal() or "-" not in steps)):
        raise field_error("logging.profile_steps", steps, fix)
    window = int(first), int(last or first)
    if not 1 <= window[0] <= window[1] <= num_steps:
        raise field_error("logging.profile_steps", steps, fix)
    return window
