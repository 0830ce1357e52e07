"""The training loop: learning, exact resume after SIGTERM, divergence, fp16 skips, accumulation,
and the memory it measures on its own steps."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from _analytic import memory_of
from _runs import run_config
from trainfit.config import ConfigError
from trainfit.memory import COMPONENTS, PHASES
from trainfit.traced import trace_step
from trainfit.train import checkpoint as ckpt
from trainfit.train.metrics import ThroughputWindow, read_metrics
from trainfit.train.optim import lr_at
from trainfit.train.step import TrainStep
from trainfit.train.trainer import Trainer, TrainingDiverged

STEPS = 20


def _trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(run_config(run_dir, f"--training.steps={STEPS}", *extra))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "logs") if "loss" in r}


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    trainer = _trainer(run_dir)  # resume=auto loads the final checkpoint
    assert trainer.step == STEPS
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_loss_falls_and_metrics_are_written(tmp_path: Path) -> None:
    result = _trainer(tmp_path, "--training.eval_interval=10").train()
    records = [r for r in read_metrics(tmp_path / "logs") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes"} <= set(records[0])
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert result.val_losses[STEPS] < result.val_losses[0]
    assert records[1]["peak_memory_bytes"] > 0  # step 2 is measured at the allocator
    # steps 1 (warm-up, watched) and 2 (measured) are no training throughput; logged every step, so
    # their records carry none, and every later one its own step's
    assert [r["tokens_per_s"] is None for r in records[:3]] == [True, True, False]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in records[2:])
    assert result.tokens_per_s == records[-1]["tokens_per_s"] and result.mfu == records[-1]["mfu"]
    cfg = run_config(tmp_path, f"--training.steps={STEPS}")
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s - 1, cfg.training) for s in range(1, STEPS + 1)])


def test_tokens_per_s_leaves_out_warm_up_measured_and_profiled_steps(tmp_path: Path, monkeypatch) -> None:
    timed_steps: dict[int, bool] = {}
    trainer = _trainer(tmp_path, "--training.steps=8", "--logging.interval=4", "--logging.memory_interval=6",
                       "--logging.profile_steps=4", "--training.eval_interval=0")
    add = ThroughputWindow.add

    def recording_add(window: ThroughputWindow, seconds: float, *, timed: bool, trained_tokens: int | None) -> None:
        timed_steps[trainer.step] = timed
        add(window, seconds, timed=timed, trained_tokens=trained_tokens)

    monkeypatch.setattr(ThroughputWindow, "add", recording_add)
    result = trainer.train()
    # 1 warm-up (watched), 2 measured, 4 profiled, 6 measured
    assert [step for step, kept in sorted(timed_steps.items()) if kept] == [3, 5, 7, 8]
    records = [r for r in read_metrics(tmp_path / "logs") if "loss" in r]
    assert [(r["step"], r["tokens_per_s"] is None) for r in records] == [(2, True), (4, False), (6, False),
                                                                        (8, False)]
    assert result.tokens_per_s == records[-1]["tokens_per_s"]


def test_throughput_window_counts_timed_steps_only() -> None:
    window = ThroughputWindow(tokens_per_step=1000)
    window.add(5.0, timed=False)
    assert window.tokens_per_s() is None
    window.add(0.5, timed=True)
    window.add(1.5, timed=True)
    assert window.tokens_per_s() == pytest.approx(1000.0)  # 2 steps x 1000 tokens / 2 s
    window.reset()
    assert window.tokens_per_s() is None


def test_measured_peak_on_the_default_config_matches_both_estimates(tmp_path: Path) -> None:
    """`trainfit train`'s own measurement (the loop watches step 1, measures step 2) of the default
    run: within 3% of the traced step, 10% of the closed form, and the components add up to it."""
    torch.set_num_threads(1)  # the same tensors; on a busy 2-core machine idle OpenMP workers spin (2-5x slower)
    cfg = run_config(tmp_path, "--training.steps=2", base=())  # the default model and batch
    traced = trace_step(cfg).worst
    result = Trainer(cfg).train()
    memory = result.memory
    assert memory is not None
    assert sum(memory.components().values()) == memory.peak
    assert memory.peak == pytest.approx(traced.peak, rel=0.03)
    assert memory.peak == pytest.approx(memory_of(cfg).worst.peak, rel=0.10)
    assert memory.peak_phase == traced.peak_phase and set(memory.phase_peaks) == set(PHASES)


def test_measured_steps_log_their_memory_per_component(tmp_path: Path) -> None:
    """Step 2 and every memory_interval steps are measured and logged, off the logging interval too."""
    result = _trainer(tmp_path, "--training.steps=5", "--logging.interval=5", "--logging.memory_interval=4").train()
    records = {r["step"]: r for r in read_metrics(tmp_path / "logs") if "loss" in r}
    assert sorted(records) == [2, 4, 5]
    fields = {f"memory_{name}_bytes" for name in COMPONENTS}
    for step in (2, 4):
        record = records[step]
        assert sum(record[name] for name in fields) == record["peak_memory_bytes"] > 0
        assert record["memory_peak_phase"] in PHASES and record["memory_reserved_margin_bytes"] >= 0
        assert 0 <= record["memory_non_tensor_bytes"] < record["peak_memory_bytes"]  # shown apart, not in the peak
    assert not (fields | {"memory_non_tensor_bytes"}) & set(records[5])
    assert result.memory is not None and result.memory.peak == records[4]["peak_memory_bytes"]
    # CUDA's reserved peak and used bytes: the CPU has neither, so they are None and never logged
    assert result.memory.reserved_peak is None and result.memory.device_used is None
    assert not {"memory_reserved_peak_bytes", "memory_device_used_bytes"} & {k for r in records.values() for k in r}


def test_cuda_device_figures_of_a_measured_step_reach_its_record(tmp_path: Path, monkeypatch) -> None:
    """The CUDA readings (memory/measured/measure.device_readings, read at the measured step's end) flow into
    the Measurement's breakdown, the step's metrics record and the run's result: here given on a CPU."""
    from trainfit.memory.measured import measure

    readings = measure.DeviceReadings(reserved_peak_bytes=300 * 2**20, device_used_bytes=1200 * 2**20)
    monkeypatch.setattr(measure, "device_readings", lambda device: readings)
    result = _trainer(tmp_path, "--training.steps=2").train()
    record = {r["step"]: r for r in read_metrics(tmp_path / "logs") if "loss" in r}[2]
    assert (record["memory_reserved_peak_bytes"], record["memory_device_used_bytes"]) == (300 * 2**20, 1200 * 2**20)
    assert result.memory is not None
    assert (result.memory.reserved_peak, result.memory.device_used) == (300 * 2**20, 1200 * 2**20)


def test_measure_memory_false_trains_the_same_steps_without_the_meter(tmp_path: Path) -> None:
    """logging.measure_memory=false: no step is watched or measured (no memory figures logged, none in
    the result), and the losses are the metered run's, bit for bit."""
    metered = _trainer(tmp_path / "metered", "--training.steps=4").train()
    plain = _trainer(tmp_path / "plain", "--training.steps=4", "--logging.measure_memory=false").train()
    assert metered.memory is not None and plain.memory is None
    assert plain.losses == metered.losses
    records = [r for r in read_metrics(tmp_path / "plain" / "logs") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any(key.startswith("memory_") for r in records for key in r)


def test_a_memory_interval_without_the_meter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"logging.memory_interval=2: .*logging.measure_memory=false"):
        run_config(tmp_path, "--logging.memory_interval=2", "--logging.measure_memory=false")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    _trainer(run_dir, "--checkpoint.interval=0").train()
    return _losses(run_dir), _final_params(run_dir)


@pytest.mark.parametrize("stop_after", [1, 8, 19])
def test_sigterm_then_resume_is_bitwise_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_after: int,
    uninterrupted: tuple[dict[int, float], dict[str, torch.Tensor]],
) -> None:
    original = TrainStep.__call__

    def step_then_signal(self: TrainStep):  # a real SIGTERM delivered right after step `stop_after`
        stats = original(self)
        if self.steps_done == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    monkeypatch.setattr(TrainStep, "__call__", step_then_signal)
    first = _trainer(tmp_path, "--checkpoint.interval=0").train()
    assert first.stopped_by_signal and first.steps_done == stop_after
    assert ckpt.latest_checkpoint(tmp_path / "ckpt").name == ckpt.step_dir_name(stop_after)
    monkeypatch.setattr(TrainStep, "__call__", original)

    second = _trainer(tmp_path, "--checkpoint.interval=0")
    assert second.step == stop_after
    second.train()
    losses, params = uninterrupted
    assert _losses(tmp_path) == losses  # bitwise: float equality on every step
    resumed = _final_params(tmp_path)
    assert all(torch.equal(resumed[k], params[k]) for k in params)


def test_nan_loss_stops_without_saving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = TrainStep.loss

    def poisoned(self: TrainStep, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None):
        loss, lm_loss = original(self, inputs, targets, documents)
        if self.steps_done == 4:  # computing step 5
            loss, lm_loss = loss * float("nan"), lm_loss * float("nan")
        return loss, lm_loss

    monkeypatch.setattr(TrainStep, "loss", poisoned)
    trainer = _trainer(tmp_path, "--checkpoint.interval=2")
    with pytest.raises(TrainingDiverged, match="step 5: the loss is nan"):
        trainer.train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ckpt")] == ["step_00000002", "step_00000004"]


def test_fp16_skips_steps_with_inf_gradients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = TrainStep.loss

    def overflowing(self: TrainStep, inputs: torch.Tensor, targets: torch.Tensor,
                    documents: torch.Tensor | None = None):
        loss, lm_loss = original(self, inputs, targets, documents)
        if self.steps_done == 2:
            loss = loss * float("inf")
        return loss, lm_loss

    monkeypatch.setattr(TrainStep, "loss", overflowing)
    trainer = _trainer(tmp_path, "--precision.mode=fp16-mixed", "--training.steps=5")
    before = {}
    original_step = TrainStep.__call__

    def snapshot(self: TrainStep):
        before[self.steps_done] = [p.detach().clone() for p in self.model.parameters()]
        return original_step(self)

    monkeypatch.setattr(TrainStep, "__call__", snapshot)
    result = trainer.train()
    assert result.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before[2], before[3], strict=True))  # step 3 skipped
    assert not all(torch.equal(a, b) for a, b in zip(before[3], before[4], strict=True))
    record = [r for r in read_metrics(tmp_path / "logs") if r.get("step") == 5 and "loss" in r][0]
    assert record["skipped_steps"] == 1 and record["loss_scale"] < 65536.0


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    big = _trainer(tmp_path / "big", "--training.micro_batch_size=8", "--training.global_batch_size=8",
                   "--training.steps=3")
    accumulated = _trainer(tmp_path / "acc", "--training.micro_batch_size=2", "--training.global_batch_size=8",
                           "--training.steps=3")
    assert accumulated.layout.grad_accum_steps == 4
    initial = [p.detach().clone() for p in big.model.parameters()]
    a, b = big.train(), accumulated.train()
    assert a.losses == pytest.approx(b.losses, rel=1e-5)
    # the weights' difference relative to how far training moved them (tests/distributed/test_dp_parity.py
    # says why not elementwise: Adam's first updates are +-lr whatever a gradient's size, so an element
    # whose gradient is ~0 follows the summation order; one of 8,192 came 1.6e-5 apart on an AMD EPYC)
    error = sum(((p - q) ** 2).sum() for p, q in zip(big.model.parameters(), accumulated.model.parameters(),
                                                      strict=True)).sqrt()
    moved = sum(((p - p0) ** 2).sum() for p, p0 in zip(big.model.parameters(), initial, strict=True)).sqrt()
    assert float(error / moved) < 1e-4


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-pure", "fp16-mixed"])
def test_low_precision_modes_train(tmp_path: Path, mode: str) -> None:
    trainer = _trainer(tmp_path, f"--precision.mode={mode}", "--training.steps=8", "--training.lr=1e-2")
    result = trainer.train()
    expected_dtype = torch.bfloat16 if mode == "bf16-pure" else torch.float32
    assert all(p.dtype == expected_dtype for p in trainer.model.parameters())
    assert result.losses[8] < result.losses[1]


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpointing_policies_train_like_none(tmp_path: Path, policy: str) -> None:
    plain = _trainer(tmp_path / "none", "--training.steps=3").train()
    ac = _trainer(tmp_path / policy, "--training.steps=3", f"--memory.activation_checkpointing={policy}").train()
    assert ac.losses == pytest.approx(plain.losses, rel=1e-5)


def test_moe_trains_with_aux_loss(tmp_path: Path) -> None:
    result = _trainer(tmp_path, "--model.preset=debug-moe", "--training.steps=8", "--training.lr=1e-2").train()
    assert result.losses[8] < result.losses[1]


def test_resume_with_more_steps_extends_the_run_on_the_new_schedule(tmp_path: Path) -> None:
    _trainer(tmp_path, "--checkpoint.interval=0").train()  # a finished run of STEPS steps
    longer = STEPS + 10
    trainer = Trainer(run_config(tmp_path, f"--training.steps={longer}"))
    assert trainer.step == STEPS
    assert f"recomputed for training.steps={longer} from step {STEPS} on" in trainer.notes[-1]
    assert sorted(trainer.train().losses) == list(range(STEPS + 1, longer + 1))
    records = read_metrics(tmp_path / "logs")
    new = run_config(tmp_path, f"--training.steps={longer}").training
    old = run_config(tmp_path, f"--training.steps={STEPS}").training
    lrs = {r["step"]: r["lr"] for r in records if "loss" in r}
    assert [lrs[s] for s in range(1, STEPS + 1)] == pytest.approx([lr_at(s - 1, old) for s in range(1, STEPS + 1)])
    assert [lrs[s] for s in range(STEPS + 1, longer + 1)] == pytest.approx(
        [lr_at(s - 1, new) for s in range(STEPS + 1, longer + 1)])
    assert lrs[STEPS + 1] > lrs[STEPS]  # the decay restarts from higher up: the schedule is longer now
    assert any("recomputed" in r.get("note", "") for r in records)  # the metrics log says so too
    assert [r["step"] for r in records if "memory_peak_phase" in r] == [2, STEPS + 2]  # each process's 2nd step
