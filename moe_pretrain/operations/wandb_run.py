"""Weights & Biases logging (logging.wandb): the step records' scalars, on the logging rank only.

A resumed run continues the same W&B run: its id is kept in <run_dir>/wandb_run_id on the first start and
read back by every later one (W&B's resume="allow"). The package is optional
(`pip install 'moe-pretrain[wandb]'`); asking for W&B without it stops at start-up naming the key.
"""

import secrets
from pathlib import Path
from typing import Any

from moe_pretrain.config import Config, ConfigError, config_to_dict

RUN_ID_FILE = "wandb_run_id"


def _wandb_module(cfg: Config) -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ConfigError(f"logging.wandb.project={cfg.logging.wandb.project!r} needs the wandb package: "
                          "pip install 'moe-pretrain[wandb]'") from err
    return wandb


def check_wandb(cfg: Config) -> None:
    """At start-up, on every rank: W&B asked for and not installed stops the run before anything starts."""
    if cfg.logging.wandb.project:
        _wandb_module(cfg)


def open_wandb_run(cfg: Config, run_dir: Path) -> Any | None:
    """The W&B run to log to, or None when logging.wandb.project is empty."""
    settings = cfg.logging.wandb
    if not settings.project:
        return None
    wandb = _wandb_module(cfg)
    id_file = run_dir / RUN_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(6)  # W&B run ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
    return wandb.init(project=settings.project, name=settings.name or run_dir.name, id=run_id, resume="allow",
                      mode=settings.mode, dir=str(run_dir), config=config_to_dict(cfg))
