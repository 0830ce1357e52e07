"""What `trainfit estimate --json` prints for a config, built once: the command and the web page
(trainfit serve) both answer with this, so the page's numbers are the command's."""

from __future__ import annotations

from typing import Any

from trainfit.config import Config
from trainfit.estimate import Estimate, as_json, estimate


def estimate_answer(cfg: Config, est: Estimate | None = None) -> dict[str, Any]:
    """The analytic estimate of a validated config as JSON, with, when it does not fit, the fewest
    changes that fit (each with its memory and speed) and the changes of method (LoRA, QLoRA)."""
    from trainfit.plan.fixes import fewest_changes, method_changes
    from trainfit.plan.space import with_global_batch

    est = est or estimate(cfg)
    out = as_json(est)
    out["warnings"] = list(est.layout.ineffective_options())
    if est.fits:
        return out
    # the fixes keep the global batch: when it is 0, the one this config's run derives (named in the output)
    fixable, batch = with_global_batch(cfg)
    out["fixes"] = [{"changes": list(f.changes), "memory_bytes": f.candidate.memory_bytes,
                     "tokens_per_second": f.candidate.tokens_per_second, "mfu": f.candidate.mfu}
                    for f in fewest_changes(fixable)]
    out["fixes_global_batch"] = batch.as_dict()
    out["method_changes"] = [{"changes": list(f.changes), "memory_bytes": f.candidate.memory_bytes,
                              "tokens_per_second": f.candidate.tokens_per_second}
                             for f in method_changes(fixable)]
    return out
