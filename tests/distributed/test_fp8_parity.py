"""fp8-mixed under FSDP2 trains like one process: 2 gloo ranks against one process given the same
global batches (tests/_dist.py's check_parity: 4 AdamW steps, 2 micro-batches of 2 rows per rank).

One process autocasts fp32 master weights into each float8 Linear; FSDP2 hands them bf16 compute
copies (and with precision.fp8_all_gather, fp8 ones with a scale all-reduced over the shards): the
amax of a bf16-rounded weight moves its scale, and e4m3's 3 mantissa bits turn that into rounding
differences of a few % on some elements, which Adam's first normalized updates carry. Measured
(tolerance): ZeRO-3 + float8 all-gather, tensorwise: loss 3.4e-4, parameters 1.3e-1; ZeRO-2 rowwise:
loss 3.1e-4, parameters 9.5e-2 (loss 1e-3, parameters 0.2; bf16-mixed's own FSDP-vs-autocast gap is
1.6e-4 and 2.6e-2: test_dp_parity.py). That the FSDP2 model holds float8 linears and fp8-gathered
weights is checked in tests/unit/test_float8.py.
"""

from __future__ import annotations

from _dist import GlooTestCase, with_comms

FP8 = {"loss_rtol": 1e-3, "update_rtol": 0.2}


class Float8Parity(GlooTestCase):
    @with_comms
    def test_fsdp_float8_matches_one_process(self) -> None:
        """ZeRO-3 with float8 all-gather (tensorwise). ZeRO-2 rowwise passed the same check when this was
        written (figures above); left out to keep the suite's time."""
        self.check_parity(("--precision.mode=fp8-mixed", "--parallel.zero_stage=3", "--precision.fp8_all_gather=true"),
                          FP8)
