"""The chunked loss (train/loss.py) is the plain loss computed another way: the same loss and
gradients (fp32: within 1e-5 relative, the issue's bound), in chunks that never hold the whole
logits, with or without a short last chunk, with a tied output (GPT-2) and without gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _runs import seeded_model
from trainfit.configure import load_config
from trainfit.train.loss import IGNORE, chunked_cross_entropy, cross_entropy, loss_function

TOKENS_BT = (3, 40)  # 120 tokens: chunks of 32 leave a last one of 24


def _model_and_batch(preset: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    cfg = load_config(None, [f"--model.preset={preset}"]).model
    model = seeded_model(cfg)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, TOKENS_BT, generator=gen)
    targets = torch.randint(0, cfg.vocab_size, TOKENS_BT, generator=gen)
    return model, inputs, targets


def _loss_and_grads(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.project_logits = not chunk_tokens
    loss = loss_function(chunk_tokens, lambda: model.output)(model(inputs), targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["debug", "debug-gpt2"])
@pytest.mark.parametrize("chunk_tokens", [32, 120, 1000])
def test_chunked_loss_and_gradients_match_the_whole_logits(preset: str, chunk_tokens: int) -> None:
    model, inputs, targets = _model_and_batch(preset)
    loss, grads = _loss_and_grads(model, inputs, targets, 0)
    chunked_loss, chunked_grads = _loss_and_grads(model, inputs, targets, chunk_tokens)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        error = (chunked_grads[name] - grad).norm() / grad.norm()
        assert error < 1e-5, (name, float(error))


class _LargestLogits(TorchDispatchMode):
    """The most rows of any new tensor over the vocabulary ([rows, V]: logits, their fp32 forms and
    gradients) an operator returns; not views (the output weight's transpose) nor the [D, V] gradient of
    that transpose."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab, self.dim, self.largest = vocab, dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if (isinstance(tensor, torch.Tensor) and not tensor._is_view() and tensor.shape[-1:] == (self.vocab,)
                    and tensor.shape != (self.dim, self.vocab)):
                self.largest = max(self.largest, tensor.numel() // self.vocab)
        return out


class _ProjectedRows(TorchDispatchMode):
    """The rows of every [rows, V] matmul output (the chunks' logits), summed."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.rows += out.shape[0]
        return out


def test_chunked_loss_never_holds_more_than_a_chunk_of_logits() -> None:
    model, inputs, targets = _model_and_batch("debug")
    vocab, chunk = model.cfg.vocab_size, 32
    model.project_logits = False
    hidden = model(inputs).detach().requires_grad_()
    with _LargestLogits(vocab, model.cfg.dim) as mode:
        loss = chunked_cross_entropy(hidden, targets, output=model.output, chunk_tokens=chunk)
        loss.backward()
    assert mode.largest == chunk  # one chunk's logits and their gradient, never the 120 rows
    with _LargestLogits(vocab, model.cfg.dim) as whole:
        cross_entropy(model.output(hidden), targets).backward()
    assert whole.largest == inputs.numel()


def test_chunked_loss_without_gradients_is_the_same_loss() -> None:
    model, inputs, targets = _model_and_batch("debug")
    model.project_logits = False
    with torch.no_grad():
        hidden = model(inputs)
        chunked = chunked_cross_entropy(hidden, targets, output=model.output, chunk_tokens=32)
        whole = cross_entropy(model.output(hidden), targets)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


def test_the_masked_chunked_loss_projects_only_the_trained_rows() -> None:
    """Fine-tuning samples: a prompt's rows are neither projected nor scored, and the loss and gradients are
    the whole logits' masked mean's; rows with nothing to train still give a loss (0) and a graph."""
    model, inputs, targets = _model_and_batch("debug")
    targets[:, :30] = IGNORE  # a 30-token prompt in every row of 40: 30 trained rows of 120
    model.zero_grad(set_to_none=True)
    model.project_logits = True
    whole = loss_function(0, lambda: model.output, masked=True)(model(inputs), targets)
    whole.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.project_logits = False
    hidden = model(inputs)
    chunked = loss_function(16, lambda: model.output, masked=True)(hidden, targets)
    chunked.backward()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        assert (model.get_parameter(name).grad - grad).norm() / grad.norm() < 1e-5, name
    with torch.no_grad(), _ProjectedRows(model.cfg.vocab_size) as projected:
        chunked_cross_entropy(model(inputs), targets, output=model.output, chunk_tokens=16, masked=True)
    assert projected.rows == 32  # the 30 trained rows in whole chunks of 16, not the 120 rows
    prompts = torch.full_like(targets, IGNORE)
    with torch.no_grad():
        assert chunked_cross_entropy(model(inputs), prompts, output=model.output, chunk_tokens=32,
                                     masked=True).item() == 0.0
