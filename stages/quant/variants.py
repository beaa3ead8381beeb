"""Quantized variants as data: a name stands for a method plus its settings.

`quantize.variants` lists names. Each is a built-in spec (`BUILTIN_VARIANTS`) or one the experiment
defines under `quantize.custom_variants` ({name: {method: ..., setting: value, ...}}). A spec's
settings override the method's section defaults:

    method  section defaults                      settings a spec may set
    rtn     bits 4, group_size = quantize.group_size, sym false   bits (4, 8), group_size, sym
    gptq    quantize.gptq (group_size null = quantize.group_size) bits, group_size, sym, desc_act,
                                                                  static_groups, damp_percent,
                                                                  true_sequential, mse
    a8w8    quantize.a8w8                                         activation, smooth, smooth_alpha,
                                                                  smooth_search, smooth_alpha_grid,
                                                                  shift, smooth_all_linears,
                                                                  shift_all_linears
    awq     quantize.awq (group_size null = quantize.group_size)  bits, group_size, sym, n_grid,
                                                                  duo_scaling, clip, max_shrink

gptq, a8w8 and awq are calibrated on `quantize.calibration` (the experiment's data); rtn needs no data.
`resolve_variant(name, section)` returns the `VariantSpec` the quantize stage applies and records;
an unknown name, method or setting is an `InputError` that lists the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages import schema
from stages.errors import InputError

METHODS = ("rtn", "gptq", "a8w8", "awq")
CALIBRATED_METHODS = ("gptq", "a8w8", "awq")  # read the experiment's data for calibration
# The modules only one method's quantize job runs: editing one reruns that method's variants and not
# the others' (the workflow's code params, stages/provenance/code.py); rtn is stages.quant.rtn, which
# every method's packing uses.
METHOD_MODULES = {"rtn": (), "gptq": ("stages.quant.gptq",), "a8w8": ("stages.quant.smoothquant", "stages.quant.a8w8"),
                  "awq": ("stages.quant.awq",)}

# Each method's defaults: rtn's here (no config section of its own), gptq's and a8w8's the schema's
# `quantize.gptq` / `quantize.a8w8` (GPTQConfig's and A8W8Config's equal them: a test holds them so).
# group_size None: `quantize.group_size`.
_SECTION = schema.defaults("quantize")
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "rtn": {"bits": 4, "group_size": None, "sym": False},
    "gptq": _SECTION["gptq"],
    "a8w8": _SECTION["a8w8"],
    "awq": _SECTION["awq"],
}
METHOD_KEYS = {method: tuple(defaults) for method, defaults in METHOD_DEFAULTS.items()}
RTN_KEYS, GPTQ_KEYS, A8W8_KEYS, AWQ_KEYS = (METHOD_KEYS[m] for m in ("rtn", "gptq", "a8w8", "awq"))

# Built-in names. The w<bits>g<group> names follow GPTQModel / Hugging Face model cards; wint8 /
# wint4 / a8w8 follow PaddleNLP's quant types. Group sizes left out come from quantize.group_size.
BUILTIN_VARIANTS: dict[str, dict[str, Any]] = {
    "wint8": {"method": "rtn", "bits": 8, "group_size": -1},  # INT8 needs no groups to stay accurate
    "wint4": {"method": "rtn", "bits": 4},
    "wint4-sym": {"method": "rtn", "bits": 4, "sym": True},
    "gptq-w4": {"method": "gptq", "bits": 4},
    "gptq-w4g128": {"method": "gptq", "bits": 4, "group_size": 128},
    # act-order's classic layout: groups of the processing order, a non-monotonic g_idx
    "gptq-w4g128-act": {"method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "static_groups": False},
    "gptq-w3g64": {"method": "gptq", "bits": 3, "group_size": 64},
    "gptq-w8": {"method": "gptq", "bits": 8, "group_size": -1},
    "a8w8": {"method": "a8w8", "smooth": False},
    "a8w8-static": {"method": "a8w8", "activation": "static", "smooth": False},
    "a8w8-smooth": {"method": "a8w8", "smooth": True},
    "a8w8-smooth-search": {"method": "a8w8", "smooth": True, "smooth_search": True},
    "a8w8-smooth-shift": {"method": "a8w8", "smooth": True, "shift": True},
    "awq-w4": {"method": "awq", "bits": 4},
    "awq-w4g128": {"method": "awq", "bits": 4, "group_size": 128},
}


@dataclass(frozen=True)
class VariantSpec:
    """One variant as applied: its name, method and every setting of that method (defaults filled)."""

    name: str
    method: str
    settings: dict[str, Any]

    @property
    def calibrated(self) -> bool:
        return self.method in CALIBRATED_METHODS


def variant_specs(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every name the `quantize` section can use: the built-ins and its `custom_variants`."""
    custom = section.get("custom_variants") or {}
    shadowed = sorted(set(custom) & set(BUILTIN_VARIANTS))
    if shadowed:
        raise InputError(f"quantize.custom_variants redefines the built-in variant(s) {shadowed}; pick another "
                         f"name (built-ins: {sorted(BUILTIN_VARIANTS)})")
    return {**BUILTIN_VARIANTS, **custom}


def spec_method(name: str, section: dict[str, Any]) -> str:
    """The method of variant `name` (rtn, gptq, a8w8, awq); InputError listing the names for an unknown one."""
    specs = variant_specs(section)
    if name not in specs:
        raise InputError(f"quantize variant {name!r} is unknown; choose one of {sorted(specs)} or define it "
                         "under quantize.custom_variants ({name: {method: rtn|gptq|a8w8|awq, ...}})")
    method = specs[name].get("method")
    if method not in METHODS:
        raise InputError(f"quantize.custom_variants.{name}.method={method!r} is unknown; choose one of {list(METHODS)}")
    return method


def _check_group_size(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
        raise InputError(f"{key}={value!r} must be a positive integer (input features per scale) or -1 (per channel)")


def resolve_variant(name: str, section: dict[str, Any]) -> VariantSpec:
    """The spec of variant `name` with the `quantize` section's defaults filled (see module docstring).

    `section` is the experiment's `quantize` section with the schema's defaults filled (its
    group_size, gptq, a8w8 and custom_variants entries are read)."""
    method = spec_method(name, section)
    spec = dict(variant_specs(section)[name])
    spec.pop("method")
    where = f"quantize.custom_variants.{name}" if name not in BUILTIN_VARIANTS else f"quantize variant {name}"
    unknown = sorted(set(spec) - set(METHOD_KEYS[method]))
    if unknown:
        raise InputError(f"{where}: {unknown} are not settings of method {method}; valid: {list(METHOD_KEYS[method])}")
    section_defaults = {k: v for k, v in (section.get(method) or {}).items() if v is not None}
    unknown = sorted(set(section_defaults) - set(METHOD_KEYS[method]))
    if unknown:
        raise InputError(f"quantize.{method}: {unknown} are not settings of method {method}; "
                         f"valid: {list(METHOD_KEYS[method])}")
    settings = {**METHOD_DEFAULTS[method], **section_defaults, **spec}
    if settings.get("group_size", -1) is None:
        settings["group_size"] = section["group_size"]
    if method in ("rtn", "awq") and settings["bits"] not in (4, 8):
        what = "round-to-nearest" if method == "rtn" else "AWQ (round-to-nearest codes)"
        raise InputError(f"{where}: bits={settings['bits']} is not supported by {what}; choose 4 or 8 "
                         "(GPTQ also packs 2 and 3 bits)")
    if "group_size" in settings:
        if "group_size" in spec:
            key = f"{where}.group_size"
        elif (section.get(method) or {}).get("group_size") is not None:
            key = f"quantize.{method}.group_size"
        else:
            key = "quantize.group_size"
        _check_group_size(settings["group_size"], key)
    return VariantSpec(name=name, method=method, settings=settings)


def variant_settings(variant: str, quant: dict[str, Any]) -> dict[str, Any]:
    """The part of a complete `quantize` section that variant `variant` reads: group_size, its
    custom spec, its method's defaults (gptq, a8w8) and, when calibrated, `calibration`. The
    workflow passes just this to the variant's job (changing one method's settings reruns only
    its variants), and meta.json records it."""
    method = spec_method(variant, quant)
    settings: dict[str, Any] = {"group_size": quant["group_size"]}
    if variant in quant["custom_variants"]:
        settings["custom_variants"] = {variant: quant["custom_variants"][variant]}
    if method in quant:  # gptq, a8w8, awq
        settings[method] = quant[method]
    if method in CALIBRATED_METHODS:
        settings["calibration"] = quant["calibration"]
    return settings
