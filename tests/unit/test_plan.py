"""plan/search.py: the listed layouts are what `trainfit estimate` says of them, the pruned search
finds what an exhaustive one finds, and a brute force over every field agrees on the fastest.
Torch-free and fast: the search is closed-form estimates."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest

from _profiles import profile
from trainfit.config import ConfigError
from trainfit.configure import load_config, resolve_and_validate
from trainfit.estimate import estimate
from trainfit.hardware_profile import write_profile
from trainfit.parallel.resolve import GlobalBatch, build_layout
from trainfit.perf.timing import estimate_perf
from trainfit.plan import search as search_module
from trainfit.plan.explain import versus, winner_toml
from trainfit.plan.fixes import fewest_changes
from trainfit.plan.search import SLOWEST_LISTED, frontier, search
from trainfit.plan.space import settings_of

LLAMA8B_8 = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
             "--training.seq_len=8192", "--training.global_batch_size=64")
# A memory-bound case: llama3-8b on four 24 GB cards, pp and cp fixed so that a brute force stays small.
LLAMA8B_4090 = ("--model.preset=llama3-8b", "--hardware.gpu=RTX-4090", "--hardware.num_gpus=4",
                "--hardware.gpus_per_node=4", "--training.seq_len=4096", "--training.global_batch_size=16",
                "--parallel.pp=1", "--parallel.cp=1")


def plan(*args: str, **kwargs):
    cfg = load_config(None, list(args))
    fixed = frozenset(a[2:].split("=")[0] for a in args)
    return cfg, search(cfg, fixed, **kwargs)


def test_every_listed_layout_is_what_estimate_says_of_its_config() -> None:
    _, result = plan(*LLAMA8B_8, top=5)
    assert result.candidates
    for c in result.candidates:
        assert build_layout(c.cfg) == c.layout  # the config alone gives the same layout
        est = estimate(c.cfg)
        assert est.fits and est.perf.time["step_time_s"] == pytest.approx(c.step_time_s)
        assert max(s.peak + s.reserved_margin for s in est.memory.per_stage) == c.memory_bytes
        assert c.layout.untrainable_reason() is None


def test_the_search_makes_no_reference_cycles() -> None:
    """search runs with the cyclic garbage collector off, so what it drops must be freed by
    reference counting alone: after a search a collection finds nothing (in a fresh process, where
    nothing else leaves cycles behind)."""
    code = ("import gc; from trainfit.configure import load_config; from trainfit.plan.search import search; "
            f"args = {list(LLAMA8B_8)!r}; cfg = load_config(None, args); gc.collect(); "
            "gc.set_debug(gc.DEBUG_SAVEALL); search(cfg, frozenset(a[2:].split('=')[0] for a in args), top=5, "
            "exhaustive=True); assert gc.isenabled(); gc.collect(); assert gc.garbage == [], gc.garbage[:5]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_list_is_a_time_memory_frontier() -> None:
    _, result = plan(*LLAMA8B_8, top=6)
    rows = result.candidates
    assert len(rows) >= 3
    for above, below in itertools.pairwise(rows):
        assert below.step_time_s >= above.step_time_s and below.memory_bytes < above.memory_bytes
        assert "less memory" in versus(above, below)
    assert rows[-1].step_time_s <= rows[0].step_time_s * SLOWEST_LISTED
    # nothing evaluated is faster than the first, or as fast and leaner
    assert all(c.step_time_s >= rows[0].step_time_s for c in result.fitting)


CPU_BUDGET = ("--model.preset=debug", "--training.seq_len=128", "--training.global_batch_size=8",
              "--hardware.memory_gib=0.03")


@pytest.mark.parametrize("case", [(*LLAMA8B_8, "--parallel.pp=1"), LLAMA8B_4090, CPU_BUDGET],
                         ids=["8b-8xh100", "8b-4x4090", "cpu-budget"])
def test_the_bounds_lose_nothing(case: tuple[str, ...]) -> None:
    """Best-first with bounds lists what visiting every layout and every setting lists."""
    _, pruned = plan(*case, top=5)
    _, everything = plan(*case, top=5, exhaustive=True)
    assert [c.settings() for c in pruned.candidates] == [c.settings() for c in frontier(everything.fitting)[:5]]
    assert pruned.stats.memory_estimates < everything.stats.memory_estimates


MIXED_MOE = ("--model.preset=debug-moe", "--model.num_layers=4", "--model.moe_dense_layers=1",
             "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8", "--training.seq_len=128",
             "--training.global_batch_size=32")


def test_a_group_waits_in_the_heap_below_its_time(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A group's first setting is estimated only when its lower bound leaves the heap (_first_bound): the
    estimated settings leave in the order they would if each were estimated at once, so the plan is the
    same, only while that bound never exceeds the step time it stands for (GPU meshes with pipelines, a
    CPU with and without a measured profile, a model whose layers differ)."""
    keys: list[tuple[float, float]] = []
    first_bound = search_module._first_bound

    def recorded(knobs, layout, rates, mesh, traffic):  # type: ignore[no-untyped-def]
        key = first_bound(knobs, layout, rates, mesh, traffic)
        c = knobs.group.cfg
        keys.append((key, estimate_perf(c.model, layout, c.training, c.hardware, rates).time["step_time_s"]))
        return key

    monkeypatch.setattr(search_module, "_first_bound", recorded)
    measured = f"--hardware.profile={write_profile(profile(), tmp_path / 'cpu.toml')}"
    for case in (LLAMA8B_8, CPU_BUDGET, (*CPU_BUDGET, measured, "--hardware.num_gpus=4"), MIXED_MOE):
        plan(*case, top=5)
    assert len(keys) > 100 and all(key <= time for key, time in keys)


LORA_8B = ("--model.preset=llama3-8b", "--hardware.gpu=RTX-4090", "--hardware.num_gpus=4",
           "--hardware.gpus_per_node=4", "--training.seq_len=2048", "--training.global_batch_size=16",
           "--peft.method=lora")


@pytest.mark.parametrize(("case", "precisions"), [
    (LLAMA8B_8, ("fp8-mixed",)), (LLAMA8B_4090, ("bf16-mixed", "fp32")), (CPU_BUDGET, ()), (MIXED_MOE, ()),
    (LORA_8B, ())], ids=["8b-8xh100", "8b-4x4090", "cpu-budget", "mixed-moe", "lora"])
def test_the_memory_floor_is_never_above_the_peak(case: tuple[str, ...], precisions: tuple[str, ...],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """StageMemory.floor, which the search asks before each rank's breakdown and which ends the estimate
    where it exceeds the device's memory, is at most the rank's peak on every rank of every layout an
    exhaustive search estimates: no layout that fits is left out by it."""
    floors: list[tuple[int, int]] = []

    class Checked(search_module.StageMemory):
        def floor(self, stage: int) -> int:
            found = super().floor(stage)
            floors.append((found, self(stage).peak))
            return found

    monkeypatch.setattr(search_module, "StageMemory", Checked)
    plan(*case, top=5, precisions=precisions, exhaustive=True)
    assert len(floors) > 50 and all(floor <= peak for floor, peak in floors)


def test_a_brute_force_over_every_field_finds_the_same_fastest_layout() -> None:
    """Every combination of the searched fields, each validated and estimated as `trainfit estimate`
    does a config: the fastest one that fits and trains is the plan's first."""
    base, result = plan(*LLAMA8B_4090, top=3)
    best = None
    for tp, zero, micro, (ac, every, regather), offload, chunked, replicate in itertools.product(
            (1, 2, 4), (0, 1, 2, 3), (1, 2, 4), (("none", 1, False), ("none", 1, True), ("selective", 1, False),
                                                 ("selective-alternate", 1, False), ("full", 1, False),
                                                 ("full", 2, False), ("full", 4, False)),
            ("none", "optimizer", "optimizer+params"), (False, True), (1, 2)):
        if regather and tp == 1:
            continue
        cfg = dataclasses.replace(
            base, parallel=dataclasses.replace(base.parallel, tp=tp, zero_stage=zero, dp_replicate=replicate,
                                               sequence_parallel=tp > 1, sp_recompute_gather=regather),
            training=dataclasses.replace(base.training, micro_batch_size=micro),
            memory=dataclasses.replace(base.memory, activation_checkpointing=ac, ac_every_n_layers=every,
                                       offload=offload, chunked_loss=chunked),
            precision=dataclasses.replace(base.precision, mode="bf16-mixed"))
        try:
            resolve_and_validate(cfg)
            est = estimate(cfg)
        except ConfigError:
            continue
        if est.fits and est.layout.untrainable_reason() is None and (
                best is None or est.perf.time["step_time_s"] < best.perf.time["step_time_s"]):
            best = est
    assert best is not None
    assert result.candidates[0].step_time_s == pytest.approx(best.perf.time["step_time_s"])


def test_the_chunked_loss_is_offered_only_where_it_splits_the_logits() -> None:
    """A chunk of at least a micro-batch's tokens holds the whole logits and adds a recomputation: the
    planner does not offer it (micro-batches of 1-8 x 128 tokens; chunks of 1024, then of 256), unless
    the user set it."""
    every = {"exhaustive": True, "top": 5}
    _, default_chunk = plan(*CPU_BUDGET, **every)
    assert default_chunk.fitting and not any(c.layout.chunked_loss for c in default_chunk.fitting)
    _, small_chunk = plan(*CPU_BUDGET, "--memory.loss_chunk_tokens=256", **every)
    chunked = {c.layout.micro_batch_size for c in small_chunk.fitting if c.layout.chunked_loss}
    assert chunked == {4, 8} and all(c.layout.loss_chunks > 1 for c in small_chunk.fitting if c.layout.chunked_loss)
    _, user_set = plan(*CPU_BUDGET, "--memory.chunked_loss=true", **every)
    assert user_set.fitting and all(c.layout.chunked_loss for c in user_set.fitting)


def test_fields_the_user_set_stay_as_set() -> None:
    _, result = plan(*LLAMA8B_8, "--parallel.tp=2", "--memory.activation_checkpointing=full", top=4)
    assert result.candidates
    for c in result.candidates:
        assert c.layout.tp == 2 and c.layout.activation_checkpointing == "full"
        assert c.layout.global_batch_size == 64
    _, fp8 = plan(*LLAMA8B_8, top=3, precisions=("bf16-mixed", "fp8-mixed"))
    assert {c.layout.precision for c in fp8.candidates} <= {"bf16-mixed", "fp8-mixed"}
    _, default = plan(*LLAMA8B_8, top=3)
    assert {c.layout.precision for c in default.candidates} == {"bf16-mixed"}  # a GPU's default, not fp32


def test_the_winner_is_written_over_the_users_own_fields(tmp_path) -> None:
    cfg, result = plan(*LLAMA8B_8, top=1)
    raw = {"model": {"preset": "llama3-8b"}, "training": {"seq_len": 8192, "global_batch_size": 64, "lr": 5e-4},
           "hardware": {"gpu": "H100-SXM-80GB", "num_gpus": 8}}
    path = tmp_path / "plan.toml"
    path.write_text(winner_toml(raw, result.candidates[0]))
    written = load_config(path)
    assert written.training.lr == 5e-4  # the user's field kept
    assert build_layout(written) == result.candidates[0].layout
    assert estimate(written).perf.time["step_time_s"] == pytest.approx(result.candidates[0].step_time_s)


def test_nothing_fits_lists_nothing_and_says_why() -> None:
    _, result = plan("--model.preset=llama3.1-405b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                     "--training.seq_len=8192", "--training.global_batch_size=8", "--memory.offload=none", top=3)
    assert result.candidates == [] and result.stats.rejected["does not fit"] > 0


def test_a_plan_without_a_global_batch_keeps_the_one_a_run_derives() -> None:
    """micro_batch_size 16 x 8 data-parallel ranks = 128 sequences, as `trainfit train` derives them:
    the same plan as one given that batch, every candidate running it whatever its micro-batch."""
    args = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
            "--training.seq_len=8192", "--training.micro_batch_size=16")
    _, derived = plan(*args, top=3)
    assert derived.global_batch == GlobalBatch(128, micro_batch_size=16, dp=8) and derived.global_batch.derived
    _, given = plan(*args, "--training.global_batch_size=128", top=3)
    assert given.global_batch == GlobalBatch(128) and not given.global_batch.derived
    assert [c.settings() for c in derived.candidates] == [c.settings() for c in given.candidates]
    assert derived.candidates and all(c.layout.global_batch_size == 128 for c in derived.candidates)


def test_a_config_that_does_not_fit_gets_the_fewest_changes_that_do() -> None:
    """DDP of llama3-8b on 8 H100s with micro-batches of 2 needs ~300 GiB per GPU: one change fits
    (tp8), and pairs are listed only where faster than every single change; each fix, applied to
    the config, is what estimate says of it."""
    cfg = load_config(None, [*LLAMA8B_8, "--training.micro_batch_size=2", "--precision.mode=bf16-mixed"])
    assert not estimate(cfg).fits
    fixes = fewest_changes(cfg)
    assert fixes and len(fixes[0].changes) == 1
    counts = [len(f.changes) for f in fixes]
    assert counts == sorted(counts)
    fastest_single = max(f.candidate.tokens_per_second for f in fixes if len(f.changes) == 1)
    assert all(f.candidate.tokens_per_second > fastest_single for f in fixes if len(f.changes) == 2)
    for fix in fixes:
        est = estimate(fix.candidate.cfg)
        assert est.fits and est.perf.time["tokens_per_second"] == pytest.approx(fix.candidate.tokens_per_second)
        followers = {"parallel.sequence_parallel", "parallel.dp_shard", "memory.ac_every_n_layers"}  # follow a choice
        changed = {k for k, v in fix.candidate.settings().items() if settings_of(cfg)[k] != v} - followers
        assert len(changed) == len(fix.changes) and all(any(w.startswith(k) for w in fix.changes) for k in changed)


def test_more_than_two_changes_come_from_the_planner() -> None:
    cfg = load_config(None, ["--model.preset=llama3-70b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                             "--training.seq_len=8192", "--training.global_batch_size=64",
                             "--training.micro_batch_size=1", "--precision.mode=bf16-mixed"])
    fixes = fewest_changes(cfg, limit=3)
    assert fixes and all(len(f.changes) > 2 and estimate(f.candidate.cfg).fits for f in fixes)
    assert fixes[0].candidate.step_time_s <= fixes[-1].candidate.step_time_s


def test_the_planner_chooses_to_re_gather_where_that_is_the_fastest_fit() -> None:
    """llama3-8b at tp 8 on 16,384-token sequences with 40 GiB per GPU: without checkpointing only the
    layout that re-gathers its column groups' inputs in backward (parallel.sp_recompute_gather) fits, and
    it is faster than checkpointing blocks; with the field set off by the user, the planner keeps it off."""
    args = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.memory_gib=40",
            "--hardware.num_gpus=8", "--model.max_seq_len=16384", "--training.seq_len=16384",
            "--training.global_batch_size=8", "--parallel.tp=8", "--parallel.pp=1", "--parallel.cp=1")
    _, result = plan(*args, top=3)
    best = result.candidates[0]
    assert best.layout.sp_recompute_gather and best.layout.activation_checkpointing == "none"
    assert best.cfg.parallel.sp_recompute_gather and estimate(best.cfg).fits
    _, kept = plan(*args, "--parallel.sp_recompute_gather=false", top=3)
    assert not any(c.layout.sp_recompute_gather for c in kept.candidates)
    assert kept.candidates[0].step_time_s > best.step_time_s
