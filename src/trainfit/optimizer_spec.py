"""What each optimizer keeps per parameter and which kernel steps it on which device: the facts
train/optim.py builds the optimizer by and both estimators price it by (memory/closed_form/optimizer_memory.py,
train/preflight.py, calibrate), so they cannot disagree. Torch-free."""

from __future__ import annotations

from trainfit.config import OptimizerConfig

ADAM_STEP_TENSOR_BYTES = 4
"""torch.optim.Adam/AdamW keep `state["step"]` as a 0-dim fp32 tensor per parameter tensor
(torch/optim/adam.py with capturable=False; measured)."""


OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adamw-8bit": 2, "adafactor": 1}
"""exp_avg and exp_avg_sq; SGD's momentum_buffer. torch creates them like the parameter
(`torch.zeros_like`), so they follow its dtype (bf16 under bf16-pure). adamw-8bit's two are 8-bit and
adafactor's one is factored (optimizer_bytes prices both exactly); the counts are what a whole-size
state of each would be, for train/preflight's rough weights."""


FUSED_DEVICES = ("cuda", "cpu")
"""Devices with torch's fused Adam/AdamW kernel (torch/optim/adam.py, _get_fused_kernels_supported_devices);
train/optim.py runs it there unless optimizer.fused=false (`uses_fused_adam`)."""


def uses_fused_adam(optimizer: OptimizerConfig, device_type: str, sharded_loss_scaling: bool = False) -> bool:
    """Whether adamw / adam run torch's fused kernel (train/optim.py builds what this says; the step's
    temporaries follow it): optimizer.fused, or by default where FUSED_DEVICES have it, except under
    `sharded_loss_scaling` (Layout.sharded_loss_scaling: fp16-mixed under FSDP2 or a pipeline): torch's
    ShardedGradScaler hands the fused step a [1]-shaped inf flag that torch 2.13's fused kernel cannot
    take ("output with shape [] doesn't match the broadcast shape [1]", measured on CPU with ZeRO-2,
    ZeRO-3 and pp2), so those runs take foreach."""
    if optimizer.name not in ("adamw", "adam"):
        return False
    if optimizer.fused is not None:
        return optimizer.fused
    return device_type in FUSED_DEVICES and not sharded_loss_scaling


EIGHT_BIT_BLOCK = 256
"""adamw-8bit (torchao.optim.AdamW8bit, torchao/optim/subclass_8bit.py): each state is uint8 codes of
the parameter's (local) shape plus one fp32 absmax scale per block of this many values (torchao's
default, passed explicitly by train/optim.py), and a 256-entry fp32 code table per state tensor."""


EIGHT_BIT_MIN_SIZE = 4096
"""torchao keeps plain states (torch.zeros_like: the parameter's dtype) for a tensor whose local
shard has fewer values than this, or a number of values no multiple of EIGHT_BIT_BLOCK (adam.py's
_new_buffer)."""


EIGHT_BIT_TABLE_BYTES = 256 * 4
"""The code table (qmap) each 8-bit state tensor carries: 2**8 fp32 values."""


PER_TENSOR_OPTIMIZERS = ("adamw-8bit", "adafactor")
"""Optimizers whose states are priced tensor by tensor (matrix_shapes); the others never read the shapes."""
