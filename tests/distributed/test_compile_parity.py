"""training.compile composes with FSDP2 and activation checkpointing: 2 gloo ranks, each block
compiled after checkpointing and before fully_shard (parallel/apply.py), train like one eager
process. One 1-block model keeps it to one compilation per rank (~30 s cold on 2 busy cores).

Measured (and the tolerance), fp32, full checkpointing, ZeRO-3, 3 steps: loss 2e-7, parameters 3e-6 (COMPILED)."""

from __future__ import annotations

import pytest

from _dist import GlooTestCase, with_comms
from _runs import COMPILE_SHAPE

pytestmark = pytest.mark.slow  # ~90 s: two ranks compile (cold) and evaluate (a second, inference graph)

COMPILED = {"loss_rtol": 1e-5, "update_rtol": 1e-4}
"""Inductor's fused kernels sum in another order than eager's: loss and weights within fp32 rounding."""


class CompileParity(GlooTestCase):
    @with_comms
    def test_fsdp_compiled_blocks_with_checkpointing(self) -> None:
        self.check_parity(("--parallel.zero_stage=3", "--training.compile=true", *COMPILE_SHAPE), COMPILED, steps=3)
