"""Every bad input a user can give ends in a named error: a non-zero exit, no traceback, a message
that names the input and its value (and says what to do), and no file of theirs changed or left
half-written.

The table runs `trainfit.cli.main` in this process (a subprocess per case would cost ~1 s of
imports each); `test_a_bad_input_exits_2_without_a_traceback_as_a_process` checks the real process
for a few. Each case runs in an empty working folder holding only what its setup wrote, whose
files must be exactly as they were afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _runs import run_overrides
from trainfit.cli import main
from trainfit.config import SECTIONS


@dataclass(frozen=True)
class Bad:
    """One bad input: `argv` for trainfit (`{tmp}` is the case's folder), what its setup writes
    there first, and the words the error must contain (the input's name, its value)."""

    category: str
    argv: tuple[str, ...]
    says: tuple[str, ...]
    setup: Callable[[Path], None] | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return f"{self.category}:{' '.join(self.argv)[:70]}"


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def chain(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        for s in setups:
            s(tmp)
    return setup


# ---------------------------------------------------------------- config values, from the schema


def _schema_cases() -> list[Bad]:
    """For every field: a value of the wrong type; for every number, NaN; for every choice, a name
    not among them. The error names the field and the value."""
    cases = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            hint = hints[f.name]
            base = [a for a in typing.get_args(hint) if a is not type(None)][0] \
                if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType) else hint
            if base is int:
                cases.append(Bad("config value", ("estimate", f"--{key}=twelve"), (key, "twelve", "integer")))
                cases.append(Bad("config value", ("estimate", f"--{key}=1.5"), (key, "1.5")))
            elif base is float:
                cases.append(Bad("config value", ("estimate", f"--{key}=fast"), (key, "fast", "number")))
                cases.append(Bad("config value", ("estimate", f"--{key}=nan"), (key, "nan")))
            elif base is bool:
                cases.append(Bad("config value", ("estimate", f"--{key}=maybe"), (key, "maybe", "true or false")))
            elif typing.get_origin(base) is typing.Literal:
                cases.append(Bad("config value", ("estimate", f"--{key}=bogus"), (key, "bogus")))
    return cases


SEMANTIC = [  # values of the right type that make no sense, each with the words of its fix
    ("--training.steps=0", ("training.steps", "0", ">= 1")),
    ("--model.sliding_window=-1", ("model.sliding_window", "-1", "0 (full causal attention)")),
    ("--model.head_dim=-8", ("model.head_dim", "-8", "0 for dim / num_heads")),
    ("--model.head_dim=7", ("model.head_dim", "7", "even for RoPE")),
    ("--training.seq_len=-4", ("training.seq_len", "-4")),
    ("--training.seq_len=100000", ("training.seq_len", "model.max_seq_len")),
    ("--training.micro_batch_size=0", ("training.micro_batch_size", ">= 1")),
    ("--training.global_batch_size=-8", ("training.global_batch_size", "-8")),
    ("--training.global_batch_size=24", ("training.global_batch_size", "24", "multiple")),
    ("--training.lr=0", ("training.lr", "> 0")),
    ("--training.lr=inf", ("training.lr", "inf", "finite")),
    ("--training.lr=-1e-3", ("training.lr", "-0.001")),
    ("--training.min_lr=1", ("training.min_lr", "training.lr")),
    ("--training.min_lr=nan", ("training.min_lr", "nan")),
    ("--training.weight_decay=-0.1", ("training.weight_decay", ">= 0")),
    ("--training.grad_clip=-1", ("training.grad_clip", ">= 0")),
    ("--training.warmup_steps=-1", ("training.warmup_steps", ">= 0")),
    ("--training.eval_interval=-5", ("training.eval_interval", ">= 0")),
    ("--training.eval_steps=0", ("training.eval_steps", ">= 1")),
    ("--training.seed=-1", ("training.seed", "-1")),
    ("--training.seed=99999999999999999999", ("training.seed", "99999999999999999999", "2**63")),
    ("--model.preset=llama9", ("model.preset", "llama9")),
    ("--model.dim=0", ("model.dim", "positive")),
    ("--model.dim=100", ("model.num_heads", "must divide model.dim=100")),
    ("--model.num_heads=3", ("model.num_heads", "3")),
    ("--model.num_kv_heads=3", ("model.num_kv_heads", "3", "must divide")),
    ("--model.num_layers=0", ("model.num_layers", "0")),
    ("--model.vocab_size=-1", ("model.vocab_size", "-1")),
    ("--model.norm_eps=0", ("model.norm_eps", "> 0")),
    ("--model.norm_eps=-1e-5", ("model.norm_eps", "> 0")),
    ("--model.max_seq_len=0", ("model.max_seq_len", "0")),
    ("--model.capacity_factor=-1", ("model.capacity_factor", "-1")),
    ("--optimizer.betas=0.9,1.5", ("optimizer.betas", "[0, 1)")),
    ("--optimizer.betas=0.9", ("optimizer.betas",)),
    ("--optimizer.betas=a,b", ("optimizer.betas", "a")),
    ("--optimizer.eps=0", ("optimizer.eps", "> 0")),
    ("--optimizer.momentum=1", ("optimizer.momentum", "[0, 1)")),
    ("--parallel.tp=3", ("parallel.tp", "3", "try")),
    ("--parallel.tp=0", ("parallel.tp", ">= 1")),
    ("--parallel.pp=-2", ("parallel.pp", "-2")),
    ("--parallel.dp_shard=0", ("parallel.dp_shard", "-1")),
    ("--parallel.dp_replicate=3", ("parallel.dp_replicate", "3")),
    ("--parallel.zero_stage=4", ("parallel.zero_stage", "4")),
    ("--parallel.num_microbatches=-1", ("parallel.num_microbatches", "-1")),
    ("--parallel.pp_virtual_stages=-1", ("parallel.pp_virtual_stages", "-1")),
    ("--memory.ac_every_n_layers=0", ("memory.ac_every_n_layers", ">= 1")),
    ("--memory.loss_chunk_tokens=0", ("memory.loss_chunk_tokens", ">= 1")),
    ("--memory.moe_imbalance=0.5", ("memory.moe_imbalance", ">= 1")),
    ("--data.val_fraction=1", ("data.val_fraction", "between 0 and 1")),
    ("--data.val_fraction=0", ("data.val_fraction", "between 0 and 1")),
    ("--data.bpe_vocab_size=100", ("data.bpe_vocab_size", "> 256")),
    ("--checkpoint.interval=-1", ("checkpoint.interval", ">= 0")),
    ("--checkpoint.keep_last=0", ("checkpoint.keep_last", ">= 1")),
    ("--logging.interval=0", ("logging.interval", ">= 1")),
    ("--logging.profile_steps=0", ("logging.profile_steps", "'0'", "3-5")),
    ("--logging.profile_steps=5-2", ("logging.profile_steps", "5-2", "training.steps")),
    ("--hardware.gpu=H900", ("hardware.gpu", "H900")),
    ("--hardware.num_gpus=0", ("hardware.num_gpus", "0")),
    ("--hardware.num_gpus=-8", ("hardware.num_gpus", "-8")),
    ("--hardware.gpus_per_node=0", ("hardware.gpus_per_node", "0")),
    ("--hardware.peak_tflops=-5", ("hardware.peak_tflops", "-5")),
    ("--hardware.memory_gib=-1", ("hardware.memory_gib", "-1")),
    ("--hardware.intra_node_link=carrier-pigeon", ("hardware.intra_node_link", "carrier-pigeon")),
    ("--hardware.inter_node_link=smoke", ("hardware.inter_node_link", "smoke")),
    ("--trainingg.steps=5", ("trainingg", "training")),
    ("--training.stepz=5", ("training.stepz", "steps")),
    ("--training.steps", ("--training.steps", "VALUE")),
    ("--training.steps=", ("training.steps",)),
]

ARGUMENTS = [  # the command line itself
    (("estimate", "--training.steps", "--json"), ("--training.steps", "--json")),
    (("estimate", "--steps=5"), ("--steps=5",)),
    (("estimate", "training.steps=5"), ("training.steps=5",)),
    (("estimate", "nowhere.toml"), ("nowhere.toml", "does not exist")),
    (("train", "--training.steps", "5", "extra.toml", "more"), ("more",)),
    (("frobnicate",), ("frobnicate",)),
    (("estimate", "--model.preset=debug-gpt2", "--model.qk_norm=head"), ("model.qk_norm", "family=gpt2", "none")),
    (("estimate", "--model.qk_norm=whole", "--hardware.num_gpus=2", "--parallel.tp=2"),
     ("parallel.tp", "model.qk_norm=whole", "parallel.tp=1")),
    (("estimate", "--model.sliding_window=8", "--hardware.num_gpus=2", "--parallel.cp=2"),
     ("parallel.cp", "sliding window", "parallel.cp=1")),
    (("estimate", "--model.attention_softcap=50", "--hardware.num_gpus=2", "--parallel.cp=2"),
     ("parallel.cp", "model.attention_softcap=50", "parallel.cp=1")),
    (("estimate", "--model.preset=debug-gpt2", "--model.final_softcap=30"), ("model.final_softcap", "family=gpt2")),
    (("estimate", "--model.sliding_window_pattern=-1"), ("model.sliding_window_pattern", "-1")),
    (("estimate", "--model.norm_placement=middle"), ("model.norm_placement", "middle")),
    (("estimate", "--model.moe_dense_layers=1"), ("model.moe_dense_layers", "num_experts=0", "set it to 0")),
    (("estimate", "--model.preset=debug-moe", "--model.moe_layer_step=0"), ("model.moe_layer_step", "0")),
    (("estimate", "--model.preset=debug-moe", "--model.moe_dense_layers=2"),
     ("model.moe_dense_layers", "num_layers - 1 = 1")),
    (("estimate", "--plot"), ("--plot",)),
    (("measure", "--steps", "1", "--training.steps=2"), ("--steps 1", "at least 2")),
    (("measure", "--steps", "x"), ("--steps", "x")),
    (("report", "--steps", "0"), ("--steps 0",)),
    (("report", "--profile", "{tmp}/none"), ("--profile", "none", "does not exist")),
    (("train", "--profile=first"), ("logging.profile_steps", "first")),
    (("sample",), ("--checkpoint",)),
    (("export", "--out", "x"), ("checkpoint",)),
    (("sample", "--checkpoint", "ckpt", "--training.steps=3"), ("--training.steps=3", "no config overrides")),
]

CONFIG_FILES = [  # what a config file can hold
    ("binary", b"\x00\x01\xff\xfe\x80 binary", ("cfg.toml",)),
    ("not toml", "this is [not toml", ("cfg.toml", "TOML")),
    ("unknown section", "[trainin]\nsteps = 3\n", ("trainin", "training")),
    ("unknown field", "[training]\nstep = 3\n", ("training.step", "steps")),
    ("wrong type", '[training]\nsteps = "many"\n', ("training.steps", "many")),
    ("float for int", "[training]\nsteps = 2.5\n", ("training.steps", "2.5")),
    ("list for int", "[training]\nsteps = [1, 2]\n", ("training.steps",)),
    ("table for value", "[training.steps]\nx = 1\n", ("training.steps",)),
    ("value for table", "training = 3\n", ("training", "3")),
    ("bad choice", '[precision]\nmode = "fp64"\n', ("precision.mode", "fp64")),
    ("bool as string", '[logging]\nprogress = "yes"\n', ("logging.progress", "yes")),
    ("nan", "[training]\nlr = nan\n", ("training.lr", "nan")),
    ("inf", "[training]\nlr = inf\n", ("training.lr", "inf")),
    ("negative", "[training]\nsteps = -3\n", ("training.steps", "-3")),
    ("betas length", "[optimizer]\nbetas = [0.9, 0.95, 0.99]\n", ("optimizer.betas",)),
    ("betas strings", '[optimizer]\nbetas = ["a", "b"]\n', ("optimizer.betas",)),
    ("latin-1 text", "[model]\npreset = \"caf\xe9\"\n".encode("latin-1"), ("cfg.toml",)),
    ("empty preset", '[model]\npreset = ""\n', ("model.",)),
    ("unknown preset", '[model]\npreset = "gpt5"\n', ("model.preset", "gpt5")),
    ("gpt2 with grouped kv heads", '[model]\npreset = "gpt2"\nnum_kv_heads = 4\n',
     ("model.num_kv_heads", "4", "set it to 12")),
    ("folder as config", None, ("cfgdir",)),
]

HF_CONFIGS = [  # --model.preset=hf:PATH reads a Hugging Face config.json
    ("list", "[1, 2, 3]", ()),
    ("not json", "{not json", ()),
    ("wrong types", '{"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2}', ("hidden_size",)),
    ("unknown model", '{"model_type": "bert", "hidden_size": 64}', ("bert",)),
    ("missing fields", '{"model_type": "llama"}', ()),
    ("binary", b"\xff\xfe\x00garbage", ()),
]

DATA = [  # what data.path and data.tokenizer can point at (trainfit train)
    ("missing file", ("--data.path={tmp}/missing.txt",), None, ("data.path", "missing.txt")),
    ("empty file", ("--data.path={tmp}/empty.txt",), write("empty.txt", ""), ("data.path", "no text")),
    ("empty folder", ("--data.path={tmp}/texts",), write("texts/readme.md", "no text here"), ("data.path",)),
    ("bad jsonl", ("--data.path={tmp}/d.jsonl",), write("d.jsonl", "{not json}\n"), ("d.jsonl", "JSON")),
    ("jsonl without text", ("--data.path={tmp}/d.jsonl",), write("d.jsonl", '{"body": "x"}\n'), ("d.jsonl", "text")),
    ("binary text", ("--data.path={tmp}/b.txt",), write("b.txt", b"\xff\xfe\xfa" * 100), ("b.txt",)),
    ("tiny corpus", ("--data.path={tmp}/t.txt",), write("t.txt", "ab"), ("data.",)),
    ("missing tokenizer", ("--data.tokenizer={tmp}/tok.json",), None, ("data.tokenizer", "tok.json")),
    ("tokenizer not json", ("--data.tokenizer={tmp}/tok.json",), write("tok.json", "{nope"), ("tok.json",)),
    ("tokenizer wrong shape", ("--data.tokenizer={tmp}/tok.json",), write("tok.json", "[1, 2]"), ("tok.json",)),
    ("tokenizer no model", ("--data.tokenizer={tmp}/tok.json",), write("tok.json", '{"version": "1.0"}'),
     ("tok.json",)),
    ("tokenizer binary", ("--data.tokenizer={tmp}/tok.json",), write("tok.json", b"\x00\xff" * 10), ("tok.json",)),
    ("bad tokenizer name", ("--data.tokenizer=sentencepiece",), None, ("data.tokenizer", "sentencepiece")),
    ("manifest not json", ("--data.path={tmp}/prep",), write("prep/manifest.json", "{oops"), ("manifest.json",)),
    ("manifest a list", ("--data.path={tmp}/prep",), write("prep/manifest.json", "[]"), ("manifest.json",)),
    ("manifest fields", ("--data.path={tmp}/prep",), write("prep/manifest.json", '{"format_version": 1}'),
     ("manifest.json",)),
    ("manifest shards missing", ("--data.path={tmp}/prep",),
     write("prep/manifest.json", json.dumps({"format_version": 1, "dtype": "uint16", "vocab_size": 256,
                                             "tokenizer": {"name": "bytes"}, "num_tokens": {"train": 9, "val": 9},
                                             "shards": {"train": ["train_000.bin"], "val": ["val_000.bin"]}})),
     ("prep",)),
]

CHECKPOINTS = [  # sample / export / train --checkpoint.resume against what a checkpoint folder holds
    ("no checkpoint", ("sample", "--checkpoint", "{tmp}/none"), None, ("none", "no checkpoint")),
    ("empty folder", ("export", "{tmp}/ck", "--out", "{tmp}/out"), write("ck/.keep", ""), ("ck", "no checkpoint")),
    ("garbage config", ("sample", "--checkpoint", "{tmp}/ck/step_00000001"),
     chain(write("ck/step_00000001/trainer_state.pt", b"junk"), write("ck/step_00000001/config.json", "{{{")),
     ("step_00000001",)),
    ("config a list", ("export", "{tmp}/ck/step_00000001", "--out", "{tmp}/out"),
     chain(write("ck/step_00000001/trainer_state.pt", b"junk"), write("ck/step_00000001/config.json", "[1]")),
     ("step_00000001",)),
    ("no manifest", ("sample", "--checkpoint", "{tmp}/ck/step_00000001"),
     chain(write("ck/step_00000001/trainer_state.pt", b"junk"), write("ck/step_00000001/config.json", "{}")),
     ("manifest.json",)),
    ("resume path missing", ("train", "--checkpoint.resume={tmp}/nope", "--checkpoint.dir={tmp}/c",
                             "--logging.dir={tmp}/l"), None, ("checkpoint.resume", "nope")),
]

SAMPLING = [
    (("--prompt", ""), ("--prompt", "''")),
    (("--temperature", "-1"), ("--temperature", "-1")),
    (("--temperature", "nan"), ("--temperature", "nan")),
    (("--temperature", "hot"), ("--temperature", "hot")),
    (("--top-k", "-3"), ("--top-k", "-3")),
    (("--top-k", "many"), ("--top-k", "many")),
    (("--max-new-tokens", "0"), ("--max-new-tokens", "0")),
    (("--max-new-tokens", "-5"), ("--max-new-tokens", "-5")),
    (("--seed", "-1"), ("--seed", "-1")),
    (("--seed", "99999999999999999999"), ("--seed", "99999999999999999999")),
]

EXPORTS = [  # where export may write
    ("onto a file", ("--out", "{tmp}/taken"), write("taken", "mine"), ("taken", "file")),
    ("into a file's child", ("--out", "{tmp}/taken/sub"), write("taken", "mine"), ("taken",)),
    ("over an export", ("--out", "{tmp}/prev"), chain(write("prev/model.safetensors", "old"), write(
        "prev/config.json", "{}")), ("prev", "an earlier export", "--force")),
    ("over other files", ("--out", "{tmp}/notes"), write("notes/todo.txt", "mine"),
     ("notes", "not an earlier export", "a new or empty folder")),
]

PLOTS = [
    (("estimate", "--plot", "{tmp}/missing/plot.png"), ("--plot", "missing")),
    (("estimate", "--plot", "{tmp}/plot.xyz"), ("--plot", "xyz")),
    (("estimate", "--plot", "{tmp}/plot"), ("--plot",)),
    (("estimate", "--plot", "{tmp}/afile/plot.png"), ("--plot", "afile")),
    (("report", "--profile", "{tmp}/afile"), ("--profile", "afile", "not a JSON trace")),
]

PROFILE = """version = 1
memory_bytes_per_s = 1.5e+10
matmul_shapes = []
optimizer = []
[machine]
device = "cpu"
name = "a CPU"
cores = 2
threads = 1
torch = "2.13.0"
date = "2025-01-01"
quick = true
seconds = 9.5
[matmul_flops_per_s]
fp32 = 5e+10
bf16 = 2e+09
fp16 = 1.5e+09
"""
"""A minimal valid hardware profile (trainfit.hardware_profile): no collectives, no fp8."""

PROFILES = [  # what --hardware.profile can point at: (name, more arguments, the file's content, words)
    ("missing", (), None, ("hardware.profile", "hw.toml", "trainfit calibrate --out")),
    ("not toml", (), "version = [", ("hardware.profile", "not a TOML profile")),
    ("binary", (), b"\xff\xfe\x00", ("hardware.profile", "not a TOML profile")),
    ("wrong version", (), "version = 7\n", ("hardware.profile", "version 7", "trainfit calibrate")),
    ("negative bandwidth", (), PROFILE.replace("1.5e+10", "-1.5e+10"),
     ("hardware.profile", "memory_bytes_per_s", "> 0")),
    ("zero matmul rate", (), PROFILE.replace("fp32 = 5e+10", "fp32 = 0"), ("matmul_flops_per_s.fp32=0",)),
    ("no bf16", (), PROFILE.replace("bf16 = 2e+09", ""), ("hardware.profile", "bf16")),
    ("a gpu", ("--hardware.gpu=A100-40GB",), PROFILE, ("hardware.profile", "cpu", "hardware.gpu='A100-40GB'")),
    ("no fp8 rate", ("--precision.mode=fp8-mixed",), PROFILE, ("precision.mode", "hardware.profile", "fp8")),
]

CALIBRATE = [  # trainfit calibrate's own arguments, refused before anything is measured: (argv, setup, words)
    (("--out", "{tmp}/taken.toml"), write("taken.toml", "mine"), ("--out", "taken.toml", "not a hardware profile")),
    (("--out", "{tmp}/old.toml"), write("old.toml", "version = 1\n"), ("--out", "old.toml", "--force")),
    (("--out", "{tmp}/nowhere/p.toml"), None, ("--out", "nowhere", "does not exist")),
    (("--out", "{tmp}/adir"), write("adir/x", ""), ("--out", "adir", "folder")),
    (("--max-ranks", "0", "--out", "{tmp}/p.toml"), None, ("--max-ranks 0", ">= 1")),
    (("--max-ranks", "two"), None, ("--max-ranks", "two")),
    (("--threads", "0", "--out", "{tmp}/p.toml"), None, ("--threads 0", ">= 1")),
    (("--training.steps=3",), None, ("--training.steps=3", "no config overrides")),
]

VALIDATE = [  # trainfit validate's own arguments, refused before the device is probed: (argv, setup, words)
    (("--only", "dense-bf16,dense-bf17", "--out", "{tmp}/v.json"), None,
     ("--only dense-bf17", "no such step or grid point", "calibrate, train, dense-fp32")),
    (("--only", " , ", "--out", "{tmp}/v.json"), None, ("--only", "names no entry")),
    (("--budget-s", "0", "--out", "{tmp}/v.json"), None, ("--budget-s 0", "> 0")),
    (("--out", "{tmp}/adir"), write("adir/x", ""), ("--out", "adir", "folder")),
    (("--out", "{tmp}/nowhere/v.json"), None, ("--out", "nowhere", "does not exist")),
    (("--device", "gpu"), None, ("--device", "gpu", "cuda")),
    (("--training.steps=3",), None, ("--training.steps=3", "no config overrides")),
]


PLAN_BASE = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
             "--training.seq_len=4096")
PLANS = [  # trainfit plan's own arguments and what it needs: (argv, setup, words)
    # no global batch: the one a run derives (micro_batch_size x num_gpus / (tp x pp x cp)), and here that fails
    ((*PLAN_BASE, "--hardware.num_gpus=6", "--parallel.tp=4"), None,
     ("hardware.num_gpus=6", "multiple of tp x pp x cp", "4 or 8 GPUs")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--top", "0"), None, ("--top 0", "--top 10")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--precisions", "bf16-mixed,fp9"), None,
     ("precision.mode", "fp9")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--out", "{tmp}/nowhere/plan.toml"), None,
     ("nowhere", "does not exist")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--out", "{tmp}/adir"), write("adir/x", ""),
     ("adir", "folder")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--tokens", "0"), None, ("--tokens 0", "> 0")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--parallel.tp=3"), None, ("parallel.tp=3", "num_heads")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--tokens", "1e9", "--gpu-options", "H100,H300"), None,
     ("--gpu-options", "H300", "unknown device")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--tokens", "1e9", "--prices", "MI300X=free"), None,
     ("--prices", "MI300X=free", "DEVICE=USD")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--tokens", "1e9", "--max-gpus", "0"), None,
     ("--max-gpus 0", ">= 1")),
    ((*PLAN_BASE, "--training.global_batch_size=64", "--hardware.price_per_gpu_hour=-1"), None,
     ("hardware.price_per_gpu_hour", "-1")),
]


def _cases() -> list[Bad]:
    cases = _schema_cases()
    cases += [Bad("config value", ("estimate", arg), says) for arg, says in SEMANTIC]
    cases += [Bad("arguments", argv, says) for argv, says in ARGUMENTS]
    for _name, content, says in CONFIG_FILES:
        if content is None:
            cases.append(Bad("config file", ("estimate", "{tmp}/cfgdir"), says, write("cfgdir/x", "")))
        else:
            cases.append(Bad("config file", ("estimate", "{tmp}/cfg.toml"), says, write("cfg.toml", content)))
    for _name, content, says in HF_CONFIGS:
        cases.append(Bad("hf config", ("estimate", "--model.preset={tmp}/hf/config.json"),
                         ("config.json", *says), write("hf/config.json", content)))
    quiet_run = ("--training.steps=2", "--checkpoint.dir={tmp}/c", "--logging.dir={tmp}/l", "--logging.progress=false")
    cases += [Bad(f"data: {name}", ("train", *argv, *quiet_run), says, setup) for name, argv, setup, says in DATA]
    cases += [Bad(f"checkpoint: {name}", argv, says, setup) for name, argv, setup, says in CHECKPOINTS]
    cases += [Bad("sampling", ("sample", "--checkpoint", "{tmp}/ckpt", *argv), says) for argv, says in SAMPLING]
    cases += [Bad(f"export: {name}", ("export", "{tmp}/ckpt", *argv), says, setup)
              for name, argv, setup, says in EXPORTS]
    cases += [Bad("plot", argv, says, write("afile", "x")) for argv, says in PLOTS]
    cases += [Bad(f"profile: {name}", ("estimate", "--hardware.profile={tmp}/hw.toml", *argv), says,
                  None if content is None else write("hw.toml", content)) for name, argv, content, says in PROFILES]
    cases += [Bad("calibrate", ("calibrate", *argv), says, setup) for argv, setup, says in CALIBRATE]
    cases += [Bad("validate", ("validate", *argv), says, setup) for argv, setup, says in VALIDATE]
    cases += [Bad("plan", ("plan", *argv), says, setup) for argv, setup, says in PLANS]
    return cases


CASES = _cases()


def test_the_table_covers_every_kind_of_input() -> None:
    kinds = {case.category.split(":")[0] for case in CASES}
    assert kinds == {"config value", "arguments", "config file", "hf config", "data", "checkpoint", "sampling",
                     "export", "plot", "profile", "calibrate", "validate", "plan"}
    assert len(CASES) >= 150


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_a_named_error(case: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], trained: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").symlink_to(trained)  # a good checkpoint, for the cases about other inputs
    if case.setup is not None:
        case.setup(tmp_path)
    before = _tree(tmp_path)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in case.argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code not in (0, None), out + err
    assert "Traceback" not in out + err
    assert err.startswith("error: ") or "error:" in err, err
    for words in case.says:
        assert words.replace("{tmp}", str(tmp_path)) in err, f"{words!r} not in {err!r}"
    assert _tree(tmp_path) == before, "files changed"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step debug run's checkpoint folder."""
    run = tmp_path_factory.mktemp("trained")
    assert main(["train", *run_overrides(run, "--training.steps=2")]) == 0
    return run / "ckpt"


@pytest.mark.parametrize("argv", [["estimate", "--training.lr=nan"], ["sample", "--checkpoint", "nowhere"],
                                  ["frobnicate"]])
def test_a_bad_input_exits_2_without_a_traceback_as_a_process(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainfit", *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith(("error:", "usage:"))
    assert list(tmp_path.iterdir()) == []
