"""YAML files and `section.key=value` overrides mapped onto the typed config dataclasses.

Every value is checked against its field's type hint before the dataclasses validate themselves, so
an error always names the dotted key, the value and what was expected; an unknown key names the
nearest valid one.
"""

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moe_pretrain.config.blend import BlendConfig, megatron_data_path
from moe_pretrain.config.errors import ConfigError
from moe_pretrain.config.run import Config


def load_config(paths: str | Path | list[str | Path] | None, overrides: list[str] | tuple[str, ...] = (),
                values: dict[str, Any] | None = None) -> Config:
    """Read YAML file(s), deep-merged in order (later files win; lists are replaced), or start from
    defaults when paths is None, then set `values` ({"a.b.c": value}, from a program: a model read from another
    format), then apply `a.b.c=value` overrides (the user's, last)."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    raw: dict[str, Any] = {}
    layers: list[tuple[str, dict[str, Any]]] = []
    """Where each key came from, in order: (a file's path or 'the command line', its keys)."""
    for path in map(Path, paths):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = _read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
        layers.append((f"config file {path}", copy.deepcopy(loaded or {})))  # merging shares its dicts with raw
        _merge(raw, loaded or {})
    for key, value in (values or {}).items():
        _set_dotted(raw, key, value)
    given: dict[str, Any] = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like section.key=value")
        parsed = yaml.safe_load(value) if value.strip() else ""
        _set_dotted(raw, key.strip(), parsed)
        _set_dotted(given, key.strip(), parsed)
    layers.append(("the command line", given))
    try:
        return build(Config, raw, "")
    except UnknownKeyError as err:
        sources = [name for name, layer in layers if _holds(layer, err.key)]
        raise ConfigError(f"{err} (from {' and '.join(sources) or 'a program-set value'})") from None
    except KeyedConfigError as err:  # the value in force is the last layer's that holds the key
        sources = [name for name, layer in layers if _holds(layer, err.key)]
        raise ConfigError(f"{err} (from {sources[-1]})" if sources else str(err)) from None


def _holds(layer: dict[str, Any], dotted: str) -> bool:
    node: Any = layer
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


class KeyedConfigError(ConfigError):
    """A problem with one key's value; load_config names the file (or the command line) it came from."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class UnknownKeyError(KeyedConfigError):
    """A key the config has no field for."""


def _read_yaml(path: Path) -> Any:
    """One YAML file; a syntax error names the file, line and column (1-based, as editors count)."""
    try:
        with path.open() as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        context = getattr(err, "context", None)
        raise ConfigError(f"config file {where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
                          ) from None


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict of a config, for saving the resolved config next to a run."""
    return dataclasses.asdict(config)


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _all_keys(cls: type, prefix: str) -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        keys.append(dotted)
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys.extend(_all_keys(hint, dotted + "."))
    return keys


def _unknown_key_error(key: str) -> "UnknownKeyError":
    valid = _all_keys(Config, "")
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    same_leaf = [k for k in valid if k.rsplit(".", 1)[-1] == leaf]
    suggestion = same_leaf[0] if same_leaf else (close[0] if close else None)
    hint = f"; did you mean {suggestion}?" if suggestion else ""
    return UnknownKeyError(f"unknown config key {key}{hint}", key)


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate dataclass cls from a mapping, checking keys and types recursively."""
    where = prefix.rstrip(".") or "the config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown_key_error(f"{prefix}{key}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        dotted = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, value, dotted + ".")
        else:
            kwargs[name] = _coerce(value, hint, dotted)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if isinstance(value, bool) and ("off" if not value else "on") in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        if value not in choices:
            raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if origin is list:
        if isinstance(value, str) and typing.get_args(hint) == (BlendConfig,):
            value = megatron_data_path(value, key)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return [build(item, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping, got {type(value).__name__}")
        key_hint, value_hint = typing.get_args(hint)
        return {_coerce(k, key_hint, f"{key} key"): _coerce(v, value_hint, f"{key}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config field {key} has a type the loader does not know: {hint}")
    raise KeyedConfigError(f"{key}={value!r} has type {type(value).__name__}, expected {hint.__name__}", key)
