"""Autoregressive sampling for `trainfit sample` and quick checks of a trained model.

No KV cache: every step re-runs the (cropped) context. That keeps the models cache-free and is
fast enough for the small models trained on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt_tokens: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """The prompt followed by `max_new_tokens` sampled tokens.

    The context is cropped to the model's max_seq_len; temperature 0 picks the argmax (greedy);
    top_k keeps only the k most likely tokens before sampling (None keeps all). Pass a seeded
    `generator` (on the model's device) for reproducible samples; `on_token(i)` is called after
    the i-th new token (progress); `stop(new_tokens)` ends it early once true (a chat's end of turn).
    """
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty: give at least one token (e.g. a newline or BOS)")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    device = next(model.parameters()).device
    max_seq_len = model.cfg.max_seq_len
    tokens = list(prompt_tokens)
    for i in range(max_new_tokens):
        if on_token is not None and i:
            on_token(i)
        if stop is not None and i and stop(tokens[len(prompt_tokens):]):
            return tokens
        context_1T = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
        logits_V = model(context_1T)[0, -1].float()
        if temperature == 0:
            tokens.append(int(logits_V.argmax()))
            continue
        logits_V = logits_V / temperature
        if top_k is not None and top_k < logits_V.numel():
            kth_best = torch.topk(logits_V, top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth_best, float("-inf"))
        probs_V = torch.softmax(logits_V, dim=-1)
        tokens.append(int(torch.multinomial(probs_V, 1, generator=generator)))
    if on_token is not None and max_new_tokens:
        on_token(max_new_tokens)
    return tokens
