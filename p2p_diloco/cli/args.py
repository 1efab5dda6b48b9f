"""Build argparse options from config dataclasses, so `--help` is the field docstrings.

A field `inner_steps` of the dataclass mounted at `inner` becomes `--inner-steps`; nested dataclasses are
walked. The docstring written under a field (torchtitan's convention) is its help text, followed by its
default. Values given on the command line replace the defaults of a base config with `dataclasses.replace`,
so the result is again a frozen, validated config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written right under it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen app): help without docs rather than a crash
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _tuple_of_str(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _converter(tp: Any):
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    if typing.get_origin(tp) is tuple:
        return _tuple_of_str
    origin_args = typing.get_args(tp)
    if origin_args and type(None) in origin_args:  # Optional[X]
        inner = next(a for a in origin_args if a is not type(None))
        return _converter(inner)
    raise TypeError(f"no command-line converter for {tp!r}")


def _leaves(cls: type, prefix: tuple[str, ...] = ()):
    """Yield (path, field, type) for every non-dataclass field, walking nested dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, prefix + (f.name,))
        else:
            yield prefix + (f.name,), f, tp, cls


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, default: Any, *, title: str, dest: str,
                       skip: frozenset[str] = frozenset()) -> None:
    """Add one option per leaf field of `cls`; defaults shown are those of the `default` instance.

    Options default to None (argparse.SUPPRESS would hide them from the namespace), so `apply_args`
    can tell "not given" from "given"; the help still shows the effective default. `dest` names this config
    in the namespace, so several configs can share one parser.
    """
    group = parser.add_argument_group(title)
    seen: set[str] = set()
    for path, _f, tp, owner in _leaves(cls):
        name = path[-1]
        if name in skip:
            continue
        if name in seen:
            raise ValueError(f"two config fields share the option name {_flag(name)}; rename one")
        seen.add(name)
        value = default
        for part in path:
            value = getattr(value, part)
        doc = field_docs(owner).get(name, "")
        group.add_argument(_flag(name), dest=f"{dest}__" + "__".join(path), type=_converter(tp), default=None,
                           metavar=name.split("_")[-1].upper(),
                           # argparse %-formats help strings; a literal % in a docstring would crash --help
                           help=f"{doc} (default: {value})".replace("%", "%%"))


def apply_args(base: Any, args: argparse.Namespace, dest: str) -> Any:
    """Return `base` with every option of config `dest` given on the command line replaced (nested too)."""
    updates: dict[tuple[str, ...], Any] = {}
    prefix = dest + "__"
    for key, value in vars(args).items():
        if key.startswith(prefix) and value is not None:
            updates[tuple(key[len(prefix):].split("__"))] = value
    return _replace(base, updates)


def _replace(obj: Any, updates: dict[tuple[str, ...], Any]) -> Any:
    direct = {path[0]: v for path, v in updates.items() if len(path) == 1}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, v in updates.items():
        if len(path) > 1:
            nested.setdefault(path[0], {})[path[1:]] = v
    for name, sub in nested.items():
        direct[name] = _replace(getattr(obj, name), sub)
    return dataclasses.replace(obj, **direct) if direct else obj
