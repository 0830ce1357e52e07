"""The memory meter: bytes of a step it is handed, measured at the allocator (measure.py) and attributed
to components (attribution.py)."""

from trainfit.memory.measured.attribution import Measurement, MemoryMeter, cuda_history
from trainfit.memory.measured.measure import collectives_completed, current_allocated_bytes, measure_peak

__all__ = ["Measurement", "MemoryMeter", "collectives_completed", "cuda_history", "current_allocated_bytes",
           "measure_peak"]
