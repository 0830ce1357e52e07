"""`trainfit prepare-data`: tokenize text into memmap token shards with a manifest."""

from __future__ import annotations

import argparse

from trainfit.cli.common import reject_overrides


def cmd_prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.data import prepare_data

    reject_overrides(overrides)
    manifest = prepare_data(args.input, args.out, tokenizer=args.tokenizer,
                            bpe_vocab_size=args.bpe_vocab_size, val_fraction=args.val_fraction)
    counts = ", ".join(f"{k}: {v:,}" for k, v in manifest["num_tokens"].items())
    print(f"wrote {args.out} ({manifest['tokenizer']['name']}, vocab {manifest['vocab_size']:,}, "
          f"{manifest['dtype']}; tokens {counts})")
    return 0
