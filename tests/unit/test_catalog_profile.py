"""`trainfit calibrate --catalog GPU`: a catalog GPU's published kernel figures as a hardware profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainfit.calibrate.catalog import catalog_profile
from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.hardware_profile import load_profile
from trainfit.perf import gpu_kernels as GK

LAYOUTS = [
    ("--model.preset=llama3-8b", "--hardware.num_gpus=8", "--parallel.zero_stage=3", "--training.seq_len=8192",
     "--training.micro_batch_size=1", "--training.global_batch_size=8"),
    ("--model.preset=llama3-70b", "--hardware.num_gpus=64", "--parallel.tp=8", "--parallel.zero_stage=3",
     "--training.seq_len=4096", "--training.micro_batch_size=1", "--training.global_batch_size=64",
     "--memory.activation_checkpointing=full"),
    ("--model.preset=llama3-8b", "--training.seq_len=2048", "--training.micro_batch_size=1",
     "--training.global_batch_size=1", "--precision.mode=fp8-mixed", "--training.compile=true"),
]


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("catalog") / "h100.toml"
    proc = subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--catalog", "H100-SXM-80GB", "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_file_names_its_sources_and_loads_as_a_profile(h100: Path) -> None:
    text = h100.read_text()
    assert "MAMF table (H100 SXM)" in text and "FlashAttention-3" in text and "not" in text.splitlines()[0]
    profile = load_profile(str(h100))
    assert profile.machine.device == "cuda" and profile.matmul_flops_per_s["bf16"] <= GK.KERNELS[
        "H100-SXM-80GB"].mamf["bf16"]
    assert {"fp32", "bf16", "fp16", "fp8"} <= set(profile.matmul_flops_per_s)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_estimates_on_it_follow_the_catalogs(h100: Path, layout: tuple[str, ...]) -> None:
    """Priced at the nearest written shape, a step's compute stays within 5% of the catalog's own pricing."""
    base = ("--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed", *layout)
    catalog = estimate(load_config(None, list(base))).perf.time
    profiled = estimate(load_config(None, [*base, f"--hardware.profile={h100}"])).perf.time
    assert profiled["compute_s"] == pytest.approx(catalog["compute_s"], rel=0.05)
    assert profiled["step_time_s"] == pytest.approx(catalog["step_time_s"], rel=0.05)


def test_a_device_without_fp8_writes_none_and_a_wrong_name_is_named() -> None:
    assert "fp8" not in catalog_profile("A100-SXM-80GB").matmul_flops_per_s
    with pytest.raises(ConfigError, match=r"--catalog 'H100'.*H100-SXM-80GB"):
        catalog_profile("H100")
