"""The one exception type for bad configuration, and the checks that raise it with the keys named."""

EX_CONFIG = 78
"""Exit status of every command for a bad config (sysexits' EX_CONFIG): a permanent failure, never retried."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent; the message names the keys."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def require_positive(section: str, **values: float) -> None:
    for key, value in values.items():
        require(value > 0, f"{section}.{key}={value} must be > 0")
