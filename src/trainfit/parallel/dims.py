"""Parallel degrees: derived, validated, explained. Torch-free (the estimator and planner use it).

The world of `hardware.num_gpus` ranks is a mesh pp x dp_replicate x dp_shard x cp x tp
(outermost first: tensor parallelism stays inside a node, pipeline stages span nodes). The
data-parallel degree is what remains after tp, pp and cp: dp = num_gpus / (tp * pp * cp) =
dp_replicate * dp_shard; `dp_shard = -1` derives it. ZeRO stages 1-3 shard over dp_shard and
replicate over dp_replicate (HSDP); stage 0 replicates over all dp ranks (DDP). Expert
parallelism borrows its ranks from the data-parallel ones (ep divides dp_shard * cp).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    num_gpus: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int
    pp_virtual_stages: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def zero_shards(self) -> int:
        """Ranks over which ZeRO/FSDP shards model states (1 under DDP)."""
        return self.dp_shard if self.zero_stage > 0 else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (virtual stages included)."""
        return self.pp * self.pp_virtual_stages


def _fail(field: str, value: object, fix: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {fix}")


def resolve_parallel_dims(cfg: object) -> ParallelDims:
    """Derive dp_shard when it is -1 and check every degree against the world and the model.

    `cfg` is a trainfit Config (typed loosely to keep this module import-light).
    """
    p, m, hw, t = cfg.parallel, cfg.model, cfg.hardware, cfg.training  # type: ignore[attr-defined]
    for name, heads in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads)):
        if heads % p.tp:
            raise _fail("parallel.tp", p.tp, f"must divide model.{name}={heads}")
    if p.tp > 1 and m.ffn_dim % p.tp:
        raise _fail("parallel.tp", p.tp, f"must divide model.ffn_dim={m.ffn_dim}")
    stages = p.pp * p.pp_virtual_stages
    if m.num_layers % stages:
        raise _fail("parallel.pp", p.pp, f"pp x pp_virtual_stages = {stages} must divide model.num_layers="
                                         f"{m.num_layers}")
    if p.pp_virtual_stages > 1 and p.pp_schedule != "interleaved-1f1b":
        raise _fail("parallel.pp_virtual_stages", p.pp_virtual_stages,
                    "needs parallel.pp_schedule='interleaved-1f1b'")
    if t.seq_len % (2 * p.cp if p.cp > 1 else 1):
        raise _fail("parallel.cp", p.cp, f"2 x cp must divide training.seq_len={t.seq_len} "
                                         "(load-balanced causal sharding)")
    model_parallel = p.tp * p.pp * p.cp
    if hw.num_gpus % model_parallel:
        raise _fail("hardware.num_gpus", hw.num_gpus,
                    f"must be a multiple of tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {model_parallel}")
    dp = hw.num_gpus // model_parallel
    if dp % p.dp_replicate:
        raise _fail("parallel.dp_replicate", p.dp_replicate,
                    f"must divide the data-parallel degree num_gpus / (tp x pp x cp) = {dp}")
    dp_shard = dp // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * dp_shard != dp:
        raise _fail("parallel.dp_shard", p.dp_shard,
                    f"dp_replicate x dp_shard must equal num_gpus / (tp x pp x cp) = {dp}; "
                    f"set dp_shard={dp // p.dp_replicate} or -1 to derive it")
    if p.zero_stage > 0 and dp_shard == 1 and dp > 1:
        raise _fail("parallel.zero_stage", p.zero_stage,
                    f"shards over dp_shard, which is 1 here (dp_replicate={p.dp_replicate}); "
                    "lower dp_replicate or use zero_stage=0")
    if p.ep > 1:
        if not m.num_experts:
            raise _fail("parallel.ep", p.ep, "expert parallelism needs an MoE model (model.num_experts > 0)")
        if m.num_experts % p.ep:
            raise _fail("parallel.ep", p.ep, f"must divide model.num_experts={m.num_experts}")
        if (dp_shard * p.cp) % p.ep:
            raise _fail("parallel.ep", p.ep, f"must divide dp_shard x cp = {dp_shard * p.cp} "
                                             "(expert ranks are carved out of the data-parallel ones)")
    return ParallelDims(num_gpus=hw.num_gpus, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp,
                        pp=p.pp, cp=p.cp, ep=p.ep, zero_stage=p.zero_stage,
                        pp_virtual_stages=p.pp_virtual_stages)
