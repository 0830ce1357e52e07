"""LoRA, DoRA and QLoRA train like one process: 2 gloo ranks under FSDP2 ZeRO-3 and DDP against one process
taking the same global batches (tests/_dist.py's check_parity: the loss of every step and both
evaluations, and the final weights relative to how far training moved them; the base never moves,
so that is the adapters'). fp32, _dist.LONG_STEPS steps (8; 20 with TRAINFIT_PARITY_LONG_STEPS=20),
the issue's tolerance: loss and parameters within 1e-4 relative. pytest -s prints the measured errors.
"""

from __future__ import annotations

import pytest

from _dist import GPT_OSS, LONG_STEPS, STEPS, GlooTestCase, with_comms

PEFT_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
LORA = ("--peft.method=lora", "--peft.targets=all-linear", "--peft.rank=4", "--training.lr=3e-3")
QLORA = (*LORA, "--peft.method=qlora", "--model.dim=256", "--model.ffn_dim=512")
"""QLoRA on blocks NF4 holds whole (debug's are too small); each rank quantizes the whole weight and
keeps its rows, so every layout trains on the same NF4 base."""
MOE_LORA = (*LORA, "--model.preset=debug-moe", "--model.num_shared_experts=1", "--training.micro_batch_size=2")
"""LoRA on every linear of an MoE block but its router: attention, the shared expert and each routed
expert (stacked adapters, split over expert-parallel ranks with their experts). The reference takes the
ranks' micro-batches of 2 (test_ep_parity.py: routing and its loss are per micro-batch)."""
pytestmark = pytest.mark.slow  # each layout trained on the ranks and on one process


class TwoRanks(GlooTestCase):
    @with_comms
    def test_lora_and_dora_under_fsdp2_and_ddp(self) -> None:
        self.check_cases([
            ((*LORA, "--parallel.zero_stage=3"), PEFT_FP32, LONG_STEPS),
            ((*LORA, "--parallel.zero_stage=0"), PEFT_FP32, LONG_STEPS),
            ((*LORA, "--parallel.zero_stage=3", "--peft.method=dora", "--memory.activation_checkpointing=full"),
             PEFT_FP32, 4),
            ((*QLORA, "--parallel.zero_stage=3"), PEFT_FP32, LONG_STEPS),
            ((*QLORA, "--parallel.zero_stage=0"), PEFT_FP32, LONG_STEPS),
        ])

    @with_comms
    def test_lora_on_routed_experts_under_fsdp2_and_expert_parallelism(self) -> None:
        self.check_cases([
            ((*MOE_LORA, "--parallel.zero_stage=3"), PEFT_FP32, LONG_STEPS),
            ((*MOE_LORA, "--parallel.ep=2", "--parallel.zero_stage=3"), PEFT_FP32, LONG_STEPS),
            ((*MOE_LORA, "--parallel.ep=2", "--parallel.zero_stage=2", "--model.capacity_factor=1.0"),
             PEFT_FP32, LONG_STEPS),
            # gpt-oss's block: LoRA on its biased attention, router and experts, under expert parallelism
            ((*MOE_LORA, *GPT_OSS, "--parallel.ep=2", "--parallel.zero_stage=3"), PEFT_FP32, STEPS),
        ])
