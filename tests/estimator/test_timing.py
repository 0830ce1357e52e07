"""perf/timing.py: step time, its parts, throughput and MFU -- pure numbers, no torch needed."""

from __future__ import annotations

import pytest

from trainfit import hardware
from trainfit.config import ConfigError, ModelConfig
from trainfit.configure import load_config
from trainfit.hardware import device_type, peak_flops
from trainfit.models.params import param_counts
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.schedules import bubble_fraction
from trainfit.perf import comms
from trainfit.perf import gpu_kernels as GK
from trainfit.perf.timing import estimate_perf

H100 = ("--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed")
LLAMA70B_64 = (*H100, "--model.preset=llama3-70b", "--hardware.num_gpus=64", "--parallel.tp=8",
               "--parallel.zero_stage=3", "--training.seq_len=4096", "--training.micro_batch_size=1",
               "--training.global_batch_size=64")


def perf(*args: str):
    cfg = load_config(None, list(args))
    dims = build_layout(cfg)
    return cfg, dims, estimate_perf(cfg.model, dims, cfg.training, cfg.hardware)


def test_llama3_70b_on_64_h100() -> None:
    cfg, dims, est = perf(*LLAMA70B_64)
    f, t = est.flops, est.time
    tokens = 64 * 4096
    assert f["model_flops_per_step"] == f["model_flops_per_token"] * tokens
    assert f["hardware_flops_per_step"] == f["hardware_flops_per_token"] * tokens >= f["model_flops_per_step"]
    # ~6 x 70e9 FLOPs per token x 262k tokens / 64 GPUs at the H100's achievable matmul rate: a few seconds
    assert 6 * 70e9 * tokens < f["model_flops_per_step"] < 1.3 * 6 * 70e9 * tokens
    assert f["flops_per_rank_per_step"] == pytest.approx(f["hardware_flops_per_step"] / 64)
    # no faster than every FLOP at the maximum achievable matmul rate; attention's kernels, partial waves
    # and elementwise traffic take a share of it
    mamf = GK.KERNELS["H100-SXM-80GB"].mamf["bf16"]
    assert f["flops_per_rank_per_step"] / mamf < t["compute_s"] < f["flops_per_rank_per_step"] / (0.55 * mamf)
    assert 1 < t["compute_s"] < 10
    assert t["step_time_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"] + t["bubble_s"] + t["optimizer_s"])
    assert t["exposed_comm_s"] == pytest.approx(sum(t["exposed_comm_by_kind_s"].values()))
    assert all(t["exposed_comm_by_kind_s"][k] <= t["comm_s"][k] + 1e-12 for k in comms.KINDS)
    assert 0 < t["mfu"] < t["hfu"] < mamf / 989.4e12
    peak = peak_flops(cfg.hardware, cfg.precision.mode)
    assert t["mfu"] == pytest.approx(f["model_flops_per_step"] / (t["step_time_s"] * 64 * peak))
    assert t["tokens_per_second"] == pytest.approx(tokens / t["step_time_s"])
    assert set(t["comm_s"]) == set(comms.KINDS) and t["comm_s"]["all_gather"] > 0


def test_pipeline_bubble_shrinks_with_microbatches_and_virtual_stages() -> None:
    assert bubble_fraction("1f1b", pp=4, num_microbatches=8) == pytest.approx(3 / 8)
    assert bubble_fraction("gpipe", pp=4, num_microbatches=8) == bubble_fraction("1f1b", 4, 8)
    assert bubble_fraction("interleaved-1f1b", pp=4, num_microbatches=8, virtual_stages=2) == pytest.approx(3 / 16)
    assert bubble_fraction("looped-bfs", pp=4, num_microbatches=8, virtual_stages=2) == pytest.approx(3 / 16)
    for zero_bubble in ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev"):
        assert bubble_fraction(zero_bubble, pp=4, num_microbatches=8, virtual_stages=2) == 0.0
    assert bubble_fraction("1f1b", pp=1, num_microbatches=1) == 0.0
    base = (*H100, "--model.preset=llama2-7b", "--hardware.num_gpus=8", "--parallel.pp=4", "--parallel.tp=2",
            "--training.seq_len=4096", "--training.micro_batch_size=1")
    shares = [perf(*base, f"--training.global_batch_size={gbs}")[2].time for gbs in (4, 16, 64)]
    fractions = [t["bubble_s"] / t["step_time_s"] for t in shares]
    assert fractions[0] > fractions[1] > fractions[2] > 0
    assert [t["bubble_fraction"] for t in shares] == [3 / 4, 3 / 16, 3 / 64]
    # the last stage carries the output projection: the busiest rank does more than an even share
    _, _, est = perf(*base, "--training.global_batch_size=16")
    assert est.flops["flops_per_rank_per_step"] > est.flops["hardware_flops_per_step"] / 8


def test_crossing_nodes_costs_more_than_staying_inside() -> None:
    args = (*H100, "--model.preset=llama3-8b", "--hardware.num_gpus=16", "--parallel.zero_stage=3",
            "--training.seq_len=4096", "--training.micro_batch_size=1", "--training.global_batch_size=16")
    _, _, one_node = perf(*args, "--hardware.gpus_per_node=16")
    _, _, two_nodes = perf(*args, "--hardware.gpus_per_node=8")
    _, _, one_nic = perf(*args, "--hardware.gpus_per_node=8", "--hardware.nics_per_node=1")
    # the 16-rank ring crosses the network through each node's 8 NICs (perf/comms.members_per_node): a little
    # slower than NVLink; with one NIC per node, its eighth
    assert one_node.time["comm_s"]["all_gather"] < two_nodes.time["comm_s"]["all_gather"]
    assert one_nic.time["comm_s"]["all_gather"] > 5 * two_nodes.time["comm_s"]["all_gather"]
    assert one_node.time["step_time_s"] < two_nodes.time["step_time_s"] < one_nic.time["step_time_s"]
    assert two_nodes.time["compute_s"] == one_node.time["compute_s"]


def test_throughput_scales_with_gpus_at_fixed_work_per_gpu() -> None:
    def tokens_per_s(gpus: int, *extra: str) -> float:
        """Tokens per second of the step without its optimizer step, whose ZeRO-3 shard shrinks with more GPUs."""
        t = perf(*H100, "--model.preset=llama3-8b", f"--hardware.num_gpus={gpus}", "--parallel.zero_stage=3",
                 "--training.seq_len=4096", "--training.micro_batch_size=1",
                 f"--training.global_batch_size={4 * gpus}", *extra)[2].time
        return t["tokens_per_second"] * t["step_time_s"] / (t["step_time_s"] - t["optimizer_s"])

    fast = ("--hardware.intra_node_gbps=1e6", "--hardware.inter_node_gbps=1e6", "--hardware.intra_node_latency_us=1e-6",
            "--hardware.inter_node_latency_us=1e-6")
    assert tokens_per_s(64, *fast) == pytest.approx(8 * tokens_per_s(8, *fast), rel=1e-3)
    # real links: sublinear; FSDP over 8 whole nodes drives all their NICs, HSDP's replica all-reduce (one rank
    # per node in each group) one NIC per group
    fsdp, hsdp = tokens_per_s(64), tokens_per_s(64, "--parallel.dp_replicate=8")
    assert tokens_per_s(8) < hsdp < fsdp < 8 * tokens_per_s(8)


def test_gradient_sync_once_per_step_and_overlap_rules() -> None:
    base = (*H100, "--model.preset=llama3-8b", "--hardware.num_gpus=8", "--training.seq_len=4096",
            "--training.micro_batch_size=1")
    hsdp = ("--parallel.zero_stage=3", "--parallel.dp_replicate=2")
    _, _, one = perf(*base, *hsdp, "--training.global_batch_size=8")
    _, _, four = perf(*base, *hsdp, "--training.global_batch_size=32")
    assert four.time["comm_s"]["all_reduce"] == one.time["comm_s"]["all_reduce"] > 0  # across replicas: once
    assert four.time["comm_s"]["reduce_scatter"] == pytest.approx(4 * one.time["comm_s"]["reduce_scatter"])
    assert four.time["comm_s"]["all_gather"] == pytest.approx(4 * one.time["comm_s"]["all_gather"])
    # DDP on NVLink: everything but the last bucket hides behind the backward
    _, _, ddp = perf(*base, "--training.global_batch_size=8")
    buckets = [(c, one_call) for c, one_call in ddp.collectives if c.purpose == "grad_sync"]
    assert len(buckets) == 1 and buckets[0][0].count > 1
    assert ddp.time["exposed_comm_by_kind_s"]["all_reduce"] == pytest.approx(buckets[0][1])
    # tensor parallelism is on the critical path, all of it
    _, _, tp = perf(*base, "--parallel.tp=8", "--training.global_batch_size=1")
    assert tp.time["comm_s"]["all_reduce"] > 0
    assert tp.time["exposed_comm_s"] == pytest.approx(tp.time["comm_s"]["all_reduce"])
    # FSDP: the root unit's all-gather is exposed even when compute could hide the rest
    fsdp_exposed = one.time["exposed_comm_by_kind_s"]
    root = [one_call * c.count for c, one_call in one.collectives if c.unit == "root" and c.kind == "all_gather"]
    assert fsdp_exposed["all_gather"] >= root[0] > 0
    assert one.time["exposed_comm_s"] < 0.2 * sum(one.time["comm_s"].values())


def test_precision_and_efficiency_set_the_compute_time() -> None:
    base = (*H100, "--model.preset=llama3-8b", "--hardware.num_gpus=8", "--parallel.zero_stage=3",
            "--training.seq_len=4096", "--training.micro_batch_size=1", "--training.global_batch_size=8")
    bf16 = perf(*base)[2].time["compute_s"]
    fp8 = perf(*base, "--precision.mode=fp8-mixed", "--training.compile=true")[2].time["compute_s"]
    # block linears at fp8's achievable rate (1.77 x bf16's on an H100), casts fused; attention, the output
    # projection and elementwise work as in bf16
    assert 0.7 * bf16 < fp8 < 0.95 * bf16
    # the efficiency scales the kernels' rates, not the memory traffic: compute = traffic + kernels / efficiency
    quarter, half = (perf(*base, f"--hardware.compute_efficiency={e}")[2].time["compute_s"] for e in (0.25, 0.5))
    assert quarter - half == pytest.approx(2 * (half - bf16)) and half - bf16 > 0.8 * (bf16 - 0.5 * half)
    assert perf(*base, "--precision.mode=fp32")[2].time["compute_s"] > 10 * bf16
    with pytest.raises(ConfigError, match="A100-SXM-80GB has no fp8"):
        perf(*base, "--hardware.gpu=A100-SXM-80GB", "--precision.mode=fp8-mixed")


def eager_minus_bf16_s(m: ModelConfig, rows: int, micro_batches: int, hbm: float) -> float:
    """What eager fp8 adds to a rank's compute over bf16, counted by hand from torchao 0.18's code
    (perf/fp8_casts.py's table): per block Linear (rows x k -> n), six casts of a bf16 tensor at 33
    bytes per element (the input, weight and output gradient twice each) and three layout copies of
    2 bytes per element, over the memory bandwidth, less what its three GEMMs save at fp8's achievable
    rate over bf16's (perf/gpu_kernels.py). So eager fp8 is slower unless rows, k and n are all large."""
    head_dim = m.dim // m.num_heads
    q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
    linears = [(m.dim, q), (m.dim, kv), (m.dim, kv), (q, m.dim), (m.dim, m.ffn_dim), (m.dim, m.ffn_dim),
               (m.ffn_dim, m.dim)]
    h100 = GK.KERNELS["H100-SXM-80GB"]

    def gemms_s(k: int, n: int, dtype: str) -> float:
        size = 1 if dtype == "fp8" else 2
        return sum(GK.gemm_passes_seconds(rows, k, n, h100.mamf[dtype], h100.sms, size, hbm))

    per_block = sum((33 * 2 + 2) * (rows * k + rows * n + k * n) / hbm - (gemms_s(k, n, "bf16") - gemms_s(k, n, "fp8"))
                    for k, n in linears)
    return micro_batches * m.num_layers * per_block


@pytest.mark.parametrize(("preset", "gpus", "seq", "mbs", "eager_is_slower"),
                         [("llama3-8b", 8, 4096, 1, True), ("llama3.1-405b", 64, 8192, 2, False)])
def test_eager_fp8_pays_for_torchaos_cast_kernels(preset: str, gpus: int, seq: int, mbs: int,
                                                  eager_is_slower: bool) -> None:
    """fp8-mixed without training.compile runs torchao's casts as separate kernels over HBM: slower than
    compiled always, and slower than bf16 where the linears are small against what they cast (an 8B
    model at 4k tokens per micro-batch), faster where they are large (405B at 16k)."""
    base = (*H100, f"--model.preset={preset}", f"--hardware.num_gpus={gpus}", "--parallel.zero_stage=3",
            f"--training.seq_len={seq}", f"--training.micro_batch_size={mbs}",
            f"--training.global_batch_size={gpus * mbs}")
    cfg, layout, bf16 = perf(*base)
    eager = perf(*base, "--precision.mode=fp8-mixed")[2].time
    compiled = perf(*base, "--precision.mode=fp8-mixed", "--training.compile=true")[2].time
    assert eager["compute_s"] > compiled["compute_s"] and eager["step_time_s"] >= compiled["step_time_s"] * (1 - 1e-12)
    assert eager["fp8_cast_s"] > 33 / 5 * compiled["fp8_cast_s"] > 0  # 33 bytes per element eager, 5 fused
    spec = hardware.GPUS["H100-SXM-80GB"]
    expected = eager_minus_bf16_s(cfg.model, mbs * seq, layout.num_microbatches, spec.hbm_bytes_per_s)
    assert eager["compute_s"] - bf16.time["compute_s"] == pytest.approx(expected)
    assert (eager["compute_s"] > bf16.time["compute_s"]) == eager_is_slower


def test_recomputation_costs_time_not_mfu_credit() -> None:
    _, _, none = perf(*LLAMA70B_64)
    _, _, full = perf(*LLAMA70B_64, "--memory.activation_checkpointing=full")
    _, _, selective = perf(*LLAMA70B_64, "--memory.activation_checkpointing=selective")
    assert full.time["compute_s"] > 1.2 * none.time["compute_s"]
    # selective recomputes no matmul, only the elementwise work between them
    assert none.time["compute_s"] < selective.time["compute_s"] < 1.15 * none.time["compute_s"]
    assert full.flops["model_flops_per_step"] == none.flops["model_flops_per_step"]
    assert full.time["hfu"] / full.time["mfu"] > none.time["hfu"] / none.time["mfu"]


def test_expert_and_context_parallel_traffic_is_counted() -> None:
    _, _, moe = perf(*H100, "--model.preset=mixtral-8x7b", "--hardware.num_gpus=64", "--parallel.ep=8",
                     "--parallel.zero_stage=3", "--training.seq_len=4096", "--training.micro_batch_size=1",
                     "--training.global_batch_size=64")
    assert moe.time["comm_s"]["all_to_all"] > 0
    assert moe.time["exposed_comm_by_kind_s"]["all_to_all"] == pytest.approx(moe.time["comm_s"]["all_to_all"])
    _, _, cp = perf(*H100, "--model.preset=llama3-8b", "--hardware.num_gpus=8", "--parallel.cp=2",
                    "--parallel.zero_stage=3", "--training.seq_len=8192", "--training.micro_batch_size=1",
                    "--training.global_batch_size=4")
    kv_gathers = [c for c, _ in cp.collectives if c.purpose == "cp" and c.kind == "all_gather"]
    kv_bytes = 8192 * 8 * 128 * 2  # K (or V) of one 8k sequence, 8 kv heads of 128, bf16
    assert {c.nbytes for c in kv_gathers} == {kv_bytes} and kv_gathers[0].group_size == 2
    # K and V apart, in forward only, every block: backward reduce-scatters their gradients and
    # gathers nothing unless it recomputes (it was counted as one K+V gather each way before, which a
    # real step contradicts: tests/distributed/test_comm_counts.py)
    assert {c.phase for c in kv_gathers} == {"forward"} and sum(c.count for c in kv_gathers) == 2 * 32


def test_a_4d_layout_on_16384_gpus_has_a_sane_mfu() -> None:
    cfg = load_config(None, [*H100, "--model.preset=llama3.1-405b", "--hardware.num_gpus=16384", "--parallel.tp=8",
                             "--parallel.pp=2", "--parallel.cp=2", "--parallel.zero_stage=3",
                             "--parallel.sequence_parallel=true", "--training.seq_len=8192",
                             "--training.micro_batch_size=1", "--training.global_batch_size=2048",
                             "--memory.activation_checkpointing=full"])
    est = estimate_perf(cfg.model, build_layout(cfg), cfg.training, cfg.hardware)  # speed: benchmarks/
    assert 0 < est.time["mfu"] < 1


def test_cpu_offload_costs_host_copies_and_the_host_optimizer_step() -> None:
    llama8b = (*H100, "--model.preset=llama3-8b", "--hardware.num_gpus=8", "--parallel.zero_stage=3",
               "--training.seq_len=4096", "--training.micro_batch_size=1", "--training.global_batch_size=32")
    _, dims, on_device = perf(*llama8b)
    cfg, _, offloaded = perf(*llama8b, "--memory.offload=optimizer")
    t = offloaded.time
    assert on_device.time["offload_s"] == {} and on_device.time["exposed_offload_s"] == 0
    shard = 8.03e9 / 8  # parameters per rank, each an fp32 master on the host
    # AdamW on the host: 28 bytes per parameter at one GPU's share of the node's DRAM bandwidth
    assert t["offload_s"]["host_optimizer"] == pytest.approx(shard * 28 / hardware.HOST_MEMORY_BYTES_PER_S_PER_GPU,
                                                             rel=0.01)
    link = hardware.host_link(cfg.hardware)
    assert link is not None and link.name == "pcie5"
    # fp32 shards copied in before each forward and backward gather (ZeRO-3), fp32 gradients out, 4 micro-batches
    blocks = 32 * param_counts(cfg.model).per_layer / 8
    assert t["offload_s"]["h2d"] == pytest.approx(4 * (2 * blocks + (shard - blocks)) * 4 / link.bytes_per_s, rel=0.02)
    assert t["offload_s"]["d2h"] == pytest.approx(4 * shard * 4 / link.bytes_per_s, rel=0.01)
    assert t["exposed_offload_s"] >= t["offload_s"]["host_optimizer"]
    assert t["optimizer_s"] == 0  # the host steps it
    assert t["step_time_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"] + t["exposed_offload_s"]
                                             + t["bubble_s"])
    # on a CPU the host is the device: only the optimizer's own time remains
    _, _, cpu = perf("--hardware.num_gpus=2", "--parallel.zero_stage=3", "--memory.offload=optimizer")
    assert cpu.time["offload_s"]["h2d"] == cpu.time["offload_s"]["d2h"] == 0


def test_chunked_loss_reruns_the_output_projection() -> None:
    _, _, whole = perf(*LLAMA70B_64)
    cfg, dims, chunked = perf(*LLAMA70B_64, "--memory.chunked_loss=true")
    head = 2 * cfg.model.dim * cfg.model.vocab_size  # forward FLOPs per token of the output projection
    tokens = 64 * 4096
    assert chunked.flops["recompute_flops_per_step"] - whole.flops["recompute_flops_per_step"] == head * tokens
    assert chunked.flops["hardware_flops_per_step"] - whole.flops["hardware_flops_per_step"] == head * tokens
    # the output projection lives on every rank of the 8 tp ranks' last (only) stage, split 8 ways
    assert chunked.flops["flops_per_rank_per_step"] - whole.flops["flops_per_rank_per_step"] == pytest.approx(
        head * tokens / 64)
    assert chunked.time["compute_s"] > whole.time["compute_s"]
    # here the extra compute hides as much of FSDP's exposed traffic: never a faster step
    assert chunked.time["step_time_s"] >= whole.time["step_time_s"] * (1 - 1e-12)  # comm-bound: equal
    assert chunked.flops["model_flops_per_step"] == whole.flops["model_flops_per_step"]  # MFU gets no credit


def test_a_step_of_short_kernels_waits_on_their_launches() -> None:
    """A tiny model on an H100: each kernel is shorter than its launch, so the host's launches set the
    compute time; a 70B layout's kernels are long, and its launches hide behind them."""
    from trainfit.perf import kernels as K

    cfg, layout, tiny = perf(*H100, "--model.preset=tiny")
    fwd, bwd = K.kernel_launches(cfg.model, layout)
    assert tiny.time["compute_s"] == pytest.approx((fwd + bwd) * GK.LAUNCH_S)
    cfg, layout, big = perf(*LLAMA70B_64)
    assert big.time["compute_s"] > 5 * sum(K.kernel_launches(cfg.model, layout)) * GK.LAUNCH_S
    # where the time goes: the kernels' parts add up to the compute unless the launches set the pace
    parts = big.time["compute_parts_s"]
    assert set(parts) == {"matmul", "attention", "elementwise", "launches"}
    assert parts["matmul"] + parts["attention"] + parts["elementwise"] == pytest.approx(big.time["compute_s"])
    assert tiny.time["compute_parts_s"]["launches"] == pytest.approx(tiny.time["compute_s"])
    assert perf("--model.preset=tiny")[2].time["compute_parts_s"] == {}  # the CPU: no GPU kernels to name


ASYNC_TP = (*H100, "--model.preset=llama3-70b", "--hardware.num_gpus=8", "--parallel.tp=8",
            "--parallel.sequence_parallel=true", "--parallel.zero_stage=3", "--training.seq_len=8192",
            "--training.micro_batch_size=2", "--training.global_batch_size=2", "--training.compile=true")


def test_async_tp_hides_each_tp_collective_behind_its_gemms() -> None:
    """Each sequence-parallel collective split over its GEMMs leaves max(C - G, 0) + min(C, G) / tp
    exposed; nothing else in the step changes."""
    cfg, layout, vanilla = perf(*ASYNC_TP)
    _, async_layout, overlapped = perf(*ASYNC_TP, "--parallel.async_tp=true")
    assert async_layout.async_tp and not layout.async_tp
    v, a = vanilla.time, overlapped.time
    assert a["compute_s"] == v["compute_s"] and a["comm_s"] == pytest.approx(v["comm_s"])
    tp_vanilla = sum(one * c.count for c, one in vanilla.collectives if c.purpose == "tp")
    tp_split = [(c, one) for c, one in overlapped.collectives if c.overlaps]
    assert tp_split and all(c.purpose == "tp" and c.kind in ("all_gather", "reduce_scatter") for c, _ in tp_split)
    # the GEMMs named exist, and the time one call leaves exposed follows the rule
    from trainfit.perf import kernels as K
    from trainfit.perf.timing import Rates, _compute_seconds, _overlapped, _rank_flops
    rates = Rates.of(cfg.hardware)
    flops = _rank_flops(cfg.model, async_layout, cfg.training, device_type(cfg.hardware))
    rate = _compute_seconds(cfg.model, async_layout, cfg.training, rates, flops).matmul_flops_per_s
    names = {g.name for g in K.block_gemms(cfg.model, async_layout)} | {"output"}
    exposed = dict(zip([id(c) for c, _ in overlapped.collectives],
                       [one for _, one in _overlapped(list(overlapped.collectives), cfg.model, async_layout,
                                                      cfg.training, rates, rate)], strict=True))
    tokens = 2 * 8192
    gemms = {g.name: g for g in [*K.block_gemms(cfg.model, async_layout), K.head_gemm(cfg.model, async_layout)]}
    for c, one in tp_split:
        assert set(c.overlaps) <= names
        g = sum(2 * tokens * gemms[n].share * gemms[n].k * gemms[n].n for n in c.overlaps) / rate
        assert exposed[id(c)] == pytest.approx(max(0.0, one - g) + min(one, g) / 8, rel=1e-6)
        assert exposed[id(c)] < one
    # the attention's and the MLP's all-gathers overlap different GEMMs, so they stay apart
    gathers = {c.overlaps for c, _ in tp_split if c.kind == "all_gather" and c.phase == "forward"}
    assert {("wq", "wk", "wv"), ("w1", "w3"), ("output",)} <= gathers
    tp_exposed = v["exposed_comm_s"] - a["exposed_comm_s"]
    assert 0.5 * tp_vanilla < tp_exposed < tp_vanilla  # most of it hidden, never more than there was
    assert a["step_time_s"] == pytest.approx(v["step_time_s"] - tp_exposed)
    # the planner's lower bound counts none of what async TP may hide, so it stays below the step's
    from trainfit.perf.timing import model_parallel_comm_s
    assert model_parallel_comm_s(cfg.model, async_layout, cfg.training, cfg.hardware) <= a["exposed_comm_s"]


@pytest.mark.parametrize(("extra", "message"), [
    (("--parallel.sequence_parallel=false",), "parallel.sequence_parallel=true"),
    (("--training.compile=false",), "training.compile=true"),
    (("--hardware.gpu=cpu", "--precision.mode=fp32"), "hardware.gpu='cpu'"),
])
def test_async_tp_refuses_what_it_cannot_run_on(extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.async_tp=true") as error:
        build_layout(load_config(None, [*ASYNC_TP, "--parallel.async_tp=true", *extra]))
    assert message in str(error.value)


def test_async_tp_without_tensor_parallelism_is_flagged_as_no_effect() -> None:
    cfg = load_config(None, [*H100, "--parallel.async_tp=true", "--training.compile=true"])
    layout = build_layout(cfg)
    assert any(text.startswith("parallel.async_tp=true has no effect") for text in layout.ineffective_options())
    _, _, vanilla = perf(*H100, "--training.compile=true")
    assert estimate_perf(cfg.model, layout, cfg.training, cfg.hardware).time == vanilla.time
