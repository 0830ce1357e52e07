"""A validated Config from a TOML file, overrides or nested dicts: the layer above models/ and hardware.py.

load.py checks names and types against the schema (`trainfit.config`); validate.py fills the model from
its preset or HF config.json and checks the hardware and every field. Both need models/ and
hardware.py, which take only the schema from config: so they live here, above all three.
"""

from trainfit.configure.load import (
    config_from_dict,
    config_of_raw,
    config_to_dict,
    load_config,
    read_config,
    read_raw,
)
from trainfit.configure.validate import resolve_and_validate

__all__ = ["config_from_dict", "config_of_raw", "config_to_dict", "load_config", "read_config", "read_raw",
           "resolve_and_validate"]
