"""The config schema (workflow/schemas/config.schema.yaml) and its sections: the bottom of the
settings layer. It reads the schema, resolves its references, rejects unknown keys with the closest
valid one, fills defaults and validates values, each failure a ConfigError naming the key path;
and it completes one section (`complete(section, name)`) with the schema's defaults, which is how a
stage's `run()` called from Python trains with the same settings as under Snakemake.

Imports nothing of `stages` but errors.py; torch-free, so that parsing the workflow stays fast.
`stages.sections` builds typed sections on it, `stages.settings` a stage's command-line options,
`stages.config` the whole config's check.

    complete({"max_steps": 20}, "lora")   # every other finetune.lora key at its default
"""

from __future__ import annotations

import copy
import difflib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from stages.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "config.schema.yaml"


def load_schema(path: str | Path = SCHEMA_PATH) -> dict[str, Any]:
    """The config schema (a fresh copy; parsed once per process, with libyaml where PyYAML has it)."""
    return copy.deepcopy(_parsed_schema(str(Path(path).resolve()), Path(path).stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _parsed_schema(path: str, mtime_ns: int) -> dict[str, Any]:
    return yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def resolve_ref(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref:
        target: Any = root
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        return target
    return node


def check_keys(instance: Any, schema: dict[str, Any], root: dict[str, Any], path: list[str]) -> None:
    """Reject unknown keys (with a suggestion) and recurse into known ones."""
    schema = resolve_ref(schema, root)
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, value in instance.items():
        if key in props:
            check_keys(value, props[key], root, path + [str(key)])
        elif isinstance(extra, dict):
            check_keys(value, extra, root, path + [str(key)])
        elif extra is False:
            where = ".".join(path) or "the top level"
            close = difflib.get_close_matches(str(key), list(props), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"config key {'.'.join(path + [str(key)])!r} is unknown{hint} "
                f"(valid keys in {where}: {', '.join(sorted(props))})"
            )


def fill_defaults(instance: Any, schema: dict[str, Any], root: dict[str, Any]) -> None:
    """Insert a deep copy of each missing property's default, then recurse."""
    schema = resolve_ref(schema, root)
    if not isinstance(instance, dict):
        return
    props = schema.get("properties", {})
    for key, sub in props.items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if key in instance:
            fill_defaults(instance[key], sub, root)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for key, value in instance.items():
            if key not in props:
                fill_defaults(value, extra, root)


def validate(instance: Any, schema: dict[str, Any], where: list[str] | None = None) -> None:
    """ConfigError for the first value `instance` breaks `schema` (types, enums, ranges), naming
    its key path below `where`; `schema` carries `$defs` for its references."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        key = ".".join([*(where or []), *(str(p) for p in e.absolute_path)]) or "the top level"
        raise ConfigError(f"config key {key!r}: {e.message}")


# section name -> its path below an experiment (finetune methods are one level deeper)
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model",), "data": ("data",), "pretrain": ("pretrain",), "sft": ("finetune", "sft"),
    "lora": ("finetune", "lora"), "prefix": ("finetune", "prefix"), "align": ("align",),
    "predict": ("predict",),
    "quantize": ("quantize",), "export": ("export",), "deploy": ("deploy",), "evaluate": ("evaluate",),
    "cluster": ("cluster",),
}


@functools.lru_cache(maxsize=None)
def root() -> dict[str, Any]:
    """The schema, parsed once per process (shared: do not modify it)."""
    return load_schema()


def key_of(name: str) -> str:
    """The section's config key below an experiment: `finetune.lora`, `pretrain`, ..."""
    return ".".join(SECTIONS[name])


def section_schema(name: str) -> dict[str, Any]:
    """The schema of section `name` (see SECTIONS), its `$ref`s resolved against the root."""
    if name not in SECTIONS:
        raise ConfigError(f"no config section {name!r}; sections: {', '.join(SECTIONS)}")
    schema = root()
    node = resolve_ref(schema["$defs"]["experiment"], schema)
    for part in SECTIONS[name]:
        node = resolve_ref(node["properties"][part], schema)
    return node


def defaults(name: str) -> dict[str, Any]:
    """Every setting of section `name` at its schema default (a fresh copy)."""
    return complete({}, name)


def complete(section: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """`section` with every missing setting at its schema default, checked against the schema:
    an unknown key (with the closest valid one) or a wrong value is a ConfigError naming the key."""
    whole, schema = root(), section_schema(name)
    section = copy.deepcopy(dict(section or {}))
    check_keys(section, schema, whole, [key_of(name)])
    fill_defaults(section, schema, whole)
    validate(section, {**schema, "$defs": whole.get("$defs", {})}, [key_of(name)])
    return section
