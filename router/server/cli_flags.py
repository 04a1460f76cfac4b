"""Flags declared once as rows that name a `RouterConfig` field: the parser and the config are built from them.

A row holds what the command line adds (flag names, help, env var, choices); the default and the type come
from the config model, so a default is written in exactly one place. A boolean field becomes a switch
that moves it away from its default (`--disable-health-check` for `enabled=True`, `--log-json` for False).
"""

from __future__ import annotations

import argparse
import functools
import types
import typing
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from typing import Any

from router.core.config import RouterConfig
from router.core.config_model import ConfigModel

DEFAULTS = RouterConfig()


@dataclass(frozen=True, slots=True)
class Flag:
    names: tuple[str, ...]  # e.g. ("--timeout", "--request-timeout-secs"): --help shows the first
    path: str  # the config field: "port", or "<group>.<field>" such as "health.interval_secs" (one level)
    help: str | None = None
    env: str | None = None  # read when the flag is not given (secrets stay out of `ps`)
    choices: tuple[str, ...] | None = None
    # a list's values: "+" (one or more; given again, the last wins) or "*" (none or more, each given adds: the
    # peers' `nargs="*", action="extend"`)
    nargs: str = "+"

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    @property
    def default(self) -> Any:
        value = DEFAULTS
        for name in self.path.split("."):
            value = getattr(value, name)
        return value

    @property
    def value_type(self) -> type:
        """The field's annotated type, with `| None` taken off."""
        owner: Any = DEFAULTS
        *groups, leaf = self.path.split(".")
        for name in groups:
            owner = getattr(owner, name)
        hint = _type_hints(type(owner))[leaf]
        if isinstance(hint, types.UnionType):
            (hint,) = [arg for arg in hint.__args__ if arg is not type(None)]
        return hint


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    """A config group's resolved annotations (resolving them is most of the cost of building the parser)."""
    return typing.get_type_hints(cls)


def flag(*names: str, path: str | None = None, **options: Any) -> Flag:
    """A row; the path defaults to the first flag's name (`--max-connections` -> `max_connections`)."""
    return Flag(names, path or names[0].removeprefix("--").replace("-", "_"), **options)


def field_flags(group: str, cls: type, prefix: str = "", helps: dict[str, str] | None = None,
                skip: tuple[str, ...] = (), aliases: dict[str, tuple[str, ...]] | None = None) -> list[Flag]:
    """One row per field of a group, named `--<prefix><field-name>` (the policies' and rebalancer's knobs), and
    the field's other names (the peers' spellings) after it."""
    helps, aliases = helps or {}, aliases or {}
    return [Flag(("--" + prefix + f.name.replace("_", "-"), *aliases.get(f.name, ())), f"{group}.{f.name}",
                 helps.get(f.name))
            for f in fields(cls) if f.name not in skip]


def add_flags(parser: argparse.ArgumentParser, rows: list[Flag],
              container_for: typing.Callable[[Flag], Any] | None = None) -> None:
    """Each row as an argument of `parser`, or of the argument group `container_for(row)` names (its --help
    section; None: the parser's own)."""
    for row in rows:
        target = (container_for(row) if container_for else None) or parser
        default = row.default
        help_text = row.help
        if row.env:
            help_text = f"{help_text} (env {row.env})"
        if isinstance(default, bool):
            # A switch; the value it sets is the opposite of the default.
            target.add_argument(*row.names, dest=row.dest, action="store_false" if default else "store_true",
                                default=default, help=help_text)
            continue
        if default is not None and default != ():
            shown = f"(default: {' '.join(map(str, default)) if isinstance(default, tuple) else default})"
            help_text = f"{help_text} {shown}" if help_text else shown
        kind = str if row.choices else row.value_type
        metavar = None if row.choices else short_metavar(row.names[0], kind)
        if typing.get_origin(kind) is tuple:  # a list: one or more values after the flag (empty by default)
            (kind, _) = typing.get_args(kind)
            if row.nargs == "*":
                target.add_argument(*row.names, dest=row.dest, type=kind, nargs="*", action="extend",
                                    default=list(default), metavar=metavar, help=help_text)
                continue
            target.add_argument(*row.names, dest=row.dest, type=kind, nargs="+", default=default,
                                metavar=metavar, help=help_text)
            continue
        target.add_argument(*row.names, dest=row.dest, type=kind, default=default, choices=row.choices,
                            metavar=metavar, help=help_text)


_UNITS = ("secs", "ms", "bytes")


def short_metavar(name: str, kind: Any) -> str:
    """What --help shows for a flag's value: its unit (SECS) or N for a number, else the name's last word
    (HOST, PATH, ENDPOINTS), so that the help of most flags starts on the flag's own line."""
    last = name.rsplit("-", 1)[-1]
    if last in _UNITS:
        return last.upper()
    if kind in (int, float):
        return "N"
    return last.upper()


def config_with_flags(config: RouterConfig, rows: list[Flag], args: argparse.Namespace,
                      env: typing.Mapping[str, str]) -> RouterConfig:
    """`config` with every row's field set from the parsed flags (or the row's env var)."""
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = defaultdict(dict)
    for row in rows:
        value = getattr(args, row.dest)
        if isinstance(value, list):
            value = tuple(value)
        if row.env:
            value = value or env.get(row.env) or None
        group, _, leaf = row.path.rpartition(".")
        if group:
            groups[group][leaf] = value
        else:
            top[leaf] = value
    for group, values in groups.items():
        part = getattr(config, group)
        # the config's own groups are checked again by `with_`; the policies' dataclasses are checked by the config
        top[group] = part.with_(**values) if isinstance(part, ConfigModel) else replace(part, **values)
    return config.with_(**top)
