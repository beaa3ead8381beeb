"""The typed settings objects (stages.sections) hold exactly the schema's keys, typed as the schema
types them, with the schema's defaults; a wrong key or value is refused by name."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import pytest

from stages import sections, settings
from stages.config import resolve_ref
from stages.errors import ConfigError

# JSON schema type -> the Python type a field must allow
PY_TYPES = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": dict,
            "null": type(None)}


def schema_types(prop: dict) -> set[type]:
    """The Python types a schema property allows (enum: its values' types; oneOf: the union)."""
    prop = resolve_ref(prop, settings._root())
    if "oneOf" in prop or "anyOf" in prop:
        return set().union(*(schema_types(p) for p in prop.get("oneOf", prop.get("anyOf"))))
    if "const" in prop:
        return {type(prop["const"])}
    kinds = prop.get("type")
    if kinds is None and "enum" in prop:
        return {type(v) for v in prop["enum"]}
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return {PY_TYPES[k] for k in kinds}


def field_types(annotation) -> set[type]:
    """The runtime types of a field's annotation (`int | None` -> {int, NoneType}, list[str] -> list)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(field_types(a) for a in typing.get_args(annotation)))
    return {typing.get_origin(annotation) or annotation}


def test_every_section_but_predict_has_a_class():
    assert set(sections.BY_NAME) == set(settings.SECTIONS) - {"predict"}
    assert sections.FINETUNE == {n: sections.BY_NAME[n] for n in ("sft", "lora", "prefix")}


@pytest.mark.parametrize("name", sorted(sections.BY_NAME))
def test_fields_are_the_schema_keys_with_the_schema_types(name):
    cls = sections.BY_NAME[name]
    props = settings.section_schema(name)["properties"]
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    assert sorted(fields) == sorted(props), f"{cls.__name__} fields differ from the schema's {settings.key_of(name)}"
    for key in fields:
        assert field_types(hints[key]) == schema_types(props[key]), (name, key)
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)), \
        "a field default would be a second source of defaults: the schema's come through .of()"


@pytest.mark.parametrize("name", sorted(sections.BY_NAME))
def test_of_gives_the_schema_defaults_and_reads_as_a_mapping(name):
    typed = sections.BY_NAME[name].of()
    assert typed.as_dict() == settings.defaults(name)
    assert dict(typed) == settings.defaults(name)
    assert json.loads(json.dumps(typed.as_dict())) == typed.as_dict()
    key = next(iter(typed))
    assert typed[key] == getattr(typed, key) and key in typed and len(typed) == len(settings.defaults(name))
    with pytest.raises(KeyError, match="is not a"):
        typed["no_such_setting"]
    assert sections.BY_NAME[name].of(typed) is typed


def test_wrong_keys_and_values_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"'finetune.lora.lora_rnak' is unknown; did you mean 'lora_rank'"):
        sections.LoraSettings.of({"lora_rnak": 8})
    with pytest.raises(ConfigError, match=r"'pretrain.max_steps': 'ten' is not of type 'integer'"):
        sections.PretrainSettings.of({"max_steps": "ten"})
    lora = sections.LoraSettings.of({"max_steps": 20})
    with pytest.raises(ConfigError, match=r"'finetune.lora.lora_rank'"):
        lora.replace(lora_rank=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lora.max_steps = 3  # type: ignore[misc]


def test_replace_and_the_finetune_family():
    lora = sections.LoraSettings.of({"max_steps": 20})
    longer = lora.replace(max_steps=40)
    assert (lora.max_steps, longer.max_steps, longer.lora_rank) == (20, 40, lora.lora_rank)
    assert isinstance(lora, sections.SftSettings) and isinstance(lora, sections.TrainingSettings)
    # a section of another method is not silently read as this one's
    with pytest.raises(ConfigError, match="num_prefix_tokens"):
        sections.LoraSettings.of(sections.PrefixSettings.of({}))
    assert (lora | {"max_steps": 40}) == longer and isinstance(lora | {}, sections.LoraSettings)
