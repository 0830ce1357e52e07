"""`trainfit export`: write a checkpoint's weights as Hugging Face safetensors and config.json."""

from __future__ import annotations

import argparse

from trainfit.cli.common import reject_overrides


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.sample import export_to_hf

    reject_overrides(overrides)
    out = export_to_hf(args.checkpoint, args.out, force=args.force, merge=args.merge)
    if (out / "adapter_config.json").exists():
        print(f"wrote {out}/adapter_model.safetensors and adapter_config.json (peft: PeftModel.from_pretrained "
              "on the base's transformers model; --merge writes the merged weights instead)")
    else:
        print(f"wrote {out}/model.safetensors and config.json (transformers: AutoModelForCausalLM.from_pretrained)")
    return 0
