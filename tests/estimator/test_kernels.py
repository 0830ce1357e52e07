"""trainfit.perf.kernels: the elementwise bytes it counts against what a real step moves, and how a
measured profile's rates price a layout's compute."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from _profiles import profile
from trainfit.configure import load_config
from trainfit.hardware import device_type
from trainfit.hardware_profile import (
    AttentionShape,
    Concurrency,
    HardwareProfile,
    HostOverhead,
    MatmulBackward,
    MatmulShape,
    write_profile,
)
from trainfit.models import build_model, materialize
from trainfit.parallel.resolve import build_layout
from trainfit.perf import kernels as K
from trainfit.perf import timing
from trainfit.train.loss import cross_entropy

# Work that is not elementwise: priced by FLOPs (matmuls, the attention kernel) or not at all (lookups).
NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward", "embedding", "embedding_dense_backward"}


class ElementwiseBytes(TorchDispatchMode):
    """Bytes every other op reads and writes; views (outputs sharing an input's storage) move none."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in NOT_ELEMENTWISE:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        written = [t for t in outputs if t.untyped_storage().data_ptr() not in storages]
        if outputs and not written and not func.overloadpacket.__name__.endswith("_"):
            return out
        self.bytes += sum(t.numel() * t.element_size() for t in (*inputs, *written))
        return out


def step_bytes(*args: str) -> tuple[int, int]:
    """(counted, predicted) elementwise bytes of one forward and backward of a small Llama on one process."""
    cfg = load_config(None, ["--model.preset=", "--model.family=llama", "--model.num_layers=2",
                             "--model.vocab_size=512", "--model.max_seq_len=256", "--training.seq_len=256",
                             "--training.micro_batch_size=4", "--training.global_batch_size=4", *args])
    layout = build_layout(cfg, world_size=1)
    torch.manual_seed(0)
    model = materialize(build_model(cfg.model), "cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 256))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision.mode == "bf16-mixed")
    with ElementwiseBytes() as counter:
        with autocast:
            logits = model(tokens)
        cross_entropy(logits, tokens).backward()
    return counter.bytes, sum(K.elementwise_bytes(cfg.model, layout, cfg.training))


@pytest.mark.parametrize("shape", [
    ("--model.dim=128", "--model.num_heads=4", "--model.num_kv_heads=2", "--model.ffn_dim=384"),
    ("--model.dim=256", "--model.num_heads=8", "--model.num_kv_heads=8", "--model.ffn_dim=1024"),
])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_elementwise_bytes_are_what_a_step_moves(shape: tuple[str, ...], precision: str) -> None:
    counted, predicted = step_bytes(*shape, f"--precision.mode={precision}")
    assert predicted == pytest.approx(counted, rel=0.1)


def test_a_compiled_block_moves_each_fused_chains_inputs_and_outputs_once() -> None:
    """training.compile: a block's elementwise bytes are the fused kernels' (17 per model dimension, 4 per
    query and key/value dimension, 8 per hidden unit, against eager's 83, 24 and 14); the output layer's
    and the loss's stay eager."""
    cfg = load_config(None, ["--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB",
                             "--precision.mode=bf16-mixed", "--training.seq_len=4096",
                             "--training.micro_batch_size=1", "--training.global_batch_size=1"])
    eager = build_layout(cfg)
    compiled = dataclasses.replace(eager, compile=True)
    m, tokens = cfg.model, 4096
    stream, inner = eager.stream_bytes, 2
    head_dim = m.dim // m.num_heads

    def block(d: int, rope: int, ffn: int) -> float:
        return (d * m.dim * stream + rope * (m.num_heads + m.num_kv_heads) * head_dim * inner
                + ffn * m.ffn_dim * inner) * m.num_layers * tokens

    saved = sum(K.elementwise_bytes(m, eager, cfg.training)) - sum(K.elementwise_bytes(m, compiled, cfg.training))
    assert saved == pytest.approx(block(83, 24, 14) - block(17, 4, 8))


class KernelCount(TorchDispatchMode):
    """Operators that launch a kernel: they write a new storage, or one of their inputs in place (views
    and other metadata-only operators launch none)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable or any(id(t.untyped_storage()) not in inputs for t in outputs):
            self.count += 1
        return out


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "eager"), ("bf16-mixed", "autocast")])
def test_kernel_launches_are_what_a_step_launches(precision: str, mode: str) -> None:
    """K.LAUNCHES_BLOCK and LAUNCHES_REST against a dispatcher count of 2- and 4-block models' forward and
    backward: the 2 blocks' difference is two blocks', the rest what remains."""
    counts = {}
    for layers in (2, 4):
        cfg = load_config(None, ["--model.preset=tiny", f"--model.num_layers={layers}", f"--precision.mode={precision}",
                                 "--training.seq_len=64", "--training.micro_batch_size=2",
                                 "--training.global_batch_size=2"])
        model = materialize(build_model(cfg.model), "cpu")
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 64))
        with KernelCount() as forward:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                logits = model(tokens)
            loss = cross_entropy(logits, tokens)
        with KernelCount() as backward:
            loss.backward()
        counts[layers] = (forward.count, backward.count)
    block = [(counts[4][i] - counts[2][i]) / 2 for i in (0, 1)]
    rest = [counts[2][i] - 2 * block[i] for i in (0, 1)]
    assert block == pytest.approx(K.LAUNCHES_BLOCK[mode], rel=0.1)
    assert rest == pytest.approx(K.LAUNCHES_REST[mode], rel=0.2)


def cpu(*args: str, num_gpus: int = 1) -> tuple:
    cfg = load_config(None, ["--model.preset=tiny", f"--hardware.num_gpus={num_gpus}", *args])
    return cfg, build_layout(cfg)


def test_each_gemm_runs_at_its_nearest_measured_shape() -> None:
    cfg, layout = cpu()
    one_rate = profile(matmul_shapes=(MatmulShape("fp32", 512, 128, 128, 4e10),))
    assert K.matmul_rate(one_rate, "fp32", cfg.model, layout, 512) == pytest.approx(4e10)
    # a slow small shape and a fast large one: the model's GEMMs land between, nearer the shape they resemble
    two = profile(matmul_shapes=(MatmulShape("fp32", 8, 8, 8, 1e9), MatmulShape("fp32", 4096, 1024, 4096, 1e11)))
    small, large = (K.matmul_rate(two, "fp32", cfg.model, layout, tokens) for tokens in (8, 8192))
    assert small == pytest.approx(1e9) and small < large <= 1e11 * (1 + 1e-9)


def test_backward_gemms_run_at_their_own_measured_rates() -> None:
    """Forward, input-gradient and weight-gradient GEMMs do equal FLOPs: the rate is their harmonic mean."""
    cfg, layout = cpu()
    p = profile(matmul_shapes=(MatmulShape("fp32", 512, 128, 128, 4e10),),
                matmul_backward=(MatmulBackward("fp32", 512, 128, 128, 1e10, 2e10),))
    assert K.matmul_rate(p, "fp32", cfg.model, layout, 512) == pytest.approx(3 / (1 / 4e10 + 1 / 1e10 + 1 / 2e10))


def test_attention_runs_at_its_nearest_measured_sequence() -> None:
    cfg, _ = cpu()
    p = profile(attention=(AttentionShape("fp32", 8, 8, 256, 32, 2e10), AttentionShape("fp32", 2, 8, 2048, 64, 5e10)))
    assert K.attention_rate(p, "fp32", cfg.model, 256) == 2e10
    assert K.attention_rate(p, "fp32", cfg.model, 4096) == 5e10
    assert K.attention_rate(profile(), "fp32", cfg.model, 256) is None  # not measured: the matmul rate stands


def test_ranks_beyond_the_cores_share_them() -> None:
    p = profile()  # 2 cores, 1 thread per rank, no concurrency measured
    assert K.concurrency_slowdown(p, cpu(num_gpus=1)[0].hardware, cpu(num_gpus=1)[1]) == (1, 1)
    assert K.concurrency_slowdown(p, cpu(num_gpus=2)[0].hardware, cpu(num_gpus=2)[1]) == (1, 1)
    assert K.concurrency_slowdown(p, cpu(num_gpus=4)[0].hardware, cpu(num_gpus=4)[1]) == (2, 2)
    two_threads = dataclasses.replace(p, machine=dataclasses.replace(p.machine, threads=2))
    assert K.concurrency_slowdown(two_threads, cpu(num_gpus=2)[0].hardware, cpu(num_gpus=2)[1]) == (2, 2)


def test_measured_concurrency_slows_each_kind_of_work_by_its_fraction(tmp_path: Path) -> None:
    """At a world size calibrate measured, GEMMs and attention run at the matmul fraction, elementwise
    work at the bandwidth fraction; a world size beyond the cores not measured takes the contention
    measured at as many ranks as fill them, time-shared on top."""
    p = profile(concurrency=(Concurrency(2, 0.8, 0.5),))  # 2 cores, 1 thread per rank
    for n, expected in ((2, (1.25, 2.0)), (4, (2 * 1.25, 2 * 2.0))):
        cfg, layout = cpu(num_gpus=n)
        assert K.concurrency_slowdown(p, cfg.hardware, layout) == pytest.approx(expected)
    measured_four = profile(concurrency=(Concurrency(2, 0.8, 0.5), Concurrency(4, 0.3125, 0.2)))
    cfg, layout = cpu(num_gpus=4)
    assert K.concurrency_slowdown(measured_four, cfg.hardware, layout) == pytest.approx((3.2, 5.0))
    cfg, layout = cpu(num_gpus=2)
    flops = timing._rank_flops(cfg.model, layout, cfg.training, device_type(cfg.hardware))

    def compute(measured: HardwareProfile, name: str) -> tuple[float, float]:
        hw = dataclasses.replace(cfg.hardware, profile=str(write_profile(measured, tmp_path / name)))
        return timing._compute_seconds(cfg.model, layout, cfg.training, timing.Rates.of(hw), flops)[:2]

    elementwise = [b / p.memory_bytes_per_s for b in K.elementwise_bytes(cfg.model, layout, cfg.training)]
    for alone, together, memory_bound in zip(compute(profile(), "alone.toml"), compute(p, "together.toml"),
                                             elementwise, strict=True):
        assert together == pytest.approx(1.25 * (alone - memory_bound) + 2 * memory_bound)


def test_a_pipeline_bubble_on_time_shared_cores_is_filled_by_the_other_ranks(tmp_path: Path) -> None:
    """pp2 x dp2 on 2 cores: a stage's ranks idle in the bubble leave both cores to the other stage's,
    so the machine's work (2x a rank's own) sets the step, not the rank's own path plus its bubble."""
    def step(num_gpus: int, cores: int) -> dict:
        p = profile()
        p = dataclasses.replace(p, machine=dataclasses.replace(p.machine, cores=cores))
        cfg = load_config(None, ["--model.preset=tiny", f"--hardware.num_gpus={num_gpus}", "--parallel.pp=2",
                                 "--parallel.zero_stage=0", "--training.micro_batch_size=1",
                                 f"--training.global_batch_size={num_gpus}",
                                 f"--hardware.profile={write_profile(p, tmp_path / f'{cores}.toml')}"])
        return timing.estimate_perf(cfg.model, build_layout(cfg), cfg.training, cfg.hardware).time

    alone = step(2, cores=2)  # the cores to themselves: the whole bubble shows
    assert alone["bubble_fraction"] == 0.5
    assert alone["bubble_s"] == pytest.approx(0.5 * (alone["compute_s"] + alone["exposed_comm_s"]), rel=0.05)
    shared = step(4, cores=2)  # 4 ranks on 2 cores: 2x over, the bubble all filled
    assert shared["bubble_fraction"] == 0.5 and shared["bubble_s"] == 0.0
    partly = step(4, cores=3)  # 4/3 over: the bubble exceeds what the others fill
    own = partly["compute_s"] * 3 / 4
    assert 0 < partly["bubble_s"] == pytest.approx(0.5 * own - (partly["compute_s"] - own), rel=0.05)


def test_framework_host_work_is_priced_per_block_and_micro_batch() -> None:
    """The profile's host work: DTensor's per tensor-parallel block (with or without sequence
    parallelism, as measured; checkpointed blocks rerun the forward's third) and FSDP2's per unit,
    each per block and for the rest of the model, every micro-batch."""
    p = profile(host_overhead=(HostOverhead(2, "tensor_parallel", 0.01, 0.004),
                               HostOverhead(2, "sequence_parallel", 0.02, 0.008),
                               HostOverhead(2, "fully_shard", 0.005, 0.001)))
    mb = ("--training.micro_batch_size=1", "--training.global_batch_size=4")
    _, ddp = cpu("--parallel.zero_stage=0", num_gpus=2)
    assert K.host_overhead_seconds(p, ddp) == 0  # neither framework
    _, tp = cpu("--parallel.tp=2", *mb, num_gpus=2)
    blocks, micro = tp.busiest_rank_blocks(), tp.num_microbatches
    assert micro > 1 and K.host_overhead_seconds(p, tp) == pytest.approx((blocks * 0.01 + 0.004) * micro)
    _, sp = cpu("--parallel.tp=2", "--parallel.sequence_parallel=true", *mb, num_gpus=2)
    assert K.host_overhead_seconds(p, sp) == pytest.approx((blocks * 0.02 + 0.008) * micro)
    _, full = cpu("--parallel.tp=2", "--memory.activation_checkpointing=full", *mb, num_gpus=2)
    assert K.host_overhead_seconds(p, full) == pytest.approx((blocks * 0.01 * (1 + K.FORWARD_SHARE) + 0.004) * micro)
    _, fsdp = cpu("--parallel.zero_stage=3", *mb, num_gpus=2)
    assert K.host_overhead_seconds(p, fsdp) == pytest.approx((blocks * 0.005 + 0.001) * fsdp.num_microbatches)
    _, both = cpu("--parallel.zero_stage=3", "--parallel.tp=2", *mb, num_gpus=4)
    assert K.host_overhead_seconds(p, both) == pytest.approx((blocks * 0.015 + 0.005) * both.num_microbatches)
    assert K.host_overhead_seconds(profile(), tp) == 0  # not measured


def test_a_cpu_adds_the_host_work_and_a_gpu_hides_it_behind_its_kernels(tmp_path: Path) -> None:
    p = profile(host_overhead=(HostOverhead(2, "tensor_parallel", 0.01, 0.004),))

    def time(num_gpus: int, *args: str, measured: HardwareProfile = p) -> dict:
        cfg = load_config(None, ["--model.preset=tiny", f"--hardware.num_gpus={num_gpus}", "--parallel.tp=2",
                                 f"--hardware.profile={write_profile(measured, tmp_path / 'tp.toml')}", *args])
        return timing.estimate_perf(cfg.model, build_layout(cfg), cfg.training, cfg.hardware).time

    _, layout = cpu("--parallel.tp=2", num_gpus=2)
    two, four = time(2), time(4, "--parallel.zero_stage=0")  # 4 ranks on 2 cores time-share the host work too
    assert K.host_overhead_seconds(p, layout) > 0
    assert two["exposed_host_s"] == pytest.approx(K.host_overhead_seconds(p, layout))
    assert four["exposed_host_s"] == pytest.approx(2 * two["exposed_host_s"])
    assert two["step_time_s"] == pytest.approx(two["compute_s"] + two["exposed_host_s"] + two["exposed_comm_s"]
                                               + two["optimizer_s"])
    on_gpus = dataclasses.replace(p, machine=dataclasses.replace(p.machine, device="cuda", name="H100"))
    gpu = time(2, "--hardware.gpu=H100-SXM-80GB", measured=on_gpus)  # the host runs ahead of the kernels
    assert gpu["exposed_host_s"] == max(0.0, K.host_overhead_seconds(p, layout) - gpu["compute_s"]
                                        - gpu["exposed_comm_s"])


def test_the_optimizer_steps_the_ranks_shard() -> None:
    p = profile()  # fused AdamW: 20 us + 1.25 ns per parameter
    cfg, whole = cpu("--parallel.zero_stage=0", num_gpus=2)
    _, sharded = cpu("--parallel.zero_stage=3", num_gpus=2)
    params = (K.optimizer_seconds(p, cfg.model, whole) - 2e-5) / 1.25e-9
    assert params == pytest.approx(sum(K._rank_params(cfg.model, whole)))
    assert K.optimizer_seconds(p, cfg.model, sharded) == pytest.approx(2e-5 + 1.25e-9 * params / 2)


def test_fp8_on_a_profile_prices_its_linears_at_fp8s_rate_and_its_casts_at_the_measured_bandwidth(
        tmp_path: Path) -> None:
    """fp8-mixed on a measured profile: the float8 linears at fp8's measured rate (here twice bf16's),
    the output projection and attention at bf16's, and torchao's casts (perf/fp8_casts.py) over the
    measured bandwidth, fewer bytes of them compiled."""
    rates = {**profile().matmul_flops_per_s, "fp8": 4e9}
    shapes = (*profile().matmul_shapes, MatmulShape("fp8", 512, 128, 128, 4e9))
    path = str(write_profile(profile(matmul_flops_per_s=rates, matmul_shapes=shapes), tmp_path / "fp8.toml"))

    def time(*args: str) -> tuple[dict, float]:
        cfg, layout = cpu(f"--hardware.profile={path}", *args)
        flops = timing._rank_flops(cfg.model, layout, cfg.training, device_type(cfg.hardware))
        cast_bytes = sum(timing._fp8_cast_bytes(cfg.model, layout, cfg.training, flops))
        return timing.estimate_perf(cfg.model, layout, cfg.training, cfg.hardware).time, cast_bytes

    eager, eager_bytes = time("--precision.mode=fp8-mixed")
    compiled, compiled_bytes = time("--precision.mode=fp8-mixed", "--training.compile=true")
    bf16, no_casts = time("--precision.mode=bf16-mixed")
    assert no_casts == 0 and bf16["fp8_cast_s"] == 0
    assert 0 < compiled_bytes < eager_bytes
    for t, cast_bytes in ((eager, eager_bytes), (compiled, compiled_bytes)):
        assert t["fp8_cast_s"] == pytest.approx(cast_bytes / profile().memory_bytes_per_s)
        assert t["compute_s"] - t["fp8_cast_s"] < bf16["compute_s"]
