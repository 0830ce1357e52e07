"""Using a trained checkpoint: load its model, sample text from it, export it to HF format."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from trainfit.config import Config, ConfigError
from trainfit.configure import config_from_dict, resolve_and_validate
from trainfit.models import build_model, materialize
from trainfit.models.generate import generate
from trainfit.models.hf import load_hf_weights, save_hf_weights
from trainfit.peft.adapters import apply_adapters
from trainfit.peft.export import merge_adapters, save_adapters
from trainfit.peft.nf4 import dequantize_base, quantize_base
from trainfit.peft.spec import adaptation_of
from trainfit.train import checkpoint as ckpt
from trainfit.train.chat_template import load_saved_chat_template
from trainfit.train.preflight import nearest_existing
from trainfit.train.tokenizer import Tokenizer, load_tokenizer_from_dir


def load_trained_model(path: str | Path, device: torch.device) -> tuple[nn.Module, Config, Tokenizer]:
    """The model (eval mode), config and tokenizer of a checkpoint folder or checkpoint.dir."""
    folder = ckpt.resolve_checkpoint(path)
    problems = ckpt.verify_checkpoint(folder)
    if problems:
        raise ckpt.CheckpointError(f"{folder} is damaged: {'; '.join(problems[:3])}")
    cfg = config_from_dict(ckpt.load_checkpoint_config(folder))
    resolve_and_validate(cfg)
    # A fine-tuned checkpoint holds what trained: its base is where the run started, model.init_from's
    # weights or the seed's (models/init.py), as the trainer built it
    # (QLoRA's in NF4, quantized from the same weights)
    model = apply_adapters(build_model(cfg.model), cfg.model, cfg.peft)
    adaptation = adaptation_of(cfg.model, cfg.peft)
    if adaptation is not None:
        quantize_base(model, cfg.model, cfg.peft, adaptation.quantized)
    materialize(model, device, cfg.training.seed)
    if cfg.peft.method != "none" and cfg.model.init_from:
        load_hf_weights(model, cfg.model, cfg.model.init_from)
    ckpt.load_checkpoint(folder, model, optimizer=None)
    return model.eval(), cfg, load_tokenizer_from_dir(folder)


def sample_from_checkpoint(path: str, prompt: str, *, max_new_tokens: int, temperature: float,
                           top_k: int | None, seed: int, chat: str | None = None, system: tuple[str, ...] = ()
                           ) -> str:
    """The prompt continued; with `chat`, the assistant's answer to that user message (after `system`
    messages), the conversation written by the chat template the run trained with, ended at its
    end-of-turn token."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _, tokenizer = load_trained_model(path, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    stop = None
    if chat is not None:
        template = load_saved_chat_template(ckpt.resolve_checkpoint(path))
        if template is None:
            raise ConfigError(f"--chat: {path!r} was not trained on chat records (no chat template in its checkpoint); "
                              "use --prompt to continue text")
        messages = [*({"role": "system", "content": text} for text in system), {"role": "user", "content": chat}]
        prompt_tokens = tokenizer.encode_rendered(template.render(messages, add_generation_prompt=True))[0]
        end = template.special_tokens.get("eos_token")
        stop = (lambda new: end in tokenizer.decode(new)) if end else None  # noqa: E731
    else:
        prompt_tokens = tokenizer.encode(prompt)
    if not prompt_tokens:
        raise ConfigError(f"--prompt {prompt!r}: encodes to no tokens; give some text (the default is a newline)")
    with Progress(TextColumn("sampling"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sample", total=max_new_tokens)
        tokens = generate(model, prompt_tokens, max_new_tokens, temperature=temperature, top_k=top_k or None,
                          generator=generator, on_token=lambda n: progress.update(task, completed=n), stop=stop)
    if chat is None:
        return tokenizer.decode(tokens)
    answer = tokenizer.decode(tokens[len(prompt_tokens):])
    end = template.special_tokens.get("eos_token")
    return answer.split(end)[0] if end else answer


def export_to_hf(path: str, out_dir: str, *, force: bool = False, merge: bool = False) -> Path:
    """Write model.safetensors + config.json (loadable by transformers) and the tokenizer files; for a
    fine-tuned checkpoint (peft.method), its adapters in PEFT's format instead, or with `merge` the
    base with the adapters folded in.

    Written into a temp folder beside `out_dir`, then moved in: a failure leaves nothing behind,
    and `out_dir` is replaced only with `force`. Files get the usual permissions (0644 with the
    common umask), not safetensors' 0600."""
    out = Path(out_dir)
    _check_export_target(out, force)
    model, cfg, tokenizer = load_trained_model(path, torch.device("cpu"))
    tmp = Path(tempfile.mkdtemp(prefix=".trainfit-export-", dir=nearest_existing(out.parent)))
    try:
        if cfg.peft.method != "none" and not merge:
            save_adapters(model, cfg.model, cfg.peft, tmp)
        else:
            dequantize_base(model, model.tok_embeddings.weight.dtype)  # QLoRA: merged into the NF4 base it trained on
            merge_adapters(model)
            save_hf_weights(model, cfg.model, tmp)
        tokenizer.save(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for file in tmp.iterdir():
            file.chmod(0o666 & ~umask)
        out.mkdir(parents=True, exist_ok=True)
        for file in tmp.iterdir():
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_export_target(out: Path, force: bool) -> None:
    existing = nearest_existing(out)
    if not existing.is_dir():
        where = "is a file" if existing == out.absolute() else f"is inside {str(existing)!r}, a file"
        raise ConfigError(f"--out {str(out)!r}: {where}; give a folder to write the model into")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r}: {str(existing)!r} is not writable; choose a folder you can write")
    if out.is_dir() and any(out.iterdir()):
        names = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        if not is_export(out):
            raise ConfigError(f"--out {str(out)!r}: holds files already ({names}) and is not an earlier export (no "
                              "config.json or adapter_config.json); choose a new or empty folder")
        if not force:
            raise ConfigError(f"--out {str(out)!r}: holds an earlier export ({names}); pass --force to replace it, "
                              "or choose a new folder")


EXPORT_MARKERS = ("config.json", "adapter_config.json")
"""A file every export writes (the model's config, or PEFT's for adapters): what --force may replace."""


def is_export(folder: Path) -> bool:
    """Whether `folder` holds an earlier export (a Hugging Face model or PEFT adapters)."""
    return any((folder / name).is_file() for name in EXPORT_MARKERS)
