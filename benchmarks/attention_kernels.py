"""The attention kernels on this machine: for each training.attention_backend that runs here, a small
Llama's measured peak memory (one step at the allocator), the analytic estimate's, and training
tokens/s, at two sequence lengths. Kernels the device lacks are listed as such (the trainer's probe).

    python benchmarks/attention_kernels.py [--seq-lens 256 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer, measure_step

MiB = 2**20
BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
MODEL = ["--model.preset=debug", "--model.dim=128", "--model.ffn_dim=384", "--model.vocab_size=512",
         "--model.max_seq_len=2048"]
"""2 blocks, 4 heads over 2 kv heads, head dim 32."""


def _config(run_dir: Path, backend: str, seq_len: int, steps: int):  # noqa: ANN202
    tokens = 2048  # per micro-batch, whatever the sequence length
    return load_config(None, [
        *MODEL, f"--training.seq_len={seq_len}", f"--training.micro_batch_size={tokens // seq_len}",
        "--training.global_batch_size=0", f"--training.steps={steps}", "--training.warmup_steps=1",
        "--training.eval_interval=0", "--training.device=cpu", f"--training.attention_backend={backend}",
        "--checkpoint.interval=0", "--checkpoint.resume=never", f"--checkpoint.dir={run_dir / 'ckpt'}",
        f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false"])


def _tokens_per_s(cfg, steps: int) -> tuple[float, str]:  # noqa: ANN001
    """(training tokens/s over `steps` steps after one warm-up step, the kernel's name)."""
    trainer = Trainer(cfg, world=World())
    kernel = trainer.attention_kernel.name
    try:
        trainer.train_step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        seconds = time.perf_counter() - start
    finally:
        trainer.close()
    return steps * cfg.training.micro_batch_size * cfg.training.seq_len / seconds, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", nargs=2, type=int, default=[256, 1024])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    args = parser.parse_args()
    table = Table(title="attention kernels on this machine (2,048 tokens per step, debug Llama, fp32)")
    for header in ("backend", "kernel", "seq", "measured MiB", "analytic MiB", "error", "tokens/s"):
        table.add_column(header, justify="left" if header in ("backend", "kernel") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in BACKENDS:
            for seq_len in args.seq_lens:
                cfg = _config(Path(tmp, f"{backend}-{seq_len}"), backend, seq_len, args.steps + 1)
                try:
                    measured = measure_step(cfg).breakdown.peak
                except ConfigError:  # the trainer's probe: this device has no such kernel
                    table.add_row(backend, "cannot run here", str(seq_len), "-", "-", "-", "-")
                    continue
                predicted = estimate(cfg).worst.peak
                speed, kernel = _tokens_per_s(cfg, args.steps)
                table.add_row(backend, kernel, str(seq_len), f"{measured / MiB:.1f}", f"{predicted / MiB:.1f}",
                              f"{predicted / measured - 1:+.1%}", f"{speed:,.0f}")
    Console().print(table)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
