"""Log lines of training processes: `2026-11-30 14:40:01 node17 [rank 3] WARNING message`.

The host is in every line: c10d gives node ranks in the order nodes join, so the rank alone does not say
which machine a line (a hang, a crash) came from.

With hundreds of ranks, informational lines come from rank 0 only (every rank says the same); warnings
and errors come from every rank, since they are usually about that rank. Information goes to stdout,
warnings and errors to stderr, so a job log separates them and `2>` catches what needs a look.
The level comes from logging.level, or MOE_PRETRAIN_LOG_LEVEL when set (it wins: it is how a person
turns on debug output for one relaunch without editing the config). Command-line tools print their
product (a table, a script, JSON) on stdout with print: that is output, not a log.
"""

import logging
import os
import socket
import sys

from moe_pretrain.config.errors import ConfigError

PACKAGES = ("moe_pretrain", "parallel", "gpu_kernels", "launch", "checkpoints_tool")
"""Our top-level packages: their loggers get the handlers; third-party loggers are left alone."""
LEVEL_ENV = "MOE_PRETRAIN_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


class _RankFilter(logging.Filter):
    """Drops records below WARNING on ranks other than 0 (unless every rank is asked for)."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def resolve_level(configured: str = "info") -> int:
    """The level in force: $MOE_PRETRAIN_LOG_LEVEL if set, else the configured one."""
    name = os.environ.get(LEVEL_ENV, "").strip().lower() or configured.lower()
    if name not in LEVELS:
        source = f"${LEVEL_ENV}" if os.environ.get(LEVEL_ENV, "").strip() else "logging.level"
        raise ConfigError(f"{source}={name!r} must be one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def setup_logging(rank: int = 0, level: str = "info", all_ranks: bool = False) -> None:
    """(Re)configure our packages' loggers for this process; safe to call again (e.g. once the config,
    and so logging.level, is known)."""
    numeric = resolve_level(level)
    formatter = logging.Formatter(f"%(asctime)s {socket.gethostname()} [rank %(rank)s] %(levelname)s %(message)s",
                                  "%Y-%m-%d %H:%M:%S")
    rank_filter = _RankFilter(rank, all_ranks)
    info = logging.StreamHandler(sys.stdout)
    info.addFilter(_Below(logging.WARNING))
    problems = logging.StreamHandler(sys.stderr)
    problems.setLevel(logging.WARNING)
    for handler in (info, problems):
        handler.setFormatter(formatter)
        handler.addFilter(rank_filter)
    for package in PACKAGES:
        logger = logging.getLogger(package)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(info)
        logger.addHandler(problems)
        logger.setLevel(numeric)
        logger.propagate = False
