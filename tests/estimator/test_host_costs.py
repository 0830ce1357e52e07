"""The host side of a GPU step (perf/host_costs.py) and how the time model waits on it (perf/timing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.parallel.resolve import build_layout
from trainfit.perf.engines import Engine
from trainfit.perf.host_costs import NO_ENGINE_HOST, TRAINFIT, HostCosts

ENGINE = HostCosts("test", {("eager", 1): (1e-3, 2e-3), ("sequence_parallel", 2): (3e-3, 5e-3),
                            ("sequence_parallel", 8): (4e-3, 7e-3), ("fully_shard", 8): (0.5e-3, 1e-3)},
                   rest_s=(2e-3, 4e-3), boundary_s={2: 10e-3, 8: 50e-3})


def _layout(*args: str):
    cfg = load_config(None, ["--model.preset=", "--model.family=llama", "--model.num_layers=8", "--model.dim=1024",
                             "--model.num_heads=16", "--model.num_kv_heads=16", "--model.ffn_dim=4096",
                             "--model.vocab_size=32768", "--model.max_seq_len=2048", "--training.seq_len=2048",
                             "--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed", *args])
    return cfg, build_layout(cfg)


def test_a_step_holds_each_blocks_host_work_every_micro_batch() -> None:
    """Blocks x (forward + backward) + the rest, times the micro-batches; a checkpointed block's forward twice."""
    _, plain = _layout("--training.micro_batch_size=1", "--training.global_batch_size=4")
    assert plain.num_microbatches == 4
    assert ENGINE.step_seconds(plain) == pytest.approx(4 * (8 * 3e-3 + 6e-3))
    _, wrapped = _layout("--training.micro_batch_size=1", "--training.global_batch_size=4",
                         "--memory.activation_checkpointing=full")
    assert ENGINE.step_seconds(wrapped) == pytest.approx(4 * (8 * (3e-3 + 1e-3) + 6e-3))
    _, compiled = _layout("--training.micro_batch_size=1", "--training.global_batch_size=4", "--training.compile=true")
    assert ENGINE.step_seconds(compiled) == pytest.approx(4 * 6e-3)  # a compiled block only launches kernels


def test_tensor_parallel_fsdp_and_pipeline_ranks_add_their_frameworks() -> None:
    """The nearest measured tp degree (4 takes 2's or 8's, whichever is nearer by ratio: a tie takes the first);
    FSDP2's hooks on top; a pipeline rank its own blocks and its boundaries' figure."""
    _, tp4 = _layout("--hardware.num_gpus=4", "--parallel.tp=4", "--parallel.sequence_parallel=true",
                     "--training.micro_batch_size=1", "--training.global_batch_size=1")
    assert ENGINE.block(tp4) in ((3e-3, 5e-3), (4e-3, 7e-3))
    _, tp8 = _layout("--hardware.num_gpus=8", "--parallel.tp=8", "--parallel.sequence_parallel=true",
                     "--training.micro_batch_size=1", "--training.global_batch_size=1")
    assert ENGINE.block(tp8) == (4e-3, 7e-3)
    _, fsdp = _layout("--hardware.num_gpus=8", "--parallel.zero_stage=3", "--training.micro_batch_size=1",
                      "--training.global_batch_size=8")
    assert ENGINE.block(fsdp) == pytest.approx((1.5e-3, 3e-3))
    _, staged = _layout("--hardware.num_gpus=4", "--parallel.pp=2", "--parallel.tp=2",
                        "--parallel.sequence_parallel=true", "--training.micro_batch_size=1",
                        "--training.global_batch_size=4")
    # each rank its own blocks (the split gives the head's stage fewer), the head's rest on the last stage,
    # the boundaries' figure on every rank; the busiest sets the step
    ranks = [blocks * 8e-3 + last * 6e-3 + 10e-3 for blocks, _, last in staged.rank_shapes()]
    assert len(ranks) == 2 and ENGINE.step_seconds(staged) == pytest.approx(4 * max(ranks))
    assert NO_ENGINE_HOST.step_seconds(staged) == 0.0


def test_a_gpu_waits_on_the_host_only_where_it_exceeds_the_device() -> None:
    """Small micro-batches at tp 8: the host's work per block outlasts each rank's GEMMs and the step
    follows the host; a large micro-batch hides it. Without an engine host side the step is the device's."""
    args = ("--hardware.num_gpus=8", "--parallel.tp=8", "--parallel.sequence_parallel=true",
            "--training.global_batch_size=64")
    cfg, _ = _layout(*args, "--training.micro_batch_size=1")
    small, bare = estimate(cfg).perf.time, estimate(cfg, engine=Engine("bare", NO_ENGINE_HOST)).perf.time
    host = TRAINFIT.step_seconds(estimate(cfg).layout)
    assert bare["exposed_host_s"] == 0.0
    assert small["exposed_host_s"] == pytest.approx(host - small["compute_s"] - small["exposed_comm_s"])
    assert small["step_time_s"] == pytest.approx(bare["step_time_s"] + small["exposed_host_s"])
    cfg, _ = _layout(*args, "--training.micro_batch_size=64", "--model.max_seq_len=4096", "--training.seq_len=4096")
    assert estimate(cfg).perf.time["exposed_host_s"] == 0.0


def test_the_host_time_benchmark_measures_a_block() -> None:
    """benchmarks/host_time.py (which measured TRAINFIT) still runs: one kind, few repeats; the figures are
    durations (the benchmark's timing is not asserted: a busy machine moves it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import host_time

    block_f, block_b, rest_f, rest_b = host_time.measure("eager", 1, [], repeats=4)
    assert all(isinstance(x, float) for x in (block_f, block_b, rest_f, rest_b))
    assert block_f + block_b > 0  # eight more blocks take longer
