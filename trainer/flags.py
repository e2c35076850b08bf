"""Command-line flags as typed, frozen dataclasses.

A program's flags are one dataclass. A field whose type is another dataclass is a group,
set with dotted names: `--data.path=...`, `--optimizer.lr=...`. A field's type is its
flag's type: bool, int, float, str, a `Literal[...]` of choices, a `tuple[...]` (written
comma-separated) or `X | None` (written `none`). Choices are declared once, in the type,
and checked when flags are parsed, or a config is read back from JSON, before a program
touches a device or writes a file. A group may carry named presets (`--model=llama3_8b`);
its dotted flags then override the preset wherever they appear on the command line.

We parse by hand: no flag library offers "a preset plus dotted overrides of its fields"
with one-line errors, and this is short.
"""

import dataclasses
import functools
import json
import sys
import types
import typing
from typing import Literal, get_args, get_origin

from trainer.errors import UserError


class ConfigError(UserError):
    """A bad flag or config field. The message is one line that names it and the fix."""


def flag(default, help, presets=None):
    """A dataclass field with its help text; a group may name presets of its own type."""
    return dataclasses.field(default=default, metadata={"help": help, "presets": presets})


@functools.cache
def _hints(cls):
    return typing.get_type_hints(cls)


def _optional(tp):
    """X | None -> (X, True); X -> (X, False)."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0], True
    return tp, False


def _is_group(tp):
    return dataclasses.is_dataclass(_optional(tp)[0])


def choices(tp):
    """The allowed values of a Literal (or tuple-of-Literal) type; None for free values."""
    tp = _optional(tp)[0]
    if get_origin(tp) is tuple:
        tp = get_args(tp)[0]
    return get_args(tp) if get_origin(tp) is Literal else None


def _type_name(tp):
    tp, optional = _optional(tp)
    name = ("one of " + ", ".join(map(str, choices(tp))) if get_origin(tp) is Literal
            else "a comma-separated list" if get_origin(tp) is tuple
            else {bool: "true or false", int: "an integer", float: "a number",
                  str: "a string"}.get(tp, getattr(tp, "__name__", str(tp))))
    return name + (" or none" if optional else "")


def _from_text(where, text, tp):
    """A flag's text -> a value of type tp."""
    inner, optional = _optional(tp)
    if optional and text.lower() in ("none", "null"):
        return None
    if get_origin(inner) is tuple:
        item = get_args(inner)[0]
        return tuple(_from_text(where, t.strip(), item) for t in text.split(",") if t.strip())
    if inner is bool:
        if text.lower() in ("", "1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
    elif inner is int:
        try:
            return int(text)
        except ValueError:
            pass
    elif inner is float:
        try:
            return float(text)
        except ValueError:
            pass
    elif inner is str or (get_origin(inner) is Literal and text in get_args(inner)):
        return text
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got '{text}'")


def _check(where, value, tp):
    """A JSON-like value -> a value of type tp, or a ConfigError naming `where`."""
    inner, optional = _optional(tp)
    if value is None and optional:
        return None
    if dataclasses.is_dataclass(inner):
        return from_dict(inner, value, where + ".")
    if get_origin(inner) is tuple and isinstance(value, (list, tuple)):
        item = get_args(inner)[0]
        return tuple(_check(f"{where}[{i}]", v, item) for i, v in enumerate(value))
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(inner)
    if get_origin(inner) is Literal:
        ok = lambda v: v in get_args(inner)  # noqa: E731
    if ok is None or not ok(value):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {json.dumps(value)}")
    return float(value) if inner is float else value


def from_dict(cls, data, prefix=""):
    """A nested dict (flags, or a config.json read back) -> a checked instance of cls."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.')}: expected an object, got {json.dumps(data)}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field; see --help")
    hints = _hints(cls)
    return cls(**{k: _check(prefix + k, v, hints[k]) for k, v in data.items()})


def to_dict(instance):
    """An instance -> nested plain dicts, lists and scalars (JSON-ready)."""
    return json.loads(json.dumps(dataclasses.asdict(instance)))


def split_args(argv):
    """['--a=1', '--b', '2', '--c'] -> [('a', '1'), ('b', '2'), ('c', None)]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; flags look like --name=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            else:
                value = None  # a bare boolean flag
        pairs.append((name.replace("-", "_"), value))
        i += 1
    return pairs


def _field(cls, name):
    return next((f for f in dataclasses.fields(cls) if f.name == name and f.init), None)


def parse(cls, argv, defaults=None):
    """argv (without the program name) -> a checked instance of cls. Raises ConfigError.
    defaults: {field: value} replacing cls's own defaults before the flags apply."""
    values = dataclasses.asdict(cls())
    for name, value in (defaults or {}).items():
        values[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    pairs = split_args(argv)
    given_names = {n for n, _ in pairs}
    presets = [(n, v) for n, v in pairs if "." not in n and _field(cls, n) is not None
               and _field(cls, n).metadata.get("presets")]
    for name, value in presets:  # first, so that dotted flags override them
        table = _field(cls, name).metadata["presets"]
        if value not in table:
            raise ConfigError(f"--{name}: unknown preset '{value}'; choose one of: "
                              + ", ".join(table))
        values[name] = dataclasses.asdict(table[value])
    for name, value in pairs:
        if (name, value) in presets:
            continue
        *parents, leaf = name.split(".")
        node, node_cls = values, cls
        for part in parents:
            f = _field(node_cls, part)
            if f is None or not _is_group(_hints(node_cls)[part]):
                raise ConfigError(f"--{name}: unknown flag; see --help")
            node_cls = _optional(_hints(node_cls)[part])[0]
            if node[part] is None:  # an optional group that is off: start from its defaults
                node[part] = dataclasses.asdict(node_cls())
            node = node[part]
        f = _field(node_cls, leaf)
        if f is None or _is_group(_hints(node_cls)[leaf]):
            raise ConfigError(f"--{name}: unknown flag; see --help")
        tp = _hints(node_cls)[leaf]
        if value is None and tp is not bool:
            raise ConfigError(f"--{name}: needs a value, e.g. --{name}=...")
        node[leaf] = _from_text(f"--{name}", value or "", tp)
        for derived, sources in getattr(node_cls, "DERIVED", {}).items():
            if leaf in sources and ".".join([*parents, derived]) not in given_names:
                node[derived] = None  # filled in again from the new value
    return from_dict(cls, values, "--")


def given(argv):
    """The names of the flags on a command line, e.g. {'model', 'model.hidden_size'}."""
    return {name for name, _ in split_args(argv)}


def help_text(program, cls):
    lines = [f"usage: python -m {program} [--flag=value ...]", ""]

    def walk(group, instance, prefix):
        hints = _hints(group)
        for f in dataclasses.fields(group):
            if not f.init:
                continue
            value = getattr(instance, f.name)
            if _is_group(hints[f.name]) and value is not None:
                lines.append("")
                presets = f.metadata.get("presets")
                if presets:
                    lines.append(f"  --{prefix}{f.name}=PRESET".ljust(44)
                                 + f" {f.metadata['help']}: {' | '.join(presets)}")
                else:
                    lines.append(f"  {prefix}{f.name}: {f.metadata.get('help', '')}")
                walk(_optional(hints[f.name])[0], value, f"{prefix}{f.name}.")
                continue
            allowed = choices(hints[f.name])
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
            text = f"  --{prefix}{f.name}={shown!r}"
            lines.append(text.ljust(44) + f" {f.metadata.get('help', '')}"
                         + (f" {{{'|'.join(map(str, allowed))}}}" if allowed else ""))
    walk(cls, cls(), "")
    return "\n".join(lines)


def parse_or_exit(program, cls, argv=None):
    """Parse sys.argv for a command-line program: --help prints help; a bad flag prints one
    line and exits 1."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "--helpfull") for a in argv):
        print(help_text(program, cls))
        sys.exit(0)
    try:
        return parse(cls, argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
