"""The one CLI generator: every option of every command comes from a config dataclass and its field docstrings.

Each leaf field of a command's config (nested dataclasses walked) is the option `--SECTION.FIELD`
(`--gossip.fanout`, `--spec.outer.codec`; `_` or `-` both accepted), whose help is the docstring written under
the field (torchtitan's convention) and its default. `--help` lists only the few options a volunteer needs,
under short names (`--rounds` for `--training.rounds`); `--help-all` lists every field, grouped by section.
Values given on the command line replace those of a base config with `dataclasses.replace`, so the result is
again a frozen config, validated by its own `validate()`.

Order of precedence: the base (a preset) < the `--config` TOML file < the command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import typing
from collections.abc import Callable, Mapping
from typing import Any

from p2p_diloco.config import PRESETS
from p2p_diloco.config.load import leaves, merge_mapping, read_toml, replace_paths, value_at


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`p2p-diloco join: error: ...`, exit code 2, no usage dump), a hint for a
    misspelled option, and `--a.b_c` read as `--a.b-c`."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments: --"):
            wrong = message.split()[2].split("=")[0]
            close = difflib.get_close_matches(wrong, list(self._option_string_actions), n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None:
            args = [_dashed(a) for a in args]
        return super().parse_known_args(args, namespace)


class CommandParser(ArgumentParser):
    """A sub-command's parser: it refuses an unknown option itself, so the error names the command and the
    hint comes from the command's own options."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or "." not in arg.split("=")[0]:
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


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


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _tuple_of_str(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _converter(tp: Any) -> Callable[[str], Any]:
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    if typing.get_origin(tp) is tuple:
        return _tuple_of_str
    raise TypeError(f"no command-line converter for {tp!r}")


def dotted_flag(path: tuple[str, ...]) -> str:
    return "--" + ".".join(part.replace("_", "-") for part in path)


@dataclasses.dataclass(frozen=True)
class Options:
    """How one command's config becomes options. `shown`: dotted path -> the short flag `--help` lists for it;
    `aliases(path)`: an older flag name that keeps working, unlisted (None: none)."""

    cls: type
    default: Any
    dest: str
    shown: Mapping[str, str] = dataclasses.field(default_factory=dict)
    aliases: Callable[[tuple[str, ...]], str | None] = lambda path: None
    skip: frozenset[str] = frozenset()
    """Dotted paths that get no option (set some other way)."""


def flat_names(cls: type) -> dict[str, str]:
    """Every field of a flat config shown under its own name (`--report-s`): for small commands."""
    return {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)}


def add_config_args(parser: argparse.ArgumentParser, options: Options, *, show_all: bool = False) -> None:
    """One option per leaf field of `options.cls`; the help shows the effective default of `options.default`.

    Options default to None (argparse.SUPPRESS would hide them from the namespace), so `apply_args` can tell
    "not given" from "given". With `show_all`, every `--SECTION.FIELD` is listed under its section's title.
    """
    groups: dict[tuple[str, ...], Any] = {}
    taken = set(parser._option_string_actions)
    for path, owner, tp in leaves(options.cls):
        if ".".join(path) in options.skip:
            continue
        dest = f"{options.dest}__" + "__".join(path)
        doc = field_docs(owner).get(path[-1], "")
        # argparse %-formats help strings; a literal % in a docstring would crash --help
        text = f"{doc} (default: {_shown_value(value_at(options.default, path))})".replace("%", "%%")
        kwargs: dict[str, Any] = dict(dest=dest, type=_converter(tp), default=None,
                                      metavar=path[-1].split("_")[-1].upper())
        if tp is bool:
            kwargs.update(nargs="?", const=True, metavar="BOOL")  # `--client-mode` alone means true
        dotted = dotted_flag(path)
        short = options.shown.get(".".join(path))
        if show_all:
            section = path[:-1]
            if section not in groups:
                groups[section] = parser.add_argument_group(_section_title(options.cls, section))
            also = f" [also {short}]" if short and short != dotted else ""
            groups[section].add_argument(dotted, help=text + also.replace("%", "%%"), **kwargs)
        else:
            if short:
                parser.add_argument(short, help=text, **kwargs)
            if dotted != short:
                parser.add_argument(dotted, help=argparse.SUPPRESS, **kwargs)
        taken.update((dotted, short or dotted))
        alias = options.aliases(path)
        if alias and alias not in taken:
            parser.add_argument(alias, help=argparse.SUPPRESS, **kwargs)
            taken.add(alias)


def _shown_value(value: Any) -> Any:
    return ",".join(value) if isinstance(value, tuple) else value


def _section_title(cls: type, section: tuple[str, ...]) -> str:
    if not section:
        return "options"
    owner = cls
    for part in section:
        owner = typing.get_type_hints(owner)[part]
    summary = (owner.__doc__ or "").strip().splitlines()[0].rstrip(".") if owner.__doc__ else ""
    return f"[{'.'.join(section)}] {summary}"


def add_help_all(parser: argparse.ArgumentParser, build_full: Callable[[], argparse.ArgumentParser]) -> None:
    """`--help-all`: print the help of `build_full()` (every field, by section) and exit."""

    class HelpAll(argparse.Action):
        def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
            super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

        def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
            build_full().print_help()
            parser.exit()

    parser.add_argument("--help-all", action=HelpAll,
                        help="list every setting, by section, with its documentation and default, and exit")


def add_run_args(parser: argparse.ArgumentParser, options: Callable[[str], Options], *, default_preset: str,
                 show_all: bool = False) -> None:
    """--preset, --config, --help-all and the options of a command's config (`options(preset)` says which)."""
    parser.add_argument("--preset", default=default_preset, choices=list(PRESETS),
                        help=f"model size and hyper-parameters to start from (default: {default_preset})")
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings over the preset, one table per "
                        "section ([spec.inner], [network]...; see --help-all); options given here win over it")
    if not show_all:
        add_help_all(parser, lambda: _full_parser(parser, options, default_preset))
    add_config_args(parser, options(default_preset), show_all=show_all)


def _full_parser(short: argparse.ArgumentParser, options: Callable[[str], Options],
                 default_preset: str) -> argparse.ArgumentParser:
    full = ArgumentParser(prog=short.prog, usage=f"{short.prog} [--SECTION.FIELD VALUE ...]",
                          description="Every setting, by section. A setting is given as "
                          "--SECTION.FIELD VALUE on the command line, or as FIELD = VALUE under [SECTION] in the "
                          "--config file; the command line wins.")
    add_run_args(full, options, default_preset=default_preset, show_all=True)
    return full


def apply_args(base: Any, args: argparse.Namespace, dest: str) -> Any:
    """Return `base` with every option of config `dest` given on the command line replaced (nested too)."""
    updates: dict[tuple[str, ...], Any] = {}
    prefix = dest + "__"
    for key, value in vars(args).items():
        if key.startswith(prefix) and value is not None:
            updates[tuple(key[len(prefix):].split("__"))] = value
    return replace_paths(base, updates)


def load_config(base: Any, args: argparse.Namespace, dest: str) -> Any:
    """`base`, then the `--config` TOML file over it, then the command line over both (not yet validated)."""
    path = getattr(args, "config", None)
    if path:
        base = merge_mapping(base, read_toml(path), source=path)
    return apply_args(base, args, dest)
