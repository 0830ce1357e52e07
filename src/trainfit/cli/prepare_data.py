"""`trainfit prepare-data`: tokenize text into memmap token shards with a manifest."""

from __future__ import annotations

import argparse

from trainfit.cli.common import reject_overrides


def cmd_prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.data import prepare_data
    from trainfit.train.samples import template_folders

    reject_overrides(overrides)
    manifest = prepare_data(args.input, args.out, tokenizer=args.tokenizer,
                            bpe_vocab_size=args.bpe_vocab_size, val_fraction=args.val_fraction, fmt=args.format,
                            chat_template=args.chat_template, loss_on=args.loss_on,
                            template_folders=template_folders(args.tokenizer, args.model_folder))
    counts = ", ".join(f"{k}: {v:,}" for k, v in manifest["num_tokens"].items())
    samples = ""
    if "num_samples" in manifest:
        samples = "; samples " + ", ".join(f"{k}: {v:,}" for k, v in manifest["num_samples"].items()) + \
            ", trained tokens " + ", ".join(f"{k}: {v:,}" for k, v in manifest["trained_tokens"].items()) + \
            f" (data.loss_on={manifest['loss_on']}, template: {manifest['chat_template'] or 'none'})"
    print(f"wrote {args.out} ({manifest['tokenizer']['name']}, vocab {manifest['vocab_size']:,}, "
          f"{manifest['dtype']}; tokens {counts}{samples})")
    return 0
