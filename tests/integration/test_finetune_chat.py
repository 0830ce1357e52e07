"""Fine-tuning on chat records end to end (train/records.py, train/chat_template.py, train/samples.py):
a task whose prompts are random and whose answer is always the same is learnt on the answer's tokens,
held-out samples measured the same way, and the prompt's tokens never reach the loss."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from _runs import assert_peft_loads_adapters, run_config, write_chats
from trainfit.train.loss import IGNORE, cross_entropy
from trainfit.train.metrics import read_metrics
from trainfit.train.sample import sample_from_checkpoint
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
                     "--training.seq_len=256", "--model.max_seq_len=256", "--training.micro_batch_size=4",
                     "--training.global_batch_size=4", "--training.eval_interval=100", "--training.lr=3e-3", *extra)
    return Trainer(cfg)


def test_the_fixed_answer_is_learnt_on_held_out_prompts(tmp_path: Path) -> None:
    trainer = _run(tmp_path)
    result = trainer.train()
    # the answer "OK<|im_end|>" after a random prompt: 12 bytes, all predictable from the template
    assert result.val_losses[100] < 0.3 < result.val_losses[0]
    inputs, targets, documents = trainer.stepper.sampler.next_batch()  # packed: two samples a row of 256
    trained = targets[targets != IGNORE]
    assert bytes(trained[:12].tolist()).decode() == "OK<|im_end|>"
    samples_per_row = [len(set(row.tolist()) - {-1}) for row in documents]
    assert samples_per_row == [2] * 4
    assert (targets != IGNORE).sum(dim=1).tolist() == [2 * len("OK<|im_end|>")] * 4
    records = [r for r in read_metrics(tmp_path / "run" / "logs") if "loss" in r]
    assert all(r["trained_tokens"] == 8 * len("OK<|im_end|>") for r in records)
    timed = [r for r in records if r["tokens_per_s"] is not None]
    assert timed and all(0 < r["trained_tokens_per_s"] < r["tokens_per_s"] / 5 for r in timed)  # 24 of 256 a row
    trainer.close()
    # the checkpoint carries the template: a new question is written as the samples were, answered, and the
    # answer stops at the end-of-turn token
    answer = sample_from_checkpoint(str(tmp_path / "run" / "ckpt"), "", max_new_tokens=40, temperature=0.0,
                                    top_k=None, seed=0, chat="omega sigma alpha beta", system=())
    assert answer == "OK"


def test_a_masked_target_changes_nothing(tmp_path: Path) -> None:
    """The loss of a row is its trained tokens' mean: the prompt's targets, whatever they are, do not move it
    nor its gradient."""
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, 1, 2, IGNORE, IGNORE]])
    loss = cross_entropy(logits, targets, masked=True)
    expected = torch.nn.functional.cross_entropy(logits[targets != IGNORE], targets[targets != IGNORE])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert cross_entropy(logits, torch.full_like(targets, IGNORE), masked=True).item() == 0.0  # a prompt shard


def _uneven_data(folder: Path, n: int = 64) -> Path:
    """Answers of 1 to 30 words after prompts of 1 to 12: micro-batches of very unequal trained targets."""
    folder.mkdir(parents=True)
    write_chats(folder / "uneven.jsonl", n, 1, 12, 30, WORDS)
    return folder


def _losses(tmp_path: Path, name: str, *extra: str) -> dict[int, float]:
    data = tmp_path / "data"
    if not data.exists():
        _uneven_data(data)
    cfg = run_config(tmp_path / name, f"--data.path={data}", "--data.chat_template=chatml", "--training.steps=4",
                     "--training.seq_len=256", "--model.max_seq_len=256", "--training.global_batch_size=8",
                     "--logging.measure_memory=false",
                     *extra)
    trainer = Trainer(cfg)
    result = trainer.train()
    return {**result.losses, **{f"w.{k}": float(v.double().norm()) for k, v in trainer.model.state_dict().items()}}


def test_accumulated_micro_batches_train_like_one_on_samples_of_uneven_length(tmp_path: Path) -> None:
    """The step's loss is the mean over the trained targets of its global batch: 4 micro-batches of 2 rows
    give the losses and weights of one of 8 (fp32), where a mean of the micro-batches' means would not."""
    whole = _losses(tmp_path, "whole", "--training.micro_batch_size=8")
    parts = _losses(tmp_path, "parts", "--training.micro_batch_size=2")
    assert parts.keys() == whole.keys()
    for key, value in whole.items():
        assert parts[key] == pytest.approx(value, rel=1e-5), key


def test_a_resumed_run_sees_the_samples_an_uninterrupted_one_does(tmp_path: Path) -> None:
    """The samples of a step are a function of the seed and the step: 2 steps, then 2 more resumed from the
    checkpoint, train as 4 in one go (the same losses, fp32)."""
    straight = _losses(tmp_path, "straight", "--training.micro_batch_size=4")
    _losses(tmp_path, "resumed", "--training.micro_batch_size=4", "--training.steps=2")
    resumed = _losses(tmp_path, "resumed", "--training.micro_batch_size=4")
    assert [resumed[s] for s in (3, 4)] == pytest.approx([straight[s] for s in (3, 4)], rel=1e-6)


def test_lora_on_chat_records_exports_what_peft_loads(tmp_path: Path) -> None:
    """End to end on a Qwen3-shaped base of Hugging Face weights: LoRA trained on chat records, answering
    with sample --chat, exported in PEFT's format, which peft loads into transformers' model of the base
    with trainfit's logits (fp32, 1e-5)."""
    from trainfit.models import build_model, materialize
    from trainfit.models.hf import save_hf_weights

    source = run_config(tmp_path, "--model.preset=debug", "--model.qk_norm=head", "--model.head_dim=24",
                        "--model.max_seq_len=128").model
    save_hf_weights(materialize(build_model(source), "cpu", seed=3), source, tmp_path / "base")
    data = _chat_data(tmp_path / "data", n=64)
    cfg = run_config(tmp_path / "run", f"--model.init_from={tmp_path / 'base'}", "--peft.method=lora",
                     "--peft.targets=all-linear", f"--data.path={data}", "--data.chat_template=chatml",
                     "--training.steps=6", "--training.lr=1e-2", "--logging.measure_memory=false",
                     "--logging.traced_estimate=false",
                     base=("--training.seq_len=128", "--training.micro_batch_size=4", "--training.global_batch_size=4"))
    Trainer(cfg).train()
    ckpt = tmp_path / "run" / "ckpt"
    answer = sample_from_checkpoint(str(ckpt), "", max_new_tokens=16, temperature=0.0, top_k=None, seed=0,
                                    chat="alpha beta", system=("be brief",))
    assert isinstance(answer, str) and "<|im_end|>" not in answer
    assert_peft_loads_adapters(ckpt, tmp_path / "base", source.vocab_size, tmp_path / "adapter")
