"""One typed schema for a trainfit run: loaded from TOML, overridden by `--section.field=value`.

Split by job, dependencies one way: schema.py (the dataclasses, ConfigError; imports nothing of
trainfit's) <- hardware.py, models/presets.py, models/hf.py <- validate.py <- load.py; docs.py and
overrides.py read the schema only. Modules that the validation layer imports take their types from
`trainfit.config.schema`, never from here: this package imports them.
"""

from trainfit.config.docs import field_docs, iter_fields
from trainfit.config.dump import check_writable, dump_toml, write_atomic
from trainfit.config.load import config_from_dict, config_to_dict, load_config, read_raw
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
    PrecisionConfig,
    PrecisionMode,
    TrainingConfig,
    field_error,
)
from trainfit.config.validate import resolve_and_validate

__all__ = [
    "SECTIONS", "ACPolicy", "check_writable", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Device",
    "HardwareConfig", "LRSchedule", "LoggingConfig", "MemoryConfig", "ModelConfig", "OptimizerConfig",
    "OptimizerName", "ParallelConfig", "PrecisionConfig", "PrecisionMode", "TrainingConfig",
    "config_from_dict", "config_to_dict", "dump_toml", "field_docs", "field_error", "iter_fields", "load_config",
    "read_raw", "resolve_and_validate", "split_overrides", "write_atomic",
]
