"""What a plan found, in words and a table: each candidate's layout, memory, speed, and what it gives
up against the one above it. Torch-free; rich renders the table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainfit.config import dump_toml
from trainfit.plan.machines import MachineOption, on_cost_frontier
from trainfit.plan.search import Candidate, Plan, model_summary
from trainfit.units import fmt_bytes

if TYPE_CHECKING:  # rich only where a table is drawn (not for --json)
    from rich.table import Table

GIB = 1024**3


def layout_words(c: Candidate) -> str:
    """The parallel layout in a few words: 'tp8+sp cp2 pp4 zbv-zero-bubble | FSDP 16 (ZeRO-3)'."""
    d = c.layout
    model = [f"tp{d.tp}" + ("+sp" if d.sequence_parallel else "")] if d.tp > 1 else []
    model += [f"cp{d.cp}"] if d.cp > 1 else []
    model += [f"ep{d.ep}"] if d.ep > 1 else []
    if d.pp > 1:
        virtual = f" x{d.pp_virtual_stages}" if d.pp_virtual_stages > 1 else ""
        model.append(f"pp{d.pp} {d.pp_schedule}{virtual}")
    data = {"none": "one replica", "ddp": f"DDP {d.dp}", "zero1": f"ZeRO-1 {d.dp}"}.get(d.data_parallel)
    if data is None:
        data = (f"HSDP {d.dp_replicate}x{d.dp_shard}" if d.dp_replicate > 1 else f"FSDP {d.dp_shard}") + \
            f" (ZeRO-{d.zero_stage})"
    return " ".join(model + ["|", data]) if model else data


def memory_words(c: Candidate) -> str:
    """The memory knobs: checkpointing, offload, chunked loss."""
    d = c.layout
    ac = d.activation_checkpointing
    words = [ac + (f" every {d.ac_every_n_layers}" if d.ac_every_n_layers > 1 and ac != "none" else "")
             if ac != "none" else "no checkpointing"]
    words += [f"offload {d.offload}"] if d.offload != "none" else []
    words += ["chunked loss"] if d.chunked_loss else []
    return ", ".join(words)


def _time_parts(c: Candidate) -> dict[str, float]:
    """Where a candidate's step time goes: compute (fp8-mixed's casts and QLoRA's dequantizations apart),
    each exposed collective kind, offload, bubble, the parallel frameworks' host work."""
    t = c.perf.time
    parts = {"compute": t["compute_s"] - t["fp8_cast_s"] - t["nf4_dequant_s"], "fp8 casts": t["fp8_cast_s"],
             "NF4 dequantization": t["nf4_dequant_s"], "bubble": t["bubble_s"],
             "host offload": t["exposed_offload_s"], "host work": t["exposed_host_s"]}
    parts.update({f"exposed {kind.replace('_', '-')}": s for kind, s in t["exposed_comm_by_kind_s"].items()})
    return parts


def versus(above: Candidate, c: Candidate) -> str:
    """What `c` gives up against the faster `above`, and what it gains, in words."""
    slower = c.step_time_s / above.step_time_s - 1
    words = [f"{slower:.1%} slower" if slower > 5e-4 else "as fast"]
    a, b = _time_parts(above), _time_parts(c)
    costs = sorted(((b[k] - a[k], k) for k in b), reverse=True)
    words += [f"+{delta:.2f} s {name}" for delta, name in costs[:2] if delta > 0.005 * above.step_time_s]
    saved = above.memory_bytes - c.memory_bytes
    words.append(f"{fmt_bytes(saved)} less memory" if saved > 0 else f"{fmt_bytes(-saved)} more memory")
    return "; ".join(words)


def plan_table(plan: Plan) -> Table:
    from rich.table import Table

    first = plan.candidates[0]
    table = Table(title=f"trainfit plan: {model_summary(first.cfg)}\nthe fastest layout that fits, then each "
                        "next fastest that needs less memory", title_justify="left")
    for column, justify in (("#", "right"), ("layout", "left"), ("micro-batch x n", "right"),
                            ("memory techniques", "left"), ("per GPU", "right"), ("tokens/s", "right"),
                            ("MFU", "right"), ("against the one above", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    device = first.device_memory
    for i, c in enumerate(plan.candidates):
        memory = fmt_bytes(c.memory_bytes) + (f" / {fmt_bytes(device)}" if device and i == 0 else "")
        table.add_row(str(i + 1), layout_words(c), f"{c.layout.micro_batch_size} x {c.layout.num_microbatches}",
                      memory_words(c), memory, f"{c.tokens_per_second:,.0f}", f"{c.mfu:.1%}",
                      "" if i == 0 else versus(plan.candidates[i - 1], c))
    return table


def search_summary(plan: Plan) -> str:
    s = plan.stats
    rejected = ", ".join(f"{n:,} {why}" for why, n in s.rejected.most_common(4))
    return (f"searched {s.groups:,} layout{'s' * (s.groups != 1)}: {s.groups_visited:,} had their memory settings "
            f"tried, the rest were "
            f"bounded out by their best case; {s.memory_estimates:,} memory and {s.time_estimates:,} time estimates in "
            f"{plan.seconds:.2f} s; left out: {rejected or 'none'}")


def candidate_json(c: Candidate) -> dict[str, Any]:
    t = c.perf.time
    return {"settings": c.settings(), "layout": layout_words(c), "memory_techniques": memory_words(c),
            "memory_bytes": c.memory_bytes, "device_memory": c.device_memory,
            "peak_bytes": max(s.peak for s in c.memory.per_stage),
            "step_time_s": t["step_time_s"], "tokens_per_second": t["tokens_per_second"], "mfu": t["mfu"],
            "compute_s": t["compute_s"], "fp8_cast_s": t["fp8_cast_s"], "exposed_comm_s": t["exposed_comm_s"],
            "bubble_s": t["bubble_s"], "exposed_offload_s": t["exposed_offload_s"],
            "exposed_host_s": t["exposed_host_s"],
            "grad_accum_steps": c.layout.grad_accum_steps,
            "num_microbatches": c.layout.num_microbatches}


def plan_json(plan: Plan) -> dict[str, Any]:
    s = plan.stats
    return {"candidates": [candidate_json(c) for c in plan.candidates], "global_batch": plan.global_batch.as_dict(),
            "search": {"layouts": s.groups, "visited": s.groups_visited, "memory_estimates": s.memory_estimates,
                       "time_estimates": s.time_estimates, "rejected": dict(s.rejected), "seconds": plan.seconds}}


def winner_toml(raw: dict[str, dict[str, Any]], c: Candidate) -> str:
    """The user's own fields with the winner's choices written in: a config `trainfit train` runs as is.
    The global batch the plan ranked on is written too: left at 0 (derived), the winner's
    micro-batch would derive another."""
    merged = {section: dict(values) for section, values in raw.items()}
    for key, value in c.settings().items():
        section, name = key.split(".")
        merged.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
    merged.setdefault("training", {})["global_batch_size"] = c.layout.global_batch_size
    header = (f"written by trainfit plan: {model_summary(c.cfg)}\n{layout_words(c)}; {memory_words(c)}\n"
              f"predicted: {c.memory_bytes / GIB:.1f} GiB per GPU, {c.tokens_per_second:,.0f} tokens/s, "
              f"MFU {c.mfu:.1%}")
    return dump_toml(merged, header)


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Tokens/s against memory per GPU for every fitting candidate the search evaluated, the top ones marked."""
    from trainfit.figures import pyplot, save_figure  # matplotlib only when asked

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([c.memory_bytes / GIB for c in plan.fitting], [c.tokens_per_second for c in plan.fitting], s=12,
               alpha=0.5, label=f"{len(plan.fitting)} layouts that fit")
    top = plan.candidates
    ax.scatter([c.memory_bytes / GIB for c in top], [c.tokens_per_second for c in top], s=40, marker="*",
               color="tab:red", label=f"the {len(top)} fastest")
    ax.annotate("1", (top[0].memory_bytes / GIB, top[0].tokens_per_second), textcoords="offset points",
                xytext=(5, 5))
    if top[0].device_memory:
        ax.axvline(top[0].device_memory / GIB, color="grey", linestyle="--", label="device memory")
    ax.set_xlabel("memory per GPU (GiB, peak + reserved margin)")
    ax.set_ylabel("tokens/s (predicted)")
    ax.set_title(model_summary(top[0].cfg), fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _duration(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:,.1f} days" if days >= 1 else f"{seconds / 3600:,.1f} hours"


def machines_table(options: list[MachineOption], tokens: float) -> Table:
    """The cost-time frontier and each device's fastest option, fastest first (--json has every option)."""
    from rich.table import Table

    flags = on_cost_frontier(options)
    fastest = {o.gpu: o for o in reversed(options) if o.candidate}  # reversed: the first (fastest) one wins
    shown = [(o, f) for o, f in zip(options, flags, strict=True) if f or fastest.get(o.gpu) is o]
    first = next((o.candidate for o in options if o.candidate), None)
    what = model_summary(first.cfg).split(" on ")[0] if first else "the model"
    table = Table(title=f"trainfit plan: {what}, {tokens:.3g} tokens: each device's fastest count and the cost-time "
                        "frontier (* = cheaper than every faster option), fastest first", title_justify="left")
    for column, justify in (("device", "left"), ("GPUs", "right"), ("layout", "left"), ("tokens/s", "right"),
                            ("MFU", "right"), ("time to train", "right"), ("$/GPU-h", "right"), ("cost", "right"),
                            ("", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for option, cheapest in shown:
        c = option.candidate
        price = f"{option.price_per_gpu_hour:.2f}" if option.price_per_gpu_hour else "?"
        assert c is not None, "only options that fit are shown"
        cost = f"${option.cost:,.0f}" if option.cost is not None else "no price"
        table.add_row(option.gpu, str(option.num_gpus), f"{layout_words(c)}; {memory_words(c)}",
                      f"{c.tokens_per_second:,.0f}", f"{c.mfu:.1%}", _duration(option.seconds or 0.0), price, cost,
                      "*" if cheapest else "")
    table.caption = device_basis(sorted({o.gpu for o in options}))
    table.caption_justify = "left"
    return table


def device_basis(gpus: list[str]) -> str:
    """What a comparison of devices rests on: each one's matmul rate as published (trainfit.perf.gpu_kernels),
    not a measurement of these machines, and the time model's other figures from datasheets."""
    from trainfit.perf import gpu_kernels

    def basis(gpu: str) -> str:
        kernels = gpu_kernels.kernels_of(gpu)
        measured = kernels is not None and bool(kernels.mamf)
        return f"{gpu}: {kernels.source}" if measured else \
            f"{gpu}: datasheet peak x {gpu_kernels.MAMF_FRACTION_WITHOUT_MEASUREMENT} (no published MAMF)"

    return ("The devices are compared on published figures, not on measurements of these machines: matmul rates "
            f"({'; '.join(basis(g) for g in gpus)}), datasheet memory and link bandwidths; a --hardware.profile "
            "measured by `trainfit calibrate` on one of them replaces its figures.")


def machines_json(options: list[MachineOption]) -> dict[str, Any]:
    return {"options": [{"gpu": o.gpu, "num_gpus": o.num_gpus, "price_per_gpu_hour": o.price_per_gpu_hour,
                         "seconds_to_train": o.seconds, "cost": o.cost, "on_cost_frontier": flag,
                         "candidate": candidate_json(o.candidate) if o.candidate else None}
                        for o, flag in zip(options, on_cost_frontier(options), strict=True)]}


def plot_machines(options: list[MachineOption], path: str | Path) -> Path:
    """Cost against time to train, one marker per device, the cost-time frontier joined."""
    from trainfit.figures import pyplot, save_figure  # matplotlib only when asked

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    priced = [o for o in options if o.cost is not None]
    for gpu in dict.fromkeys(o.gpu for o in priced):
        mine = [o for o in priced if o.gpu == gpu]
        ax.scatter([o.seconds / 86400 for o in mine], [o.cost for o in mine], label=gpu, s=25)
        for o in mine:
            ax.annotate(str(o.num_gpus), (o.seconds / 86400, o.cost), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    best = [o for o, flag in zip(options, on_cost_frontier(options), strict=True) if flag]
    ax.plot([o.seconds / 86400 for o in best], [o.cost for o in best], color="grey", linestyle="--",
            label="cost-time frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("days to train (predicted)")
    ax.set_ylabel("cost (USD)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
