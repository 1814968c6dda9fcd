"""[tool.rngaudit] applied to a command's options: each key checked against the commands' options, typed as
the command line would give it, and used where the command line did not give the option."""

from __future__ import annotations

import enum
import inspect
import os
import types
import typing
from typing import Any, TypeVar

import typer

from ..errors import ConfigError
from . import config as configuration

T = TypeVar("T")

# Options that name what one run reads or writes are never defaults; [tool.rngaudit] says why. By long option,
# for every command ("*") or one.
_PER_RUN = {
    ("*", "output"): "it names the file one run writes its report to",
    ("*", "config"): "it names the configuration file itself",
    ("*", "stdin-filename"): "it names the spec one run reads from standard input",
    ("capture", "keys"): "it names the keys file one capture writes",
    ("capture", "step"): "it names the training step of one capture's TARGET",
    ("verify", "against"): "it names the keys file one run checks against",
    ("verify", "step"): "it names the training step of one run's TARGET",
    ("collisions", "write-baseline"): "it makes one run write the baseline instead of a report",
    **{("diff", k): "it names the releases one run compares" for k in ("from-flax", "to-flax", "from-jax", "to-jax")},
}
# options that name a file: a relative path in [tool.rngaudit] is relative to the pyproject.toml's directory
PATH_KEYS = {"baseline"}


def per_run(command: str, key: str) -> str | None:
    """Why `key` cannot be set in [tool.rngaudit] for `command`; None when it can."""
    return _PER_RUN.get((command, key)) or _PER_RUN.get(("*", key))


def _long(param) -> str | None:
    if getattr(param, "param_type_name", None) != "option" or getattr(param, "hidden", False):
        return None
    return next((o[2:] for o in param.opts if o.startswith("--")), None)


def _options(command) -> dict:
    """Every visible option of a command, by its long name."""
    return {k: p for p in command.params if (k := _long(p)) is not None}


def _config_keys(name: str, command) -> dict:
    """The options of a command that [tool.rngaudit] may set, by key."""
    return {k: p for k, p in _options(command).items() if per_run(name, k) is None}


def _did_you_mean(word: str, choices) -> str:
    from ..spec.fields import closest

    close = closest(word, choices)
    return f"; did you mean {close!r}?" if close else ""


def _check_config(cfg, commands: dict) -> None:
    """Every key of [tool.rngaudit] must be an option some command (its section's command) takes from it."""
    keys = {name: _config_keys(name, c) for name, c in commands.items()}
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
            if key in keys[section]:
                continue
            why = per_run(section, key) if key in _options(commands[section]) else None
            if why:
                raise ConfigError(
                    f"[{s.table}] {key}: cannot be set here: {why}; give --{key} on the command line", s.location
                )
            raise ConfigError(
                f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, keys[section])} "
                f"(`rngaudit {section} --help` lists the options)",
                s.location,
            )
    for key, s in cfg.common.items():
        if key in every:
            continue
        why = next((per_run(n, key) for n, c in commands.items() if key in _options(c)), None)
        if why:
            raise ConfigError(
                f"[{s.table}] {key}: cannot be set here: {why}; give --{key} on the command line", s.location
            )
        if key in commands:
            # (`derive = "x"`: a command's settings are a table of their own)
            raise ConfigError(
                f"[{s.table}] {key}: the settings of `rngaudit {key}` are a table, [tool.rngaudit.{key}], not a value",
                s.location,
            )
        raise ConfigError(f"[{s.table}]: unknown key {key!r}{_did_you_mean(key, every | set(commands))}", s.location)


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


def _is_choice(param) -> bool:
    return getattr(param.type, "name", "") == "choice"


def _accepted_elsewhere(ctx: typer.Context, commands: dict, command: str, s) -> bool:
    """Whether a common key's value, refused by `command`, is one another command that has the option takes
    (`format = "jsonl"`: derive's): it is then meant for those, and `command` keeps its own default."""
    for name, other in commands.items():
        param = _config_keys(name, other).get(s.key)
        if name == command or param is None or not _is_choice(param):
            continue
        try:
            _config_value(ctx, param, None, s)
        except ConfigError:
            continue
        return True
    return False


def configured(ctx: typer.Context, command: str, config: str | None, options: T) -> T:
    """`options` (a NamedTuple of the command's configurable options, by parameter name) with [tool.rngaudit]
    defaults filled in where the command line did not give the option."""
    cfg = configuration.discover(config)
    ctx.meta[_CONFIG_FILE] = cfg.file  # (config_dir: the folder config paths are relative to, without reading it again)
    commands = dict(getattr(ctx.find_root().command, "commands", None) or {ctx.info_name: ctx.command})
    _check_config(cfg, commands)
    by_key = _config_keys(command, ctx.command)
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
        if param.name not in fields:  # (tests/cli/test_config.py checks every settable option is a field)
            raise ConfigError(f"[{s.table}] {key}: `rngaudit {command}` cannot take --{key} from here", s.location)
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name not in ("DEFAULT", "DEFAULT_MAP"):
            continue
        try:
            value = _config_value(ctx, param, hints.get(param.name), s)
        except ConfigError:
            # a choice another command offers (format = "jsonl": derive's) is that command's; a value of another
            # type is a mistake whichever command runs
            if s.section is None and _is_choice(param) and _accepted_elsewhere(ctx, commands, command, s):
                continue
            raise
        if key in PATH_KEYS and isinstance(value, str) and cfg.file and not os.path.isabs(value):
            value = os.path.join(os.path.dirname(cfg.file), value)
        values[param.name] = value
    return record._replace(**values)


_CONFIG_FILE = "rngaudit.config_file"


def config_dir(ctx: typer.Context, name: str) -> str | None:
    """The folder of the pyproject.toml `configured` read, when it set option `name` (its paths are relative to
    it); None when the command line gave it or nothing did."""
    source = ctx.get_parameter_source(name)
    file = ctx.meta.get(_CONFIG_FILE)
    if source is None or source.name not in ("DEFAULT", "DEFAULT_MAP") or not file:
        return None
    return os.path.dirname(file) or "."
