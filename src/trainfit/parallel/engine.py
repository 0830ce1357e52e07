"""The data-parallel engines' settings that the estimators must price, written once. Torch-free:
parallel/data_parallel.py and parallel/zero.py build the engines with these values; perf/comms.py
counts their collectives and memory/closed_form/analytic.py their buffers from the same ones.
"""

from __future__ import annotations

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's gradient buckets (DistributedDataParallel's bucket_cap_mb, left at torch's 25): a bucket is
all-reduced once it holds at least this many bytes of gradients."""
DDP_GRADIENT_AS_BUCKET_VIEW = True
"""apply_ddp passes gradient_as_bucket_view=True (torch's default is False): DDP's flat all-reduce
buckets, allocated when DDP is built and alive as long as the module, *are* the gradients:
autograd's gradient is copied into its bucket slot and `.grad` becomes a view of it ("the saved
memory size will be equal to the total gradients size", DDP docs). So the gradients exist all step
long, the forward included (set_to_none only drops the views), and no second copy sits in buffers."""
ZERO1_BUCKET_BYTES = DDP_BUCKET_BYTES
"""ZeRO-1's largest bucket (its N chunks together, in the wider of gradient and parameter dtype),
DDP's size: it bounds the transient reduce-scatter and all-gather buffers, which exist for one
bucket at a time; a parameter larger than this gets a bucket of its own."""
FSDP_REDUCE_BYTES_MIXED = 4
"""FSDP2 reduces gradients in fp32 under the *-mixed modes (MixedPrecisionPolicy(reduce_dtype=
float32), as torchtitan configures it); fp32 and bf16-pure reduce in the parameters' dtype."""
FSDP_PREFETCH_BLOCKS = 1
"""FSDP2 blocks prefetched ahead (apply_fsdp): the next blocks' all-gathers are issued when a block
starts its forward (the previous ones' in backward), so this many more blocks' gathered weights
are alive beside the current one's."""
