"""What `trainfit estimate --json` and `trainfit plan --json` print for a config, built once: the
commands and the web page (trainfit serve) both answer with these, so the page's numbers are the
commands'."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainfit.config import Config, ConfigError
from trainfit.estimate import Estimate, as_json, estimate
from trainfit.plan.search import Cancelled

if TYPE_CHECKING:
    from trainfit.parallel.resolve import GlobalBatch
    from trainfit.plan.search import Plan


def estimate_answer(cfg: Config, est: Estimate | None = None, *, fixes: bool = True,
                    derived: list[str] | None = None) -> dict[str, Any]:
    """The analytic estimate of a validated config as JSON, with the defaults derived for its model
    (configure/defaults.py) and, when it does not fit (and `fixes`), the fewest changes that fit (each
    with its memory and speed) and the changes of method faster than those (LoRA, QLoRA): a search, up to tens of times
    the estimate's own time."""
    from trainfit.plan.fixes import fewest_changes, method_changes
    from trainfit.plan.space import with_global_batch

    est = est or estimate(cfg)
    out = as_json(est)
    out["warnings"] = list(est.layout.ineffective_options())
    out["derived_defaults"] = list(derived or [])
    if est.fits or not fixes:
        return out
    # the fixes keep the global batch: when it is 0, the one this config's run derives (named in the output)
    fixable, batch = with_global_batch(cfg)
    fixes_found = fewest_changes(fixable)
    out["fixes"] = [{"changes": list(f.changes), "overrides": f.overrides, "memory_bytes": f.candidate.memory_bytes,
                     "tokens_per_second": f.candidate.tokens_per_second, "mfu": f.candidate.mfu}
                    for f in fixes_found]
    out["fixes_global_batch"] = batch.as_dict()
    out["method_changes"] = [{"changes": list(f.changes), "overrides": f.overrides, "note": f.note,
                              "memory_bytes": f.candidate.memory_bytes,
                              "tokens_per_second": f.candidate.tokens_per_second, "mfu": f.candidate.mfu}
                             for f in method_changes(fixable, fixes_found)]
    return out


def fixed_fields(raw: dict[str, dict[str, Any]]) -> frozenset[str]:
    """The fields the user set ("section.field"): a plan keeps them and searches the rest."""
    return frozenset(f"{section}.{name}" for section, values in raw.items() for name in values)


def plan_answer(raw: dict[str, dict[str, Any]], cfg: Config, *, top: int = 10, precisions: tuple[str, ...] = (),
                progress: Callable[[str], None] | None = None,
                cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The time-memory frontier of the layouts of cfg's cluster that fit, fastest first (`top` at most),
    with the search's counts; ConfigError when no layout is even valid, and an `error` when none fits."""
    from trainfit.plan.explain import plan_json
    from trainfit.plan.search import search
    from trainfit.plan.space import with_global_batch

    if top < 1:
        raise ConfigError(f"--top {top}: show at least 1 candidate; try --top 10")
    _, batch = with_global_batch(cfg)
    if progress:
        progress(f"searching the layouts of {cfg.hardware.num_gpus} x {cfg.hardware.gpu}")
    plan = search(cfg, fixed_fields(raw), top=top, precisions=precisions, stop=cancelled)
    if cancelled and cancelled():
        raise Cancelled
    if not plan.candidates and not plan.stats.groups:
        from trainfit.parallel.resolve import build_layout

        build_layout(cfg)  # no layout was even valid: the config's own fields say why (a named error)
    out = plan_json(plan)
    if not plan.candidates:
        out["error"] = no_fit_message(cfg, plan, batch)
    return out


def no_fit_message(cfg: Config, plan: Plan, batch: GlobalBatch) -> str:
    """Why a plan lists nothing, and what to change."""
    reasons = ", ".join(f"{n:,} {why}" for why, n in plan.stats.rejected.most_common(5))
    return (f"no layout of this model fits {cfg.hardware.num_gpus} x {cfg.hardware.gpu} with global batch "
            f"{batch.words()} ({reasons or 'no valid layout'}); add GPUs (hardware.num_gpus), a device with more "
            "memory (hardware.gpu), or unfix fields that you set")


def machines_answer(raw: dict[str, dict[str, Any]], cfg: Config, *, tokens: float, gpu_options: str, max_gpus: int,
                    prices: str, progress: Callable[[str], None] | None = None,
                    cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Each device of `gpu_options` (comma-separated; default cfg's) at each count up to `max_gpus`:
    its fastest layout, the time to train on `tokens` and the cost, at one global batch."""
    from trainfit.plan.explain import machines_json
    from trainfit.plan.machines import check_gpus, compare_machines, parse_prices
    from trainfit.plan.space import with_global_batch

    if not tokens > 0:
        raise ConfigError(f"--tokens {tokens}: the tokens to train on, > 0 (e.g. 2e12)")
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus {max_gpus}: must be >= 1")
    gpus = check_gpus([g for g in (gpu_options or cfg.hardware.gpu).split(",") if g])
    _, batch = with_global_batch(cfg)

    def step(what: str) -> None:
        if cancelled and cancelled():
            raise Cancelled
        if progress:
            progress(what)

    options = compare_machines(cfg, fixed_fields(raw), tokens=tokens, gpus=gpus, max_gpus=max_gpus,
                               prices=parse_prices(prices or None), progress=step, stop=cancelled)
    return {**machines_json(options), "global_batch": batch.as_dict()}
