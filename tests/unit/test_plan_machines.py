"""plan/machines.py: which device, how many, at what cost (`trainfit plan --tokens`)."""

from __future__ import annotations

import pytest

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.hardware import PRICE_PER_GPU_HOUR
from trainfit.plan.machines import check_gpus, compare_machines, gpu_counts, on_cost_frontier, parse_prices
from trainfit.plan.search import search
from trainfit.plan.space import replace_sections

LLAMA8B = ("--model.preset=llama3-8b", "--training.seq_len=8192", "--training.global_batch_size=64")


def test_counts_are_the_powers_of_two_of_a_node_then_whole_nodes_doubling() -> None:
    assert gpu_counts(8, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert gpu_counts(8, 4) == [1, 2, 4]
    assert gpu_counts(6, 30) == [1, 2, 6, 12, 24]


def test_each_option_is_the_plan_of_that_cluster_with_its_time_and_cost() -> None:
    cfg = load_config(None, list(LLAMA8B))
    fixed = frozenset(a[2:].split("=")[0] for a in LLAMA8B)
    options = compare_machines(cfg, fixed, tokens=1e11, gpus=["H100-SXM-80GB", "A100-SXM-80GB"], max_gpus=16,
                               prices={"A100-SXM-80GB": 1.5})
    assert len(options) == 2 * 5
    times = [o.seconds for o in options if o.seconds is not None]
    assert times == sorted(times)
    for o in options[:4]:
        cluster = replace_sections(cfg, hardware={"gpu": o.gpu, "num_gpus": o.num_gpus})
        expected = search(cluster, fixed, top=1).candidates[0]
        assert o.candidate is not None and o.candidate.settings() == expected.settings()
        assert o.seconds == pytest.approx(1e11 / expected.tokens_per_second)
        price = 1.5 if o.gpu == "A100-SXM-80GB" else PRICE_PER_GPU_HOUR["H100-SXM-80GB"]
        assert o.cost == pytest.approx(o.seconds / 3600 * o.num_gpus * price)
    flags = on_cost_frontier(options)
    assert flags[0]  # the fastest priced option starts the frontier
    costs = [o.cost for o, flag in zip(options, flags, strict=True) if flag]
    assert costs == sorted(costs, reverse=True)  # each frontier row cheaper than the faster ones


def test_prices_and_devices_are_checked() -> None:
    assert parse_prices("H100-SXM-80GB=2.5,MI300X=2") == {"H100-SXM-80GB": 2.5, "MI300X": 2.0}
    for bad, words in (("H300=2", "unknown device"), ("MI300X=cheap", "DEVICE=USD"), ("MI300X=0", "> 0")):
        with pytest.raises(ConfigError, match=words):
            parse_prices(bad)


def test_the_newer_devices_are_plan_options() -> None:
    names = ["B200", "GB200", "B300", "H800-SXM-80GB", "MI325X", "L4", "RTX-A6000"]
    assert check_gpus(names) == names


def test_short_device_names_mean_their_catalog_entries() -> None:
    """`--gpu-options H100-SXM-80GB,A100-SXM-80GB,H200,MI300X` as people write it."""
    assert check_gpus(["H200", "H100", "A100", "MI300X"]) == ["H200-141GB", "H100-SXM-80GB", "A100-SXM-80GB", "MI300X"]
    assert parse_prices("H200=3.5") == {"H200-141GB": 3.5}
    assert load_config(None, [*LLAMA8B, "--hardware.gpu=H200"]).hardware.gpu == "H200-141GB"
    with pytest.raises(ConfigError, match=r"--gpu-options 'H300': unknown device; choose among .*\(or H100, H200"):
        check_gpus(["H300"])
