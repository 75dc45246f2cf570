"""How every command that reads a config takes it, the same way everywhere:

    python -m COMMAND [CONFIG ...] [--config FILE ...] [section.key=value ...]

Config files are layered in order (positional ones first, then each --config; later files win), then
the overrides apply. An item with `=` is an override, any other positional item a config file. Items
may be mixed with the command's own options in any order (argparse's intermixed parsing).
"""

import argparse
import sys

from moe_pretrain.config.errors import EX_CONFIG, ConfigError
from moe_pretrain.config.loader import load_config
from moe_pretrain.config.run import Config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML config file; repeat to layer files (later ones win)")
    parser.add_argument("config_items", nargs="*", metavar="[CONFIG] section.key=value",
                        help="config file(s), then overrides such as train.steps=20 model.moe.num_experts=8")


def config_sources(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(config files in layering order, overrides) from parsed arguments; at least one file is needed."""
    files = [item for item in args.config_items if "=" not in item] + list(args.config)
    overrides = [item for item in args.config_items if "=" in item]
    if not files:
        raise ConfigError("no config file given: pass one as CONFIG or --config FILE (e.g. configs/smoke.yaml)")
    return files, overrides


def load_config_from_args(args: argparse.Namespace) -> Config:
    return load_config(*config_sources(args))


def load_config_or_exit(args: argparse.Namespace) -> Config:
    """load_config_from_args for command-line tools: a bad config prints one line and exits EX_CONFIG (78)."""
    try:
        return load_config_from_args(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(EX_CONFIG) from None
