"""Packed fine-tuning rows (train/packing.py, train/samples.py): whole samples fill each row, in a seeded
order; a packed row trains each sample as its own padded row would (the same per-token loss and gradients);
layouts that cannot carry the rows' sample boundaries are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _runs import run_config, seeded_model, write_chats
from trainfit.config import ConfigError, ModelConfig
from trainfit.parallel.resolve import build_layout
from trainfit.train.data import eval_batches, load_prepared, prepare_data
from trainfit.train.loss import cross_entropy
from trainfit.train.packing import plan_rows, sample_positions
from trainfit.train.samples import IGNORE, SampleSampler, check_packing_layout

WORDS = ("alpha", "beta", "gamma", "delta")


def _split(tmp_path: Path, n: int = 30):
    folder = tmp_path / "data"
    folder.mkdir()
    write_chats(folder / "a.jsonl", n, 2, 6, 12, WORDS)
    prepare_data(str(folder), str(tmp_path / "out"), val_fraction=0.1, chat_template="chatml")
    return load_prepared(tmp_path / "out")


def test_rows_hold_whole_samples_in_a_seeded_order_and_no_more_than_fits() -> None:
    positions = sample_positions(np.asarray([10, 30, 5, 21, 7, 2, 40]), 20)
    assert positions.tolist() == [9, 20, 4, 20, 6, 1, 20]  # cut at seq_len + 1 tokens
    usable = np.arange(7)
    plan = plan_rows(usable, positions, 20, packing=True, seed=4)
    assert sorted(plan.samples.tolist()) == list(range(7))
    assert all(positions[plan.row(r)].sum() <= 20 for r in range(len(plan)))
    # greedy: a row is closed only when the next sample does not fit
    assert all(positions[plan.row(r)].sum() + positions[plan.row(r + 1)[0]] > 20 for r in range(len(plan) - 1))
    assert plan.samples.tolist() == plan_rows(usable, positions, 20, packing=True, seed=4).samples.tolist()
    assert plan.samples.tolist() != plan_rows(usable, positions, 20, packing=True, seed=5).samples.tolist()
    assert plan_rows(usable, positions, 20, packing=True).samples.tolist() == list(range(7))  # validation: in order
    padded = plan_rows(usable, positions, 20, packing=False)
    assert len(padded) == 7 and padded.fill == pytest.approx(positions.sum() / 140)
    assert len(plan) < len(padded) and plan.fill > padded.fill
    assert plan.per_row(np.ones(7, dtype=np.int64)).sum() == 7


def _loss_and_grads(model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> tuple[float, list]:
    """The mean over every trained target of the batches, and its gradients."""
    model.zero_grad()
    total = sum(int((b[1] != IGNORE).sum()) for b in batches)
    loss_sum = torch.zeros(())
    for inputs, targets, *documents in batches:
        logits = model(inputs, *documents)
        loss_sum = loss_sum + cross_entropy(logits, targets, masked=True) * (targets != IGNORE).sum()
    (loss_sum / total).backward()
    return float(loss_sum / total), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("preset", ["debug", "debug-gpt2"])
def test_packed_rows_train_each_sample_as_its_own_padded_row_would(preset: str, tmp_path: Path) -> None:
    """Every validation sample once, padded one a row and packed: the same token-weighted loss and the same
    gradients (fp32, 1e-5), in far fewer rows."""
    split = _split(tmp_path, n=60).train
    model = seeded_model(ModelConfig(preset=preset, max_seq_len=512))
    usable, _ = split.usable(512)
    padded = list(eval_batches(split, 512, 4, (len(usable) + 3) // 4, packing=False))
    packed_plan = plan_rows(usable, split.positions(512), 512, packing=True)
    packed = list(eval_batches(split, 512, 2, (len(packed_plan) + 1) // 2, packing=True))
    # exactly the samples once each (the batches repeat rows to fill the last one: trim to whole rows)
    rows_padded = torch.cat([b[0] for b in padded])[:len(usable)]
    rows_packed = [torch.cat(parts)[:len(packed_plan)] for parts in zip(*packed, strict=True)]
    targets_padded = torch.cat([b[1] for b in padded])[:len(usable)]
    assert int((rows_packed[1] != IGNORE).sum()) == int((targets_padded != IGNORE).sum())
    assert len(packed_plan) * 3 < len(usable)
    loss_padded, grads_padded = _loss_and_grads(model, [(rows_padded, targets_padded)])
    loss_packed, grads_packed = _loss_and_grads(model, [tuple(rows_packed)])
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5)
    for a, b in zip(grads_packed, grads_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # without the document ids the packed rows' samples see each other: gradients 100x further off
    _, grads_crossed = _loss_and_grads(model, [tuple(rows_packed[:2])])
    packed_error = max(float((a - b).abs().max()) for a, b in zip(grads_packed, grads_padded, strict=True))
    crossed_error = max(float((a - b).abs().max()) for a, b in zip(grads_crossed, grads_padded, strict=True))
    assert crossed_error > 100 * packed_error and crossed_error > 1e-4


def test_the_sampler_draws_packed_rows_per_step_and_counts_their_trained_targets(tmp_path: Path) -> None:
    split = _split(tmp_path).train
    sampler = SampleSampler(split, 256, 2, seed=1, pad_id=0, grad_accum_steps=2, packing=True)
    expected = sampler.step_trained_tokens()
    batches = [sampler.next_batch() for _ in range(2)]
    assert all(len(b) == 3 and b[2].shape == (2, 256) for b in batches)
    assert sum(int((b[1] != IGNORE).sum()) for b in batches) == expected
    assert "samples in" in sampler.note() and len(sampler.rows) < len(sampler.usable)
    resumed = SampleSampler(split, 256, 2, seed=1, pad_id=0, grad_accum_steps=2, packing=True)
    resumed.load_state_dict(sampler.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), sampler.next_batch(), strict=True))


@pytest.mark.parametrize("layout", [("--parallel.pp=2",), ("--parallel.cp=2",)])
def test_packing_under_layouts_that_split_rows_is_a_named_error(layout: tuple[str, ...], tmp_path: Path) -> None:
    field = layout[0].split("=")[0].removeprefix("--")
    cfg = run_config(tmp_path / "run", "--hardware.num_gpus=2", *layout)
    with pytest.raises(ConfigError, match=rf"data.packing=true: {field}=2 .* set data.packing=false"):
        check_packing_layout(build_layout(cfg, 2))
    check_packing_layout(build_layout(run_config(tmp_path / "run", "--hardware.num_gpus=2",
                                                 "--training.global_batch_size=8"), 2))  # dp2 packs
