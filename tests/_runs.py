"""The one way tests configure a run: `run_overrides` / `run_config` (a quiet run writing only under a
temp folder), and seeded models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from trainfit.config import Config, ModelConfig
from trainfit.configure import load_config
from trainfit.models import build_model, materialize

DEBUG_RUN = ("--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=4",
             "--training.global_batch_size=4", "--training.warmup_steps=2")
"""The run `run_overrides` starts from unless told otherwise: the debug model on 32-token sequences, one
micro-batch of 4 rows per step (one process), a 2-step warm-up."""


COMPILE_SHAPE = ("--model.num_layers=1", "--model.dim=128", "--model.ffn_dim=384", "--training.seq_len=128",
                 "--memory.activation_checkpointing=full")
"""The training.compile tests' model (after DEBUG_RUN): one block, whose activations outweigh its weights,
fully checkpointed (compiled recomputation); one shape, so inductor compiles it once for all of them."""


def run_overrides(run_dir: Path, *overrides: str, base: tuple[str, ...] = DEBUG_RUN) -> list[str]:
    """Overrides for a quiet run of `base` writing only under run_dir: no evaluation, a checkpoint at the
    end only, metrics every step, no progress bar. `overrides` come last and win; `base=()` keeps the
    default config's model and batch (rows of the accuracy grid give their whole shape)."""
    return [*base, "--training.eval_interval=0", "--checkpoint.interval=0", f"--checkpoint.dir={run_dir / 'ckpt'}",
            f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false", "--logging.interval=1", *overrides]


def run_config(run_dir: Path, *overrides: str, base: tuple[str, ...] = DEBUG_RUN) -> Config:
    """The Config of `run_overrides(run_dir, *overrides, base=base)`."""
    return load_config(None, run_overrides(run_dir, *overrides, base=base))


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py as a module (benchmarks/ is not a package). It is registered first, because
    dataclasses look their module up in sys.modules."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def seeded_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A materialized model whose weights depend on `seed` only."""
    return materialize(build_model(cfg), "cpu", seed)


def assert_export_matches(ckpt_dir: Path, out: Path) -> None:
    """`trainfit export` of the checkpoint in `ckpt_dir` writes HF weights that, loaded into a fresh
    model, give exactly the logits of the checkpoint's own model."""
    import subprocess
    import sys

    from trainfit.models.hf import load_hf_weights
    from trainfit.train.sample import load_trained_model

    proc = subprocess.run([sys.executable, "-m", "trainfit", "export", str(ckpt_dir), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ours, cfg, _ = load_trained_model(ckpt_dir, torch.device("cpu"))
    exported = materialize(build_model(cfg.model), "cpu")
    load_hf_weights(exported, cfg.model, out)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens), ours(tokens), rtol=0, atol=0)


def assert_peft_loads_adapters(ckpt_dir: Path, base: Path, vocab_size: int, out: Path
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters of the fine-tuned checkpoint in `ckpt_dir`, exported in PEFT's format into `out`, load with
    peft.PeftModel.from_pretrained onto transformers' model of `base` and give the checkpoint's own logits
    (fp32, 1e-5), which differ from the base's (the adapters trained). Returns (the tokens, those logits)."""
    import peft
    import transformers

    from trainfit.train.sample import export_to_hf, load_trained_model

    model, _, _ = load_trained_model(ckpt_dir, torch.device("cpu"))
    tokens = torch.randint(0, vocab_size, (2, 24))
    with torch.no_grad():
        ours = model(tokens)
    export_to_hf(str(ckpt_dir), str(out))
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        untouched = load(base, torch_dtype=torch.float32).eval()(tokens).logits
        theirs = peft.PeftModel.from_pretrained(load(base, torch_dtype=torch.float32), out).eval()
        torch.testing.assert_close(theirs(tokens).logits, ours, rtol=1e-5, atol=1e-5)
    assert (ours - untouched).abs().max() > 1e-3  # the adapter trained: the check compares something
    return tokens, ours


def write_chats(path: Path, n: int, seed: int, longest_prompt: int, longest_answer: int,
                words: tuple[str, ...]) -> Path:
    """`n` conversations of one user turn of 1 to `longest_prompt` words and an answer of 1 to `longest_answer`,
    drawn from `words` with `seed`: samples of uneven length, written as JSON Lines at `path`."""
    import json
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, longest_prompt)))
            answer = " ".join(rng.choice(words) for _ in range(rng.randint(1, longest_answer)))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path
