"""trainfit: predict, plan and run memory- and compute-efficient LLM training.

Nothing heavy is imported here: `import trainfit` must stay instant for the analytic estimator.
"""

from trainfit.config import Config, ConfigError
from trainfit.configure import load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
