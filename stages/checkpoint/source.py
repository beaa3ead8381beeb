"""A starting checkpoint (`model.model_name_or_path`): what it must hold, and which families we take.

Checked when Snakemake parses the workflow (torch-free, reads only JSON and file names), and again
by the `import_base` stage that copies it into `results/<name>/base/`. A directory qualifies when
it has a config.json naming a supported architecture, its weights as safetensors (pickle files are
refused, with the conversion to run), and a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.errors import InputError
from stages.model.registry import BY_ARCHITECTURE, Family


# config.json `architectures[0]` -> family (stages/model/registry.py). Every family: full SFT, LoRA,
# prefix tuning, merge, quantization, export and evaluation (tests/unit/test_families.py).
FAMILIES: dict[str, Family] = dict(BY_ARCHITECTURE)
# Seed families that exist only as remote code (a modeling file inside the checkpoint, config.json's
# `auto_map`), which this pipeline never runs, and the native transformers class that succeeds them.
REMOTE_CODE_ONLY = {
    "ChatGLMModel": ("ChatGLM-6B / ChatGLM2-6B / ChatGLM3-6B", "GLM-4 (GlmForCausalLM, Glm4ForCausalLM)"),
    "ChatGLMForConditionalGeneration": ("ChatGLM-6B", "GLM-4 (GlmForCausalLM, Glm4ForCausalLM)"),
}
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one makes a tokenizer
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickle_conversion_hint(path: str | Path) -> str:
    """How to turn a model directory's pickle weights into safetensors, as one shell line (also used
    by `stages.checkpoint.weights` for every stage's refusal)."""
    return ("convert them once with transformers, in an environment you trust: python -c \"from transformers "
            f"import AutoModelForCausalLM as M; dir = '{path}'; "
            "M.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)\"")


class ModelSourceError(InputError):
    """A starting checkpoint the chain cannot use; the message names the path and the fix."""


def supported_architectures() -> str:
    return ", ".join(f"{arch} ({f.model_type})" for arch, f in FAMILIES.items())


def read_source_config(path: str | Path, key: str = "model.model_name_or_path") -> dict[str, Any]:
    """config.json of a starting checkpoint, after checking the directory holds what the chain needs.

    Raises ModelSourceError naming `key`, the path and the fix when the directory is missing, has no
    (or a malformed) config.json, names an unsupported architecture (the supported ones are listed),
    keeps its weights only in pickle files, has no weights at all, or has no tokenizer.
    """
    path = Path(path)
    where = f"{key}={str(path)!r}"
    if not path.is_dir():
        raise ModelSourceError(f"{where}: no such directory; give a local Hugging Face checkpoint directory "
                               "(config.json, *.safetensors, tokenizer files); nothing is downloaded")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{where}: {config_path} is missing; a Hugging Face checkpoint directory has a "
                               "config.json (save it with model.save_pretrained(dir))")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{where}: {config_path} is not valid JSON ({e}); re-save the checkpoint") from None
    family_of(config, config_path)  # an unsupported architecture is refused before anything else
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not weights and pickles:
        raise ModelSourceError(
            f"{where}: the weights are pickle files ({', '.join(pickles[:3])}), which this pipeline never "
            f"loads (unpickling can run code); {pickle_conversion_hint(path)}")
    if not weights:
        raise ModelSourceError(f"{where}: no *.safetensors weights in {path}")
    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise ModelSourceError(
            f"{where}: no tokenizer in {path} (none of {', '.join(TOKENIZER_MARKERS)}); the chain keeps the "
            f"checkpoint's own tokenizer: save it beside the weights with tokenizer.save_pretrained(dir)")
    return config


def family_of(config: dict[str, Any], config_path: str | Path = "config.json") -> Family:
    """The family of a config.json dict; ModelSourceError listing the supported ones otherwise."""
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch in FAMILIES:
        return FAMILIES[arch]
    by_type = {f.model_type: f for f in FAMILIES.values()}
    if arch is None and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    if arch in REMOTE_CODE_ONLY or config.get("auto_map"):
        name, successor = REMOTE_CODE_ONLY.get(arch, (arch, "a supported architecture"))
        raise ModelSourceError(
            f"{config_path}: {name} ({arch}) exists only as remote code (config.json's auto_map names a modeling "
            f"file inside the checkpoint), which this pipeline never runs (trust_remote_code stays off); use "
            f"{successor}: transformers' own classes. Supported: {supported_architectures()}")
    raise ModelSourceError(
        f"{config_path}: architecture {arch or config.get('model_type')!r} is not supported; supported: "
        f"{supported_architectures()}")
