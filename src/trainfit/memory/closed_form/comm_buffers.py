"""NCCL's communicator buffers, per rank: an estimate from NCCL's documented and source defaults,
fitted to nothing. Torch-free. A term of the reserved margin on GPUs (memory/margin.py): the
buffers live outside torch's caching allocator, so no tensor count sees them.

    comm_buffers = sum over the rank's process groups (parallel/groups.process_groups) that run a
                   ring or tree collective (communicating_groups) of
                   channels(group) x connections_per_channel(group) x CONNECTION_BYTES

Every assumption, with its source (NCCL 2.30.7's source, github.com/NVIDIA/nccl; its user guide,
docs/userguide/source/env.rst):
- CONNECTION_BYTES: a connection to one peer holds a buffer per protocol (src/transport/p2p.cc,
  p2pRecvSetup/p2pSendSetup: every protocol's comm->buffSizes[p]; with P2P read the SIMPLE one sits
  on the sender, still on this GPU for the connection it sends on), sized by src/init.cc's defaults:
  SIMPLE = NCCL_BUFFSIZE, 4 MiB (env.rst: "The default is 4194304 (4 MiB)"; DEFAULT_BUFFSIZE);
  LL = DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x
  sizeof(union ncclLLFifoLine) = 8 x 512 x 8 x 16 = 512 KiB; LL128 = DEFAULT_LL128_BUFFSIZE =
  NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x sizeof(uint64_t) =
  120 x 640 x 8 x 8 = 4,687.5 KiB (the constants: src/include/device.h). 9,633,792 bytes in all.
- channels: NCCL picks them from the topology (src/graph/search.cc, then ncclTopoPostset doubles
  them, src/graph/connect.cc); NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS override it. Assumed per
  intra-node link (INTRA_NODE_CHANNELS) and INTER_NODE_CHANNELS for a group spanning nodes.
- connections per channel: the ring receives from one peer per channel (src/transport/generic.cc,
  ncclTransportRingConnect). A group spanning nodes also connects NCCL's tree, which all-reduces
  between nodes (src/graph/tuning.cc): a parent and up to NCCL_MAX_TREE_ARITY = 3 children per
  channel (ncclTransportTreeConnect), one usually the ring's peer: 3 more, the worst rank's. At
  most size - 1 distinct peers in all (a connection is per peer: a 2-rank group has one).
- which groups connect: NCCL connects an algorithm's peers at its first collective that uses it
  (NCCL_RUNTIME_CONNECT=1, the default since 2.22; before 2.22 at init, every group), so a group
  holds these buffers only when an all-gather, reduce-scatter or all-reduce runs on it: one that
  parallel/collectives.py declares over its axes (parallel/groups.group_of), the trainer's loss
  and gradient-norm all-reduces among them. Torch makes data-parallel groups that carry none:
  under FSDP and ZeRO-1 the flattened "dp" and "dp_cp", and "dp_shard" when cp > 1 (they shard
  over "dp_shard_cp"); under DDP all but the one it averages over (parallel/mesh.ddp_mesh). Under
  memory.offload the gradient norms are CPU tensors, all-reduced by gloo (train/distributed.
  process_group_backend), which leaves the expert group ("ep") NCCL's all-to-alls only.

Not counted: NVLink SHARP's buffers (H100/H200 on NVSwitch, NCCL_NVLS_ENABLE: src/transport/nvls.cc
allocates nvlsChannels x 2 x NVLS_CHUNKSIZE x NCCL_STEPS per head), point-to-point buffers
(P2P_NVL_CHUNKSIZE x NCCL_STEPS per peer and p2p channel: the pipeline's sends and receives, expert
parallelism's all-to-alls, which torch's ProcessGroupNCCL issues as grouped ncclSend/ncclRecv, and
assumed the same where it calls NCCL 2.28's ncclAlltoAll), the connections' rounding to 2 MiB
(CUDA_IPC_MIN, src/include/comm.h), network connections' host-memory LL buffers (counted as device
memory here), and RCCL (MI300X's infinity-fabric link: not NCCL; 0 here).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from trainfit.config import HardwareConfig, ModelConfig
from trainfit.hardware import intra_node_link_name
from trainfit.models.architecture import config_key
from trainfit.parallel.collectives import collective_calls
from trainfit.parallel.groups import Group, group_of, process_groups
from trainfit.parallel.layout import Layout
from trainfit.perf.comms import span_is_intra_node

NCCL_STEPS = 8
NCCL_LL_LINES_PER_THREAD = 8
NCCL_LL_MAX_NTHREADS = 512
LL_FIFO_LINE_BYTES = 16
"""sizeof(union ncclLLFifoLine): two (data, flag) pairs of uint32 (src/include/device.h)."""
NCCL_LL128_ELEMS_PER_THREAD = 120
NCCL_LL128_MAX_NTHREADS = 640
LL128_ELEM_BYTES = 8
"""sizeof(uint64_t)."""
NCCL_MAX_TREE_ARITY = 3

SIMPLE_BUFFSIZE = 4 * 1024**2
LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * LL_FIFO_LINE_BYTES
LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * LL128_ELEM_BYTES
CONNECTION_BYTES = SIMPLE_BUFFSIZE + LL_BUFFSIZE + LL128_BUFFSIZE

INTRA_NODE_CHANNELS = {"nvlink4": 24, "nvlink3": 24, "pcie5": 4, "pcie4": 2, "nvlink5": 24, "nvlink4-h800": 24,
                       "pcie6": 4}
"""Channels of a group inside one node, by link (trainfit.hardware.LINKS). nvlink4: "24 coll
channels" in NCCL_DEBUG=INFO logs of 8 x H100 SXM on one node (AWS p5.48xlarge), as NCCL's search
gives it: 18 NVLinks x 20.6 GB/s (SM90_NVLINK_BW, src/graph/topo.h) hold 6 rings of 60 GB/s,
ncclTopoDupChannels doubles them to 12, ncclTopoPostset to 24. nvlink3: 24, "Channel 23/24" on
HGX A100 (NVIDIA/nccl-tests issue 100). pcie4 / pcie5: one ring fits a x16 link (NCCL models it at
24 / 48 GB/s, src/graph/topo.cc kvDictPciGen), doubled by ncclTopoPostset to 2; ncclTopoDupChannels
doubles a ring of 25 GB/s or more first, so 4 on Gen5 (derived from the source, no log checked).
nvlink5 (B200, GB200, B300), nvlink4-h800 and pcie6: no NCCL log or search constant read; assumed
nvlink4's and pcie5's counts, so that their groups are not counted as holding nothing (an upper
bound for H800's 8 NVLinks, which give NCCL's search fewer rings than H100's 18). RCCL's
infinity-fabric: not NCCL, 0 (the module docstring)."""
INTER_NODE_CHANNELS = 16
"""A group spanning nodes: "Channel 00/16" on 3 nodes of 8 x H100 with a 400 Gb/s NIC per GPU
(NVIDIA/nccl issue 1453). Fewer NICs give fewer channels."""
RING_CONNECTIONS = 1
TREE_CONNECTIONS = NCCL_MAX_TREE_ARITY


def group_channels(group: Group, layout: Layout, hardware: HardwareConfig) -> int:
    """The channels assumed for `group` (0 where NCCL's are unknown: RCCL, the CPU)."""
    return _channels(group, layout.world_size, hardware.gpus_per_node, intra_node_link_name(hardware))


def _channels(group: Group, world_size: int, gpus_per_node: int, link: str) -> int:
    if not span_is_intra_node(group.size, group.stride, world_size, gpus_per_node):
        return INTER_NODE_CHANNELS
    return INTRA_NODE_CHANNELS.get(link, 0)


def group_connections(group: Group, layout: Layout, hardware: HardwareConfig) -> int:
    """Peers one channel of `group` receives from: the ring's, plus the tree's across nodes."""
    return _connections(group, layout.world_size, hardware.gpus_per_node)


def _connections(group: Group, world_size: int, gpus_per_node: int) -> int:
    across = not span_is_intra_node(group.size, group.stride, world_size, gpus_per_node)
    return min(RING_CONNECTIONS + (TREE_CONNECTIONS if across else 0), group.size - 1)


def group_buffer_bytes(group: Group, layout: Layout, hardware: HardwareConfig) -> int:
    return group_channels(group, layout, hardware) * group_connections(group, layout, hardware) * CONNECTION_BYTES


RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives that connect a group's ring (and, across nodes, tree); all-to-all and p2p do not."""


def communicating_groups(model: ModelConfig, layout: Layout) -> list[Group]:
    """The process groups of a rank that run a ring or tree collective on NCCL (module docstring),
    in process_groups' order. Which do depends on the degrees, not on the batch's shape or the memory
    knobs: looked up once per model and degrees (the planner asks for thousands of layouts)."""
    return list(_communicating_groups(config_key(model), _degrees_only(_DEGREES(layout))))


_UNREAD = {"micro_batch_size": 1, "grad_accum_steps": 1, "num_microbatches": 1, "activation_checkpointing": "none",
           "ac_every_n_layers": 1, "chunked_loss": False, "loss_chunk_tokens": 1024, "rows": None}
"""What cannot change which groups communicate, each set to one value: the batch's shape, the checkpointing,
the chunked loss, the fine-tuning rows (and global_batch_size, set to dp)."""
_DEGREE_NAMES = tuple(f.name for f in dataclasses.fields(Layout) if f.name not in {*_UNREAD, "global_batch_size"})
_DEGREES = operator.attrgetter(*_DEGREE_NAMES)
"""A Layout's fields but _UNREAD's, in order: the caches' key, made without building a Layout (the planner's
cost: a key per memory estimate, a Layout per distinct key)."""


def _degrees_only(degrees: tuple) -> Layout:
    """The Layout of `degrees` (_DEGREES) with _UNREAD's values."""
    fields = dict(zip(_DEGREE_NAMES, degrees, strict=True))
    return Layout(**fields, **_UNREAD, global_batch_size=fields["dp_replicate"] * fields["dp_shard"])


@functools.lru_cache(maxsize=4096)
def _communicating_groups(model_key: tuple, layout: Layout) -> tuple[Group, ...]:
    model = ModelConfig(*model_key)
    on_gloo = {"grad_norm"} if layout.offload != "none" else set()
    axes = {c.axes for c in collective_calls(model, layout) if c.kind in RING_KINDS and c.tensor not in on_gloo}
    used = {group_of(layout, a).name for a in axes}  # a few distinct axes among many calls
    return tuple(g for g in process_groups(layout) if g.name in used)


def comm_buffer_bytes(model: ModelConfig, layout: Layout, hardware: HardwareConfig) -> int:
    """NCCL's buffers on one rank of `layout` (0 on the CPU, where gloo runs)."""
    if hardware.gpu == "cpu":
        return 0
    return _buffer_bytes(config_key(model), _DEGREES(layout), hardware.gpus_per_node, intra_node_link_name(hardware))


@functools.lru_cache(maxsize=4096)
def _buffer_bytes(model_key: tuple, degrees: tuple, gpus_per_node: int, link: str) -> int:
    """comm_buffer_bytes, once per model, degrees and what it reads of the hardware (a node's GPUs, their link)."""
    layout = _degrees_only(degrees)
    return sum(_channels(g, layout.world_size, gpus_per_node, link) * _connections(g, layout.world_size, gpus_per_node)
               * CONNECTION_BYTES for g in _communicating_groups(model_key, layout))
