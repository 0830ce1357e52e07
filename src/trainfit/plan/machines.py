"""Which machine, how many, at what cost: `trainfit plan --tokens N --gpu-options A,B --max-gpus M`. Torch-free.

For each device and each count (one node, then doubling, up to max_gpus; powers of two below a
node), the fastest layout that fits (plan/search.search, its first row): the time to train `tokens`
at its tokens/s, and the cost at the device's price per GPU-hour (`--prices`, else
hardware.price_per_gpu_hour for the config's own device, else trainfit.hardware's indicative
price). A row is on the cost-time frontier when every faster row costs more (by COST_STEP).

Every option trains the same global batch, so their times compare: training.global_batch_size, or
when it is 0 the batch `trainfit train` derives from the config as given, once (micro_batch_size x
the data-parallel ranks of its own degrees on its own hardware.num_gpus; plan/space.with_global_batch),
not re-derived per device count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.config import Config, ConfigError
from trainfit.configure import resolve_and_validate
from trainfit.hardware import GPU_ALIASES, GPUS, canonical_gpu, price_per_gpu_hour
from trainfit.plan.search import Candidate, search
from trainfit.plan.space import replace_sections, with_global_batch

HOUR = 3600.0


@dataclass(frozen=True)
class MachineOption:
    gpu: str
    num_gpus: int
    candidate: Candidate | None
    """The fastest layout that fits, or None."""
    price_per_gpu_hour: float | None
    tokens: float

    @property
    def seconds(self) -> float | None:
        """Time to train `tokens` at the candidate's tokens/s."""
        return self.tokens / self.candidate.tokens_per_second if self.candidate else None

    @property
    def cost(self) -> float | None:
        if self.seconds is None or self.price_per_gpu_hour is None:
            return None
        return self.seconds / HOUR * self.num_gpus * self.price_per_gpu_hour


def gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """Device counts tried: the powers of two that divide a node, then whole nodes doubling, up to max_gpus."""
    below = [1 << k for k in range(gpus_per_node.bit_length())
             if (1 << k) < gpus_per_node and gpus_per_node % (1 << k) == 0 and (1 << k) <= max_gpus]
    nodes, n = [], gpus_per_node
    while n <= max_gpus:
        nodes.append(n)
        n *= 2
    return below + nodes


def check_gpus(names: list[str]) -> list[str]:
    """The catalog names of --gpu-options' devices (short aliases such as H200 accepted)."""
    for name in names:
        if canonical_gpu(name) not in GPUS:
            raise ConfigError(f"--gpu-options {name!r}: unknown device; choose among {', '.join(GPUS)} "
                              f"(or {', '.join(GPU_ALIASES)})")
    return [canonical_gpu(name) for name in names]


def compare_machines(cfg: Config, fixed: frozenset[str], *, tokens: float, gpus: list[str], max_gpus: int,
                     prices: dict[str, float], progress: Callable[[str], None] | None = None,
                     stop: Callable[[], bool] | None = None) -> list[MachineOption]:
    """Every (device, count) option, fastest first (those where nothing fits last); `stop` as search's."""
    gpus = check_gpus(gpus)
    fixed = fixed - {"hardware.gpu", "hardware.num_gpus"}
    cfg, _ = with_global_batch(cfg)  # one batch for every count (see the module docstring)
    options = []
    for gpu in gpus:
        for count in gpu_counts(cfg.hardware.gpus_per_node, max_gpus):
            if progress:
                progress(f"{count} x {gpu}")
            own = gpu == cfg.hardware.gpu
            machine = replace_sections(cfg, hardware={
                "gpu": gpu, "num_gpus": count,
                "price_per_gpu_hour": cfg.hardware.price_per_gpu_hour if own else 0.0})
            resolve_and_validate(machine)
            plan = search(machine, fixed, top=1, stop=stop)
            price = prices.get(gpu, price_per_gpu_hour(machine.hardware))
            options.append(MachineOption(gpu, count, plan.candidates[0] if plan.candidates else None, price, tokens))
    return sorted(options, key=lambda o: (o.seconds is None, o.seconds or 0.0, o.cost or 0.0))


COST_STEP = 0.005
"""A slower option is on the frontier only if it costs at least this fraction less than every faster one."""


def on_cost_frontier(options: list[MachineOption]) -> list[bool]:
    """Whether each option (in the order given: fastest first) costs less than every faster one."""
    flags, cheapest = [], float("inf")
    for option in options:
        cost = option.cost
        flags.append(cost is not None and cost < cheapest * (1 - COST_STEP))
        if cost is not None:
            cheapest = min(cheapest, cost)
    return flags


def parse_prices(text: str | None) -> dict[str, float]:
    """--prices 'H100-SXM-80GB=2.5,A100-SXM-80GB=1.6' -> {device: USD per GPU-hour}."""
    prices: dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        (name,) = check_gpus([name])
        try:
            prices[name] = float(value)
        except ValueError:
            raise ConfigError(f"--prices {item!r}: write DEVICE=USD_PER_GPU_HOUR, e.g. H100-SXM-80GB=2.49") from None
        if not prices[name] > 0:
            raise ConfigError(f"--prices {item!r}: the price must be > 0")
    return prices
