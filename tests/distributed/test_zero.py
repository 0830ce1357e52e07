"""ZeRO-1 as the paper defines it (parallel/zero.py) on gloo ranks: it trains like one process, holds
the paper's bytes per rank, and its DCP checkpoints load into a plain model and optimizer.

Runs: a tiny classifier (Linear-LayerNorm-GELU-Linear, 3 classes: the output layer's 3 rows split
unevenly, on 4 ranks one rank holds none) sees a global batch of 16 rows per step, every rank its
rows, in `accum` micro-batches; one process takes the same 16 rows at once. Warmup LR schedule on
the ZeroOptimizer (its param_groups are the inner optimizer's).

Measured (tolerance), relative errors: losses and gradient norms per step; final parameters as the
norm of the difference over the norm of the reference, per tensor:
- fp32, 20 steps, world 2 and 4, AdamW and SGD, with and without accumulation, clipping and tiny
  buckets: losses 2e-7, norms 3e-7, parameters 3e-7 (1e-5): only the summation order of the
  reduction differs; the replicated parameters equal the gathered masters bitwise.
- bf16 parameters with fp32 master weights, 20 steps: losses 7e-4, norms 2e-3, parameters 8e-3;
  with grad_dtype=fp32: 5e-4, 2e-3, 6e-3 (losses and norms 1e-2, parameters 2e-2, i.e. a few bf16
  ulps of 2^-8). One process computes one bf16 gradient over the whole batch; here each rank rounds
  its micro-batches' gradients to bf16, accumulates and averages them in bf16 (or fp32), so the
  gradients differ by about a bf16 ulp, and the bf16 parameters and bf16 logits by one here and there.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LambdaLR

from _dist import FourRankGlooTestCase, GlooTestCase, with_comms
from trainfit.configure import load_config
from trainfit.parallel.zero import ZeroOptimizer
from trainfit.precision import step_optimizer
from trainfit.train.optim import make_optimizer, param_groups

STEPS = 20
ROWS = 16  # global batch
FEATURES = 16
WEIGHT_DECAY = 0.1
FP32 = {"loss_rtol": 1e-5, "param_rtol": 1e-5}
BF16 = {"loss_rtol": 1e-2, "param_rtol": 2e-2}


class Tiny(nn.Module):
    def __init__(self, hidden: int = 30, classes: int = 3) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(FEATURES, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def tiny(dtype: torch.dtype, seed: int = 0, **sizes: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(**sizes).to(dtype)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, FEATURES, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator)


def inner_factory(optimizer: str) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    cfg = load_config(None, [f"--optimizer.name={optimizer}", "--training.lr=1e-2",
                             f"--training.weight_decay={WEIGHT_DECAY}"])
    return functools.partial(make_optimizer, opt=cfg.optimizer, train=cfg.training, device_type="cpu")


def warmup(optimizer: torch.optim.Optimizer) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def reference(dtype: torch.dtype, optimizer: str, clip: float) -> tuple[list[float], list[float], dict]:
    """One process, whole global batches: a plain optimizer on the parameters (fp32), or on fp32
    master copies of bf16 parameters (cast gradients in, updated weights out)."""
    model = tiny(dtype)
    groups = param_groups(model, WEIGHT_DECAY)
    masters = {id(p): p if dtype == torch.float32 else p.detach().float() for g in groups for p in g["params"]}
    inner = inner_factory(optimizer)([{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups])
    schedule = warmup(inner)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step))
        loss.backward()
        losses.append(loss.item())
        for p in model.parameters():
            if masters[id(p)] is not p:
                masters[id(p)].grad = p.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip).item())
        inner.step()
        schedule.step()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(masters[id(p)])
        model.zero_grad(set_to_none=True)
        inner.zero_grad(set_to_none=True)
    return losses, norms, {name: masters[id(p)].detach() for name, p in model.named_parameters()}


def full_masters(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """The fp32 master weights, whole, by parameter name (collective)."""
    return {name: value.full_tensor() for name, value in zero.model_state_dict().items()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


class ZeroParity:
    """Mixed into GlooTestCase at world 2 and 4."""

    def train(self, model: nn.Module, zero: ZeroOptimizer, accum: int, clip: float) -> tuple[list[float], list[float]]:
        """STEPS steps on this rank's rows of each global batch, in `accum` micro-batches."""
        schedule = warmup(zero)
        losses, norms = [], []
        for step in range(STEPS):
            x, y = (t.chunk(self.world_size)[self.rank] for t in batch(step))
            total = torch.zeros(())
            for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
                loss = loss_of(model, xs, ys) / accum
                loss.backward()
                total += loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / self.world_size)
            zero.reduce_gradients()
            norms.append(zero.clip_grad_norm_(clip).item())
            zero.step()
            schedule.step()
            zero.zero_grad()
        return losses, norms

    def check_parity(self, dtype: torch.dtype, optimizer: str, accum: int, clip: float, bucket_bytes: int,
                     grad_dtype: torch.dtype | None, tolerances: dict[str, float]) -> None:
        model = tiny(dtype)
        zero = ZeroOptimizer(model, param_groups(model, WEIGHT_DECAY), inner_factory(optimizer),
                             dist.group.WORLD, grad_dtype=grad_dtype, bucket_bytes=bucket_bytes)
        losses, norms = self.train(model, zero, accum, clip)
        expected_losses, expected_norms, expected = reference(dtype, optimizer, clip)
        for step, (loss, expected_loss) in enumerate(zip(losses, expected_losses, strict=True)):
            self.assertLess(abs(loss - expected_loss), tolerances["loss_rtol"] * expected_loss, step)
        for norm, expected_norm in zip(norms, expected_norms, strict=True):
            self.assertLess(abs(norm - expected_norm), tolerances["loss_rtol"] * expected_norm)
        masters = full_masters(zero)
        for name, p in model.named_parameters():
            self.assertLess(relative_error(masters[name], expected[name]), tolerances["param_rtol"], name)
            self.assertTrue(torch.equal(p, masters[name].to(dtype)), name)  # replicas are the masters, cast


class ZeroWorld2(ZeroParity, GlooTestCase):
    @with_comms
    def test_parity_memory_loss_scaling_and_checkpoint(self) -> None:
        torch.set_num_threads(1)  # one per rank: the ranks share the machine's cores
        self.run_subtests({"case": [
            (torch.float32, "adamw", 1, math.inf, 2**20, None, FP32),
            (torch.float32, "adamw", 2, 0.1, 256, None, FP32),  # several buckets, fc1.weight alone in one
            (torch.float32, "sgd", 2, 0.1, 2**20, None, FP32),
            (torch.bfloat16, "adamw", 2, 0.1, 2**20, None, BF16),
            (torch.bfloat16, "adamw", 2, 0.1, 2**20, torch.float32, BF16),
        ]}, lambda case: self.check_parity(*case))
        self.run_subtests({"dtype": [torch.bfloat16, torch.float32], "grad_dtype": [None, torch.float32]},
                          self.check_memory)
        self.check_inf_skips_the_step_on_every_rank()
        self.run_subtests({"dtype": [torch.bfloat16, torch.float32]}, self.check_dcp_checkpoint)

    def check_memory(self, dtype: torch.dtype, grad_dtype: torch.dtype | None) -> None:
        """Each category holds the paper's bytes exactly (every dim 0 even: no padding)."""
        x, y = (t.chunk(self.world_size)[self.rank] for t in batch(0))
        model = tiny(dtype, hidden=64, classes=4)
        psi, n = sum(p.numel() for p in model.parameters()), self.world_size
        low, grad_bytes = dtype.itemsize, (grad_dtype or dtype).itemsize
        num_tensors = len(list(model.parameters()))
        before = live_tensor_bytes() if dtype != torch.float32 else None  # a scan of every object: 0.8 s
        zero = ZeroOptimizer(model, param_groups(model, WEIGHT_DECAY), inner_factory("adamw"), dist.group.WORLD,
                             grad_dtype=grad_dtype)
        for _ in range(2):  # the second step finds the optimizer states in place
            loss_of(model, x, y).backward()
            zero.reduce_gradients()
            stepping = zero.state_bytes()
            zero.step()
            zero.zero_grad()
        between = zero.state_bytes()
        master = 0 if dtype == torch.float32 else 4 * psi // n
        master_grads = 0 if grad_bytes == 4 else 4 * psi // n  # fp32 gradient shards are views of the buffers
        expected = {"params": low * psi, "grads": grad_bytes * psi, "master_params": master,
                    "master_grads": 0, "optimizer": 8 * psi // n + 4 * num_tensors}  # + AdamW's step counters
        self.assertEqual(between, expected)
        self.assertEqual(stepping, {**expected, "master_grads": master_grads})
        if before is not None:  # nothing else stays: every tensor the optimizer added is in a category
            self.assertEqual(live_tensor_bytes() - before, sum(between.values()) - between["params"])

    def check_inf_skips_the_step_on_every_rank(self) -> None:
        """fp16 with ShardedGradScaler: an inf in rank 1's gradient shard only skips step 2 on both
        ranks (weights and states unchanged, scale halved); steps 1 and 3 update."""
        model = tiny(torch.float16)
        zero = ZeroOptimizer(model, param_groups(model, WEIGHT_DECAY), inner_factory("adamw"), dist.group.WORLD)
        with self.assertRaisesRegex(RuntimeError, "before reduce_gradients"):
            zero.step()
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10, process_group=dist.group.WORLD)
        x, y = (t.chunk(self.world_size)[self.rank] for t in batch(0))
        for step in (1, 2, 3):
            before = [p.detach().clone() for p in model.parameters()]
            before_masters = {k: v.clone() for k, v in full_masters(zero).items()}
            scale = scaler.get_scale()
            scaler.scale(loss_of(model, x, y)).backward()
            zero.reduce_gradients()
            if step == 2 and self.rank == 1:
                zero.param_groups[0]["params"][0].grad[0, 0] = math.inf
            scaler.unscale_(zero)
            zero.clip_grad_norm_(1.0)
            stepped = step_optimizer(zero, scaler)
            zero.zero_grad()
            changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
            masters = full_masters(zero)
            if step == 2:
                self.assertFalse(stepped)
                self.assertFalse(any(changed))
                self.assertEqual(scaler.get_scale(), scale / 2)
                for name, value in masters.items():
                    self.assertTrue(torch.equal(value, before_masters[name]), name)
                self.assertTrue(all(s["step"].item() == 1 for s in zero.state.values()))
            else:
                self.assertTrue(stepped)
                self.assertTrue(all(changed))
        self.assertTrue(all(s["step"].item() == 2 for s in zero.state.values()))

    def check_dcp_checkpoint(self, dtype: torch.dtype) -> None:
        """3 steps, dcp.save by both ranks; then (a) one plain process loads it into an fp32 model and
        a plain AdamW (dcp.load + set_state_dict): the fp32 master weights and the states exactly;
        (b) a fresh ZeroOptimizer loads it and continues exactly as the saved one does."""
        model = tiny(dtype)
        zero = ZeroOptimizer(model, param_groups(model, WEIGHT_DECAY), inner_factory("adamw"), dist.group.WORLD)
        x, y = (t.chunk(self.world_size)[self.rank] for t in batch(0))

        def one_step(model: nn.Module, zero: ZeroOptimizer) -> None:
            loss_of(model, x, y).backward()
            zero.reduce_gradients()
            zero.step()
            zero.zero_grad()

        for _ in range(3):
            one_step(model, zero)
        path = str(self.shared_dir / f"zero1-dcp-{dtype}")
        dcp.save({"model": zero.model_state_dict(), "optimizer": zero.optimizer_state_dict()}, checkpoint_id=path)
        masters = full_masters(zero)
        states = {fqn: {k: v.full_tensor() if k != "step" else v for k, v in s.items()}
                  for fqn, s in zero.optimizer_state_dict()["state"].items()}
        if self.rank == 0:
            plain = tiny(torch.float32, seed=1)
            optimizer = inner_factory("adamw")(param_groups(plain, WEIGHT_DECAY))
            model_sd, optim_sd = get_state_dict(plain, optimizer)
            dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=True)
            set_state_dict(plain, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            for name, p in plain.named_parameters():
                self.assertTrue(torch.equal(p, masters[name]), name)
                self.assertEqual(set(optimizer.state[p]), {"step", "exp_avg", "exp_avg_sq"})
                for key, value in optimizer.state[p].items():
                    self.assertTrue(torch.equal(value, states[name][key]), (name, key))
            self.assertEqual([g["lr"] for g in optimizer.param_groups], [g["lr"] for g in zero.param_groups])
        if dtype != torch.float32:  # what was saved is the fp32 masters, not the bf16 weights
            self.assertFalse(torch.equal(masters["fc1.weight"], model.fc1.weight.float()))
        resumed_model = tiny(dtype, seed=1)
        resumed = ZeroOptimizer(resumed_model, param_groups(resumed_model, WEIGHT_DECAY), inner_factory("adamw"),
                                dist.group.WORLD)
        state = {"model": resumed.model_state_dict(), "optimizer": resumed.optimizer_state_dict()}
        dcp.load(state, checkpoint_id=path)
        resumed.load_model_state_dict(state["model"])
        resumed.load_optimizer_state_dict(state["optimizer"])
        one_step(model, zero)
        one_step(resumed_model, resumed)
        for (name, p), q in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
            self.assertTrue(torch.equal(p, q), name)
        expected = full_masters(zero)
        for name, value in full_masters(resumed).items():
            self.assertTrue(torch.equal(value, expected[name]), name)


class ZeroWorld4(ZeroParity, FourRankGlooTestCase):
    @with_comms
    def test_parity(self) -> None:
        torch.set_num_threads(1)  # one per rank: the ranks share the machine's cores
        self.run_subtests({"case": [
            (torch.float32, "adamw", 1, math.inf, 2**20, None, FP32),
            (torch.float32, "adamw", 2, 0.1, 256, None, FP32),
        ]}, lambda case: self.check_parity(*case))


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python holds (each counted once), not the allocator's view."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
