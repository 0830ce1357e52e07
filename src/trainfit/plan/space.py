"""What `trainfit plan` chooses among: each searched field's options for one config (fields the
user set have one). Torch-free.

| choice                      | options                                                               |
|-----------------------------|-----------------------------------------------------------------------|
| parallel.tp                 | divisors of a node's GPUs that divide the heads, KV heads and FFN     |
| parallel.sequence_parallel  | on whenever tp > 1: the same bytes as tensor parallelism's            |
|                             | all-reduces (perf/comms.py), less activation memory                   |
| parallel.cp                 | divides the world, 2 cp divides the sequence, >= MIN_CP_TOKENS each   |
| parallel.pp, pp_schedule    | divides what tp x cp leave; 1f1b, interleaved-1f1b, zbv-zero-bubble,  |
|                             | interleaved-zero-bubble (gpipe, looped-bfs and dualpipev have the     |
|                             | bubble of one of these and hold more micro-batches: never better)     |
| parallel.ep                 | MoE: divisors of the experts that divide dp_shard x cp                |
| parallel.dp_replicate       | 1 (FSDP over all data-parallel ranks), or HSDP with shard groups of   |
|                             | 1, 2, 4 or 8 whole nodes                                              |
| parallel.zero_stage         | 0-3                                                                   |
| training.micro_batch_size   | divisors of a data-parallel rank's sequences per step, up to          |
|                             | MAX_MICRO_BATCH; the rest is accumulation (pipeline micro-batches).   |
|                             | The global batch stays: the config's, or when 0 the one `train`       |
|                             | derives from the config as given (with_global_batch)                  |
| memory.activation_checkpointing, ac_every_n_layers | none, selective, full every 4, selective- |
|                             | alternate, full every 2, full                                         |
| parallel.sp_recompute_gather | under sequence parallelism, with each checkpointing option that      |
|                             | leaves blocks unwrapped: off, on (plan/search.py's _Knobs)            |
| memory.offload              | none, optimizer (ZeRO-2/3), optimizer+params (ZeRO-3)                 |
| memory.chunked_loss         | off, on (where a micro-batch has more than memory.loss_chunk_tokens   |
|                             | tokens on a rank: plan/search.py's _Knobs)                            |
| precision.mode              | the config's (bf16-mixed on a GPU when the user leaves it), or those  |
|                             | the caller allows                                                     |

Every option is searched only where it trains: plan/search.py keeps no layout, and no memory
setting of one, that Layout.untrainable_reason refuses (DDP and ZeRO-1 with tp, pp or ep;
selective checkpointing under zero-bubble schedules; Adafactor with ZeRO-1, FSDP2 or tp; ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from trainfit.config import Config
from trainfit.parallel.resolve import GlobalBatch, global_batch_of

T = TypeVar("T")

MIN_CP_TOKENS = 1024
"""Fewest tokens of a sequence one context-parallel rank holds: below that its K/V all-gathers
outweigh the attention they split (Llama 3 used cp 16 on 131,072 tokens: 8,192 each)."""
MAX_MICRO_BATCH = 16
"""Largest micro-batch tried: the time model prices no matmul-efficiency gain from bigger ones."""
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv-zero-bubble", "interleaved-zero-bubble")
HSDP_NODES = (1, 2, 4, 8)
"""Nodes per HSDP shard group tried (besides sharding over every data-parallel rank)."""
AC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("none", 1), ("selective", 1), ("full", 4), ("selective-alternate", 1), ("full", 2), ("full", 1))
OFFLOAD_OPTIONS = ("none", "optimizer", "optimizer+params")

SEARCHED = (
    "parallel.tp", "parallel.sequence_parallel", "parallel.cp", "parallel.pp", "parallel.pp_schedule",
    "parallel.pp_virtual_stages", "parallel.ep", "parallel.dp_replicate", "parallel.dp_shard",
    "parallel.zero_stage", "training.micro_batch_size", "memory.activation_checkpointing",
    "memory.ac_every_n_layers", "memory.offload", "memory.chunked_loss", "precision.mode",
    "parallel.sp_recompute_gather",
)
"""The fields a plan chooses (the rest of the config is the user's)."""


def settings_of(cfg: Config) -> dict[str, Any]:
    """A config's values of the fields a plan chooses ("section.field" -> value)."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SEARCHED}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Space:
    """The options of every searched field for one config (fixed fields have one)."""

    world: int
    tp: tuple[int, ...]
    cp: tuple[int, ...]
    pp: tuple[int, ...]
    schedules: tuple[str, ...]
    ep: tuple[int, ...]
    zero: tuple[int, ...]
    precision: tuple[str, ...]
    ac: tuple[tuple[str, int], ...]
    offload: tuple[str, ...]
    chunked: tuple[bool, ...]
    fixed: frozenset[str]
    cfg: Config

    @classmethod
    def of(cls, cfg: Config, fixed: frozenset[str], precisions: tuple[str, ...] = ()) -> Space:
        m, t, hw, mem = cfg.model, cfg.training, cfg.hardware, cfg.memory
        world = hw.num_gpus

        def pick(key: str, options: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
            section, name = key.split(".")
            return (getattr(getattr(cfg, section), name),) if key in fixed else tuple(options)

        tp = [d for d in _divisors(min(hw.gpus_per_node, world)) if world % d == 0 and m.num_heads % d == 0
              and m.num_kv_heads % d == 0 and m.ffn_dim % d == 0]
        cp = [d for d in _divisors(world) if t.seq_len % (2 * d) == 0 and t.seq_len // d >= MIN_CP_TOKENS]
        pp = [d for d in _divisors(world) if d <= m.num_layers]
        ep = [d for d in _divisors(m.num_experts) if d <= world] if m.num_experts else [1]
        if precisions:
            precision: tuple[str, ...] = precisions
        elif "precision.mode" in fixed or hw.gpu == "cpu":
            precision = (cfg.precision.mode,)
        else:
            precision = ("bf16-mixed",)
        ac = AC_OPTIONS
        if "memory.activation_checkpointing" in fixed or "memory.ac_every_n_layers" in fixed:
            ac = tuple((policy, every) for policy, every in AC_OPTIONS + ((mem.activation_checkpointing,
                                                                           mem.ac_every_n_layers),)
                       if ("memory.activation_checkpointing" not in fixed or policy == mem.activation_checkpointing)
                       and ("memory.ac_every_n_layers" not in fixed or every == mem.ac_every_n_layers))
            ac = tuple(dict.fromkeys(ac))
        return cls(world=world, tp=pick("parallel.tp", tp or [1]), cp=pick("parallel.cp", cp or [1]),
                   pp=pick("parallel.pp", pp), schedules=pick("parallel.pp_schedule", PIPELINE_SCHEDULES),
                   ep=pick("parallel.ep", ep), zero=pick("parallel.zero_stage", (0, 1, 2, 3)), precision=precision,
                   ac=ac, offload=pick("memory.offload", OFFLOAD_OPTIONS), chunked=pick("memory.chunked_loss",
                                                                                       (False, True)),
                   fixed=fixed, cfg=cfg)

    def dp_replicates(self, dp: int, inner: int) -> list[int]:
        """HSDP replica counts for dp data-parallel ranks whose shard groups hold `inner` = cp x tp ranks each."""
        if "parallel.dp_replicate" in self.fixed or "parallel.dp_shard" in self.fixed:
            p = self.cfg.parallel
            if p.dp_shard == -1:
                return [p.dp_replicate] if dp % p.dp_replicate == 0 else []
            return [dp // p.dp_shard] if dp % p.dp_shard == 0 else []  # a fixed shard count the mesh cannot take
        per_node = self.cfg.hardware.gpus_per_node
        shards = {per_node * nodes // inner for nodes in HSDP_NODES if per_node * nodes % inner == 0}
        return [1] + sorted(dp // s for s in shards if 0 < s < dp and dp % s == 0)

    def micro_batches(self, dp: int) -> list[int]:
        """Micro-batch sizes for dp data-parallel ranks: divisors of each rank's sequences per step."""
        if "training.micro_batch_size" in self.fixed:
            return [self.cfg.training.micro_batch_size]
        rows = self.cfg.training.global_batch_size // dp
        return [b for b in _divisors(rows) if b <= MAX_MICRO_BATCH] if rows else []


def with_global_batch(cfg: Config) -> tuple[Config, GlobalBatch]:
    """cfg with training.global_batch_size set, and where it comes from: the config's own, or when it
    is 0 the batch `trainfit train` derives from cfg as given (micro_batch_size x the data-parallel
    ranks of its own degrees, parallel/resolve.global_batch_of). A plan keeps the global batch and
    searches how to split it, so it is fixed before the micro-batch or a degree changes; a config
    whose own degrees do not divide hardware.num_gpus is build_layout's named error."""
    batch = global_batch_of(cfg)
    return (replace_sections(cfg, training={"global_batch_size": batch.size}) if batch.derived else cfg), batch


def replace_sections(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A shallow copy of cfg with fields of some sections replaced (the planner never mutates one)."""
    return replaced(cfg, **{name: replaced(getattr(cfg, name), **values) for name, values in sections.items()})


def replaced(obj: T, **values: Any) -> T:
    """dataclasses.replace(obj, **values) for dataclasses whose fields are all init fields, built
    from the instance's own: replace inspects the class's fields on each call, and a plan makes
    thousands of configs and Layouts."""
    return type(obj)(**{**vars(obj), **values})
