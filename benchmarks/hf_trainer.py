"""Tokens/s of `trainfit train` against Hugging Face transformers' `Trainer` on the same Llama and data.

transformers' LlamaForCausalLM gets the configuration and the initial weights of trainfit's model
(models/hf.py: hf_config_dict and save_hf_weights, loaded with from_pretrained), so both start from
the same weights. Both train on CPU, one process, on the same batches: a torch IterableDataset yields
the rows of trainfit's BatchSampler in order (the packaged Shakespeare slice, byte tokenizer), and the
HF loss is the same fp32 mean cross-entropy over the same (shifted) targets (Trainer's
compute_loss_func; the model's own loss would drop each row's last target). Same batch size, sequence
length, AdamW (foreach, betas, eps, weight decay on matrices only: HF's decay groups leave out the
norms, which are our only vectors), gradient clipping, precision (bf16-mixed is HF's bf16=True: fp32
weights, bf16 autocast), cosine schedule to the same min_lr (HF's `cosine_with_min_lr`; its warm-up
is one step behind trainfit's: step k has lr k/W, trainfit's (k+1)/W). HF's overheads are set like
trainfit's: no saving, no evaluation, no progress bar, a loss logged every 10 steps (trainfit's
logging.interval), no reporting integrations. `--hf-default-optim` adds a row for HF's own default
optimizer (adamw_torch_fused on torch >= 2.8), which trainfit does not use on CPU.

Timing as in training_overhead.py: the CPU and wall time from one step's start to the next (HF: its
on_step_begin callback; trainfit: the step's "forward" moment), median over the steps after the first
`--skip`, median over repeats run in turn; ratios pair by pair. The loss columns are a sanity check:
step 1 (same weights, same batch) and the mean of the last 10 steps, which differ by the warm-up
offset alone (HF's Trainer given trainfit's schedule, by overriding create_scheduler, reproduced
trainfit's tiny fp32 losses to the last digit; not done here, to time HF's Trainer as it comes).

    pip install "transformers[torch]>=4.45"   # with accelerate, which Trainer needs; not a trainfit dependency
    python benchmarks/hf_trainer.py                          # tiny and 25M, fp32 and bf16-mixed, 3 repeats
    python benchmarks/hf_trainer.py --models tiny --precisions fp32 --repeats 5 --hf-default-optim
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from trainfit.config import Config
from trainfit.models import build_model, count_params, materialize
from trainfit.models.hf import save_hf_weights
from trainfit.train.data import BatchSampler, resolve_data
from trainfit.train.trainer import data_cache_dir
from training_overhead import MODELS, run_config, timed_run, trainfit_loop

try:
    import accelerate  # noqa: F401  (transformers' Trainer needs it)
    import transformers
except ImportError:
    transformers = None

LOG_EVERY = 10
"""Steps between logged losses, for both (trainfit's default logging.interval)."""


class TrainfitRows(torch.utils.data.IterableDataset):
    """The rows of trainfit's batches, in trainfit's order: {"input_ids", "labels"} of seq_len tokens each,
    labels already shifted (the next token of each input)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        t = self.cfg.training
        data = resolve_data(self.cfg.data, str(data_cache_dir()))
        sampler = BatchSampler(data.train, t.seq_len, t.micro_batch_size, t.seed)
        for _ in range(t.steps):
            inputs, targets = sampler.next_batch()
            for row in range(len(inputs)):
                yield {"input_ids": inputs[row], "labels": targets[row]}


def shifted_loss(outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """trainfit's loss: the fp32 mean cross-entropy of every position against its (already shifted)
    target. `num_items_in_batch` is not used: HF counts it for labels it would shift (seq_len - 1 per
    row); with one micro-batch per step the mean is exact."""
    return F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten())


def hf_loop(cfg: Config, stamp: Callable[[], None] = lambda: None, *, default_optim: bool = False) -> list[float]:
    """Train `cfg`'s model, converted to transformers, with HF's Trainer; returns the logged losses
    (step 1's, then the mean of each 10 steps). `stamp` is called at the start of every step."""
    t, opt = cfg.training, cfg.optimizer
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_weights(materialize(build_model(cfg.model), "cpu", t.seed), cfg.model, tmp)
        model = transformers.LlamaForCausalLM.from_pretrained(tmp)
        args = transformers.TrainingArguments(
            output_dir=str(Path(tmp) / "hf"), use_cpu=True, bf16=cfg.precision.mode == "bf16-mixed",
            per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=1, max_steps=t.steps,
            learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1],
            adam_epsilon=opt.eps, max_grad_norm=t.grad_clip, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr": t.min_lr}, warmup_steps=t.warmup_steps, seed=t.seed,
            save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=LOG_EVERY,
            logging_first_step=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0)
        losses: list[float] = []

        class Stamps(transformers.TrainerCallback):
            def on_step_begin(self, *_: object, **__: object) -> None:
                stamp()

            def on_log(self, _args: object, _state: object, _control: object, logs: dict | None = None,
                       **__: object) -> None:
                if logs and "loss" in logs:
                    losses.append(float(logs["loss"]))

        foreach = (torch.optim.AdamW, dict(lr=t.lr, betas=opt.betas, eps=opt.eps, foreach=True))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TrainfitRows(cfg),
                                       compute_loss_func=shifted_loss, callbacks=[Stamps()],
                                       optimizer_cls_and_kwargs=None if default_optim else foreach)
        trainer.remove_callback(transformers.PrinterCallback)  # trainfit prints nothing either (metrics go to a file)
        trainer.train()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=["fp32", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=0, help=f"steps per run, a multiple of {LOG_EVERY} "
                        "(default: 30 tiny, 20 25M)")
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the timing (>= 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--hf-default-optim", action="store_true",
                        help="also time HF's default optimizer (args.optim) instead of foreach AdamW")
    args = parser.parse_args()
    if transformers is None:
        sys.exit("this benchmark needs transformers and accelerate: pip install 'transformers[torch]>=4.45' "
                 "(in the benchmark's environment only; trainfit does not depend on them)")
    assert args.skip >= 2, "trainfit's first two steps are its memory-watched and -measured ones"
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers|accelerate")
    loops: dict[str, Callable[..., list[float]]] = {"trainfit train": trainfit_loop, "HF Trainer": hf_loop}
    if args.hf_default_optim:
        name = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True).optim
        loops[f"HF Trainer, {getattr(name, 'value', name)}"] = lambda cfg, stamp: hf_loop(cfg, stamp,
                                                                                          default_optim=True)
    table = Table(title=f"trainfit vs HF Trainer (transformers {transformers.__version__}): 1 process, CPU, "
                        f"{args.threads} thread(s), {args.repeats} repeats (medians), steps after the first "
                        f"{args.skip}")
    for column in ("model", "precision", "loop", "tok/s CPU", "trainfit / this CPU", "tok/s wall",
                   "trainfit / this wall", "loss step 1", f"loss last {LOG_EVERY}"):
        table.add_column(column, justify="left" if column in ("model", "precision", "loop") else "right")
    for model_name in args.models:
        for precision in args.precisions:
            steps = args.steps or (30 if model_name == "tiny" else 20)
            assert steps % LOG_EVERY == 0 and steps >= 2 * LOG_EVERY, f"--steps: a multiple of {LOG_EVERY}, >= 20"
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}
            losses: dict[str, list[float]] = {}
            with tempfile.TemporaryDirectory() as tmp:
                cfg = run_config(Path(tmp), MODELS[model_name], precision, steps)
                for repeat in range(args.repeats):
                    order = list(loops) if repeat % 2 == 0 else list(reversed(loops))
                    for name in order:
                        cpu, wall, losses[name] = timed_run(loops[name], cfg, args.skip)
                        times[name].append((cpu, wall))
            ours = losses["trainfit train"]  # per step; HF logs step 1, then means over 10 steps
            losses["trainfit train"] = [ours[0], statistics.fmean(ours[-LOG_EVERY:])]
            tokens = cfg.training.micro_batch_size * cfg.training.seq_len
            label = f"{model_name} ({count_params(build_model(cfg.model)) / 1e6:.1f}M)"
            for name in loops:
                row = [label, precision, name]
                for clock in (0, 1):
                    ratios = [b[clock] / a[clock] for a, b in zip(times["trainfit train"], times[name], strict=True)]
                    row += [f"{tokens / statistics.median(x[clock] for x in times[name]):,.0f}",
                            f"{statistics.median(ratios):.2f}x"]
                table.add_row(*row, f"{losses[name][0]:.4f}", f"{losses[name][-1]:.4f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
