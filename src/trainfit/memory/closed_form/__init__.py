"""The analytic memory estimator: every component of a step's peak on every rank, in closed form from the
model's description (models/architecture.py) and the layout. Torch-free."""

from trainfit.memory.closed_form.analytic import MemoryEstimate, StageMemory, estimate_memory, model_states
from trainfit.memory.closed_form.micro_batch import SharedSizes
from trainfit.memory.closed_form.run_shape import assumed_attention_kernel

__all__ = ["MemoryEstimate", "SharedSizes", "StageMemory", "assumed_attention_kernel", "estimate_memory",
           "model_states"]
