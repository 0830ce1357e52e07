"""What makes a run's batches resumable: the rows of optimizer step k (all ranks, all accumulation
micro-batches) are drawn from default_rng([seed, k]) and each (micro-batch, rank) takes its own, so the
data of a step does not depend on micro_batch_size, accumulation or world size, and {"seed", "position"}
is the whole state. BatchSampler (text windows, train/data.py) and SampleSampler (fine-tuning samples,
train/samples.py) draw through it. Torch-free."""

from __future__ import annotations

import numpy as np

from trainfit.config import ConfigError


class StepRows:
    """The seeded draw of each step's global rows and this rank's share of them."""

    def __init__(self, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 grad_accum_steps: int = 1) -> None:
        if seed < 0:
            raise ConfigError(f"training.seed={seed}: must be >= 0 (it seeds the data order)")
        assert 0 <= rank < world_size and batch_size >= 1 and grad_accum_steps >= 1
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.grad_accum_steps = grad_accum_steps
        self.position = 0  # micro-batches drawn so far by this rank

    def step_draw(self, step: int, high: int) -> np.ndarray:
        """Step `step`'s global rows: integers in [0, high)."""
        global_rows = self.grad_accum_steps * self.world_size * self.batch_size
        return np.random.default_rng([self.seed, step]).integers(0, high, size=global_rows)

    def next_rows(self, high: int) -> np.ndarray:
        """This rank's rows of the next micro-batch (and one micro-batch further)."""
        step, micro = divmod(self.position, self.grad_accum_steps)
        first = (micro * self.world_size + self.rank) * self.batch_size
        self.position += 1
        return self.step_draw(step, high)[first:first + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ConfigError(f"training.seed={self.seed}: the checkpoint's data stream used seed "
                              f"{state['seed']}; resume with training.seed={state['seed']} or start a "
                              "fresh run (checkpoint.resume=never)")
        self.position = int(state["position"])
