"""[tool.rngaudit] applied to a command's options: each key checked against the commands' options, typed as
the command line would give it, and used where the command line did not give the option."""

from __future__ import annotations

import enum
import inspect
import types
import typing
from typing import Any, TypeVar

import typer

from ..errors import ConfigError
from . import config as configuration

T = TypeVar("T")

_NOT_CONFIGURABLE = {"output", "config"}  # per-run choices, never defaults


def _config_key(param) -> str | None:
    if getattr(param, "param_type_name", None) != "option" or param.name in _NOT_CONFIGURABLE:
        return None
    return next((o[2:] for o in param.opts if o.startswith("--")), None)


def _config_keys(command) -> dict:
    return {k: p for p in command.params if (k := _config_key(p)) is not None}


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_config(cfg, commands: dict) -> None:
    """Every key of [tool.rngaudit] must be an option of some command (of its section's command)."""
    keys = {name: _config_keys(c) for name, c in commands.items()}
    every = set().union(*keys.values())
    for section, settings in cfg.sections.items():
        if section not in commands:
            raise ConfigError(
                f"[tool.rngaudit.{section}]: no command is called {section!r}"
                f"{_did_you_mean(section, commands)} (sections are named after commands: "
                f"{', '.join(sorted(commands))})",
                cfg.section_locations[section],
            )
        for key, s in settings.items():
            if key not in keys[section]:
                raise ConfigError(
                    f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, keys[section])} "
                    f"(`rngaudit {section} --help` lists the options)",
                    s.location,
                )
    for key, s in cfg.common.items():
        if key not in every:
            raise ConfigError(
                f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, every | set(commands))}", s.location
            )


_TOML_TYPE = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}
_TOML_TYPES = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _config_value(ctx: typer.Context, param, hint, s):
    """The TOML value as the command line would have given it, type-checked against the option."""
    kind = param.type.name  # boolean, int (integer), int range, float, float range, choice, str (text)
    want: type
    if param.is_flag or kind == "boolean":
        want = bool
    elif kind.startswith("int"):
        want = int
    elif kind.startswith("float"):
        want = float
    else:
        want = str

    def typed(v) -> bool:
        if want is float:
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return isinstance(v, want) and (want is bool or not isinstance(v, bool))

    value = s.value
    if param.multiple:
        if not isinstance(value, list) or not all(typed(v) for v in value):
            raise ConfigError(
                f"[{s.table}] {s.key}: must be a list of {_TOML_TYPES[want]}, e.g. {s.key} = [...]", s.location
            )
    elif not typed(value):
        raise ConfigError(
            f"[{s.table}] {s.key}: must be {_TOML_TYPE[want]}, not {type(value).__name__} {value!r}", s.location
        )
    try:
        value = param.type_cast_value(ctx, value)
    except typer.BadParameter as e:
        raise ConfigError(f"[{s.table}] {s.key}: {e.message}", s.location) from None
    # typer converts choices to the Enum of the parameter's annotation, and repeated options to lists
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) else []
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)  # Optional[X] and X | None
    base = args[0] if union and len(args) == 1 else hint
    item = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    if item is not None:
        return [item(v) if isinstance(item, type) and issubclass(item, enum.Enum) else v for v in value]
    if isinstance(base, type) and issubclass(base, enum.Enum) and value is not None:
        return base(value)
    return value


def configured(ctx: typer.Context, command: str, config: str | None, options: T) -> T:
    """`options` (a NamedTuple of the command's configurable options, by parameter name) with [tool.rngaudit]
    defaults filled in where the command line did not give the option. A key for an option that is not a
    field of `options` is refused (that option is taken on the command line only)."""
    cfg = configuration.discover(config)
    commands = dict(getattr(ctx.find_root().command, "commands", None) or {ctx.info_name: ctx.command})
    _check_config(cfg, commands)
    by_key = _config_keys(ctx.command)
    callback = ctx.command.callback
    assert callback is not None  # (every command is a function)
    hints = typing.get_type_hints(inspect.unwrap(callback))
    record: Any = options  # a NamedTuple of the command's configurable options
    fields = set(record._fields)
    values = {}
    for key, s in cfg.for_command(command).items():
        param = by_key.get(key)
        if param is None:  # a common key for another command's option
            continue
        if param.name not in fields:
            raise ConfigError(
                f"[{s.table}] {key}: `rngaudit {command}` takes --{key} only on the command line", s.location
            )
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name in ("DEFAULT", "DEFAULT_MAP"):
            values[param.name] = _config_value(ctx, param, hints.get(param.name), s)
    return record._replace(**values)
