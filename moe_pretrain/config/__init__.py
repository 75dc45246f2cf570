"""Typed configuration: dataclasses per section, loaded from YAML with command-line overrides."""

from moe_pretrain.config.blend import BlendConfig
from moe_pretrain.config.cli import add_config_arguments, load_config_from_args, load_config_or_exit
from moe_pretrain.config.dry_run import DryRunConfig
from moe_pretrain.config.errors import EX_CONFIG, ConfigError
from moe_pretrain.config.evaluation import EvalConfig
from moe_pretrain.config.loader import config_to_dict, load_config
from moe_pretrain.config.model import (
    AttnResConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    VisionConfig,
    VisionEncoderConfig,
)
from moe_pretrain.config.precision import KernelsConfig, PrecisionConfig
from moe_pretrain.config.run import (
    CheckpointConfig,
    ClusterConfig,
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
    "EX_CONFIG",
    "AttnResConfig",
    "BlendConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DryRunConfig",
    "EvalConfig",
    "KDAConfig",
    "KernelsConfig",
    "LaunchConfig",
    "LoggingConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "StageConfig",
    "TrainConfig",
    "VisionConfig",
    "VisionEncoderConfig",
    "add_config_arguments",
    "config_to_dict",
    "load_config",
    "load_config_from_args",
    "load_config_or_exit",
]
