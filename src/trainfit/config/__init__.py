"""One typed schema for a trainfit run, and its helpers: the bottom layer of trainfit.

schema.py (the dataclasses, ConfigError), docs.py, dump.py and overrides.py import nothing of
trainfit's outside this package. Reading a TOML file, resolving model presets and validating the
hardware need models/ and hardware.py, which sit above the schema: that is `trainfit.configure`
(load_config, config_from_dict, resolve_and_validate), one layer above them.
"""

from trainfit.config.docs import field_docs, iter_fields
from trainfit.config.dump import check_writable, dump_toml, write_atomic
from trainfit.config.overrides import split_overrides
from trainfit.config.schema import (
    SECTIONS,
    ACPolicy,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    Device,
    HardwareConfig,
    LoggingConfig,
    LRSchedule,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    OptimizerName,
    ParallelConfig,
    PeftConfig,
    PrecisionConfig,
    PrecisionMode,
    TrainingConfig,
    field_error,
)

__all__ = [
    "SECTIONS", "ACPolicy", "check_writable", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Device",
    "HardwareConfig", "LRSchedule", "LoggingConfig", "MemoryConfig", "ModelConfig", "OptimizerConfig",
    "OptimizerName", "ParallelConfig", "PeftConfig", "PrecisionConfig", "PrecisionMode", "TrainingConfig",
    "dump_toml", "field_docs", "field_error", "iter_fields", "split_overrides", "write_atomic",
]
