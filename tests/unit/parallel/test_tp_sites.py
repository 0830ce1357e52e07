"""parallel/tp_sites.py: the one description of what tensor parallelism touches, which the DTensor plan
(parallel/tensor_parallel.py) and the priced collectives (parallel/collectives.py) both read."""

from __future__ import annotations

import pytest
import torch

from trainfit.configure import load_config
from trainfit.models import build_model
from trainfit.models.architecture import describe
from trainfit.parallel import tensor_parallel
from trainfit.parallel.tp_sites import block_sites, root_sites

PRESETS = ["debug", "debug-moe", "gpt2", "qwen3-0.6b", "gemma-2-2b", "olmo-2-7b", "phi-3-mini"]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_site_is_a_module_of_the_model_and_the_plan_lays_out_each(preset: str, sp: bool) -> None:
    cfg = load_config(None, [f"--model.preset={preset}", "--model.num_layers=2"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    block = next(iter(dict(model.layers.named_children()).values()))
    modules = dict(block.named_modules())
    sites = block_sites(cfg, sp)
    assert all(site.path in modules for site in sites), [s.path for s in sites if s.path not in modules]
    assert set(tensor_parallel.block_plan(cfg, block, sp)) == {site.path for site in sites}
    # each column-parallel linear sits under a branch whose input the plan lays out once
    branches = {site.path for site in sites if site.style == "branch_input"}
    assert all(site.path.split(".")[0] in branches for site in sites if site.style == "colwise")
    root = [s for s in root_sites(cfg, sp) if s.style != "loss"]
    assert set(tensor_parallel.root_plan(model, sp)) == {s.path for s in root}
    assert all(getattr(model, s.path) is not None for s in root)


@pytest.mark.parametrize("preset", PRESETS)
def test_partial_gains_are_the_norms_that_compute_on_part_of_a_tensor(preset: str) -> None:
    """Under SP every norm on the stream (two per layer, four sandwiched) and the final norm compute on the
    rank's tokens; QK-norm on its heads with or without SP."""
    cfg = load_config(None, [f"--model.preset={preset}"]).model
    layer = describe(cfg).block
    per_norm = layer.norm.params(cfg.dim) // cfg.dim
    qk = 2 if layer.attention.qk_norm else 0
    for sp in (False, True):
        block = {g: sum(s.partial_gains for s in block_sites(cfg, sp) if s.gain_tensor == g)
                 for g in ("norm_gain", "qk_norm_gain")}
        root = sum(s.partial_gains for s in root_sites(cfg, sp))
        assert block == {"norm_gain": layer.stream_norms * per_norm if sp else 0, "qk_norm_gain": qk}
        assert root == (per_norm if sp else 0)
