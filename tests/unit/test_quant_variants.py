"""Quantized variants as named specs (stages.quant.variants): resolution, defaults, errors."""

from __future__ import annotations

import pytest

from stages.config import load_schema
from stages.errors import InputError
from stages.quant.awq import AWQConfig
from stages.quant.gptq import GPTQConfig
from stages.quant.variants import BUILTIN_VARIANTS, METHOD_DEFAULTS, METHOD_KEYS, resolve_variant, spec_method


def _schema_quantize() -> dict:
    return load_schema()["$defs"]["experiment"]["properties"]["quantize"]["properties"]


def _section(**extra) -> dict:
    """A quantize section as check_config fills it."""
    quant = _schema_quantize()
    section = {k: v["default"] for k, v in quant.items() if "default" in v}
    for method in ("gptq", "a8w8", "awq", "calibration"):
        section[method] = {k: v["default"] for k, v in quant[method]["properties"].items()}
    return {**section, **extra}


def test_method_defaults_are_the_schemas_and_the_configs():
    quant = _schema_quantize()
    for method in ("gptq", "a8w8", "awq"):
        assert {k: v["default"] for k, v in quant[method]["properties"].items()} == METHOD_DEFAULTS[method]
    for method, config in (("gptq", GPTQConfig()), ("awq", AWQConfig())):
        assert {k: getattr(config, k) for k in METHOD_KEYS[method] if k != "group_size"} == \
            {k: v for k, v in METHOD_DEFAULTS[method].items() if k != "group_size"}
    # the schema lists every setting a custom variant may hold
    assert set(quant["custom_variants"]["additionalProperties"]["properties"]) == \
        {"method"} | {k for keys in METHOD_KEYS.values() for k in keys}


def test_builtin_names_resolve_with_the_section_defaults():
    section = _section(group_size=32)
    assert resolve_variant("wint4", section).settings == {"bits": 4, "group_size": 32, "sym": False}
    assert resolve_variant("wint8", section).settings["group_size"] == -1
    gptq = resolve_variant("gptq-w4", section)
    assert gptq.method == "gptq" and gptq.calibrated and gptq.settings["group_size"] == 32
    assert resolve_variant("gptq-w4g128", section).settings["group_size"] == 128
    assert resolve_variant("gptq-w3g64", section).settings["bits"] == 3
    smooth = resolve_variant("a8w8-smooth", section)
    assert smooth.method == "a8w8" and smooth.settings["smooth"] and smooth.settings["smooth_alpha"] == 0.5
    awq = resolve_variant("awq-w4", section)
    assert awq.method == "awq" and awq.calibrated and awq.settings["group_size"] == 32 and not awq.settings["sym"]
    assert resolve_variant("awq-w4g128", section).settings["group_size"] == 128
    for name in BUILTIN_VARIANTS:
        assert resolve_variant(name, section).name == name


def test_section_and_custom_settings_override_in_that_order():
    section = _section(group_size=32, gptq={**_section()["gptq"], "group_size": 16, "desc_act": True},
                       a8w8={**_section()["a8w8"], "smooth_alpha": 0.8},
                       custom_variants={"mine": {"method": "gptq", "bits": 2, "group_size": 8}})
    assert resolve_variant("gptq-w4", section).settings["group_size"] == 16  # quantize.gptq beats quantize.group_size
    assert resolve_variant("gptq-w4", section).settings["desc_act"] is True
    assert resolve_variant("gptq-w4g128", section).settings["group_size"] == 128  # the spec beats the section
    assert resolve_variant("a8w8-smooth", section).settings["smooth_alpha"] == 0.8
    mine = resolve_variant("mine", section)
    assert mine.settings["bits"] == 2 and mine.settings["group_size"] == 8 and mine.settings["desc_act"] is True


@pytest.mark.parametrize("name,section,expected", [
    ("wint5", {}, r"variant 'wint5' is unknown; choose one of \['a8w8', .*'wint8'\] or define it under "
                  r"quantize\.custom_variants"),
    ("x", {"custom_variants": {"x": {"method": "hqq"}}}, r"custom_variants\.x\.method='hqq' is unknown; choose one "
                                                         r"of \['rtn', 'gptq', 'a8w8', 'awq'\]"),
    ("x", {"custom_variants": {"x": {"method": "awq", "bits": 3}}}, r"bits=3 is not supported by AWQ"),
    ("x", {"custom_variants": {"x": {"method": "rtn", "desc_act": True}}},
     r"custom_variants\.x: \['desc_act'\] are not settings of method rtn; valid: \['bits', 'group_size', 'sym'\]"),
    ("x", {"custom_variants": {"x": {"method": "rtn", "bits": 3}}}, r"bits=3 is not supported by round-to-nearest"),
    ("x", {"custom_variants": {"x": {"method": "gptq", "group_size": 0}}},
     r"quantize\.custom_variants\.x\.group_size=0 must be a positive integer"),
    ("wint4", {"group_size": -7}, r"quantize\.group_size=-7 must be a positive integer"),
    ("wint8", {"custom_variants": {"wint8": {"method": "rtn"}}}, r"redefines the built-in variant\(s\) \['wint8'\]"),
])
def test_bad_variants_name_the_key_and_the_valid_choices(name, section, expected):
    with pytest.raises(InputError, match=expected):
        resolve_variant(name, _section(**section))


def test_spec_method():
    assert spec_method("a8w8", {}) == "a8w8" and spec_method("wint8", {}) == "rtn"


def test_a8w8_defaults_are_a8w8configs():
    from stages.quant.a8w8 import A8W8Config

    config = A8W8Config()
    assert {k: getattr(config, k) for k in METHOD_KEYS["a8w8"]} == \
        {k: tuple(v) if isinstance(v, list) else v for k, v in METHOD_DEFAULTS["a8w8"].items()}
