"""parallel.sp_recompute_gather (parallel/tensor_parallel._RegatherInBackward): under sequence parallelism a
column group keeps its input's shard and all-gathers it again in backward. On 2 gloo ranks: training
matches one process (tests/_dist.py's check_parity, the tolerances of test_tp_cp_parity.py); one step's
gradients are bit-identical to the same layout without it; what autograd keeps whole shrinks by the
gathered inputs; and backward issues one all-gather more per column group of every unwrapped block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from _dist import AUTOCAST, DP_BATCH, GlooTestCase, with_comms
from _runs import DEBUG_RUN
from trainfit.configure import load_config
from trainfit.models import build_model, materialize
from trainfit.parallel.mesh import build_mesh
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.tensor_parallel import vocabulary_parallel_loss
from trainfit.precision import precision_policy
from trainfit.train.parallelize import parallelize

TP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
TP_BF16 = {**AUTOCAST, "loss_rtol": 3e-4}
SP = ("--parallel.tp=2", "--parallel.sequence_parallel=true")
REGATHER = "--parallel.sp_recompute_gather=true"
pytestmark = pytest.mark.slow


def _step(regather: bool, *args: str) -> tuple[dict[str, torch.Tensor], int, int]:
    """One forward and backward of the debug Llama on this rank: (its local gradients, the bytes autograd
    saved whole of tensors of the gathered input's size, backward's all-gathers)."""
    cfg = load_config(None, [*DEBUG_RUN, *DP_BATCH, "--hardware.num_gpus=2", "--training.micro_batch_size=2", *SP,
                             f"--parallel.sp_recompute_gather={str(regather).lower()}", *args])
    layout = build_layout(cfg)
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), layout, build_mesh(layout, "cpu"),
                        precision_policy(cfg.precision.mode, "cpu"))
    model = materialize(model, torch.device("cpu"))
    seeded = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.training.seq_len), generator=seeded)
    whole = cfg.training.micro_batch_size * cfg.training.seq_len * cfg.model.dim
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor) and t.numel() == whole and t.to_local().numel() == whole:
            saved[0] += t.to_local().numel() * t.element_size()
        return t

    with vocabulary_parallel_loss(True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(tokens).flatten(0, -2).float(), tokens.flatten())
        counter = CommDebugMode()
        with counter:
            loss.backward()
    gathers = sum(n for op, n in counter.get_comm_counts().items() if "all_gather" in str(op))
    grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in model.named_parameters()}
    return grads, saved[0], gathers


class TwoRanks(GlooTestCase):
    @with_comms
    def test_training_matches_one_process(self) -> None:
        self.check_cases([
            ((*SP, REGATHER), TP_FP32, 4),
            ((*SP, REGATHER, "--precision.mode=bf16-mixed"), TP_BF16, 20),  # each projection's own cast
            # blocks 0 and 2 checkpointed (selective: they re-gather already), 1 and 3 re-gather by the option
            ((*SP, REGATHER, "--memory.activation_checkpointing=selective", "--memory.ac_every_n_layers=2"),
             TP_FP32, 4),
        ])

    @with_comms
    def test_the_gradients_are_those_of_the_gathered_inputs(self) -> None:
        for precision in ("fp32", "bf16-mixed"):
            kept, kept_bytes, kept_gathers = _step(False, f"--precision.mode={precision}")
            regathered, regathered_bytes, regathered_gathers = _step(True, f"--precision.mode={precision}")
            assert kept.keys() == regathered.keys()
            for name, grad in kept.items():
                assert torch.equal(grad, regathered[name]), name
            blocks = 2  # the debug preset's: attention and MLP groups in each
            assert regathered_gathers == kept_gathers + 2 * blocks
            # whole-sequence inputs of q/k/v and w1/w3 (each projection its own cast under autocast) no longer
            # saved whole: at least one [B x T x D] per group and block
            dtype_bytes = 4 if precision == "fp32" else 2
            whole = 2 * 32 * 64 * dtype_bytes  # debug preset: dim 64, 32 tokens; micro-batch 2
            assert kept_bytes - regathered_bytes >= 2 * blocks * whole, (kept_bytes, regathered_bytes)
