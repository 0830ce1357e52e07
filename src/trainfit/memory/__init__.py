"""What a training step holds in memory, per component: one vocabulary and three ways to know it.

- here: the vocabulary every part shares (breakdown.py: the components and phases of `MemoryBreakdown`),
  predicted against measured (compare.py), and the allocator's margins (margin.py);
- closed_form/: the analytic estimator, torch-free (estimate_memory: every term from the model's
  description and the layout; block/ holds what one block keeps and makes in backward);
- traced/: the traced estimator's tools (the storage ledger and the CUDA caching allocator's rules); the
  traced estimate itself, trainfit/traced.py, sits above train/, whose step it runs;
- measured/: the meter (measure.py counts bytes at the allocator, attribution.py by component).

Code outside memory/ imports from these four faces only (tests/unit/test_imports.py holds it).
"""

from trainfit.memory.breakdown import COMPONENTS, PHASES, MemoryBreakdown
from trainfit.memory.compare import Comparison, comparison_table, plot_comparison
from trainfit.memory.margin import ALLOCATOR_FRAGMENTATION, CUDA_CONTEXT_BYTES

__all__ = ["ALLOCATOR_FRAGMENTATION", "COMPONENTS", "CUDA_CONTEXT_BYTES", "PHASES", "Comparison", "MemoryBreakdown",
           "comparison_table", "plot_comparison"]
