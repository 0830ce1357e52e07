"""Fine-tuning on chat records end to end (train/records.py, train/chat_template.py, train/samples.py):
a task whose prompts are random and whose answer is always the same is learnt on the answer's tokens,
held-out samples measured the same way, and the prompt's tokens never reach the loss."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from _runs import run_config
from trainfit.train.loss import IGNORE, cross_entropy
from trainfit.train.trainer import Trainer

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma")


def _chat_data(folder: Path, n: int = 200) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True)
    with (folder / "chat.jsonl").open("w") as f:
        for _ in range(n):
            question = " ".join(rng.choice(WORDS) for _ in range(6))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": "OK"}]}) + "\n")
    return folder


def _run(tmp_path: Path, *extra: str) -> Trainer:
    data = _chat_data(tmp_path / "data")
    cfg = run_config(tmp_path / "run", f"--data.path={data}", "--data.chat_template=chatml", "--training.steps=100",
                     "--training.seq_len=128", "--training.micro_batch_size=8", "--training.global_batch_size=8",
                     "--training.eval_interval=100", "--training.lr=3e-3", *extra)
    return Trainer(cfg)


def test_the_fixed_answer_is_learnt_on_held_out_prompts(tmp_path: Path) -> None:
    trainer = _run(tmp_path)
    result = trainer.train()
    # the answer "OK<|im_end|>" after a random prompt: 12 bytes, all predictable from the template
    assert result.val_losses[100] < 0.3 < result.val_losses[0]
    inputs, targets = trainer.stepper.sampler.next_batch()
    trained = targets[targets != IGNORE]
    assert bytes(trained[:12].tolist()).decode() == "OK<|im_end|>"
    assert (targets != IGNORE).sum(dim=1).tolist() == [len("OK<|im_end|>")] * 8


def test_a_masked_target_changes_nothing(tmp_path: Path) -> None:
    """The loss of a row is its trained tokens' mean: the prompt's targets, whatever they are, do not move it
    nor its gradient."""
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, 1, 2, IGNORE, IGNORE]])
    loss = cross_entropy(logits, targets)
    expected = torch.nn.functional.cross_entropy(logits[targets != IGNORE], targets[targets != IGNORE])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert cross_entropy(logits, torch.full_like(targets, IGNORE)).item() == 0.0  # a shard of prompt only
