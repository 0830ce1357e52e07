"""The chunked loss (memory.chunked_loss) trains like one process computing the whole logits, on the
layouts it composes with: tensor parallelism's vocabulary-parallel loss (with sequence parallelism),
FSDP2 in bf16, context parallelism and a pipeline's last stage (tests/_dist.py's check_parity: the
reference drops the chunking, so what is compared is the plain loss's run). 4 steps each; chunks of
24 tokens, which divide no micro-batch's 64 (or a cp rank's 32) evenly, so a short last chunk runs too.
Tolerances: _dist's FP32 (loss 1e-5, parameters 1e-4) for context parallelism, tensor and pipeline
parallelism's own 1e-4, and _dist's LOW for FSDP2 in bf16: there the plain loss's run is itself
1.3e-4 from one process at step 4's evaluation (4.87239 against 4.87177; chunked: 4.87245).
"""

from __future__ import annotations

import pytest

from _dist import FP32, LOW, GlooTestCase, with_comms

CHUNKED = ("--memory.chunked_loss=true", "--memory.loss_chunk_tokens=24")
TP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
"""Tensor and pipeline parallelism's own bound (test_tp_cp_parity.py, test_pp_parity.py)."""
pytestmark = pytest.mark.slow  # each layout trained on the ranks and on one process


class TwoRanks(GlooTestCase):
    @with_comms
    def test_chunked_loss_layouts(self) -> None:
        self.check_cases([
            ((*CHUNKED, "--parallel.tp=2", "--parallel.sequence_parallel=true"), TP_FP32, 4),
            ((*CHUNKED, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed"), LOW, 4),
            ((*CHUNKED, "--parallel.cp=2"), FP32, 4),
            ((*CHUNKED, "--parallel.pp=2", "--parallel.pp_schedule=1f1b"), TP_FP32, 4),
            ((*CHUNKED, "--parallel.pp=2", "--parallel.pp_schedule=zbv-zero-bubble", "--model.num_layers=4"),
             TP_FP32, 4),
        ])
