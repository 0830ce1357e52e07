"""NCCL's communicator buffers (memory/comm_buffers.py) against a hand computation from NCCL's
constants, and their place in the reserved margin: a term of it on GPUs, nothing on the CPU.
The group count itself is checked against a real mesh in tests/distributed/test_process_groups.py."""

from __future__ import annotations

from trainfit.configure import load_config
from trainfit.memory import comm_buffers
from trainfit.memory.analytic import estimate_memory
from trainfit.memory.comm_buffers import comm_buffer_bytes
from trainfit.memory.margin import ALLOCATOR_FRAGMENTATION, CUDA_CONTEXT_BYTES
from trainfit.parallel.groups import process_groups
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
    assert comm_buffer_bytes(layout, cfg.hardware) == 3 * 24 * 1 * CONNECTION  # 3 groups x 24 channels x 1 ring peer
    # PCIe 4 (L40S): 2 channels
    layout, cfg = _run("--hardware.gpu=L40S", "--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.zero_stage=3",
                       "--training.global_batch_size=4")
    assert comm_buffer_bytes(layout, cfg.hardware) == 3 * 2 * CONNECTION


def test_groups_across_nodes_add_the_trees_peers() -> None:
    # 2 nodes of 8: tp=8 inside a node; dp_shard=2 joins one GPU of each node; the world spans both.
    layout, cfg = _run("--hardware.gpu=H100", "--hardware.num_gpus=16", "--parallel.tp=8", "--parallel.zero_stage=3",
                       "--training.global_batch_size=2")
    assert [(g.name, g.size, g.stride) for g in process_groups(layout)] == [
        ("world", 16, 1), ("dp_shard", 2, 8), ("tp", 8, 1)]
    world = 16 * (1 + 3) * CONNECTION  # inter-node channels x (ring + tree peers)
    dp_shard = 16 * 1 * CONNECTION  # two ranks: one peer, whatever the algorithm
    tp = 24 * 1 * CONNECTION
    assert comm_buffer_bytes(layout, cfg.hardware) == world + dp_shard + tp


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
    assert comm_buffer_bytes(layout, cfg.hardware) == 0  # gloo's, not NCCL's
    assert (cpu.reserved_margin, cpu.margin_terms) == (0, {})
