"""Job configuration: dataclass sections (`sections`, `parallelism`; fields declared with `fields.setting`),
loaded from TOML and `--section.key value` overrides
(`loader`), documented by `--help` and the reference in docs/config.md (`reference`). Imports no torch.

`python -m titanlite.config [--world-size N] [overrides]` checks a configuration (titanlite.cli.check_config).
"""

from titanlite.config.dpo import DPO_LOSSES, REFERENCES, Dpo
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.fields import DTYPE_NAMES
from titanlite.config.float8 import FLOAT8_RECIPES, Float8
from titanlite.config.loader import CONFIG_DIR, gradient_sync_mode, load, resolve_config_file, to_toml, validate
from titanlite.config.lora import LORA_TARGETS, Lora
from titanlite.config.parallelism import GRADIENT_SYNC, Parallelism
from titanlite.config.reference import help_text, markdown_reference
from titanlite.config.sections import (
    CHECKPOINT_PARTS,
    SECTIONS,
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Data,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    MoE,
    Optimizer,
    Profiling,
    Training,
    Validation,
)
from titanlite.errors import ConfigError

__all__ = [
    "CHECKPOINT_PARTS",
    "CONFIG_DIR",
    "DTYPE_NAMES",
    "GRADIENT_SYNC",
    "SECTIONS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "Data",
    "DPO_LOSSES",
    "Dpo",
    "FLOAT8_RECIPES",
    "FaultTolerance",
    "Float8",
    "ConfigError",
    "Job",
    "JobConfig",
    "LORA_TARGETS",
    "LRScheduler",
    "Lora",
    "Metrics",
    "MoE",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "REFERENCES",
    "Training",
    "Validation",
    "gradient_sync_mode",
    "help_text",
    "load",
    "markdown_reference",
    "resolve_config_file",
    "to_toml",
    "validate",
]
