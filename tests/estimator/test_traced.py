"""The traced estimator (memory/traced.py) against real CPU steps measured at the allocator
(memory/attribution.py), and its promises: no real memory for big models, any world size on the
fake backend, repeatable in one process.

Ground truth on CPU: the step's growth in glibc's in-use bytes on top of the tensors alive at its
start. What no tensor explains (autograd's graph objects, tensor headers: ~0.1-0.3 MiB on these
models) is the measured side's extra, so models are sized for peaks of 20-50 MiB.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainfit.config import Config, load_config
from trainfit.memory.attribution import Measurement, measure_step
from trainfit.memory.breakdown import COMPONENTS, PHASES
from trainfit.memory.traced import TracedEstimate, trace_step

MiB = 2**20
PEAK_TOLERANCE = 0.03
COMPONENT_TOLERANCE = 0.02
"""Per component, as a fraction of the measured peak (buffers, the measured residual, excepted)."""

_SHAPE = ["--model.dim=128", "--model.vocab_size=512", "--model.max_seq_len=256", "--training.seq_len=256",
          "--training.micro_batch_size=4", "--training.global_batch_size=4"]
LLAMA = ["--model.preset=debug", "--model.ffn_dim=384", *_SHAPE]
MOE = ["--model.preset=debug-moe", "--model.expert_ffn_dim=128", *_SHAPE]
GPT2 = ["--model.preset=debug-gpt2", "--model.ffn_dim=512", *_SHAPE]


def _p(name: str, *overrides: str) -> object:
    return pytest.param(list(overrides), id=name)


GRID = [
    _p("llama-fp32", *LLAMA),
    _p("llama-bf16-mixed", *LLAMA, "--precision.mode=bf16-mixed"),
    _p("llama-fp16-mixed", *LLAMA, "--precision.mode=fp16-mixed"),
    _p("llama-bf16-pure", *LLAMA, "--precision.mode=bf16-pure"),
    _p("llama-selective", *LLAMA, "--memory.activation_checkpointing=selective"),
    _p("llama-full", *LLAMA, "--memory.activation_checkpointing=full"),
    _p("llama-bf16-mixed-selective", *LLAMA, "--precision.mode=bf16-mixed",
       "--memory.activation_checkpointing=selective"),
    _p("llama-bf16-mixed-full", *LLAMA, "--precision.mode=bf16-mixed", "--memory.activation_checkpointing=full"),
    _p("llama-fp16-selective-sgd", *LLAMA, "--precision.mode=fp16-mixed", "--memory.activation_checkpointing=selective",
       "--optimizer.name=sgd"),
    _p("llama-sgd", *LLAMA, "--optimizer.name=sgd"),
    _p("llama-adam", *LLAMA, "--optimizer.name=adam"),
    _p("llama-bf16-pure-full-sgd", *LLAMA, "--precision.mode=bf16-pure", "--memory.activation_checkpointing=full",
       "--optimizer.name=sgd"),
    _p("llama-accumulation", *LLAMA, "--training.micro_batch_size=2", "--training.global_batch_size=4"),
    _p("llama-seq64-micro8", *LLAMA, "--training.seq_len=64", "--training.micro_batch_size=8",
       "--training.global_batch_size=8"),
    _p("llama-3-layers-full-every-2", *LLAMA, "--model.num_layers=3", "--memory.activation_checkpointing=full",
       "--memory.ac_every_n_layers=2"),
    _p("moe-fp32", *MOE),
    _p("moe-bf16-mixed", *MOE, "--precision.mode=bf16-mixed"),
    _p("moe-bf16-pure-selective", *MOE, "--precision.mode=bf16-pure", "--memory.activation_checkpointing=selective"),
    _p("moe-full-sgd", *MOE, "--memory.activation_checkpointing=full", "--optimizer.name=sgd"),
    _p("gpt2-fp32", *GPT2),
    _p("gpt2-bf16-mixed", *GPT2, "--precision.mode=bf16-mixed"),
    _p("gpt2-selective", *GPT2, "--memory.activation_checkpointing=selective"),
    _p("gpt2-fp16-full", *GPT2, "--precision.mode=fp16-mixed", "--memory.activation_checkpointing=full"),
]


def run_config(tmp: Path, *overrides: str) -> Config:
    """A quiet CPU run writing only under `tmp`."""
    base = ["--training.eval_interval=0", "--checkpoint.interval=0", "--checkpoint.resume=never",
            f"--checkpoint.dir={tmp / 'ckpt'}", f"--logging.dir={tmp / 'logs'}", "--logging.progress=false",
            "--training.device=cpu"]
    return load_config(None, [*base, *overrides])


def measure(cfg: Config) -> Measurement:
    """measure_step; for MoE in 16 bits without oneDNN, which caches a kernel (with workspace) per
    new matmul shape: routing changes the shapes every step, so the cache grows mid-step on CPU.
    A GPU has no such cache and the estimator does not model it."""
    if not (cfg.model.num_experts and cfg.precision.mode != "fp32"):
        return measure_step(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flags() re-sets oneDNN's TF32 switch, which warns on CPU
        with torch.backends.mkldnn.flags(enabled=False):
            return measure_step(cfg)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny CPU steps gain nothing from a second intra-op thread, and on a shared 2-core machine
    its spin-waiting costs several times the work (memory figures do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def warm_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first step of a process allocates for good (imports, thread pools, library tables)."""
    measure(run_config(tmp_path_factory.mktemp("warm"), *LLAMA))


@pytest.mark.parametrize("overrides", GRID)
def test_traced_peak_and_components_match_a_measured_step(overrides: list[str], tmp_path: Path,
                                                          warm_process: None) -> None:
    traced = trace_step(run_config(tmp_path, *overrides)).worst
    measured = measure(run_config(tmp_path, *overrides)).breakdown
    error = traced.peak / measured.peak - 1
    assert abs(error) <= PEAK_TOLERANCE, f"traced {traced.peak / MiB:.2f} MiB, measured {measured.peak / MiB:.2f}"
    assert traced.peak_phase == measured.peak_phase
    for name in COMPONENTS:
        if name != "buffers":
            ours, theirs = getattr(traced, name), getattr(measured, name)
            assert abs(ours - theirs) <= COMPONENT_TOLERANCE * measured.peak, f"{name}: {ours} vs {theirs}"
    assert 0 <= measured.buffers - traced.buffers <= PEAK_TOLERANCE * measured.peak


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_a_big_model_is_traced_without_its_memory() -> None:
    """llama3-8b's full width (4096 wide, 128k vocabulary) with 2 of its 32 layers, bf16-mixed, one
    8k sequence: ~1.7 B parameters, ~30 GiB at the peak, in a process that grows by far less."""
    cfg = load_config(None, ["--model.preset=llama3-8b", "--model.num_layers=2", "--hardware.gpu=H100-SXM-80GB",
                             "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
                             "--training.global_batch_size=1", "--memory.activation_checkpointing=selective"])
    before, peak_rss, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_rss[0] = max(peak_rss[0], _rss_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        est = trace_step(cfg)
    finally:
        done.set()
        sampler.join()
    num_params = 2 * 128256 * 4096 + 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert est.worst.master_params == 4 * num_params  # fp32 masters of every parameter
    assert est.worst.peak > 20 * 2**30
    assert peak_rss[0] - before < 0.5 * 2**30


def _layout(num_gpus: int, *extra: str) -> Config:
    return load_config(None, ["--model.preset=debug", "--training.seq_len=64", "--training.micro_batch_size=2",
                              f"--training.global_batch_size={2 * num_gpus}", f"--hardware.num_gpus={num_gpus}",
                              *extra])


def test_zero3_on_the_fake_backend_shards_model_states_per_rank() -> None:
    whole = trace_step(_layout(1)).worst
    sharded = trace_step(_layout(8, "--parallel.zero_stage=3")).worst
    assert not dist.is_initialized()
    for name in ("params", "optimizer"):
        assert getattr(sharded, name) == pytest.approx(getattr(whole, name) / 8, rel=0.05)
    mixed = trace_step(_layout(8, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed")).worst
    assert mixed.master_params == pytest.approx(whole.params / 8, rel=0.05)


def test_ddp_keeps_states_whole_and_adds_gradient_buckets() -> None:
    whole = trace_step(_layout(1)).worst
    ddp = trace_step(_layout(4, "--parallel.zero_stage=0")).worst
    assert (ddp.params, ddp.optimizer) == (whole.params, whole.optimizer)
    assert ddp.buffers - whole.buffers == pytest.approx(whole.params, rel=0.01)  # fp32 buckets of every gradient
    zero1 = trace_step(_layout(4, "--parallel.zero_stage=1")).worst
    assert zero1.optimizer < 0.5 * whole.optimizer


def test_cpu_offload_keeps_model_states_off_the_device() -> None:
    on_device = trace_step(_layout(2, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed")).worst
    offloaded = trace_step(_layout(2, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed",
                                   "--memory.offload=optimizer")).worst
    assert offloaded.master_params == offloaded.grads == offloaded.optimizer == 0
    assert offloaded.activations == on_device.activations
    assert offloaded.peak == on_device.peak - on_device.master_params - on_device.optimizer - on_device.grads


def test_tracing_twice_in_one_process_gives_the_same_answer() -> None:
    cfg = _layout(4, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed")
    first, second = trace_step(cfg), trace_step(cfg)
    assert not dist.is_initialized()
    assert first.worst == second.worst and first.timeline == second.timeline


def test_timeline_runs_through_the_phases_and_holds_the_peak() -> None:
    est: TracedEstimate = trace_step(_layout(2, "--parallel.zero_stage=3", "--training.micro_batch_size=1"))
    phases = [phase for _, _, phase, _ in est.timeline]
    order = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert order == ["forward", "backward", "forward", "backward", "optimizer"]  # two micro-batches
    worst = est.worst
    assert max(b for _, b, _, _ in est.timeline) == worst.peak
    assert set(worst.phase_peaks) == set(PHASES) and max(worst.phase_peaks.values()) == worst.peak
    assert sum(worst.components().values()) == worst.peak
    assert est.peak_module and est.seconds > 0 and est.peak_rss_bytes > 0
