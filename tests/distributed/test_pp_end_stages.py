"""A pipeline's last stage may hold the head alone (no blocks: nanotron's compute-balanced split gives such a
stage where the head weighs as much as several blocks): on 2 gloo ranks it trains like one process
(tests/_dist.py's check_parity, test_pp_parity.py's tolerance), under 1F1B and under GPipe with checkpointed
blocks. Its estimates: tests/estimator/test_consistency.py's pp2-head-alone point (the analytic and traced
peaks within 0.5%)."""

from __future__ import annotations

import pytest

from _dist import GlooTestCase, with_comms

PP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
STEPS = 4
pytestmark = pytest.mark.slow


class TwoRanks(GlooTestCase):
    @with_comms
    def test_end_stages_without_blocks(self) -> None:
        self.check_cases([
            (("--parallel.pp=2", "--parallel.pp_layers_per_stage=2,0"), PP_FP32, STEPS),  # the head alone
            (("--parallel.pp=2", "--parallel.pp_layers_per_stage=2,0", "--parallel.pp_schedule=gpipe",
              "--memory.activation_checkpointing=full"), PP_FP32, STEPS),
        ])
