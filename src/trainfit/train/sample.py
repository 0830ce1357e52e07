"""`trainfit sample`: text from a trained checkpoint, on the CPU (or CUDA when present)."""

from __future__ import annotations

import torch

from trainfit.config import config_from_dict, resolve_and_validate
from trainfit.models import build_model
from trainfit.models.generate import generate
from trainfit.train import checkpoint as ckpt
from trainfit.train.tokenizer import load_tokenizer_from_dir


def sample_from_checkpoint(path: str, prompt: str, *, max_new_tokens: int, temperature: float,
                           top_k: int | None, seed: int) -> str:
    folder = ckpt.resolve_checkpoint(path)
    cfg = config_from_dict(ckpt.load_checkpoint_config(folder))
    resolve_and_validate(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg.model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # also fills the non-persistent buffers (RoPE tables)
    ckpt.load_checkpoint(folder, model, optimizer=None)
    model.eval()
    tokenizer = load_tokenizer_from_dir(folder)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = generate(model, tokenizer.encode(prompt), max_new_tokens, temperature=temperature,
                      top_k=top_k or None, generator=generator)
    return tokenizer.decode(tokens)
