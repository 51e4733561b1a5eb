"""Settings as flags and TANDEM_* variables: one flag and one variable per dataclass field of
`tandem.config`, parsed the same way from either."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any


def parse_value(value: str, typ: Any, name: str) -> Any:
    """A TANDEM_<NAME> value as the field's type (its annotation as a string)."""
    t = str(typ)
    if t in ("bool", "bool | None"):
        return parse_bool(value, f"TANDEM_{name.upper()}")
    try:
        if "int" in t:
            return None if value.lower() in ("", "none") else int(value)
        if "float" in t:
            return None if "None" in t and value.lower() in ("", "none") else float(value)
    except ValueError as e:
        raise ValueError(f"TANDEM_{name.upper()}={value!r} is not a valid {t}") from e
    return value or None if "None" in t else value


def parse_bool(value: str, what: str) -> bool:
    """The one boolean spelling of flags and variables; `what` names the source in errors."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what}={value!r} is not a boolean: 1, true, yes, on or 0, false, no, off")


class _RefuseOnCommandLine(argparse.Action):
    """A flag for a secret that must not be on a command line: using it is an error."""

    def __init__(self, option_strings, dest, env: str, **kw) -> None:
        super().__init__(option_strings, dest, nargs=1, **kw)
        self.env = env

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(
            f"{option_string} is not accepted (a command line is visible to every user): set "
            f"{self.env}, or give a file with {option_string}-file"
        )


class _JoinRepeated(argparse.Action):
    """A repeatable flag whose values are kept as one comma-separated string."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        prev = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{prev},{values}" if prev else values)


def add_dataclass_args(parser: Any, cls: Any, what: str, skip: tuple[str, ...] = ()) -> None:
    """A `--flag` per field of the dataclass `cls` (but `skip`), unset by default."""
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.metadata.get("env_only"):
            # Not settable here: the flag exists only to refuse (rather than be taken as an
            # abbreviation of a longer flag) and to say where the value goes.
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f"refused_{f.name}",
                action=_RefuseOnCommandLine,
                env=f"TANDEM_{f.name.upper()}",
                help=argparse.SUPPRESS,
            )
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        default = f.metadata.get("default_help", "unset" if f.default is None else f.default)
        env = f"TANDEM_{f.name.upper()}"
        if f.metadata.get("repeatable"):
            parser.add_argument(
                flag,
                dest=f.name,
                action=_JoinRepeated,
                default=None,
                metavar="ITEM",
                help=f"{what} {f.name}, repeatable (default {default}; {env}, comma separated)",
            )
            continue
        if t in ("bool", "bool | None"):
            parser.add_argument(
                flag,
                dest=f.name,
                type=lambda v, _f=flag: parse_bool(v, _f),
                default=None,
                metavar="true|false",
                help=f"{what} {f.name} (default {default}; {env})",
            )
            continue
        typ = int if "int" in t else float if "float" in t else str
        parser.add_argument(
            flag,
            dest=f.name,
            type=typ,
            default=None,
            metavar=typ.__name__.upper(),
            help=f"{what} {f.name} (default {default}; {env})",
        )


def dataclass_from_args(cls: Any, args: Any) -> Any:
    """`cls` from parsed flags, then TANDEM_* variables for those not given, then defaults."""
    opts = {}
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is None:
            env = os.environ.get(f"TANDEM_{f.name.upper()}")
            if env is not None and f.metadata.get("credential") and not env.strip():
                # Elsewhere an empty variable means unset; for a credential that would turn
                # authentication off by a typo, so it is an error.
                raise ValueError(
                    f"TANDEM_{f.name.upper()} is set but empty: give a value, or unset it"
                )
            if env is not None:
                v = parse_value(env, f.type, f.name)
        if v is not None:
            opts[f.name] = v
    return cls(**opts)
