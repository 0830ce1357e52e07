"""What each pipeline schedule is, once (`SCHEDULES`, keyed by parallel.pp_schedule): the torch class that
runs it, how many stages a rank holds and where, whether its backward splits into an input and a weight
pass, which micro-batch counts it takes, how many micro-batches of activations a rank keeps at its peak, and
its ideal bubble. The stage split, the layout's checks, the pipeline runtime, both estimators and the time
model read it, as checkpoint_policy.POLICIES is read for checkpointing. Torch-free.

Micro-batches in flight at a rank's peak (in units of one micro-batch through all of the rank's blocks):
gpipe runs every forward before any backward: m; looped-bfs too, one local stage after the other
(Lamy-Poirier 2023, arXiv 2211.05953). 1F1B (Narayanan et al., arXiv 2104.04473): rank i keeps p - i.
Interleaved 1F1B (Megatron's and torch.distributed.pipelining's warm-up): rank i runs (v - 1) p + 2 (p - 1 - i)
chunk forwards before its first backward, so keeps that plus one chunk of its v: for rank 0, Korthikanti's
L (1 + (p - 1)/(pv)) layers (arXiv 2205.05198, Sec. 4.2.3). Interleaved zero-bubble (torch's): a warm-up of
(v - 1) p + (p - 1 - i) chunk forwards plus one, and i micro-batches whose weight gradients wait with their
inputs saved: v p chunks, p micro-batches, on every rank. ZB-V (Qi et al., arXiv 2401.10241, Sec. 6): 1F1B's
first-rank peak, p, on every rank (the V balances it). DualPipeV: torch's ScheduleDualPipeV order reaches
2p + 1 of the rank's chunks (its two stages) before its first backward, on every rank: p + 1/2 micro-batches
(the DeepSeek-V3 report's "PP + 1" counts chunks of a DualPipe device, arXiv 2412.19437, Table 2).
tests/estimator/test_pipeline_memory.py walks torch's own orders against these counts.

Bubble, the idle share of an ideal step: (p - 1) / m for gpipe and 1f1b (Narayanan et al. 2021), divided by
the virtual stages for interleaved-1f1b and looped-bfs (Lamy-Poirier 2023), and 0 for the zero-bubble family
(Qi et al. 2024: no bubble when forward, input-gradient and weight-gradient passes take equal time; the
residual from unequal passes is not modelled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule, as the trainer runs it and the estimators price it."""

    torch_class: str
    """The torch.distributed.pipelining.schedules class that runs it."""
    keeps: Callable[[int, int, int, int], float]
    """(pp, v, m, rank) -> micro-batches of activations alive on the rank at its peak (module docstring)."""
    bubble: Callable[[int, int, int], float]
    """(pp, m, v) -> the idle share of an ideal step, pp > 1 (module docstring)."""
    stages_per_rank: int = 2
    """Stages each rank holds: fixed where `fixed_stages`, else the default of parallel.pp_virtual_stages=0."""
    fixed_stages: bool = False
    """The class takes exactly `stages_per_rank` stages per rank (1: torch's PipelineScheduleSingle)."""
    v_shape: bool = False
    """Rank r runs stages r and 2 pp - 1 - r (else r, r + pp, ...)."""
    split_backward: bool = False
    """Backward runs as an input-gradient pass and a later weight-gradient pass."""
    weight_pass_at_peak: bool = False
    """Of those, the weight passes wait past the activation peak (ScheduleDualPipeV splits only its
    cooldown, after its peak)."""
    fill_drain: bool = False
    """Every rank runs the same actions wherever it sits (all its forwards, then all their backwards:
    ScheduleGPipe reads a stage's index only to know whether it is the first or the last), so ranks that
    hold alike stages allocate alike and one traced rank stands for them; under the others a rank's place
    decides how many micro-batches it holds at once, and every rank is traced."""
    whole_rounds: bool = False
    """m must be a multiple of m // pp (torch's interleaved classes run whole rounds)."""
    microbatch_per_stage: bool = False
    """m must be at least the number of stages, pp x v (else at least pp)."""
    head_keeps_all: bool = False
    """The last stage's head keeps every micro-batch's activations at its peak (else one)."""

    @property
    def single_stage(self) -> bool:
        """torch's PipelineScheduleSingle: one stage per rank, stepped directly rather than through the
        runtime's action lists."""
        return self.fixed_stages and self.stages_per_rank == 1

    def least_microbatches(self, pp: int, virtual_stages: int) -> int:
        """The fewest micro-batches it takes on pp ranks."""
        return pp * virtual_stages if self.microbatch_per_stage else pp


def _fill_drain_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / m


def _looped_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / m / v


def _no_bubble(p: int, m: int, v: int) -> float:
    return 0.0


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("ScheduleGPipe", keeps=lambda p, v, m, i: float(m), bubble=_fill_drain_bubble,
                      stages_per_rank=1, fixed_stages=True, fill_drain=True, head_keeps_all=True),
    "1f1b": Schedule("Schedule1F1B", keeps=lambda p, v, m, i: float(min(p - i, m)), bubble=_fill_drain_bubble,
                     stages_per_rank=1, fixed_stages=True),
    "interleaved-1f1b": Schedule("ScheduleInterleaved1F1B", bubble=_looped_bubble, whole_rounds=True,
                                 keeps=lambda p, v, m, i: min(m * v, (v - 1) * p + 2 * (p - 1 - i) + 1) / v),
    "looped-bfs": Schedule("ScheduleLoopedBFS", keeps=lambda p, v, m, i: float(m), bubble=_looped_bubble,
                           head_keeps_all=True),
    "interleaved-zero-bubble": Schedule("ScheduleInterleavedZeroBubble", keeps=lambda p, v, m, i: float(min(p, m)),
                                        bubble=_no_bubble, split_backward=True, weight_pass_at_peak=True,
                                        whole_rounds=True),
    "zbv-zero-bubble": Schedule("ScheduleZBVZeroBubble", keeps=lambda p, v, m, i: float(min(p, m)),
                                bubble=_no_bubble, fixed_stages=True, v_shape=True, split_backward=True,
                                weight_pass_at_peak=True),
    "dualpipev": Schedule("ScheduleDualPipeV", keeps=lambda p, v, m, i: min(2 * p + 1, 2 * m) / 2, bubble=_no_bubble,
                          fixed_stages=True, v_shape=True, split_backward=True, microbatch_per_stage=True),
}
"""parallel.pp_schedule -> what it is (config/schema.py's PipelineSchedule lists the same names)."""


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank when parallel.pp_virtual_stages is 0."""
    return SCHEDULES[schedule].stages_per_rank


def micro_batches_in_flight(pp: int, virtual_stages: int, num_microbatches: int, schedule: str, rank: int
                            ) -> tuple[float, int]:
    """Micro-batches of activations alive on pipeline rank `rank` at its peak, and of the head."""
    if pp == 1:
        return 1.0, 1
    s = SCHEDULES[schedule]
    return s.keeps(pp, virtual_stages, num_microbatches, rank), num_microbatches if s.head_keeps_all else 1


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of an ideal step."""
    return 0.0 if pp <= 1 else SCHEDULES[schedule].bubble(pp, num_microbatches, virtual_stages)


def refuses(schedule: str, pp: int, virtual_stages: int, m: int) -> str | None:
    """Why torch's class for `schedule` refuses m micro-batches on pp ranks, or None."""
    s = SCHEDULES[schedule]
    if m < pp:
        return f"fewer micro-batches than the {pp} pipeline ranks leaves one idle the whole step"
    if m < s.least_microbatches(pp, virtual_stages):
        return f"{schedule} needs at least one micro-batch per stage ({pp * virtual_stages})"
    if s.whole_rounds and m % (m // pp):
        return f"{schedule} runs whole rounds: a multiple of m // pp = {m // pp} micro-batches"
    return None
