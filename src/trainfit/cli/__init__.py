"""The `trainfit` command: each subcommand parses its arguments, calls one library function and
prints the result; the work lives in the library.

This module holds the parser and main(); each command's function lives in its own module
(cli/estimate.py, cli/plan.py, ...), imported only when that command runs, and its heavy imports
(torch) happen inside the function, so `trainfit --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import textwrap
import warnings

from trainfit.config import ConfigError, iter_fields, split_overrides

# command -> (module, function): the module is imported only when its command runs
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("trainfit.cli.estimate", "cmd_estimate"),
    "plan": ("trainfit.cli.plan", "cmd_plan"),
    "measure": ("trainfit.cli.measure", "cmd_measure"),
    "report": ("trainfit.cli.report", "cmd_report"),
    "train": ("trainfit.cli.train", "cmd_train"),
    "sample": ("trainfit.cli.sample", "cmd_sample"),
    "prepare-data": ("trainfit.cli.prepare_data", "cmd_prepare_data"),
    "export": ("trainfit.cli.export", "cmd_export"),
    "calibrate": ("trainfit.cli.calibrate", "cmd_calibrate"),
    "validate": ("trainfit.cli.validate", "cmd_validate"),
    "serve": ("trainfit.cli.serve", "cmd_serve"),
}


def _fields_help() -> str:
    lines = ["config fields (set in the TOML file, or as --section.field=value or --section.field value):"]
    section = None
    for name, field_name, default, doc in iter_fields():
        if name != section:
            section = name
            lines.append(f"\n  [{section}]")
        shown = "(from preset)" if default is None else repr(default)
        lines.append(f"  --{section}.{field_name}  default {shown}")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def _config_parser(sub: argparse._SubParsersAction, name: str, help_text: str, fields_help: str
                   ) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, epilog=fields_help,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="TOML config (default: the built-in tiny run)")
    return parser


INTRO = """\
trainfit: will this LLM training run fit, how fast will it go, and train it.

Predicts per-GPU memory (parameters, gradients, optimizer states, activations, peak), FLOPs, step
time and MFU for a model and a parallel layout; trains the same config for real (DDP, ZeRO-1/2/3,
HSDP, offload, bf16/fp16, activation checkpointing) and reports predicted against measured.

commands:
  estimate      predict memory and speed (no GPU needed, instant)
  plan          search every layout that fits a cluster, rank by predicted speed, write the fastest
  train         train a model (default: a tiny Llama on Shakespeare, on CPU, ~2 minutes)
  report        analytic and traced predictions against a measured step (--profile: a profiled run)
  measure       measure a real step's memory per component
  sample        generate text from a checkpoint
  export        write a checkpoint as Hugging Face safetensors
  prepare-data  tokenize text into training shards
  calibrate     measure this machine (matmuls, memory, collectives, optimizer) into a hardware profile
  validate      check the predictions against measured steps on this machine (one CUDA GPU: minutes)
  serve         the estimate and the plan in a local web page (offline; prints the URL)

examples:
  trainfit estimate --model.preset=llama3-8b --hardware.gpu=H100-SXM-80GB --hardware.num_gpus=8
  trainfit plan --model.preset=llama3-70b --hardware.gpu=H100-SXM-80GB --hardware.num_gpus=64 \\
      --training.seq_len=8192 --training.global_batch_size=512 --out plan.toml
  trainfit train
  torchrun --nproc_per_node 2 -m trainfit train --parallel.zero_stage=3
  trainfit train --profile=4-5 && trainfit report --profile runs/default/profile
  trainfit calibrate --out cpu.toml && trainfit estimate --hardware.profile=cpu.toml
  trainfit validate --out validate.json

`trainfit COMMAND --help` lists a command's options and every config field with its default."""


def build_parser() -> argparse.ArgumentParser:
    about, rest = INTRO.split("\ncommands:")
    examples = "examples:" + rest.split("examples:")[1]
    parser = argparse.ArgumentParser(prog="trainfit", description=about, epilog=examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fields = _fields_help()  # the epilog of every command that reads a config
    estimate = _config_parser(sub, "estimate", "predict per-GPU memory, FLOPs, step time and MFU (no torch, instant)",
                              fields)
    estimate.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    estimate.add_argument("--plot", metavar="FILE.png", help="draw the memory breakdown as a stacked bar")
    estimate.add_argument("--traced", action="store_true",
                          help="run the real step on fake tensors and a fake process group (exact, slower)")
    plan = _config_parser(sub, "plan", "search the layouts that fit and rank them by predicted step time (no torch); "
                          "fields set in CONFIG or on the command line stay fixed, the others are searched", fields)
    plan.add_argument("--top", type=int, default=10, help="how many candidates to show (default 10)")
    plan.add_argument("--out", metavar="FILE.toml", help="write the fastest layout as a config trainfit train runs")
    plan.add_argument("--json", action="store_true", help="print the candidates and the search as one JSON object")
    plan.add_argument("--plot", metavar="FILE.png", help="draw tokens/s against memory for every candidate that fits "
                      "(searches exhaustively, without the bound)")
    plan.add_argument("--traced", type=int, default=0, metavar="K", help="re-check the first K candidates' memory "
                      "with the traced estimator (the real step on fake tensors: seconds to minutes each)")
    plan.add_argument("--tokens", type=float, metavar="N", help="compare machines instead: each device of "
                      "--gpu-options at 1, 2, 4 ... up to a node, then whole nodes doubling up to --max-gpus, its "
                      "fastest layout, the time to train N tokens and its cost")
    plan.add_argument("--gpu-options", metavar="DEVICES", help="with --tokens: devices to compare, comma-separated "
                      "(default: hardware.gpu)")
    plan.add_argument("--max-gpus", type=int, metavar="N", help="with --tokens: the most devices (default: "
                      "hardware.num_gpus)")
    plan.add_argument("--prices", metavar="PRICES", help="with --tokens: USD per GPU-hour, e.g. "
                      "H100-SXM-80GB=2.49,A100-SXM-80GB=1.60 (default: hardware.price_per_gpu_hour for hardware.gpu, "
                      "else trainfit.hardware's indicative prices)")
    plan.add_argument("--precisions", metavar="MODES", help="precision modes the plan may choose, comma-separated "
                      "(e.g. bf16-mixed,fp8-mixed; default: the config's, bf16-mixed on a GPU when unset)")
    measure = _config_parser(sub, "measure", "run real steps and measure memory at the allocator, per component",
                             fields)
    measure.add_argument("--json", action="store_true", help="print the estimate's schema (model, per_rank, per_stage)")
    measure.add_argument("--steps", type=int, default=2, help="steps to run; the last one is measured")
    report = _config_parser(sub, "report", "analytic and traced predictions against a measured step", fields)
    report.add_argument("--json", action="store_true")
    report.add_argument("--steps", type=int, default=2, help="steps to run; the last one is measured")
    report.add_argument("--plot", metavar="FILE.png", help="draw the step's memory timeline and the three breakdowns "
                        "(with --profile: the per-rank timeline, by default timeline.png beside the traces)")
    report.add_argument("--profile", metavar="TRACE",
                        help="summarise a `trainfit train --profile` run instead (its <logging.dir>/profile folder, "
                        "or one trace): per rank compute, communication, exposed communication, idle, top operators")
    train = _config_parser(sub, "train", "train a model from a config (default: tiny Llama on Shakespeare, CPU)",
                           fields)
    train.add_argument("--force", action="store_true",
                       help="start even when the memory estimate exceeds what this machine has")
    train.add_argument("--profile", metavar="STEPS",
                       help="torch.profiler trace of these steps on every rank: 3 or 3-5 (= --logging.profile_steps)")

    sample = sub.add_parser("sample", help="generate text from a trained checkpoint")
    sample.add_argument("--checkpoint", required=True, help="a checkpoint folder or a checkpoint.dir")
    sample.add_argument("--prompt", default="\n", help="text to continue")
    sample.add_argument("--chat", metavar="MESSAGE", help="a user message: the assistant's answer, written with the "
                        "chat template the run trained with and ended at its end-of-turn token")
    sample.add_argument("--system", action="append", default=[], metavar="MESSAGE",
                        help="a system message before --chat's (repeatable)")
    sample.add_argument("--max-new-tokens", type=int, default=200)
    sample.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    sample.add_argument("--top-k", type=int, default=50)
    sample.add_argument("--seed", type=int, default=0)

    export = sub.add_parser("export", help="write a checkpoint's weights as HF safetensors + config.json")
    export.add_argument("checkpoint", help="a checkpoint folder or a checkpoint.dir")
    export.add_argument("--out", required=True, help="output folder (new, or empty; --force replaces an export)")
    export.add_argument("--force", action="store_true", help="replace the files of an earlier export in --out")
    export.add_argument("--merge", action="store_true", help="a fine-tuned checkpoint (peft.method): write the base "
                        "with the adapters merged in, as full HF weights, instead of the adapters in PEFT's format")

    prep = sub.add_parser("prepare-data", help="tokenize text into memmap token shards with a manifest")
    prep.add_argument("input", help="a text file or a folder of .txt/.jsonl/.json files ('' = packaged corpus)")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--tokenizer", default="bytes", help="bytes | a tokenizer.json path (or its folder) | train")
    prep.add_argument("--bpe-vocab-size", type=int, default=4096)
    prep.add_argument("--val-fraction", type=float, default=0.05)
    prep.add_argument("--format", default="auto", choices=("auto", "text", "chat", "prompt-completion", "alpaca"),
                      help="the records' format (data.format; auto: each file's, from its first record)")
    prep.add_argument("--chat-template", default="", metavar="NAME_OR_FILE",
                      help="chatml | llama3 | a Jinja file (data.chat_template; default: the tokenizer's or "
                      "--model-folder's own)")
    prep.add_argument("--loss-on", default="completion", choices=("completion", "all"),
                      help="what fine-tuning samples train on (data.loss_on)")
    prep.add_argument("--model-folder", default="", metavar="DIR",
                      help="a Hugging Face model folder whose chat template to use (model.init_from)")

    calib = sub.add_parser("calibrate", help="measure this machine into a hardware profile (TOML) for "
                           "--hardware.profile", description="measure matmul FLOP/s per dtype and shape, memory "
                           "bandwidth, collectives over gloo (nccl on GPUs) at 2..N ranks and the AdamW step, and "
                           "write them as a hardware profile that estimate and train read with "
                           "--hardware.profile=FILE (about a minute; --quick: seconds)")
    calib.add_argument("--out", default="hardware-profile.toml", metavar="FILE",
                       help="profile to write (default: %(default)s)")
    calib.add_argument("--force", action="store_true", help="replace an existing --out file")
    calib.add_argument("--quick", action="store_true", help="fewer, smaller samples: seconds, rougher figures")
    calib.add_argument("--max-ranks", type=int, metavar="N",
                       help="measure collectives at 2..N ranks (default: min(4, cores), at least 2; GPUs: min(4, "
                       "GPUs)); 1 skips them")
    calib.add_argument("--threads", type=int, metavar="N",
                       help="torch threads per process, as training would use (default: torch's here, which "
                       "follows OMP_NUM_THREADS; torchrun sets 1 per rank)")
    calib.add_argument("--json", action="store_true", help="print the profile as JSON instead of tables")
    calib.add_argument("--catalog", metavar="GPU", help="measure nothing: write a catalog GPU's published kernel "
                       "figures (achievable matmul rates by shape, attention kernels, memory bandwidth) as a profile "
                       "to read and edit")

    check = sub.add_parser("validate", help="check the predictions against measured steps on this machine",
                           description="run `trainfit calibrate --quick`, `trainfit train` and a grid of single-device "
                           "configurations (fp32, bf16-mixed, fp8-mixed, every checkpointing policy, chunked loss, "
                           "compile, offload; a dense and an MoE model sized to fill 20-60% of the GPU), each in a "
                           "process of its own; print each one's analytic and traced peak and step time beside the "
                           "measured ones, and write them all to one JSON file. On the CPU: the same grid on the debug "
                           "models")
    check.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: cuda where torch sees a GPU, else cpu")
    check.add_argument("--out", default="validate.json", metavar="FILE.json",
                       help="the results (default: %(default)s; rewritten as entries finish)")
    check.add_argument("--budget-s", type=float, default=450, metavar="N",
                       help="the whole run's time limit; entries that would not fit are skipped (default %(default)s)")
    check.add_argument("--only", metavar="NAMES", help="comma-separated entries to run: calibrate, train, and the "
                       "grid's points (default: all)")
    serve = _config_parser(sub, "serve", "the estimate and the plan in a local web page: change a field, see the "
                           "memory and the step time change (offline; CONFIG is where the page starts)", fields)
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s; 0: a free one)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine "
                       "only; 0.0.0.0 lets every machine that reaches this one in, without a login)")
    serve.add_argument("--files", action="append", default=[], metavar="DIR",
                       help="a folder whose config.json files, weights folders and hardware profiles the page may "
                       "name by path (repeatable; default: none, the page uploads them)")
    return parser


def _format_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    """Warnings read like errors: one line, no source path."""
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    try:
        argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
        if not argv and not overrides:
            print(INTRO)
            return 0
        args = build_parser().parse_args(argv)
        module, function = COMMANDS[args.command]
        return getattr(importlib.import_module(module), function)(args, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainfit ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside training: checkpoints are written atomically
        print("interrupted: stopped at once; the last good checkpoint (if any) is intact", file=sys.stderr)
        return 128 + signal.SIGINT
