"""trainfit's estimate of the Ultra-Scale Playbook's measured H100 runs (the given half, ../shared/data/playbook).

Every run of dev.csv (nanotron on 1-64 nodes of 8 x H100-SXM-80GB; Llama-shaped 1B/3B/8B/80B models, sequence
4096, global batch 256, every dp/tp/pp/ZeRO/micro-batch combination) is built as a trainfit config and
estimated by the analytic estimate and the time model, as trainfit's engine would run it (so far: torch's
sequence parallelism, trainfit's ZeRO-1 and pipeline split; the data's README says where nanotron differs).
Printed, per (model, nodes) group and in all:

- memory: the predicted reserved bytes of world rank 0 (pipeline stage 0: the peak plus the allocator's
  fragmentation, what torch.cuda.max_memory_reserved counts; no CUDA context) against the measured GiB of the
  runs that ran: median |error| and the shares within 10% and 20%;
- fit calls both ways: of the runs that ran, those predicted to fit; of the crashes that are out-of-memory (a
  crash where the same layout ran at an equal or larger micro-batch is not: counted apart), those predicted
  not to fit;
- ranking: Spearman's correlation of predicted with measured tokens/s per GPU over a group's runs that ran, and
  whether the layout predicted fastest among them is in the measured top 10%; the 64-node groups reported
  apart (their scaling from 32 nodes is anomalous: the data's README).

    python benchmarks/playbook.py [--data CSV] [--only 8B-1 ...] [--json OUT] [--record "REASON"]

The record (playbook_record.json, `--record`) is a gate: a change that makes the 1-32-node groups' median
rank correlation, their count of predicted bests in the measured top 10%, the memory median |error| or either
fit call worse fails the suite (tests/estimator/test_playbook_record.py) unless re-recorded with a reason.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import Estimate, estimate
from trainfit.perf.engines import Engine
from trainfit.perf.host_costs import NO_ENGINE_HOST, HostCosts
from trainfit.tables import print_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_split import spearman  # noqa: E402 (beside this script)

DATA = Path(__file__).resolve().parent / "data" / "playbook" / "dev.csv"
"""The given half, copied with its data card (README.md beside it) from the project's shared data."""
RECORD = Path(__file__).with_name("playbook_record.json")
"""The figures the suite holds the estimates to (tests/estimator/test_playbook_record.py)."""
GIB = 2**30
SEQ, GLOBAL_BATCH, GPUS_PER_NODE = 4096, 256, 8
MODELS = {  # name -> (layers, hidden, heads, ffn, tied): nanotron's scripts/scaling_benchmarks.py (the README)
    "1B": (16, 2048, 32, 8192, True),
    "3B": (28, 3072, 32, 8192, True),
    "8B": (32, 4096, 32, 14336, False),
    "80B": (80, 8192, 64, 28672, False),
}
VOCAB = 131_072
TOP_SHARE = 0.10
"""The measured top share the predicted best should land in."""


@dataclass(frozen=True)
class Run:
    model: str
    nodes: int
    mbs: int
    grad_acc: int
    dp: int
    pp: int
    tp: int
    zero: int
    tok_s_gpu: float
    memory_gib: float | None
    """None: the run crashed."""

    @property
    def group(self) -> str:
        return f"{self.model}-{self.nodes}"

    @property
    def layout(self) -> tuple[int, ...]:
        return (self.dp, self.pp, self.tp, self.zero)


def read_runs(path: Path) -> list[Run]:
    runs = []
    with path.open() as f:
        for row in csv.DictReader(f):
            dp, pp, tp, mbs = int(row["dp"]), int(row["pp"]), int(row["tp"]), int(row["mbs"])
            runs.append(Run(row["model"], int(row["nodes"]), mbs, GLOBAL_BATCH // (dp * mbs), dp, pp, tp,
                            int(row["zero"]), float(row["tok_s_gpu"] or 0),
                            float(row["gpu_memory_gb"]) if row["gpu_memory_gb"] else None))
    return runs


def nanotron_split(run: Run) -> list[int]:
    """Blocks per pipeline stage as nanotron assigns them (src/nanotron/models/base.py, build_model, and
    models/llama.py, get_block_compute_costs): each decoder layer costs 4 h^2 + 3 ffn h, the head V h, the
    embedding nothing; blocks go in order to the current stage, which moves on once the cumulative cost
    exceeds its share (k / pp of the total), so a stage keeps the block that crosses its threshold."""
    layers, dim, _, ffn, _ = MODELS[run.model]
    costs = [4 * dim * dim + 3 * ffn * dim] * layers + [VOCAB * dim]
    total, stage, cumulative = sum(costs), 0, 0
    split = [0] * run.pp
    for cost in costs[:-1]:
        cumulative += cost
        split[stage] += 1
        if cumulative > total * (stage + 1) / run.pp:
            stage += 1
    return split


def overrides(run: Run) -> list[str]:
    """The run as a trainfit config: the model's shape, the layout, nanotron's bf16 with fp32 gradient
    accumulation, no recomputation, sequence parallelism with tensor parallelism, FlashAttention-2's kernel
    (models/llama.py's CoreAttention calls flash_attn_varlen_func of the flash-attn package)."""
    layers, dim, heads, ffn, tied = MODELS[run.model]
    return ["--model.preset=", "--model.family=llama", f"--model.num_layers={layers}", f"--model.dim={dim}",
            f"--model.num_heads={heads}", f"--model.num_kv_heads={heads}", f"--model.ffn_dim={ffn}",
            f"--model.vocab_size={VOCAB}", f"--model.tie_embeddings={str(tied).lower()}",
            f"--model.max_seq_len={SEQ}", f"--training.seq_len={SEQ}", f"--training.micro_batch_size={run.mbs}",
            f"--training.global_batch_size={GLOBAL_BATCH}", "--hardware.gpu=H100-SXM-80GB",
            f"--hardware.num_gpus={run.nodes * GPUS_PER_NODE}", f"--hardware.gpus_per_node={GPUS_PER_NODE}",
            f"--parallel.tp={run.tp}", f"--parallel.pp={run.pp}", f"--parallel.zero_stage={run.zero}",
            f"--parallel.sequence_parallel={str(run.tp > 1).lower()}", "--parallel.sp_recompute_gather=true",
            "--parallel.pp_schedule=1f1b",
            "--precision.mode=bf16-mixed", "--optimizer.grad_accum_dtype=fp32",
            "--memory.activation_checkpointing=none", "--training.attention_backend=flash",
            *([f"--parallel.pp_layers_per_stage={','.join(map(str, nanotron_split(run)))}"] if run.pp > 1 else [])]


@dataclass(frozen=True)
class Predicted:
    run: Run
    est: Estimate | None
    refusal: str = ""

    @property
    def reserved_gib(self) -> float | None:
        """World rank 0's (pipeline stage 0's) reserved bytes: its peak and the allocator's fragmentation."""
        if self.est is None:
            return None
        stage = self.est.memory.per_stage[0]
        return (stage.peak + stage.margin_terms.get("allocator_fragmentation", 0)) / GIB

    @property
    def tok_s_gpu(self) -> float | None:
        return None if self.est is None else self.est.perf.time["tokens_per_second"] / self.est.layout.world_size

    @property
    def fits(self) -> bool:
        return self.est is not None and self.est.fits


NANOTRON_TP = (1, 2, 4, 8, 16, 32)
"""The tp degrees the sweep ran, each with its own fitted host figures."""
NANOTRON_HOST_S = {1: 0.0063, 2: 0.0055, 4: 0.0047, 8: 0.005, 16: 0.0093, 32: 0.016}
"""nanotron's host seconds per block and micro-batch (forward and backward) by tp degree, fitted on the given
half's runs without pipeline parallelism by `python benchmarks/playbook.py --fit-host` (benchmarks/README.md
has the fit): an engine profile of nanotron used here only; trainfit's own estimates use trainfit's measured
host time (perf/host_costs.TRAINFIT)."""
NANOTRON_BOUNDARY_S = {1: 0.016, 2: 0.016, 4: 0.04, 8: 0.2, 16: 0.49, 32: 1.0}
"""... and per micro-batch at a pipeline rank's stage boundaries, fitted on the runs with pipeline parallelism
once the block figures are set."""
FORWARD_SHARE = 0.3
"""Of a block's host time, the forward's (trainfit's measured split, perf/host_costs.TRAINFIT: about 0.3)."""


def nanotron_engine(block_s: dict[int, float] = NANOTRON_HOST_S,
                    boundary_s: dict[int, float] = NANOTRON_BOUNDARY_S) -> HostCosts:
    """nanotron's host side as perf/host_costs.py prices an engine: every tp degree's block figure, split
    forward/backward as trainfit's is, and its stage-boundary figure; the rest of the model left to the launches."""
    kind = {1: "eager"}
    return HostCosts("nanotron", {(kind.get(tp, "sequence_parallel"), tp): (FORWARD_SHARE * h, (1 - FORWARD_SHARE) * h)
                                  for tp, h in block_s.items()}, boundary_s=dict(boundary_s),
                     source="fitted: benchmarks/playbook.py --fit-host")


def predict(run: Run, host: HostCosts | None = None) -> Predicted:
    """A run estimated as nanotron ran it, its host side `host` (default: nanotron's fitted one); elsewhere
    nanotron is priced as trainfit's engine (perf/engines.py)."""
    engine = Engine("nanotron", host or nanotron_engine(), ddp_master_weights=True, zero1_grad_reduce="all_reduce",
                    source="huggingface/nanotron, as the Playbook ran it")
    try:
        return Predicted(run, estimate(load_config(None, overrides(run)), engine=engine))
    except ConfigError as err:
        return Predicted(run, None, str(err))


GRID = [1e-4 * 1.05**i for i in range(round(math.log(1e4) / math.log(1.05)) + 1)]
"""The figures fit_host tries: 0.1 ms to 1 s, a factor 1.05 apart (and 0)."""


def fit_host(runs: list[Run], console: Console) -> tuple[dict[int, float], dict[int, float]]:
    """nanotron's host figures at each tp degree: the figure of GRID whose predicted step times have the
    smallest median |log error| against the measured ones, over the 1-32-node runs that ran at that degree:
    per block and micro-batch from the runs without pipeline parallelism, then per micro-batch at the stage
    boundaries from those with it. Each run is estimated once without a host side; host seconds H add
    max(0, H - compute - exposed communication) to its step, as perf/timing.py does (the refit estimates
    reproduce the errors printed)."""
    unit_block = HostCosts("unit", {(k, tp): (FORWARD_SHARE, 1 - FORWARD_SHARE) for tp in NANOTRON_TP
                                    for k in ("eager", "sequence_parallel")})
    unit_boundary = HostCosts("unit", boundary_s=dict.fromkeys(NANOTRON_TP, 1.0))
    pieces: dict[tuple[int, bool], list[tuple[float, float, float, float, float]]] = defaultdict(list)
    for run in runs:
        if run.memory_gib is None or run.tok_s_gpu <= 0 or run.nodes == 64:
            continue
        p = predict(run, NO_ENGINE_HOST)
        if p.est is None:
            continue
        t, layout = p.est.perf.time, p.est.layout
        measured = GLOBAL_BATCH * SEQ / (run.tok_s_gpu * run.nodes * GPUS_PER_NODE)
        pieces[run.tp, run.pp > 1].append((t["step_time_s"], t["compute_s"] + t["exposed_comm_s"],
                                           unit_block.step_seconds(layout), unit_boundary.step_seconds(layout),
                                           measured))

    def error(rows: list[tuple[float, float, float, float, float]], block: float, boundary: float) -> float:
        return statistics.median(abs(math.log((step + max(0.0, block * b + boundary * c - device)) / measured))
                                 for step, device, b, c, measured in rows)

    blocks, boundaries = {}, {}
    for tp in NANOTRON_TP:
        flat, staged = pieces[tp, False], pieces[tp, True]
        block = min([0.0, *GRID], key=lambda h: error(flat, h, 0.0)) if flat else 0.0
        blocks[tp] = float(f"{block:.2g}")
        boundary = min([0.0, *GRID], key=lambda h: error(staged, blocks[tp], h)) if staged else 0.0
        boundaries[tp] = float(f"{boundary:.2g}")
        console.print(f"tp {tp}: {len(flat)} runs without pp, {1e3 * blocks[tp]:.2g} ms per block and micro-batch, "
                      f"median |log error| {error(flat, 0, 0) if flat else 0:.3f} -> "
                      f"{error(flat, blocks[tp], 0) if flat else 0:.3f}; {len(staged)} with pp, "
                      f"{1e3 * boundaries[tp]:.3g} ms per micro-batch at the boundaries, "
                      f"{error(staged, 0, 0) if staged else 0:.3f} -> "
                      f"{error(staged, blocks[tp], boundaries[tp]) if staged else 0:.3f}")
    return blocks, boundaries


def not_oom(run: Run, runs: list[Run]) -> bool:
    """A crash where the same layout ran at an equal or larger micro-batch: not out of memory."""
    return run.memory_gib is None and any(
        o.memory_gib is not None and o.layout == run.layout and o.group == run.group and o.mbs >= run.mbs
        for o in runs)


def nanotron_refuses(run: Run) -> bool:
    """A layout nanotron's 1F1B engine refuses before its first step: fewer micro-batches than pp - 1
    (OneForwardOneBackwardPipelineEngine.train_batch_iter asserts nb_microbatches >= pp - 1,
    src/nanotron/parallel/pipeline_parallel/engine.py). None of the given half's such runs ran (106 crashed):
    their crashes are the assertion's, not out of memory, and count apart."""
    return run.pp > 1 and run.grad_acc < run.pp - 1


@dataclass
class Summary:
    ran: int = 0
    memory_errors: list[float] | None = None
    fits_called: int = 0
    ooms: int = 0
    ooms_called: int = 0
    other_crashes: int = 0
    engine_refused: int = 0
    """Crashes nanotron's schedule explains (nanotron_refuses)."""
    engine_refused_called: int = 0
    """... of them called "does not fit" (the fit call the issue's rule, which counts them as OOMs, adds)."""
    refused: int = 0
    rho: float | None = None
    best_in_top: bool | None = None

    def as_dict(self) -> dict:
        errors = self.memory_errors or []
        return {"ran": self.ran, "memory_median_abs_error": statistics.median(map(abs, errors)) if errors else None,
                "memory_within_10": sum(abs(e) <= 0.10 for e in errors), "memory_within_20":
                sum(abs(e) <= 0.20 for e in errors), "ran_called_fits": self.fits_called, "ooms": self.ooms,
                "ooms_called_not_fit": self.ooms_called, "other_crashes": self.other_crashes,
                "nanotron_refuses": self.engine_refused, "nanotron_refuses_called_not_fit": self.engine_refused_called,
                "refused": self.refused, "spearman": self.rho, "best_in_top_10": self.best_in_top}


def summarize(preds: list[Predicted], runs: list[Run], rank: bool = True) -> Summary:
    """A group's figures; `rank` False for several groups together (ranks compare within a group only)."""
    s = Summary(memory_errors=[])
    ran = [p for p in preds if p.run.memory_gib is not None]
    s.ran = len(ran)
    s.refused = sum(p.est is None for p in preds)
    for p in ran:
        if p.reserved_gib is not None:
            s.memory_errors.append(p.reserved_gib / p.run.memory_gib - 1)
        s.fits_called += p.fits
    for p in preds:
        if p.run.memory_gib is None:
            if not_oom(p.run, runs):
                s.other_crashes += 1
            elif nanotron_refuses(p.run):
                s.engine_refused += 1
                s.engine_refused_called += p.est is not None and not p.est.fits
            else:
                s.ooms += 1
                s.ooms_called += p.est is not None and not p.est.fits
    timed = [p for p in ran if p.tok_s_gpu is not None and p.run.tok_s_gpu > 0]
    if rank and len(timed) >= 3:
        s.rho = spearman([p.tok_s_gpu for p in timed], [p.run.tok_s_gpu for p in timed])
        best = max(timed, key=lambda p: p.tok_s_gpu)
        ordered = sorted((p.run.tok_s_gpu for p in timed), reverse=True)
        s.best_in_top = best.run.tok_s_gpu >= ordered[max(0, round(TOP_SHARE * len(ordered)) - 1)]
    return s


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def report(summaries: dict[str, Summary], console: Console) -> dict:
    table = Table(title="trainfit against the Playbook's measured H100 runs (given half)")
    for header in ("group", "ran", "memory median |error|", "within 10%", "within 20%", "ran, called fits",
                   "OOM, called not fit", "other crashes", "nanotron refuses", "refused", "Spearman",
                   "best in top 10%"):
        table.add_column(header, justify="left" if header == "group" else "right")
    out = {}
    for name, s in summaries.items():
        d = out[name] = s.as_dict()
        table.add_row(name, str(s.ran), _pct(d["memory_median_abs_error"]), str(d["memory_within_10"]),
                      str(d["memory_within_20"]), f"{s.fits_called} of {s.ran}", f"{s.ooms_called} of {s.ooms}",
                      str(s.other_crashes), str(s.engine_refused), str(s.refused),
                      "-" if s.rho is None else f"{s.rho:.2f}",
                      "-" if s.best_in_top is None else "yes" if s.best_in_top else "no")
    print_table(table, console)
    return out


def _layout_name(run: Run) -> str:
    return f"dp{run.dp} tp{run.tp} pp{run.pp} zero{run.zero} mbs{run.mbs}"


def choices(predicted: dict[str, list[Predicted]], console: Console) -> None:
    """Each group's choice (the run the estimates rank fastest, what the planner would pick among the layouts
    measured) beside the measured best: its measured throughput, its rank among the group's timed runs."""
    table = Table(title="the estimates' choice against the measured best, per group")
    for header in ("group", "chosen (predicted fastest)", "its tok/s/GPU measured", "its measured rank",
                   "measured best", "best tok/s/GPU", "chosen / best"):
        table.add_column(header, justify="left" if header in ("group", "chosen (predicted fastest)", "measured best")
                         else "right")
    for name, preds in predicted.items():
        timed = [p for p in preds if p.run.memory_gib is not None and p.run.tok_s_gpu > 0 and p.tok_s_gpu is not None]
        if len(timed) < 3:
            continue
        chosen = max(timed, key=lambda p: p.tok_s_gpu).run
        ordered = sorted(timed, key=lambda p: p.run.tok_s_gpu, reverse=True)
        best = ordered[0].run
        rank = 1 + [p.run for p in ordered].index(chosen)
        table.add_row(name, _layout_name(chosen), f"{chosen.tok_s_gpu:,.0f}", f"{rank} of {len(ordered)}",
                      _layout_name(best), f"{best.tok_s_gpu:,.0f}", f"{chosen.tok_s_gpu / best.tok_s_gpu:.0%}")
    print_table(table, console)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the runs' CSV (default: the given half)")
    parser.add_argument("--only", nargs="*", default=[], help="groups (MODEL-NODES, e.g. 8B-1) to estimate")
    parser.add_argument("--json", metavar="OUT", help="write every group's figures there")
    parser.add_argument("--record", metavar="REASON", help=f"write the whole data's figures to {RECORD.name}")
    parser.add_argument("--fit-host", action="store_true", help="fit nanotron's host figures (NANOTRON_HOST_S)")
    args = parser.parse_args()
    console = Console()
    runs = read_runs(args.data)
    if args.fit_host:
        blocks, boundaries = fit_host(runs, console)
        console.print(f"NANOTRON_HOST_S = {blocks}\nNANOTRON_BOUNDARY_S = {boundaries}")
        return
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        if not args.only or run.group in args.only:
            groups[run.group].append(run)
    start = time.perf_counter()
    predicted = {name: [predict(r) for r in members] for name, members in sorted(groups.items(), key=_group_order)}
    seconds = time.perf_counter() - start
    summaries = {name: summarize(preds, runs) for name, preds in predicted.items()}
    regular = [n for n in summaries if not n.endswith("-64")]
    every = [p for n in regular for p in predicted[n]]
    summaries["1-32 nodes, all"] = summarize(every, runs, rank=False)
    far = [n for n in summaries if n.endswith("-64")]
    if far:
        summaries["64 nodes, all"] = summarize([p for n in far for p in predicted[n]], runs, rank=False)
    out = report(summaries, console)
    choices(predicted, console)
    headline = headline_of(summaries)
    if headline["groups"]:
        console.print(f"1-32-node groups: median Spearman {headline['median_spearman']:.2f} over "
                      f"{headline['groups']} groups; predicted best in the measured top 10% in "
                      f"{headline['best_in_top_10']} of {headline['groups']}")
        both = headline['ooms_called_not_fit'] + headline['nanotron_refuses_called_not_fit']
        console.print(f"runs called fits {headline['ran_called_fits']} of {headline['ran']}; OOMs called not fit "
                      f"{headline['ooms_called_not_fit']} of {headline['ooms']} "
                      f"({headline['ooms_called_not_fit'] / max(1, headline['ooms']):.1%}); counting nanotron's "
                      f"refusals as OOMs too: {both} of {headline['ooms'] + headline['nanotron_refuses']}")
    console.print(f"{sum(len(p) for p in predicted.values())} runs estimated in {seconds:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.record:
        if args.only or args.data != DATA:
            parser.error("--record takes the whole given half: no --only, no --data")
        RECORD.write_text(json.dumps({"recorded": datetime.date.today().isoformat(), "reason": args.record,
                                      **headline, "groups_figures": out}, indent=1) + "\n")
        console.print(f"wrote {RECORD}")


def headline_of(summaries: dict[str, Summary]) -> dict:
    """What the record holds: over the 1-32-node groups, the median rank correlation and the count of
    predicted bests in the measured top 10%; over all their runs, memory and the fit calls."""
    regular = [s for n, s in summaries.items() if n[0].isdigit() and n.split("-")[-1].isdigit()
               and not n.endswith("-64") and s.rho is not None]
    every = summaries.get("1-32 nodes, all", Summary()).as_dict()
    return {"groups": len(regular), "median_spearman": statistics.median(s.rho for s in regular) if regular else None,
            "best_in_top_10": sum(bool(s.best_in_top) for s in regular),
            "memory_median_abs_error": every["memory_median_abs_error"],
            "ran": every["ran"], "ran_called_fits": every["ran_called_fits"], "ooms": every["ooms"],
            "ooms_called_not_fit": every["ooms_called_not_fit"], "nanotron_refuses": every["nanotron_refuses"],
            "nanotron_refuses_called_not_fit": every["nanotron_refuses_called_not_fit"]}


def current() -> dict:
    """headline_of the whole given half, estimated now (the gate's recomputation: a few seconds)."""
    runs = read_runs(DATA)
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    predicted = {name: [predict(r) for r in members] for name, members in groups.items()}
    summaries = {name: summarize(preds, runs) for name, preds in predicted.items()}
    summaries["1-32 nodes, all"] = summarize([p for n, ps in predicted.items() if not n.endswith("-64") for p in ps],
                                             runs, rank=False)
    return headline_of(summaries)


def _group_order(item: tuple[str, list[Run]]) -> tuple[int, int]:
    model, nodes = item[0].split("-")
    return (list(MODELS).index(model), int(nodes))


if __name__ == "__main__":
    main()
