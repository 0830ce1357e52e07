"""Fine-tuning samples of uneven length (train/samples.py) train on 2 gloo ranks like one process: the
step's loss is the mean over the trained targets of its whole global batch (train/step.py's token_weight),
so the ranks' micro-batches, of unequal trained targets, weigh by their targets, under DDP and ZeRO-3 on
packed rows, and context parallelism (which shards each row's targets unevenly) and a pipeline's schedule on
padded ones (neither carries packed rows' sample boundaries: train/samples.check_packing_layout). fp32,
_dist.FP32's tolerances (1e-5 on the losses, 1e-4 on the update); `pytest -s` prints the measured errors:
losses 1-2e-7, weights 1.6e-6 to 7e-6 of the update."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from _dist import FP32, GlooTestCase, with_comms

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma")


def _uneven_chats(folder: Path, rank: int) -> Path:
    """Answers of 1 to 20 words after prompts of 1 to 8: rows of very unequal trained targets. Every rank
    writes the same file (atomically), so none waits for another."""
    rng = random.Random(1)
    lines = []
    for _ in range(64):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        lines.append(json.dumps({"messages": [{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}]}) + "\n")
    path = folder / "uneven.jsonl"
    partial = folder / f".uneven.{rank}.{os.getpid()}"
    partial.write_text("".join(lines))
    partial.replace(path)
    return path


class FineTuningParity(GlooTestCase):
    @with_comms
    def test_uneven_samples_train_like_one_process(self) -> None:
        data = _uneven_chats(self.shared_dir, self.rank)
        shape = (f"--data.path={data}", "--data.chat_template=chatml", "--training.seq_len=192",
                 "--model.max_seq_len=192")
        self.run_subtests({"layout": [("--parallel.zero_stage=0",), ("--parallel.zero_stage=3",),
                                      ("--parallel.cp=2", "--parallel.zero_stage=1", "--data.packing=false"),
                                      ("--parallel.pp=2", "--data.packing=false")]},
                          lambda layout: self.check_parity((*shape, *layout), FP32))
