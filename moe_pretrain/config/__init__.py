"""Typed configuration: dataclasses per section, loaded from YAML with command-line overrides."""

from moe_pretrain.config.blend import BlendConfig
from moe_pretrain.config.errors import ConfigError
from moe_pretrain.config.loader import config_to_dict, load_config, load_config_or_exit
from moe_pretrain.config.model import (
    AttnResConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    VisionConfig,
)
from moe_pretrain.config.run import (
    CheckpointConfig,
    Config,
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from moe_pretrain.config.stages import StageConfig

__all__ = [
    "AttnResConfig",
    "BlendConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "KDAConfig",
    "LaunchConfig",
    "LoggingConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "StageConfig",
    "TrainConfig",
    "VisionConfig",
    "config_to_dict",
    "load_config",
    "load_config_or_exit",
]
