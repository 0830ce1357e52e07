"""The one importer of torch.testing._internal (private: an API move breaks this file only), and
the helpers of the multi-process tests in tests/distributed/.

GlooTestCase starts `world_size` real processes (gloo on CPU) per test method; a method groups its
configurations with `run_subtests`, so one start covers a whole technique. The processes are forked
from the session's fork server (tests/_ranks.py), not spawned as fresh interpreters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import run_subtests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

from _fp8_flops import counted_rank
from _ranks import rank_context, start_ranks
from _runs import run_config
from trainfit.parallel.data_parallel import state_dicts
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer, TrainResult

__all__ = ["AUTOCAST", "DP_BATCH", "FP32", "LONG_STEPS", "LOW", "MIXED_MOE", "MOE", "REFERENCES_ENV", "STEPS",
           "ZERO1_LAYOUT",
           "ZERO1_RUN_ENV", "ZERO3_LAYOUT", "ZERO3_RUN_ENV", "ZERO3_STEPS", "FourRankGlooTestCase", "GlooTestCase",
           "Reference", "fake_world", "full_params", "parity_name", "spawn_gloo", "subprocess_env", "torchrun",
           "with_comms"]


# Parity with one process (tests/distributed/test_dp_parity.py explains the measures and tolerances).
STEPS = 4
LONG_STEPS = int(os.environ.get("TRAINFIT_PARITY_LONG_STEPS", "8"))
"""The parity tests' longer runs (each technique's own layouts: every ZeRO stage, tp and cp, every pipeline
schedule, ep; the compositions beside them run STEPS): 8 AdamW steps, 6 past the 2-step warm-up, held to
the tolerances of the 20 steps the parity tables of docs/techniques were measured over
(TRAINFIT_PARITY_LONG_STEPS=20 runs those). Over 8 steps on an AMD EPYC, fp32: losses 3e-8 to 2.1e-7,
parameters 8e-8 to 1.7e-5, as over 20 (bounds: loss 1e-5 or 1e-4, parameters 1e-4); tp2 + SP in
bf16-mixed keeps 20 steps (test_tp_cp_parity.BF16_STEPS)."""
FP32 = {"loss_rtol": 1e-5, "update_rtol": 1e-4}
"""fp32: the parameters' bound is tensor, context and pipeline parallelism's 1e-4 (their parity tests'):
Adam's first updates are +-lr whatever a gradient's size, so the kernels' summation order sets the
figure, 4e-7 for DDP on one machine's CPU and 1.0e-5 on another's (AMD EPYC, foreach and fused alike)."""
AUTOCAST = {"loss_rtol": 1e-4, "update_rtol": 2e-2}
LOW = {"loss_rtol": 1e-3, "update_rtol": 6e-2}
MOE = {"loss_rtol": 1e-3, "update_rtol": 0.2}
MIXED_MOE = ("--model.num_layers=4", "--model.moe_dense_layers=1", "--model.moe_layer_step=2")
"""On an MoE model: the first layer dense, then every second one MoE (Qwen3-MoE's mlp_only_layers [0] and
decoder_sparse_step 2): dense, MoE, dense, MoE."""
GEMMA3 = ("--model.norm_placement=sandwich", "--model.norm_offset=true", "--model.mlp_activation=gelu_tanh",
          "--model.embedding_scale=true", "--model.qk_norm=head", "--model.head_dim=24",
          "--model.query_pre_attn_scalar=20", "--model.sliding_window=8", "--model.sliding_window_pattern=2",
          "--model.rope_local_theta=100")
"""Gemma 3's block on the debug model: four (1 + w) norms, GeGLU, QK-norm, scaled embeddings and queries, a
windowed layer (8 of the tests' 32 positions; its own RoPE base) before a global one."""
GEMMA2 = (*(a for a in GEMMA3 if not a.startswith(("--model.qk_norm", "--model.head_dim", "--model.rope_local"))),
          "--model.attention_softcap=5", "--model.final_softcap=3")
"""Gemma 2's block on the debug model: Gemma 3's without QK-norm, soft-capped scores (the eager attention) and
logits, capped low enough to bend them."""
GPT_OSS = ("--model.num_shared_experts=0", "--model.norm_fp32_gain=true", "--model.attention_sinks=true",
           "--model.qkv_bias=true", "--model.attention_out_bias=true", "--model.router_bias=true",
           "--model.expert_bias=true", "--model.swiglu_limit=2", "--model.sliding_window=8",
           "--model.sliding_window_pattern=2")
"""gpt-oss's block on the debug MoE model: attention sinks (the eager attention), biases on q, k, v, o, the router
and the experts, the clamped SwiGLU at a limit the debug model's values reach, a windowed layer (8 of the tests'
32 positions) before a global one."""
DP_BATCH = ("--training.micro_batch_size=2", "--training.global_batch_size=8")
"""The data-parallel tests' batch (after _runs.DEBUG_RUN, which they run): global batch 8, on 2 ranks 2
micro-batches of 2 rows each per rank, so gradient accumulation is part of every layout's test."""
# Only the layout differs from the reference: these fields are dropped from its config (the chunked
# loss too: the reference computes the whole logits, so its parity is the plain loss's; and
# training.compile: compiled runs are compared with one eager process).
LAYOUT_FIELDS = ("--parallel.", "--memory.offload", "--hardware.num_gpus", "--memory.chunked_loss",
                 "--memory.loss_chunk_tokens", "--training.compile")


# A spawned test method is killed after TIMEOUT_DEFAULT seconds (300 unless the environment's
# DISTRIBUTED_TESTS_DEFAULT_TIMEOUT says otherwise). That is a hang guard, and on a busy 2-core machine
# a parity method takes up to 90 s: give it pytest-timeout's 600 s (pyproject.toml), not a speed limit.
if "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT" not in os.environ:
    common_distributed.TIMEOUT_DEFAULT = 600


REFERENCES_ENV = "TRAINFIT_TEST_REFERENCES"
"""The folder of the session's one-process reference runs (GlooTestCase._reference)."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """One process's run of a parity case: its weights before and after (fp32, by name), its loss at
    every step and its validation losses."""

    initial: dict[str, torch.Tensor]
    losses: dict[int, float]
    val_losses: dict[int, float]
    final: dict[str, torch.Tensor]


class GlooTestCase(DTensorTestBase):
    """World of 2 CPU processes on gloo; the process group exists inside @with_comms methods."""

    @property
    def world_size(self) -> int:
        return 2

    def _spawn_processes(self) -> None:
        """Start the ranks from the fork server (tests/_ranks.py), each given this process's environment
        (the session's data cache, the run folders of session fixtures)."""
        context = rank_context("torch.testing._internal.common_distributed", "_dist")
        environ = dict(os.environ)

        def process(**kwargs: Any) -> multiprocessing.process.BaseProcess:
            return context.Process(**{**kwargs, "kwargs": {**kwargs["kwargs"], "environ": environ}})

        self._start_processes(process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe: Any, *, environ: dict[str, str],
             **kwargs: Any) -> None:
        """A rank: the starting process's environment, then the test (MultiProcessTestCase._run), its
        fp8 work counted for the pytest test that started it (tests/_fp8_flops.py)."""
        os.environ.clear()
        os.environ.update(environ)
        with counted_rank():
            super()._run(rank, test_name, file_name, parent_pipe, **kwargs)

    def run_subtests(self, config: dict[str, list[Any]], fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """fn(**one combination of config) for every combination, inside this one spawn."""
        run_subtests(self, config, fn, *args, **kwargs)

    @property
    def shared_dir(self) -> Path:
        """A folder every rank of this test sees (beside the test's FileStore)."""
        path = Path(self.file_name + ".d")
        path.mkdir(exist_ok=True)
        return path

    def check_parity(self, overrides: tuple[str, ...], tolerances: dict[str, float], steps: int = STEPS, *,
                     measure_memory: bool = False) -> TrainResult:
        """Train `steps` steps with `overrides` on this world and, on rank 0, compare the losses and the
        final weights (the ones the optimizer updates: ZeRO-1's fp32 masters, not its 16-bit
        parameters) with one process given the same global batches (tolerances: see FP32...).
        Returns this rank's result (its run's folder: shared_dir / parity_name(overrides, steps)).
        Rank 0 prints the largest relative loss error and the parameters' relative error (pytest -s
        shows them: the figures the parity tables of docs/techniques quote). The memory meter's steps are off
        unless `measure_memory` (numerics are the point; the accuracy grid measures the layouts)."""
        name = parity_name(overrides, steps)
        evaluation = (f"--training.eval_interval={steps}", "--training.eval_steps=2")  # at steps 0 and `steps`
        meter = f"--logging.measure_memory={str(measure_memory).lower()}"
        trainer = Trainer(run_config(self.shared_dir / name, *DP_BATCH, f"--training.steps={steps}", *evaluation,
                                     meter, *overrides))
        result = trainer.train()
        params = full_params(trainer)
        if self.rank != 0:
            return result
        reference_overrides = tuple(o for o in overrides if not o.startswith(LAYOUT_FIELDS))
        expected = self._reference(name, reference_overrides, steps)
        # the checkpoint form (state_dicts) holds what trains: a fine-tuned run's adapters, not its frozen base
        assert params and set(params) <= set(expected.final), sorted(set(params) - set(expected.final))[:3]
        initial = {key: value for key, value in expected.initial.items() if key in params}
        final = {key: value for key, value in expected.final.items() if key in params}
        self.assertEqual(sorted(result.losses), list(range(1, steps + 1)))
        self.assertEqual(sorted(result.val_losses), [0, steps])
        loss_error = 0.0
        for losses, expected_losses in ((result.losses, expected.losses), (result.val_losses, expected.val_losses)):
            for step, loss in expected_losses.items():
                self.assertAlmostEqual(losses[step], loss, delta=tolerances["loss_rtol"] * abs(loss), msg=str(step))
                loss_error = max(loss_error, abs(losses[step] / loss - 1))
        error = sum(((params[key] - value) ** 2).sum() for key, value in final.items()).sqrt()
        moved = sum(((value - initial[key]) ** 2).sum() for key, value in final.items()).sqrt()
        self.assertLess(float(error / moved), tolerances["update_rtol"])
        print(f"world {self.world_size}, {steps} steps, {' '.join(overrides)}: loss {loss_error:.1e}, "
              f"parameters {float(error / moved):.1e}")
        return result

    def check_cases(self, cases: list[tuple[tuple[str, ...], dict[str, float], int]]) -> None:
        """check_parity of every (overrides, tolerances, steps), in this one spawn."""
        self.run_subtests({"case": cases}, lambda case: self.check_parity(case[0], case[1], steps=case[2]))

    def _reference(self, name: str, overrides: tuple[str, ...], steps: int) -> Reference:
        """One process's run of `overrides` over `steps`, trained once per session: saved in the
        folder of REFERENCES_ENV (tests/distributed/conftest.py; else this test's own), where every
        later parity case with the same reference, in this test or another, reads it. The run is a
        function of its overrides alone (one process, seeded weights and data)."""
        evaluation = (f"--training.eval_interval={steps}", "--training.eval_steps=2")
        args = (*DP_BATCH, f"--training.steps={steps}", *evaluation, "--training.micro_batch_size=8",
                "--logging.measure_memory=false", *overrides)
        folder = Path(os.environ.get(REFERENCES_ENV) or self.shared_dir / "references")
        path = folder / f"{hashlib.sha256(repr(args).encode()).hexdigest()[:20]}.pt"
        if path.exists():
            return Reference(**torch.load(path))
        trainer = Trainer(run_config(self.shared_dir / f"{name}-reference", *args), world=World())
        initial = {key: value.detach().float().clone() for key, value in trainer.model.state_dict().items()}
        result = trainer.train()
        final = {key: value.detach().float() for key, value in trainer.model.state_dict().items()}
        reference = Reference(initial, result.losses, result.val_losses, final)
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(dataclasses.asdict(reference), partial)
        partial.replace(path)  # whole or absent, for a reader in another test
        return reference



PARITY_NAME_CHARS = 120
"""A parity run's folder name at most (with room under the file system's 255 for what its runs add): a longer
one keeps its start and a hash of the whole, the same on every rank."""


def parity_name(overrides: tuple[str, ...], steps: int) -> str:
    """The folder (under GlooTestCase.shared_dir) of check_parity's run of `overrides`."""
    name = "_".join(o.split(".")[-1] for o in overrides).replace("=", "-").replace("+", "-") + f"-{steps}"
    if len(name) <= PARITY_NAME_CHARS:
        return name
    return f"{name[:PARITY_NAME_CHARS - 17]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


class FourRankGlooTestCase(GlooTestCase):
    """World of 4 CPU processes on gloo."""

    @property
    def world_size(self) -> int:
        return 4

def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained weights, whole, on every rank, by name (collective for sharded layouts): the
    model state dict a checkpoint saves (ZeRO-1: the master weights)."""
    state = state_dicts(trainer.model, trainer.optimizer)[0]
    params = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()
              for name, t in state.items()}
    if trainer.layout.pp == 1:
        return params
    merged: dict[str, torch.Tensor] = {}
    for stage_params in trainer.world.gather_objects(params):  # each pipeline rank holds its stages'
        merged.update(stage_params)
    return merged


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank `rank` of a `world_size`-rank world on the `fake` backend: collectives
    return at once without moving data, so FSDP2 / DTensor / DDP run their real code paths in one
    process. Right for counting collectives (tests/estimator/test_comms.py), never for numerics."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- a gloo world the caller waits for


def spawn_gloo(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `fn(rank, *args)` in `world_size` fresh processes (tests/_ranks.py's start_ranks) joined in
    one gloo world (torchrun's environment), and wait for them: for tests that need the calling
    process free of any process group (the traced estimator brings a fake one). `fn` must be a
    module-level function."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_gloo_rank, world_size, world_size, port, fn, args)


def _gloo_rank(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    torch.distributed.init_process_group("gloo")
    try:
        fn(rank, *args)
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- torchrun, as users launch trainfit

# 2-rank ZeRO-3 and ZeRO-1 runs of the CLI (tests/distributed/conftest.py: zero3_run, zero1_run),
# resumed elsewhere.
ZERO3_STEPS = 6
ZERO3_LAYOUT = ("--parallel.zero_stage=3", "--checkpoint.interval=3", "--training.eval_interval=3")
ZERO3_RUN_ENV = "TRAINFIT_TEST_ZERO3_RUN"
ZERO3_PROFILED_STEP = 4
"""The step of the ZeRO-3 run that `trainfit train --profile` traces (tests/distributed/test_profile_ranks.py):
neither the memory meter's (1-2) nor a checkpoint's or evaluation's."""
ZERO1_LAYOUT = ("--parallel.zero_stage=1", "--checkpoint.interval=3", "--training.eval_interval=3")
ZERO1_RUN_ENV = "TRAINFIT_TEST_ZERO1_RUN"


def torchrun(nproc: int, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N ARGS` (the torchrun script, as a module; standalone
    picks a free port, so concurrent test sessions do not collide)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], capture_output=True, text=True, env=env)


def subprocess_env(tmp_path_factory: Any) -> dict[str, str]:
    """The session's data cache (tests/conftest.py), for processes a session fixture starts."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.getbasetemp() / "cache"), "OMP_NUM_THREADS": "1"}
