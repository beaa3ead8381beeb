"""Sweeps: a grid (or a list) of overrides of one experiment, expanded into ordinary experiments.

    sweeps:
      lora_rank:
        base: llama                         # the experiment every member starts from
        grid:                               # every combination (a cartesian product) ...
          finetune.lora.lora_rank: [4, 16]  # ... of values by key path
          seed: [1, 2]                      # `seed`: every seed of the chain (data, pretrain, finetune, ...)
        # list: [{finetune.lora.lora_rank: 4}, {finetune.lora.lora_rank: 16, finetune.lora.lora_alpha: 32}]
        variants: [lora]                    # compared variants (default: the base's quantize.source)
        metrics: [exact_match, ppl_ratio]   # compared metrics (eval/<variant>.json keys, or ppl_ratio)

expands into experiments named `<sweep>.<key>-<value>...` (Snakemake's Paramspace naming: the
last part of each key path, `lora_rank.lora_rank-4.seed-1`), each the base with that row's values
merged in. Members whose upstream (model, data and pretraining sections) is the same share it: the
data and the pretrained (or imported) model are made once, by a hidden experiment
`shared-<hash>` named by the upstream's content (so two sweeps of the same base share it too), and
every member's `data`, `pretrain` or `base` is a link to it. Adding a value to the grid adds
experiments and leaves every existing one (and its upstream) as it was, so Snakemake runs only the
new ones.

`comparisons:` lists experiments to compare that are not a sweep (`{experiments: [...], variants,
metrics}`). Both are compared by `python -m stages.compare` into results/sweeps/<name>/ and
results/comparisons/<name>/. Torch-free: the workflow calls this while it parses.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from typing import Any

from stages.errors import ConfigError

SEED_KEY = "seed"
# what `seed` sets: every seed of the chain (as bench/finetune_quality.py always did)
SEEDED_SECTIONS = ("data", "pretrain", "align", "predict")
FINETUNE_METHODS = ("sft", "lora", "prefix")
UPSTREAM_SECTIONS = ("model", "data", "pretrain", "cluster")  # what makes the data and the starting model
SHARED_ARTIFACTS = ("data", "pretrain", "base")  # what members link to instead of making
DEFAULT_METRICS = ("exact_match", "ppl")
_VALUE = re.compile(r"^[A-Za-z0-9_.+-]+$")


class SweepError(ConfigError):
    """A sweep that cannot be expanded; the message names the sweep and the key."""


def set_path(exp: dict[str, Any], path: str, value: Any) -> None:
    """exp[a][b][c] = value for path "a.b.c" (sections created as needed); `seed` sets every seed."""
    if path == SEED_KEY:
        for section in SEEDED_SECTIONS:
            exp.setdefault(section, {})["seed"] = value
        for method in FINETUNE_METHODS:
            exp.setdefault("finetune", {}).setdefault(method, {})["seed"] = value
        exp.setdefault("quantize", {}).setdefault("calibration", {})["seed"] = value
        return
    *parents, leaf = path.split(".")
    node = exp
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SweepError(f"{path}: {part!r} is a value ({child!r}), not a section")
        node = child
    node[leaf] = copy.deepcopy(value)


def short_names(paths: list[str]) -> dict[str, str]:
    """Each key path's name in experiment names: its last part, or more parts joined by `_` where
    two paths end alike (finetune.sft.learning_rate, finetune.lora.learning_rate)."""
    names = {}
    for path in paths:
        parts = path.split(".")
        for n in range(1, len(parts) + 1):
            name = "_".join(parts[-n:])
            if sum(p.split(".")[-n:] == parts[-n:] for p in paths) == 1:
                break
        names[path] = name
    return names


def _rows(name: str, sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep's rows of {key path: value}, grid in its order (the last key fastest), or its list."""
    if ("grid" in sweep) == ("list" in sweep):
        raise SweepError(f"sweeps.{name}: give exactly one of `grid` (values per key path) or `list` (rows)")
    if "grid" in sweep:
        grid = sweep["grid"]
        if not isinstance(grid, dict) or not grid:
            raise SweepError(f"sweeps.{name}.grid: a mapping from key path to a list of values")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise SweepError(f"sweeps.{name}.grid.{key}: a non-empty list of values, not {values!r}")
        keys = list(grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    rows = sweep["list"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and r for r in rows):
        raise SweepError(f"sweeps.{name}.list: a non-empty list of mappings from key path to value")
    return [dict(r) for r in rows]


def _value_text(name: str, key: str, value: Any) -> str:
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    if not _VALUE.match(text):
        raise SweepError(f"sweeps.{name}: value {value!r} of {key} cannot be part of an experiment name "
                         "(letters, digits and _.+- only); sweep over simple values")
    return text


def upstream_key(exp: dict[str, Any]) -> str:
    """8 hex digits of the sections that make the data and the starting model."""
    upstream = {s: exp.get(s) for s in UPSTREAM_SECTIONS}
    return hashlib.sha256(json.dumps(upstream, sort_keys=True).encode()).hexdigest()[:8]


def _without_sweep_only(exp: dict[str, Any]) -> dict[str, Any]:
    """An upstream experiment: the member's sections that shape data and the starting model, plus
    what the workflow needs to check it (the rest falls back to the schema's defaults)."""
    return {s: copy.deepcopy(exp[s]) for s in UPSTREAM_SECTIONS if s in exp}


def expand(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config with every sweep's members and shared upstream experiments added to `experiments`
    and the `sweeps` / `comparisons` sections removed, the comparisons: {kind/name: spec}).

    A comparison spec: {kind: sweeps|comparisons, name, members: [experiment names], columns:
    {member: {short key: value}} (sweeps only), variants, metrics, shared: {member: upstream
    experiment} (sweeps only)}."""
    config = copy.deepcopy(config)
    experiments = config.setdefault("experiments", {})
    if not isinstance(experiments, dict):
        return config, {}  # check_config reports the shape
    comparisons: dict[str, Any] = {}
    for name, sweep in (config.pop("sweeps", None) or {}).items():
        comparisons[f"sweeps/{name}"] = _expand_sweep(name, sweep, experiments)
    for name, spec in (config.pop("comparisons", None) or {}).items():
        comparisons[f"comparisons/{name}"] = _comparison(name, spec, experiments)
    return config, comparisons


def _check_spec(where: str, spec: Any, allowed: set[str]) -> None:
    if not isinstance(spec, dict):
        raise SweepError(f"{where}: a mapping, not {type(spec).__name__}")
    unknown = set(spec) - allowed
    if unknown:
        raise SweepError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def _listed(where: str, spec: dict[str, Any], key: str, default: list[str]) -> list[str]:
    value = spec.get(key, default)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise SweepError(f"{where}.{key}: a non-empty list of names, not {value!r}")
    return list(value)


def _default_variants(exp: dict[str, Any]) -> list[str]:
    return [(exp.get("quantize") or {}).get("source", "lora-merged")]


def _expand_sweep(name: str, sweep: Any, experiments: dict[str, Any]) -> dict[str, Any]:
    where = f"sweeps.{name}"
    _check_spec(where, sweep, {"base", "grid", "list", "variants", "metrics"})
    base_name = sweep.get("base")
    if base_name not in experiments:
        raise SweepError(f"{where}.base: {base_name!r} is not an experiment "
                         f"(defined: {', '.join(sorted(experiments))})")
    base = experiments[base_name]
    rows = _rows(name, sweep)
    paths = list(dict.fromkeys(k for row in rows for k in row))
    short = short_names(paths)
    members, columns, shared = [], {}, {}
    for row in rows:
        exp = copy.deepcopy(base)
        for path, value in row.items():
            set_path(exp, path, value)
        member = ".".join([name, *(f"{short[p]}-{_value_text(name, p, row[p])}" for p in paths if p in row)])
        if member in experiments or member in members:
            raise SweepError(f"{where}: experiment {member!r} is defined twice (an experiment of that name exists, "
                             "or two rows have the same values)")
        upstream = f"shared-{upstream_key(exp)}"
        if upstream not in experiments:
            experiments[upstream] = _without_sweep_only(exp)
        experiments[member] = exp
        members.append(member)
        columns[member] = {short[p]: row[p] for p in paths if p in row}
        shared[member] = upstream
    return {"kind": "sweeps", "name": name, "members": members, "columns": columns, "shared": shared,
            "variants": _listed(where, sweep, "variants", _default_variants(base)),
            "metrics": _listed(where, sweep, "metrics", list(DEFAULT_METRICS))}


def _comparison(name: str, spec: Any, experiments: dict[str, Any]) -> dict[str, Any]:
    where = f"comparisons.{name}"
    _check_spec(where, spec, {"experiments", "variants", "metrics"})
    members = _listed(where, spec, "experiments", [])
    unknown = [m for m in members if m not in experiments]
    if unknown:
        raise SweepError(f"{where}.experiments: {unknown} are not experiments "
                         f"(defined: {', '.join(sorted(experiments))})")
    return {"kind": "comparisons", "name": name, "members": members, "columns": {m: {} for m in members},
            "shared": {}, "variants": _listed(where, spec, "variants", _default_variants(experiments[members[0]])),
            "metrics": _listed(where, spec, "metrics", list(DEFAULT_METRICS))}
