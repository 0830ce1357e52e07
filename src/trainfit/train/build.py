"""The one way a run's model is built: on the meta device from the config, its fingerprint taken,
the precision policy's preparation, then parallelized for the layout on this rank's mesh. The
trainer and the traced estimator (traced.py) both build through here, so the model whose
step is traced is the model that trains; each then materializes it where it runs (the trainer on
its device, the traced estimator under fake tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainfit.config import Config
from trainfit.configure import config_to_dict
from trainfit.models import build_model, count_params
from trainfit.models.init import canonical_name
from trainfit.parallel.layout import Layout
from trainfit.peft.adapters import apply_adapters
from trainfit.peft.nf4 import quantize_base
from trainfit.peft.spec import base_identity
from trainfit.precision import PrecisionPolicy, precision_policy
from trainfit.train import manifest
from trainfit.train.parallelize import parallelize


@dataclass(frozen=True)
class BuiltModel:
    model: nn.Module
    """Parallelized, still on the meta device: materialize it where it runs."""
    num_params: int
    """Parameters of the whole model (every rank's together)."""
    fingerprint: manifest.Fingerprint
    """What this run's checkpoints hold (train/manifest.py): a checkpoint must match it to resume."""


def run_precision(layout: Layout, device_type: str) -> PrecisionPolicy:
    """The run's precision policy, read from the Layout (mode, fp8 scaling, fp8 all-gather) as every
    estimator reads it: the trainer and the traced estimator both take it here."""
    return precision_policy(layout.precision, device_type, fp8_scaling=layout.fp8_scaling,
                            fp8_all_gather=layout.fp8_all_gather)


def build_parallel_model(cfg: Config, layout: Layout, mesh: DeviceMesh | None, policy: PrecisionPolicy) -> BuiltModel:
    """The model of `cfg` for `layout`, this rank's part of it (pipeline stages, tensor and data
    parallel shards), on the meta device."""
    model = apply_adapters(build_model(cfg.model), cfg.model, cfg.peft)
    num_params = count_params(model)
    fingerprint = manifest.fingerprint({canonical_name(name): p.shape for name, p in model.named_parameters()},
                                       cfg.optimizer.name, cfg.precision.mode, config_to_dict(cfg)["model"])
    if cfg.peft.method != "none":  # its checkpoints hold the adapters: they fit one base only
        fingerprint["base"] = base_identity(cfg.model.init_from, cfg.training.seed)
    policy.prepare_model(model)
    if layout.adaptation is not None:  # QLoRA: NF4 after the policy's cast, before FSDP shards it
        quantize_base(model, cfg.model, cfg.peft, layout.adaptation.quantized)
    return BuiltModel(parallelize(model, layout, mesh, policy), num_params, fingerprint)
