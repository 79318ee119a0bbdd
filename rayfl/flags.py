"""The config keys as command-line flags, shared by ``rayfl run``, ``rayfl tune`` and ``rayfl compare``: every key a
flag whose default is 'not given' (a ``--config`` file is overridden only by what was typed), algorithm knobs as
``-p KEY=VALUE``, and which of them were typed.
"""

from __future__ import annotations

import argparse

from rayfl.config import FIELDS, UserError, make_config, yaml_value
from rayfl.config_help import GROUPS


def add_config_arguments(parser: argparse.ArgumentParser, hidden: tuple[str, ...] = ()) -> None:
    """Every Config field as a flag whose default is 'not given', so a --config file is only overridden
    by what the user typed. ``hidden``: keys whose flag the command takes but leaves out of its help (its
    handler names the flag to use instead)."""
    from rayfl.plugins import add_plugin_argument

    add_plugin_argument(parser)
    parser.add_argument("--config", metavar="FILE", help="YAML file of config keys; flags override it")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="an algorithm knob, e.g. -p epsilon=0.3 -p M=5 (see `rayfl algos`)")
    for title, fields in GROUPS.items():
        group = parser.add_argument_group(title)
        for name, text in fields.items():
            default = FIELDS[name].default
            flag = "--" + name.replace("_", "-")
            if isinstance(default, bool):
                group.add_argument(flag, action="store_true", default=argparse.SUPPRESS,
                                   help=argparse.SUPPRESS if name in hidden else text)
            else:
                metavar = {int: "N", float: "X"}.get(type(default), name.split("_")[-1].upper())
                metavar = "N|auto" if name == "clients_per_actor" else metavar
                shown = "" if "default" in text else f" (default: {default})"  # a text that says it, once
                group.add_argument(flag, default=argparse.SUPPRESS, metavar=metavar,
                                   help=argparse.SUPPRESS if name in hidden else text + shown)


def parse_params(items: list[str]) -> dict:
    """``-p KEY=VALUE`` flags as a dict, values read as YAML scalars (0.3 -> float, [1, 2] -> list)."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param {item!r}: expected KEY=VALUE")
        if key.strip() in params:
            raise UserError(f"--param {item!r}: {key.strip()} is given twice; give each knob once")
        params[key.strip()] = yaml_value(value.strip(), key.strip())
    return params


def config_from_args(args: argparse.Namespace):
    """The Config that ``rayfl run``'s flags ask for: the --config file, then the flags typed."""
    overrides = {k: v for k, v in vars(args).items() if k in FIELDS}
    params = parse_params(args.param)
    if params:
        overrides["params"] = params
    return make_config(args.config, overrides)


def config_flags_given(args: argparse.Namespace) -> list[str]:
    """The config flags typed on the command line (a --resume takes none: the saved config is the run's)."""
    given = [f"--{k.replace('_', '-')}" for k in vars(args) if k in FIELDS and k != "params"]
    return given + (["--param"] if args.param else []) + (["--config"] if args.config else [])


def add_options(group, options: type) -> None:
    """A flag per field of an options class (:class:`rayfl.specs.SweepOptions`, :class:`rayfl.specs.CompareOptions`):
    its default, choices and help are the field's, so the command's flags and the API's keywords cannot drift
    (a field with ``flag=None`` is a keyword of the API alone)."""
    import dataclasses

    for f in dataclasses.fields(options):
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        if flag is None:  # the API's keyword alone
            continue
        text = meta.pop("help").replace("{default}", " ".join(map(str, f.default)) if isinstance(f.default, tuple)
                                        else str(f.default))
        default = meta.pop("cli_default", f.default)
        if callable(meta.get("choices")):
            meta["choices"] = meta["choices"]()
        group.add_argument(flag, dest=f.name, default=default, help=text, **meta)


def add_session_arguments(group, resume: str | None = None) -> None:
    """The flags every command that runs experiments takes: where Ray is, whether rounds are shown, where the
    MLflow UI is (``--ui-port``), and (with ``resume``: its help) ``--resume``."""
    if resume:
        group.add_argument("--resume", metavar="DIR", help=resume)
    from rayfl.specs import ViewOptions

    group.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance)")
    group.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    add_options(group, ViewOptions)
