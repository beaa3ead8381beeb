"""Which models one server answers with, and the id each answers as: the variants of an experiment
(`--experiment results/<exp>`) and model directories named one by one (`--model DIR`, any number).

An experiment's variants are the torch model directories the chain wrote into results/<exp>/ that
`stages.inference.loading.load_variant` loads: the imported checkpoint (`base`), `pretrain`, the
fine-tuned `sft`, `lora` and `prefix` (adapters, on their base), `lora-merged`, the aligned `align`
(a model, or a LoRA adapter on its source), and each quantized `quant/<variant>`. Each is named as evaluate and the report name it (`eval/<variant>.json`, the
rows of report.md): its directory's name, so quant/wint4 answers as `wint4`. Not served:
`export/` (ONNX; the server runs torch models), `deploy/` (files for other runtimes) and
`checkpoints/` (training state), nor any directory that holds no config.json or adapter_config.json.

Every id must be unique: two directories with the same name (`--model a/sft --model b/sft`) are
refused, naming both, until `--served-model-name` tells them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stages.deployment.onnx_model import is_onnx_dir
from stages.errors import InputError

# The report's row order (the starting model, then the chain); other directories follow by name.
CHAIN_ORDER = ("base", "pretrain", "sft", "lora", "prefix", "lora-merged", "align")
NOT_VARIANTS = ("export", "deploy", "checkpoints", "data")  # directories of an experiment that are no model


@dataclass(frozen=True)
class ModelSpec:
    """One model of a server: the id requests name and the directory it is loaded from."""

    model_id: str
    model_dir: Path


def is_model_dir(directory: Path) -> bool:
    """Whether `directory` holds a torch model or adapter the server loads (not an ONNX export)."""
    if not directory.is_dir() or is_onnx_dir(directory):
        return False
    return (directory / "adapter_config.json").is_file() or (directory / "config.json").is_file()


def _chain_key(name: str) -> tuple[int, str]:
    return (CHAIN_ORDER.index(name) if name in CHAIN_ORDER else len(CHAIN_ORDER), name)


def experiment_variants(experiment_dir: str | Path) -> list[ModelSpec]:
    """The servable variants of results/<exp> (module docstring), in the report's order, then the
    quantized ones by name; InputError when the directory holds none."""
    experiment_dir = Path(experiment_dir)
    if not experiment_dir.is_dir():
        raise InputError(f"--experiment {experiment_dir} is not a directory; pass results/<experiment>")
    top = [d for d in experiment_dir.iterdir() if d.name not in NOT_VARIANTS and d.name != "quant" and is_model_dir(d)]
    quant_dir = experiment_dir / "quant"
    quant = [d for d in quant_dir.iterdir() if is_model_dir(d)] if quant_dir.is_dir() else []
    specs = [ModelSpec(d.name, d) for d in sorted(top, key=lambda d: _chain_key(d.name))]
    specs += [ModelSpec(d.name, d) for d in sorted(quant, key=lambda d: d.name)]
    if not specs:
        raise InputError(f"--experiment {experiment_dir} holds no model directory yet (pretrain, sft, lora, prefix, "
                         "lora-merged, quant/<variant>); run its chain first, e.g. snakemake --cores all "
                         f"{experiment_dir}/quant_eval.json")
    check_unique(specs)
    return specs


def named_dirs(model_dirs: Sequence[str | Path], names: Sequence[str] | None = None) -> list[ModelSpec]:
    """`--model` directories with their ids: `names` (`--served-model-name`, one per `--model`, in
    order) or each directory's name."""
    if names and len(names) != len(model_dirs):
        raise InputError(f"--served-model-name is given {len(names)} times for {len(model_dirs)} --model; give one "
                         "name per --model, in the same order (or none: each model is named by its directory)")
    return [ModelSpec(names[i] if names else Path(d).resolve().name, Path(d)) for i, d in enumerate(model_dirs)]


def check_unique(specs: Sequence[ModelSpec]) -> None:
    """InputError when two models would answer as the same id."""
    seen: dict[str, Path] = {}
    for spec in specs:
        if spec.model_id in seen:
            raise InputError(f"two models would be served as {spec.model_id!r}: {seen[spec.model_id]} and "
                             f"{spec.model_dir}; give each --model its own --served-model-name")
        seen[spec.model_id] = spec.model_dir
