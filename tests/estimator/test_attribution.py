"""Measurement of a real training step attributed to components (memory/measured/attribution.py): the
components add up to the tensors' peak and agree with figures computed independently; what the
allocator holds beyond the tensors is non_tensor, never a component."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accuracy_grid import LLAMA, join_world

from _analytic import memory_of
from _ranks import start_ranks
from _runs import run_config
from trainfit.memory import PHASES
from trainfit.traced import trace_step
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer, measure_step, measure_trainer_step


def test_components_add_up_to_the_peak_and_match_the_trainers_own_count(tmp_path: Path) -> None:
    m = measure_step(run_config(tmp_path, *LLAMA, "--precision.mode=bf16-mixed"))
    b = m.breakdown
    assert sum(b.components().values()) == b.peak
    assert max(used for _, used, _, _ in m.timeline) == b.peak
    assert set(b.phase_peaks) == set(PHASES) and b.peak_phase in PHASES and m.peak_module
    # Independent counts: the trainer's local_state_bytes (taken after backward) and the ledger.
    assert b.master_params == m.state_bytes["params"]  # bf16-mixed: the fp32 parameters are the masters
    assert b.optimizer == m.state_bytes["optimizer"]
    assert m.state_bytes["grads"] == m.state_bytes["params"]
    assert b.params > 0  # autocast's bf16 weight copies, saved for backward
    assert 0 <= b.buffers < 0.01 * b.peak  # no recomputation, no collectives: module buffers (RoPE tables)
    assert b.reserved_margin >= 0 and 0 <= b.non_tensor < 0.03 * b.peak  # autograd's objects, tensor headers


MiB = 2**20
OUTSIDE_TENSORS = 24 * MiB


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    return libc


def test_memory_a_library_holds_outside_tensors_is_non_tensor_and_no_component(tmp_path: Path) -> None:
    """A step that mallocs a block no tensor owns (as oneDNN's primitive cache does) and keeps it:
    the same tensors, component by component, and the block in non_tensor."""
    libc = _libc()
    held: list[int] = []

    def hold_a_block(moment: str) -> None:
        if moment == "forward" and not held:
            held.append(libc.malloc(OUTSIDE_TENSORS))

    trainer = Trainer(run_config(tmp_path, *LLAMA), world=World())
    try:
        plain = measure_trainer_step(trainer, warmup_steps=1).breakdown
        with trainer.listening(hold_a_block):
            holding = measure_trainer_step(trainer).breakdown
    finally:
        for block in held:
            libc.free(block)
        trainer.close()
    assert held and held[0]
    assert holding.components() == plain.components() and holding.peak == plain.peak
    assert holding.peak_phase == plain.peak_phase
    assert holding.non_tensor - plain.non_tensor == pytest.approx(OUTSIDE_TENSORS, abs=MiB / 4)


def test_a_dropless_moe_step_in_bf16_has_its_buffers_estimated_and_non_tensor_apart(tmp_path: Path) -> None:
    """The tiny MoE preset, dropless, bf16-mixed: its experts' matmuls get new shapes every step
    (where oneDNN runs them, each new shape leaves a cached primitive outside tensors). buffers
    holds tensors only, as the estimate counts them; the rest is non_tensor."""
    cfg = run_config(tmp_path, "--model.preset=debug-moe", "--precision.mode=bf16-mixed")
    assert cfg.model.num_experts and not cfg.model.capacity_factor
    b = measure_step(cfg).breakdown
    estimate = memory_of(cfg).worst
    assert b.buffers == pytest.approx(estimate.buffers, abs=0.01 * b.peak)
    assert sum(b.components().values()) == b.peak
    assert estimate.peak == pytest.approx(b.peak, rel=0.05)
    assert b.non_tensor >= 0 and b.as_dict()["non_tensor"] == b.non_tensor


def test_forward_retained_bytes_match_the_traced_forward(tmp_path: Path) -> None:
    """The allocator's view of what one forward + loss leaves for backward, against the traced
    timeline's (its first backward point, `loss / accum`, comes after `_loss` has returned)."""
    overrides = [*LLAMA, "--memory.activation_checkpointing=selective"]
    measured = measure_step(run_config(tmp_path, *overrides))
    timeline = trace_step(run_config(tmp_path, *overrides)).timeline
    first_backward = next(i for i, point in enumerate(timeline) if point[2] == "backward")
    traced = timeline[first_backward][1] - timeline[0][1]
    assert measured.forward_retained == pytest.approx(traced, rel=0.03)


def test_logits_are_the_loss_tensors(tmp_path: Path) -> None:
    """A wide vocabulary on a narrow model: the peak is in the loss, made of fp32 logits-sized
    tensors (the upcast, log-softmax and the gradient in flight)."""
    m = measure_step(run_config(tmp_path, *LLAMA, "--model.vocab_size=4096")).breakdown
    logits_fp32 = 4 * 256 * 4096 * 4  # micro-batch x sequence x vocabulary x 4 bytes
    assert m.peak_phase in ("forward", "backward") and m.logits >= 2 * logits_fp32
    assert m.logits == max(m.components().values())


def test_measure_trainer_step_measures_a_trainer_in_place(tmp_path: Path) -> None:
    trainer = Trainer(run_config(tmp_path, *LLAMA), world=World())
    trainer.train_step()
    m = measure_trainer_step(trainer)
    assert trainer.step == 2 and m.breakdown.peak > 0 and m.world_size == 1
    assert "loss" not in vars(trainer.stepper) and "unscale_" not in vars(trainer.scaler)  # wrappers removed
    assert trainer.train_step().loss > 0  # and it trains on


def test_fewer_than_two_steps_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--steps 1"):
        measure_step(run_config(tmp_path, *LLAMA), steps=1)


ZERO3_ON_TWO = [*LLAMA, "--training.global_batch_size=8", "--hardware.num_gpus=2", "--parallel.zero_stage=3"]


def _measure_rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    join_world(rank, 2, Path(out, "rendezvous"))
    try:
        m = measure_step(run_config(Path(out), *ZERO3_ON_TWO))
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(m.breakdown.as_dict()))


def test_each_gloo_rank_measures_itself_and_matches_the_trace(tmp_path: Path) -> None:
    start_ranks(_measure_rank, 2, str(tmp_path))
    traced = trace_step(run_config(tmp_path, *ZERO3_ON_TWO)).worst
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert traced.peak == pytest.approx(measured["peak"], rel=0.03)
        assert traced.master_params == measured["master_params"] == 0
        assert traced.params == measured["params"]  # this rank's shards: half of the model
        assert traced.optimizer == measured["optimizer"]
