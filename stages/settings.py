"""A section's settings on a stage's command line, with the defaults of
workflow/schemas/config.schema.yaml. `add_arguments` lists a section's settings as `--<setting>`
options (`--help` shows each with its default and description) and `from_arguments` lays the ones
given over the section passed as `--config`, completed with the schema's defaults
(`stages.schema.complete`) and built as its typed section (`stages.sections`). The schema access
that other modules use (`complete`, `defaults`, `section_schema`, `key_of`, `SECTIONS`) lives in
`stages.schema` and is importable from here too. Torch-free.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from stages.errors import ConfigError
from stages.schema import SECTIONS, complete, defaults, key_of, resolve_ref, section_schema
from stages.schema import root as _root
from stages.sections import BY_NAME

__all__ = ["SECTIONS", "add_arguments", "complete", "defaults", "from_arguments", "given_settings", "key_of",
           "section_schema"]


def _argument_type(prop: dict[str, Any]):
    """How one setting is read from the command line: JSON for lists, mappings and mixed types,
    else the schema type."""
    kinds = prop.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    plain = [k for k in kinds if k != "null"]
    if "enum" in prop or plain == ["string"]:
        return str
    if plain == ["integer"]:
        return int
    if plain == ["number"]:
        return float
    return json.loads


def _shared_description(key: str) -> str:
    """The description of a setting the training sections share (`$defs.*_properties`), for a
    section that overrides its default without repeating it."""
    for name, group in _root().get("$defs", {}).items():
        if name.endswith("_properties") and isinstance(group.get(key), dict) and group[key].get("description"):
            return " ".join(str(group[key]["description"]).split())
    return ""


METAVARS = {int: "N", float: "X", str: "TEXT", json.loads: "JSON"}


def add_arguments(parser: argparse.ArgumentParser, *names: str, group: str | None = None) -> None:
    """One `--<setting>` option per setting of the sections `names` (several: the fine-tuning
    methods, whose settings mostly coincide), in a group of its own; `--help` shows each one's
    description and default (per section where they differ). An option given overrides the value
    in `--config`; `from_arguments` refuses one the chosen section lacks."""
    root = _root()
    keys = [", ".join(f"`{key_of(n)}`" for n in names)]
    box = parser.add_argument_group(
        group or f"{key_of(names[0])} settings",
        f"the experiment's {keys[0]} section (workflow/schemas/config.schema.yaml); each overrides the "
        "value in --config (Snakemake passes the section as --config)")
    props: dict[str, dict[str, Any]] = {}
    for name in names:
        for key, prop in section_schema(name).get("properties", {}).items():
            props.setdefault(key, {})[name] = resolve_ref(prop, root)
    filled = {name: defaults(name) for name in names}
    for key, per_section in props.items():
        prop = next(iter(per_section.values()))
        shown = {json.dumps(filled[n][key]) for n in per_section}
        if len(shown) == 1 and len(per_section) == len(names):
            default = f"default: {shown.pop()}"
        else:
            default = "default: " + ", ".join(f"{n} {json.dumps(filled[n][key])}" for n in per_section)
        text = next((" ".join(str(p["description"]).split()) for p in per_section.values() if p.get("description")), "")
        text = text or _shared_description(key)
        help_text = f"{text} ({default})" if text else default
        flag, dest = "--" + key.replace("_", "-"), f"setting.{key}"
        if prop.get("type") == "boolean":
            option = dict(action=argparse.BooleanOptionalAction)
        else:
            choices, kind = prop.get("enum"), _argument_type(prop)
            option = dict(type=kind, choices=choices, metavar=None if choices else METAVARS[kind])
        try:
            box.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_text, **option)
        except argparse.ArgumentError:  # the command's own option (quantize --source): set it in --config
            continue


def from_arguments(args: argparse.Namespace, name: str, config: str | None = None):
    """Section `name` from a stage's command line: the JSON object of `--config` (none: {}), the
    `--<setting>` options of that section given laid over it, completed with the schema's defaults,
    as its typed settings object (`stages.sections`; a dict for `predict`)."""
    section: dict[str, Any] = {}
    if config:
        try:
            section = json.loads(config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config is not valid JSON ({e.msg} at column {e.colno}); pass the "
                              f"{key_of(name)} section as one object") from None
        if not isinstance(section, dict):
            raise ConfigError(f"--config must be a JSON object (the {key_of(name)} section), "
                              f"not {type(section).__name__}")
    own = section_schema(name).get("properties", {})
    for dest, value in vars(args).items():
        key = dest.removeprefix("setting.")
        if dest.startswith("setting.") and key in own:
            section[key] = value
    # `predict` has its own dataclass with a non-config switch (stages.predict.PredictSettings)
    return BY_NAME[name].of(section) if name in BY_NAME else complete(section, name)


def given_settings(args: argparse.Namespace) -> list[str]:
    """The `--<setting>` options given on a command line (their keys)."""
    return [dest.removeprefix("setting.") for dest in vars(args) if dest.startswith("setting.")]
