"""A config from a TOML file, and overrides by dotted path: every mistake is one line that names the key.

A file's tables are the config's sections (`[network]`, `[spec.outer]`); a key that is no field, or a value of
the wrong type, is a ConfigError such as `peer.toml: [gossip] unknown key 'fanot' (did you mean 'fanout'?)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from p2p_diloco.config.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ConfigT = TypeVar("ConfigT", bound="DataclassInstance")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file (stdlib `tomllib`; `tomli` on Python 3.10 if it is installed)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(f"{path}: reading a TOML config file needs Python >= 3.11 or `pip install tomli`") \
                from None
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        tables: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))  # tomli (3.10) has no types
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return tables


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field's type, resolved (the modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type, Any]]:
    """(path, owning dataclass, type) of every field that is not itself a dataclass, nested ones walked."""
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from leaves(tp, prefix + (f.name,))
        else:
            yield prefix + (f.name,), cls, tp


def value_at(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def replace_paths(obj: ConfigT, updates: Mapping[tuple[str, ...], Any]) -> ConfigT:
    """`obj` with the field at each path replaced (`dataclasses.replace`, level by level)."""
    direct = {path[0]: v for path, v in updates.items() if len(path) == 1}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, v in updates.items():
        if len(path) > 1:
            nested.setdefault(path[0], {})[path[1:]] = v
    for name, sub in nested.items():
        direct[name] = replace_paths(getattr(obj, name), sub)
    return dataclasses.replace(obj, **direct) if direct else obj


def merge_mapping(base: ConfigT, data: Mapping[str, Any], *, source: str, section: tuple[str, ...] = ()) -> ConfigT:
    """`base` with the values of `data` (a TOML document or one of its tables) put in; ConfigError names the key."""
    where = f"{source}: [{'.'.join(section)}]" if section else f"{source}:"
    names = [f.name for f in dataclasses.fields(base)]
    updates: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{where} unknown key '{key}'{hint}")
        tp = field_types(type(base))[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where} '{key}' must be a table [{'.'.join((*section, key))}], got {value!r}")
            updates[key] = merge_mapping(getattr(base, key), value, source=source, section=(*section, key))
        else:
            updates[key] = checked(tp, value, f"{where} {key}")
    return dataclasses.replace(base, **updates) if updates else base


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def checked(tp: Any, value: Any, label: str) -> Any:
    """A TOML value checked against a field's type: an int is a float too; a list (or a comma-separated string)
    is a tuple of strings."""
    if typing.get_origin(tp) is tuple:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{label} must be a list of strings, got {value!r}")
        return tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in _SCALARS and (not isinstance(value, tp) or (tp is not bool and isinstance(value, bool))):
        raise ConfigError(f"{label} must be {_SCALARS[tp]}, got {value!r}")
    return value
