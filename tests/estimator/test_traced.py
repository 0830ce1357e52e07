"""The traced estimator's promises: no real memory for big models, any world size on the fake
backend, repeatable in one process. Its accuracy against measured steps, on 1, 2 and 4 gloo
ranks, is tests/estimator/test_accuracy.py's.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from trainfit.config import Config
from trainfit.configure import load_config
from trainfit.memory import PHASES
from trainfit.memory.traced import TimelinePoint
from trainfit.traced import TracedEstimate, trace_step


def _rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS), or its high-water mark (VmHWM), from Linux's /proc."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _can_reset_peak_rss() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK)


@pytest.mark.skipif(not _can_reset_peak_rss(), reason="resets Linux's peak RSS through /proc/self/clear_refs")
def test_a_big_model_is_traced_without_its_memory() -> None:
    """llama3-8b's full width (4096 wide, 128k vocabulary) with 2 of its 32 layers, bf16-mixed, one
    8k sequence: ~1.7 B parameters, ~30 GiB at the peak, in a process that grows by far less. The
    kernel keeps the process's peak resident memory (reset to the current one first), so no moment
    of the trace is missed, however busy the machine."""
    cfg = load_config(None, ["--model.preset=llama3-8b", "--model.num_layers=2", "--hardware.gpu=H100-SXM-80GB",
                             "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
                             "--training.global_batch_size=1", "--memory.activation_checkpointing=selective"])
    before = _rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    est = trace_step(cfg)
    peak_rss = _rss_bytes("VmHWM")
    num_params = 2 * 128256 * 4096 + 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert est.worst.master_params == 4 * num_params  # fp32 masters of every parameter
    assert est.worst.peak > 20 * 2**30
    assert peak_rss - before < 0.5 * 2**30


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


def test_ddp_keeps_states_whole_and_gradients_in_its_buckets() -> None:
    whole = trace_step(_layout(1)).worst
    ddp = trace_step(_layout(4, "--parallel.zero_stage=0")).worst
    assert (ddp.params, ddp.optimizer) == (whole.params, whole.optimizer)
    # gradient_as_bucket_view: the fp32 buckets are the gradients, alive through the forward too,
    # and no second copy of them among the buffers.
    assert ddp.grads == pytest.approx(whole.params, rel=0.01)
    assert ddp.buffers - whole.buffers < 0.01 * whole.params
    zero1 = trace_step(_layout(4, "--parallel.zero_stage=1")).worst
    assert zero1.optimizer < 0.5 * whole.optimizer


def test_zero1_traces_its_engine() -> None:
    """ZeRO-1 (parallel/zero.py) under bf16-mixed on 4 fake ranks: bf16 parameters and gradient
    buffers whole, fp32 master shards (and, once the optimizer is about to step, their fp32
    gradients), a quarter of the optimizer states; its collectives in place add no buffers."""
    whole = trace_step(_layout(1)).worst  # fp32: params = 4 bytes x parameters
    est = trace_step(_layout(4, "--parallel.zero_stage=1", "--precision.mode=bf16-mixed"))
    fp32 = whole.params
    assert est.state_bytes["params"] == fp32 // 2 and est.state_bytes["master_params"] == fp32 // 4
    assert est.state_bytes["grads"] == fp32 // 2 + fp32 // 4
    assert est.state_bytes["optimizer"] == pytest.approx(whole.optimizer / 4, rel=0.01)
    zero1 = est.worst
    assert (zero1.params, zero1.master_params) == (fp32 // 2, fp32 // 4)
    assert zero1.grads >= fp32 // 2  # the buffers exist all step long


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


@pytest.mark.parametrize("routing", ["--model.capacity_factor=0", "--model.capacity_factor=1.0"])
def test_expert_parallelism_is_traced_as_its_busiest_rank(routing: str) -> None:
    """ep2 over 2 ranks (ZeRO-3, the accuracy grid's MoE shape): the dispatch's all-to-alls run on the
    fake backend. Dropless, its routes are routing.expert_parallel_loads' (at the ceiling the rank
    receives both ranks' every pair: more than balanced), which the analytic estimate assumes too;
    capacity fixes them (the imbalance changes nothing). The rank holds half the experts' states."""
    from _analytic import memory_of, states_of

    def config(imbalance: str) -> Config:
        return load_config(None, ["--model.preset=debug-moe", "--model.dim=128", "--model.expert_ffn_dim=128",
                                  "--model.vocab_size=512", "--model.max_seq_len=256",
                                  "--hardware.num_gpus=2", "--parallel.ep=2", "--parallel.zero_stage=3",
                                  "--training.micro_batch_size=4", "--training.seq_len=256",
                                  f"--memory.moe_imbalance={imbalance}", routing])

    ceiling, balanced = trace_step(config("inf")), trace_step(config("1"))
    assert (ceiling.worst.peak > balanced.worst.peak) == routing.endswith("=0")
    assert sum(ceiling.state_bytes.values()) == states_of(config("inf")).model_states
    assert ceiling.worst.peak == pytest.approx(memory_of(config("inf")).worst.peak, rel=0.01)


def test_moe_pipeline_stages_are_traced() -> None:
    """debug-moe on 2 pipeline stages (FSDP2 per stage): the pipeline axis is sliced from the mesh once,
    outside the fake tensors (a slice taken inside them computed its coordinates from fake values and
    failed), so each stage's step is traced."""
    cfg = load_config(None, ["--model.preset=debug-moe", "--hardware.num_gpus=2", "--parallel.pp=2",
                             "--parallel.zero_stage=3", "--training.global_batch_size=16"])
    traced = trace_step(cfg)
    assert len(traced.per_stage) == 2 and all(stage.peak > 0 for stage in traced.per_stage)


def _allocations(timeline: list[TimelinePoint]) -> list[tuple[int, str, str]]:
    """The in-use bytes, phase and module of a timeline wherever one of them changes: the same for
    two traces of one step whatever operators that allocate nothing each counted (`.device`
    queries, which depend on what torch's caches saw before: traced._trace_key)."""
    points = [(total, phase, module) for _, total, phase, module in timeline]
    return [point for i, point in enumerate(points) if i == 0 or point != points[i - 1]]


@pytest.mark.parametrize(("extra", "num_traced"), [
    # ranks 1 and 2 alike: two blocks each
    (("--model.num_layers=6", "--parallel.pp_layers_per_stage=1,2,2,1", "--parallel.zero_stage=3"), 3),
    # three blocks each, but blocks 1-3 and 4-6 are checkpointed every other one from a different start
    (("--parallel.pp_layers_per_stage=1,3,3,1", "--memory.activation_checkpointing=full",
      "--memory.ac_every_n_layers=2"), 4),
], ids=["alike-middle-ranks", "checkpointed-differently"])
def test_a_fill_drain_pipeline_traces_each_rank_shape_once(extra: tuple[str, ...], num_traced: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe on 4 pipeline ranks: ranks that hold alike stages are traced once, and every rank's
    figures are those of its own trace, byte for byte."""
    import trainfit.traced as traced_module

    cfg = load_config(None, ["--model.preset=debug", "--model.num_layers=8", "--hardware.num_gpus=4",
                             "--parallel.pp=4", "--parallel.pp_schedule=gpipe", "--training.seq_len=64",
                             "--training.micro_batch_size=1", "--training.global_batch_size=4", *extra])
    trace_rank = traced_module._trace_rank
    calls: list[int] = []
    monkeypatch.setattr(traced_module, "_trace_rank", lambda *args: calls.append(args[2]) or trace_rank(*args))
    est = trace_step(cfg)
    assert len(calls) == num_traced
    layout = traced_module.trainable(traced_module.build_layout(cfg))
    own = [trace_rank(cfg, layout, pp_rank) for pp_rank in range(4)]
    assert est.per_stage == [trace.breakdown for trace in own]
    worst = own[est.worst_stage]
    assert (_allocations(est.timeline), est.peak_module) == (_allocations(worst.timeline), worst.peak_module)
    if num_traced == 4:
        assert own[1].breakdown != own[2].breakdown


def test_a_1f1b_pipeline_traces_every_rank() -> None:
    """1F1B: a rank's place decides its warm-up (pp - rank - 1 forwards in flight), so ranks with
    alike stages differ and each is traced."""
    cfg = load_config(None, ["--model.preset=debug", "--model.num_layers=6", "--hardware.num_gpus=4",
                             "--parallel.pp=4", "--parallel.pp_layers_per_stage=1,2,2,1", "--training.seq_len=64",
                             "--training.micro_batch_size=1", "--training.global_batch_size=4"])
    peaks = [stage.peak for stage in trace_step(cfg).per_stage]
    assert peaks[1] != peaks[2]
