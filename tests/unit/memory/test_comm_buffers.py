"""NCCL's communicator buffers (memory/closed_form/comm_buffers.py) against a hand computation from NCCL's
constants, only for the groups that communicate (parallel/collectives.py's declaration), and their
place in the reserved margin: a term of it on GPUs, nothing on the CPU. The group count itself is
checked against a real mesh in tests/distributed/test_process_groups.py."""

from __future__ import annotations

import pytest

from trainfit.configure import load_config
from trainfit.memory import ALLOCATOR_FRAGMENTATION, CUDA_CONTEXT_BYTES
from trainfit.memory.closed_form import comm_buffers, estimate_memory
from trainfit.memory.closed_form.comm_buffers import (
    RING_KINDS,
    comm_buffer_bytes,
    communicating_groups,
    group_buffer_bytes,
)
from trainfit.parallel.collectives import collective_calls, group_size
from trainfit.parallel.groups import group_of, process_groups
from trainfit.parallel.resolve import build_layout

MiB = 2**20
# NCCL 2.30's defaults by hand (src/include/device.h, src/init.cc; NCCL_BUFFSIZE from its user guide):
SIMPLE = 4 * MiB  # NCCL_BUFFSIZE
LL = 8 * 512 * 8 * 16  # LINES_PER_THREAD x LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine)
LL128 = 120 * 640 * 8 * 8  # LL128_ELEMS_PER_THREAD x LL128_MAX_NTHREADS x NCCL_STEPS x sizeof(uint64_t)
CONNECTION = SIMPLE + LL + LL128  # 9,633,792 bytes: 9.19 MiB per peer and channel


def _run(*overrides: str):
    cfg = load_config(None, ["--model.preset=llama3-8b", "--training.micro_batch_size=1", *overrides])
    return build_layout(cfg), cfg


def test_the_constants_are_nccls_defaults() -> None:
    assert (comm_buffers.LL_BUFFSIZE, comm_buffers.LL128_BUFFSIZE, comm_buffers.SIMPLE_BUFFSIZE) == (LL, LL128, SIMPLE)
    assert comm_buffers.CONNECTION_BYTES == CONNECTION == 9_633_792


def test_one_node_of_h100s_holds_a_ring_per_group_and_channel() -> None:
    # tp=2 x dp_shard=4 on 8 GPUs of one node: the world's group, dp_shard's, tp's; all over NVLink 4.
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.zero_stage=3",
                       "--training.global_batch_size=4")
    assert [g.name for g in process_groups(layout)] == ["world", "dp_shard", "tp"]
    # 3 groups x 24 channels x 1 ring peer
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == 3 * 24 * 1 * CONNECTION
    # PCIe 4 (L40S): 2 channels
    layout, cfg = _run("--hardware.gpu=L40S", "--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.zero_stage=3",
                       "--training.global_batch_size=4")
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == 3 * 2 * CONNECTION


def test_groups_across_nodes_add_the_trees_peers() -> None:
    # 2 nodes of 8: tp=8 inside a node; dp_shard=2 joins one GPU of each node; the world spans both.
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=16", "--parallel.tp=8", "--parallel.zero_stage=3",
                       "--training.global_batch_size=2")
    assert [(g.name, g.size, g.stride) for g in process_groups(layout)] == [
        ("world", 16, 1), ("dp_shard", 2, 8), ("tp", 8, 1)]
    world = 16 * (1 + 3) * CONNECTION  # inter-node channels x (ring + tree peers)
    dp_shard = 16 * 1 * CONNECTION  # two ranks: one peer, whatever the algorithm
    tp = 24 * 1 * CONNECTION
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == world + dp_shard + tp


def test_the_margin_is_its_terms_on_gpus_and_nothing_on_the_cpu() -> None:
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=8", "--parallel.zero_stage=3",
                       "--training.global_batch_size=8")
    gpu = estimate_memory(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer).worst
    assert gpu.margin_terms == {"cuda_context": CUDA_CONTEXT_BYTES,
                                "allocator_fragmentation": int(ALLOCATOR_FRAGMENTATION * gpu.peak),
                                "comm_buffers": 24 * CONNECTION}  # dp_shard is the world: one group
    assert gpu.reserved_margin == sum(gpu.margin_terms.values())
    layout, cfg = _run("--hardware.num_gpus=8", "--parallel.zero_stage=3", "--training.global_batch_size=8")
    cpu = estimate_memory(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer).worst
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == 0  # gloo's, not NCCL's
    assert (cpu.reserved_margin, cpu.margin_terms) == (0, {})


def test_a_group_that_never_communicates_holds_none_and_every_communicating_one_does() -> None:
    # HSDP x tp on 16 GPUs: dp_replicate=2 x dp_shard=4 x tp=2. FSDP2 communicates over dp_shard (and
    # across dp_replicate), tp over tp, the loss over the world; nothing runs on the flattened "dp".
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=16", "--parallel.dp_replicate=2",
                       "--parallel.tp=2", "--parallel.zero_stage=3", "--training.global_batch_size=8")
    groups = process_groups(layout)
    assert [g.name for g in groups] == ["world", "dp_replicate", "dp_shard", "tp", "dp"]
    declared = {group_of(layout, c.axes).name for c in collective_calls(cfg.model, layout) if c.kind in RING_KINDS}
    assert declared == {"world", "dp_replicate", "dp_shard", "tp"}
    assert [g.name for g in communicating_groups(cfg.model, layout)] == ["world", "dp_replicate", "dp_shard", "tp"]
    dp = next(g for g in groups if g.name == "dp")
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == (
        sum(group_buffer_bytes(g, layout, cfg.hardware) for g in groups) - group_buffer_bytes(dp, layout, cfg.hardware))


def test_the_pipelines_group_holds_ring_buffers_for_the_gradient_norm_not_for_its_sends() -> None:
    # pp=2 x dp_shard=4: the stages' sends and receives are point-to-point (not counted); clipping
    # all-reduces the stages' squared gradient norms over pp (data_parallel.clip_grad_norm_).
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=8", "--parallel.pp=2", "--parallel.zero_stage=3",
                       "--training.global_batch_size=8")
    pp = [c for c in collective_calls(cfg.model, layout) if c.axes == ("pp",)]
    assert {(c.kind, c.tensor, c.timed) for c in pp} == {("p2p", "boundary", True), ("all_reduce", "grad_norm", False)}
    assert "pp" in [g.name for g in communicating_groups(cfg.model, layout)]


def test_the_expert_group_under_cpu_offload_runs_all_to_alls_only_on_nccl() -> None:
    # ep=2 inside dp_shard=8: the expert gradients' norm is all-reduced over ep, by gloo under offload.
    args = ("--model.preset=debug-moe", "--hardware.gpu=H100", "--hardware.num_gpus=8", "--parallel.ep=2",
            "--parallel.zero_stage=3", "--training.global_batch_size=8")
    layout, cfg = _run(*args)
    assert [g.name for g in communicating_groups(cfg.model, layout)] == ["world", "edp", "ep"]
    layout, cfg = _run(*args, "--memory.offload=optimizer")
    assert [g.name for g in communicating_groups(cfg.model, layout)] == ["world", "edp"]


@pytest.mark.parametrize("degrees", [
    ("--parallel.zero_stage=0", "--parallel.dp_replicate=2", "--parallel.cp=2"),
    ("--parallel.zero_stage=1", "--parallel.dp_replicate=2", "--parallel.cp=2"),
    ("--parallel.zero_stage=3", "--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.tp=2"),
    ("--parallel.zero_stage=2", "--parallel.pp=2", "--parallel.tp=2"),
    ("--model.preset=debug-moe", "--parallel.zero_stage=3", "--parallel.cp=2", "--parallel.ep=2"),
])
def test_every_declared_collective_runs_on_a_group_of_its_size_and_only_those_hold_buffers(degrees) -> None:
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=16", "--training.global_batch_size=16", *degrees)
    groups = process_groups(layout)
    used = set()
    for call in collective_calls(cfg.model, layout):
        group = group_of(layout, call.axes)
        assert group in groups and group.size == group_size(layout, call.axes), (call, group)
        used |= {group.name} if call.kind in RING_KINDS else set()
    assert {g.name for g in communicating_groups(cfg.model, layout)} == used
    assert comm_buffer_bytes(cfg.model, layout, cfg.hardware) == sum(
        group_buffer_bytes(g, layout, cfg.hardware) for g in groups if g.name in used)
    assert all(group_buffer_bytes(g, layout, cfg.hardware) > 0 for g in groups)


def test_every_nccl_device_of_the_catalog_has_a_channel_count() -> None:
    """A device whose link NCCL runs on never counts its groups as holding no buffers (RCCL's
    infinity-fabric is not NCCL: 0 by the module's statement)."""
    from trainfit.hardware import GPUS
    from trainfit.memory.closed_form.comm_buffers import INTRA_NODE_CHANNELS

    missing = {name: spec.default_link for name, spec in GPUS.items()
               if spec.default_link != "infinity-fabric" and spec.default_link not in INTRA_NODE_CHANNELS}
    assert not missing


@pytest.mark.parametrize("extra", [
    ("--training.micro_batch_size=4", "--memory.activation_checkpointing=full"),
    ("--memory.chunked_loss=true", "--memory.activation_checkpointing=selective", "--training.micro_batch_size=2"),
    ("--parallel.pp=2", "--training.micro_batch_size=2", "--parallel.num_microbatches=4"),
])
def test_the_groups_looked_up_once_per_degrees_are_the_layouts_own(extra: tuple[str, ...]) -> None:
    """communicating_groups caches by the degrees alone (the planner's cost): the groups of a layout with its
    own batch shape and memory knobs, computed afresh, are the cached ones."""
    cfg = load_config(None, ["--model.preset=debug", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                             "--parallel.tp=2", "--parallel.zero_stage=3", "--training.global_batch_size=16",
                             *extra])
    layout = build_layout(cfg)
    fresh = comm_buffers._communicating_groups.__wrapped__(comm_buffers.config_key(cfg.model), layout)
    assert comm_buffers.communicating_groups(cfg.model, layout) == list(fresh)
