"""`trainfit sample`: generate text from a trained checkpoint."""

from __future__ import annotations

import argparse

from trainfit.cli.common import reject_overrides
from trainfit.config import ConfigError


def cmd_sample(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.sample import sample_from_checkpoint

    reject_overrides(overrides)
    _check_sampling(args)
    if args.system and args.chat is None:
        raise ConfigError("--system: a system message goes with --chat MESSAGE; give the user's message too")
    text = sample_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, seed=args.seed, chat=args.chat,
                                  system=tuple(args.system))
    print(text)
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """`trainfit sample`'s own options, before the checkpoint is loaded."""
    if args.prompt == "":
        raise ConfigError("--prompt '': give some text to continue (the default is a newline)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy, 0.8 = default)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 0 (0 keeps every token)")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed {args.seed}: must be between 0 and 2**63 - 1")
