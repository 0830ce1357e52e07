"""perf/comms.py: cost formulas, the link of each mesh axis, and the collectives a step issues --
the last checked against what CommDebugMode sees real FSDP2 / DDP / tensor-parallel code issue on
the fake process group."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter

import pytest
import torch

from _collectives import CollectiveLog, sync_allreduce_hook
from _dist import fake_world
from trainfit.configure import load_config
from trainfit.hardware import COLLECTIVE_BASE_LATENCY_S, Link, inter_node_link, intra_node_link
from trainfit.models import build_model, count_params, materialize
from trainfit.parallel.layout import AXES
from trainfit.parallel.resolve import build_layout
from trainfit.perf import comms
from trainfit.perf.timing import Rates
from trainfit.plan.space import AC_OPTIONS, OFFLOAD_OPTIONS

# FSDP2 and DTensor warn about CPU meshes and views; irrelevant to counting collectives.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LINK = Link("test", bytes_per_s=100e9, latency_s=5e-6)


def test_ring_cost_formulas() -> None:
    nbytes, n = 1e9, 8
    a0, a, bw = COLLECTIVE_BASE_LATENCY_S, LINK.latency_s, LINK.bytes_per_s
    assert comms.all_reduce_time(nbytes, n, LINK) == pytest.approx(a0 + 2 * 7 * a + 2 * 7 / 8 * nbytes / bw)
    assert comms.all_gather_time(nbytes, n, LINK) == pytest.approx(a0 + 7 * a + 7 / 8 * nbytes / bw)
    assert comms.reduce_scatter_time(nbytes, n, LINK) == comms.all_gather_time(nbytes, n, LINK)
    assert comms.all_to_all_time(nbytes, n, LINK) == comms.all_gather_time(nbytes, n, LINK)
    assert comms.p2p_time(nbytes, LINK) == pytest.approx(a0 + a + nbytes / bw)

    # all-reduce = reduce-scatter + all-gather in volume; a group of one communicates nothing
    ar, rs = comms.all_reduce_time(nbytes, n, LINK), comms.reduce_scatter_time(nbytes, n, LINK)
    assert ar == pytest.approx(2 * rs - a0)
    assert comms.all_reduce_time(nbytes, 1, LINK) == comms.all_gather_time(nbytes, 1, LINK) == 0.0
    # tiny messages across many ranks: the tree's log2(n) latency beats the ring's n
    small, ranks = 1024, 1024
    assert comms.all_reduce_time(small, ranks, LINK) == pytest.approx(
        a0 + 2 * math.log2(ranks) * a + 2 * small / bw)
    for kind in comms.KINDS:
        assert comms.collective_time(kind, nbytes, n, LINK) > 0

def test_small_collectives_run_nccls_low_latency_protocols_large_ones_simple() -> None:
    """NCCL times LL, LL128 and Simple and runs the fastest: a norm gain's 16 KiB all-reduce over 8
    NVLink GPUs takes LL's small fixed cost; a 1 GB all-gather Simple's full bandwidth."""
    hw = load_config(None, ["--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8"]).hardware
    nvlink = intra_node_link(hw)
    ll, ll128 = nvlink.protocols
    assert (ll.name, ll128.name) == ("LL", "LL128")
    small, big, n = 16 * 1024, 1e9, 8
    simple = COLLECTIVE_BASE_LATENCY_S + 14 * nvlink.latency_s + 14 / 8 * small / nvlink.bytes_per_s
    with_ll = ll.base_s + 14 * ll.hop_s + 14 / 8 * small / (nvlink.bytes_per_s * ll.bandwidth_share_reduce)
    assert with_ll < simple / 3
    assert comms.all_reduce_time(small, n, nvlink) == pytest.approx(min(with_ll, comms.all_reduce_time(
        small, n, dataclasses.replace(nvlink, protocols=()))))
    bare = dataclasses.replace(nvlink, protocols=())
    assert comms.all_gather_time(big, n, nvlink) == comms.all_gather_time(big, n, bare)
    # a measured or overridden latency is a Simple figure: nothing beside it
    custom = load_config(None, ["--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                                "--hardware.intra_node_latency_us=2"]).hardware
    assert intra_node_link(custom).protocols == ()
    cpu = load_config(None, []).hardware
    assert intra_node_link(cpu).protocols == () and inter_node_link(hw).protocols[0].name == "LL"



def _dims(*args: str):
    """A config and its layout; one sequence per rank and step unless the args say otherwise."""
    gpus = next((a.split("=")[1] for a in args if a.startswith("--hardware.num_gpus=")), "1")
    cfg = load_config(None, ["--training.micro_batch_size=1", f"--training.global_batch_size={gpus}", *args])
    return cfg, build_layout(cfg)


def test_each_axis_gets_the_link_of_its_span() -> None:
    cfg, dims = _dims("--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=64", "--parallel.tp=4", "--parallel.cp=2",
                      "--parallel.pp=2", "--training.seq_len=128", "--training.global_batch_size=8",
                      "--training.micro_batch_size=1")
    hw = cfg.hardware
    assert comms.axis_stride(dims, "tp") == 1 and comms.axis_stride(dims, "cp") == 4
    assert comms.axis_stride(dims, "dp_shard") == 8 and comms.axis_stride(dims, "pp") == 32
    intra = {axis for axis in AXES if comms.axes_are_intra_node(dims, (axis,), hw.gpus_per_node)}
    assert intra == {"tp", "cp", "dp_replicate"}  # tp x cp = 8 ranks = one node; dp_replicate is 1
    rates = Rates.of(hw)
    assert rates.link(dims, ("tp",)) == intra_node_link(hw)
    assert rates.link(dims, ("dp_shard",)) == inter_node_link(hw)
    # across nodes, a group drives the NICs of its members on a node: cp's 2 ranks of each node (dp_shard's one)
    assert comms.members_per_node(dims, ("dp_shard",), hw.gpus_per_node) == 1
    assert comms.members_per_node(dims, ("cp", "dp_shard"), hw.gpus_per_node) == 2
    assert rates.link(dims, ("cp", "dp_shard")) == dataclasses.replace(
        inter_node_link(hw), bytes_per_s=2 * inter_node_link(hw).bytes_per_s)
    # groups that straddle nodes: 3 ranks per group with 8 GPUs per node
    assert not comms.span_is_intra_node(3, 1, num_gpus=24, gpus_per_node=8)
    assert comms.span_is_intra_node(3, 1, num_gpus=6, gpus_per_node=8)  # the whole job is one node
    # one node: every axis intra-node
    cfg, dims = _dims("--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.zero_stage=3")
    assert comms.axes_are_intra_node(dims, ("dp_shard", "tp"), cfg.hardware.gpus_per_node)


def test_a_group_spanning_whole_nodes_drives_all_their_nics() -> None:
    """tp 16 over two 8-GPU nodes runs its channels through each node's 8 NICs: 8 GPUs' shares of the
    network (NVIDIA/nccl#1168: bus bandwidth scales with the GPUs per node on the same NICs), capped by
    what NVLink carries; with 4 NICs per node, half that; a data-parallel group with one rank per node
    keeps one GPU's share."""
    cfg, dims = _dims("--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=32", "--parallel.tp=16",
                      "--model.num_heads=16", "--model.num_kv_heads=16", "--training.seq_len=128",
                      "--training.global_batch_size=8", "--training.micro_batch_size=1")
    hw, rates = cfg.hardware, Rates.of(cfg.hardware)
    assert comms.members_per_node(dims, ("tp",), hw.gpus_per_node) == 8
    share = inter_node_link(hw).bytes_per_s
    assert rates.link(dims, ("tp",)).bytes_per_s == pytest.approx(min(8 * share, intra_node_link(hw).bytes_per_s))
    assert rates.link(dims, ("dp_shard",)) == inter_node_link(hw)
    hw4 = dataclasses.replace(hw, nics_per_node=4)
    assert Rates.of(hw4).link(dims, ("tp",)).bytes_per_s == pytest.approx(8 * inter_node_link(hw4).bytes_per_s)
    assert inter_node_link(hw4).bytes_per_s == pytest.approx(share / 2)


def test_the_network_is_slower_than_nvlink() -> None:
    cfg, _ = _dims("--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=16")
    intra, inter = intra_node_link(cfg.hardware), inter_node_link(cfg.hardware)
    assert comms.all_gather_time(1e9, 8, inter) > 5 * comms.all_gather_time(1e9, 8, intra)


def test_what_gradient_accumulation_repeats() -> None:
    def collectives(accum: int, *args: str) -> Counter:
        cfg, dims = _dims("--model.preset=llama2-7b", "--hardware.num_gpus=8",
                          f"--training.global_batch_size={8 * accum}", *args)
        out: Counter = Counter()
        for c in comms.step_collectives(cfg.model, dims, cfg.training):
            out[c.purpose, c.kind] += c.count
        return out

    # FSDP: parameters gathered and gradients reduce-scattered in every micro-batch; HSDP's
    # all-reduce of the shards across replicas once per step
    one, four = (collectives(n, "--parallel.zero_stage=3", "--parallel.dp_replicate=2") for n in (1, 4))
    assert four["fsdp_param", "all_gather"] == 4 * one["fsdp_param", "all_gather"] == 4 * (2 * 32 + 1)
    assert four["grad_sync", "reduce_scatter"] == 4 * one["grad_sync", "reduce_scatter"] == 4 * (32 + 1)
    assert four["grad_sync", "all_reduce"] == one["grad_sync", "all_reduce"] == 32 + 1
    # ZeRO-2 gathers in forward only
    assert collectives(1, "--parallel.zero_stage=2")["fsdp_param", "all_gather"] == 32 + 1
    # DDP: one all-reduce per step. ZeRO-1: once per step too, a reduce-scatter of the gradients
    # and an all-gather of the updated parameters per bucket (25 MiB of fp32: ~1000 for 27 GB)
    assert collectives(4) == collectives(1)
    zero1 = collectives(4, "--parallel.zero_stage=1")
    assert zero1 == collectives(1, "--parallel.zero_stage=1")
    assert set(zero1) == {("grad_sync", "reduce_scatter"), ("zero1_params", "all_gather")}
    assert zero1["grad_sync", "reduce_scatter"] == zero1["zero1_params", "all_gather"] == 1029


@pytest.mark.parametrize("gpus", [2, 16], ids=["one-replica", "dp4"])
def test_the_memory_knobs_reach_the_collectives_only_through_their_key(gpus: int) -> None:
    """plan/search.py times a group's collectives once per collectives_key: layouts that differ in
    memory knobs only, with one key, issue the same collectives (on one replica, offload turns
    FSDP2 on: the key's data_parallel)."""
    cfg, dims = _dims("--model.preset=llama2-7b", "--hardware.gpu=H100-SXM-80GB", f"--hardware.num_gpus={gpus}",
                      "--parallel.tp=2", f"--parallel.cp={1 if gpus == 2 else 2}", "--parallel.zero_stage=3")
    by_key: dict[tuple, set] = {}
    for (policy, every), offload, chunked in itertools.product(AC_OPTIONS, OFFLOAD_OPTIONS, (False, True)):
        knobs = dataclasses.replace(dims, activation_checkpointing=policy, ac_every_n_layers=every, offload=offload,
                                    chunked_loss=chunked)
        by_key.setdefault(comms.collectives_key(knobs), set()).add(
            tuple(comms.step_collectives(cfg.model, knobs, cfg.training)))
    assert all(len(issued) == 1 for issued in by_key.values())
    assert len(by_key) == len(AC_OPTIONS) * (2 if gpus == 2 else 1)


# ---------------------------------------------------------------- against real code on the fake backend


def expected(cfg, dims, phases: tuple[str, ...] = ("forward", "backward", "step")) -> Counter:
    out: Counter = Counter()
    for c in comms.step_collectives(cfg.model, dims, cfg.training):
        if c.phase in phases:
            out[c.kind, c.nbytes] += c.count
    return out


def observed_total(log: CollectiveLog) -> int:
    return sum(n for op, n in log.get_comm_counts().items() if "wait" not in str(op))


@pytest.mark.parametrize(("zero_stage", "dp_replicate"), [(3, 1), (2, 1), (3, 2)])
def test_fsdp_collectives_match_fully_shard(zero_stage: int, dp_replicate: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg, dims = _dims("--model.preset=debug", "--model.num_layers=3", "--hardware.num_gpus=4",
                      f"--parallel.zero_stage={zero_stage}", f"--parallel.dp_replicate={dp_replicate}",
                      "--precision.mode=bf16-mixed", "--training.seq_len=16", "--training.micro_batch_size=2",
                      "--training.global_batch_size=8")
    with fake_world(4):
        mesh = init_device_mesh("cpu", (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("rep", "shard"))
        mesh = mesh if dp_replicate > 1 else mesh["shard"]
        model = build_model(cfg.model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options = dict(mesh=mesh, mp_policy=policy)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=zero_stage == 3, **options)
        fully_shard(model, **options)  # the root keeps FSDP2's default: not resharded after forward
        materialize(model, "cpu")
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
        with CollectiveLog() as log:
            model(tokens).float().mean().backward()
    assert log.calls == expected(cfg, dims)
    assert observed_total(log) == sum(log.calls.values())


def test_ddp_collectives_match_distributed_data_parallel() -> None:
    from torch.nn.parallel import DistributedDataParallel

    cfg, dims = _dims("--model.preset=debug", "--hardware.num_gpus=4", "--training.seq_len=16",
                      "--training.micro_batch_size=2", "--training.global_batch_size=8")
    with fake_world(4):
        model = materialize(build_model(cfg.model), "cpu")
        ddp = DistributedDataParallel(model, broadcast_buffers=False)  # as parallel/data_parallel.py
        ddp.register_comm_hook(None, sync_allreduce_hook)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
        with CollectiveLog() as log:
            ddp(tokens).mean().backward()
    grads = 4 * count_params(model)
    assert log.calls == Counter({("all_reduce", grads): 1})  # one bucket: the model is far below 25 MiB
    assert expected(cfg, dims) == log.calls


@pytest.mark.parametrize(("precision", "grad_accum_dtype"), [("fp32", "param"), ("bf16-mixed", "param"),
                                                             ("bf16-mixed", "fp32")])
def test_zero1_collectives_match_the_zero_optimizer(precision: str, grad_accum_dtype: str) -> None:
    """parallel/zero.py's step: one reduce-scatter of the gradients (their accumulation dtype), one
    all-gather of the parameters (compute dtype), per bucket (one here), nothing in backward."""
    from trainfit.parallel.mesh import build_mesh
    from trainfit.precision import precision_policy
    from trainfit.train.optim import make_optimizer, param_groups
    from trainfit.train.parallelize import parallelize_optimizer

    cfg, dims = _dims("--model.preset=debug", "--hardware.num_gpus=4", "--parallel.zero_stage=1",
                      f"--precision.mode={precision}", f"--optimizer.grad_accum_dtype={grad_accum_dtype}",
                      "--training.seq_len=16", "--training.micro_batch_size=2", "--training.global_batch_size=8")
    with fake_world(4):
        model = materialize(build_model(cfg.model), "cpu")
        make = functools.partial(make_optimizer, opt=cfg.optimizer, train=cfg.training, device_type="cpu")
        zero = parallelize_optimizer(model, param_groups(model, 0.1), make, dims, build_mesh(dims, "cpu"),
                                     precision_policy(precision, "cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
        with CollectiveLog() as log:
            model(tokens).float().mean().backward()
            assert not log.calls  # no communication in backward
            zero.reduce_gradients()
            zero.step()
    params = count_params(model)
    compute = 2 if precision == "bf16-mixed" else 4
    grad = 4 if grad_accum_dtype == "fp32" else compute
    assert log.calls == Counter({("reduce_scatter", grad * params): 1, ("all_gather", compute * params): 1})
    assert expected(cfg, dims) == log.calls


@pytest.mark.parametrize("sequence_parallel, regather", [(False, False), (True, False), (True, True)])
def test_tensor_parallel_collectives_match_parallelize_module(sequence_parallel: bool, regather: bool) -> None:
    """The whole model as parallel/tensor_parallel.py plans it: blocks, the vocabulary-parallel
    embedding and output projection, and loss_parallel's cross-entropy (the block alone was checked
    before; tests/distributed/test_comm_counts.py checks a real step). Selective recomputation
    without sequence parallelism now repeats no all-reduce: recompute.py saves all-reduce outputs
    (the expectation of one dated from before all_reduce joined its _SAVE_OPS)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainfit.parallel.tensor_parallel import apply_tensor_parallel, recompute_gathers, vocabulary_parallel_loss
    from trainfit.recompute import apply_activation_checkpointing

    for policy in ("none", "full", "selective"):
        cfg, dims = _dims("--model.preset=debug", "--model.num_layers=1", "--hardware.num_gpus=2", "--parallel.tp=2",
                          f"--parallel.sequence_parallel={sequence_parallel}", "--precision.mode=fp32",
                          f"--memory.activation_checkpointing={policy}", "--training.seq_len=16",
                          "--training.micro_batch_size=2", "--training.global_batch_size=2",
                          f"--parallel.sp_recompute_gather={regather}")
        with fake_world(2):
            model = build_model(cfg.model)
            mesh = init_device_mesh("cpu", (2,))
            apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
            if regather:  # a checkpointed block re-gathers (selective) or keeps its input (full) already
                wraps = policy != "none"
                assert recompute_gathers(model, mesh, lambda i, wraps=wraps: wraps) == (0 if wraps else 2)
            apply_activation_checkpointing(model, policy)
            materialize(model, "cpu")
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
            with CollectiveLog() as log, vocabulary_parallel_loss(True):
                torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        # a forward and backward: not the step, where the gains' partial gradients are reduced without FSDP
        assert log.calls == expected(cfg, dims, phases=("forward", "backward")), policy
        assert observed_total(log) == sum(log.calls.values())


def test_fsdp_float8_all_gather_bytes_match_fully_shard() -> None:
    """precision.fp8_all_gather: each block's all-gather carries its float8 linears' weights in fp8
    (torchao's WeightWithDynamicFloat8CastTensor) and the rest in bf16, in one call per block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainfit.float8 import convert_to_float8, precompute_scales
    from trainfit.precision import precision_policy

    cfg, dims = _dims("--model.preset=debug", "--model.num_layers=2", "--hardware.num_gpus=4",
                      "--parallel.zero_stage=3", "--precision.mode=fp8-mixed", "--precision.fp8_all_gather=true",
                      "--training.seq_len=16", "--training.micro_batch_size=2", "--training.global_batch_size=8")
    policy = precision_policy("fp8-mixed", "cpu", fp8_all_gather=True)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        model = build_model(cfg.model)
        convert_to_float8(model, policy, tokens_per_matmul=32)
        options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
        for block in model.layers:
            fully_shard(block, **options)
        fully_shard(model, **options)
        materialize(model, "cpu")
        precompute_scales(model, policy)  # as the trainer does after each optimizer step
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
        with CollectiveLog() as log:
            model(tokens).float().mean().backward()
    gathers = Counter({key: n for key, n in log.calls.items() if key[0] == "all_gather"})
    assert gathers == Counter({key: n for key, n in expected(cfg, dims).items() if key[0] == "all_gather"})
