"""Loading a model directory of any kind for inference: `load_variant(dir)` -> (model in eval
mode, tokenizer, kind), the one loader of evaluate, predict and the server.

What is loaded depends on what the directory holds:
  * `adapter_config.json`            -> peft adapter (kind "adapter"): base from `meta.json`'s
                                        `parent` (else adapter_config's `base_model_name_or_path`,
                                        `adapter_base_dir`), then `peft.PeftModel.from_pretrained(base, dir)`;
                                        or on a base the caller already loaded (`base_model`: the
                                        server puts several adapters on one copy of their base's weights)
  * config.json with `quantization_config` -> `stages.quant.load_quantized(dir)` ("quantized")
  * `model.onnx` (stages.export)     -> onnxruntime, CPU provider ("onnx",
                                        `stages.deployment.onnx_model.OnnxCausalLM`)
  * otherwise                        -> plain HF dir ("hf"), `AutoModelForCausalLM` in fp32, local
                                        files only, safetensors only, never `trust_remote_code`
Every torch directory passes `stages.checkpoint.weights` first (the sha256 its meta.json records,
no pickle weights, whole safetensors files). The tokenizer always comes from the directory itself
(adapter dirs carry the tokenizer files too). Bad input raises InputError naming the directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.weights import check_adapter_dir, check_model_dir
from stages.data.tokenizer import load_model_tokenizer
from stages.deployment.onnx_model import OnnxCausalLM, is_onnx_dir
from stages.errors import InputError
from stages.inference import BACKENDS

log = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file a stage wrote; InputError naming it (and the stage to re-run) when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-run the stage "
                         "that wrote it") from None


def _load_full_model(model_dir: Path) -> tuple[torch.nn.Module, str]:
    """A complete (non-adapter) model: quantized dirs via stages.quant, others via transformers."""
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise InputError(f"{config_path} is missing: {model_dir} is neither an HF model dir nor a peft "
                         "adapter dir (no adapter_config.json); pass a directory written by a stage")
    if "quantization_config" in read_json(config_path):
        # Imported here: it brings transformers, which ONNX dirs never need; only quantized dirs use it.
        from stages.quant import load_quantized

        return load_quantized(model_dir), "quantized"  # its weights go through check_model_dir too
    from transformers import AutoModelForCausalLM

    check_model_dir(model_dir)  # sha256 against meta.json, no pickle, whole safetensors
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=False, use_safetensors=True)
    return model, "hf"


def adapter_base_dir(adapter_dir: Path) -> Path:
    """Where the base model of a peft adapter lives.

    Candidates, in order: meta.json's `parent`, then adapter_config.json's
    `base_model_name_or_path`; each as written (relative to the working directory, the repo root
    under Snakemake), then as a sibling of the adapter dir with the same name (so an experiment
    directory that was moved still resolves).
    """
    names = []
    if (adapter_dir / "meta.json").exists():
        names.append(read_json(adapter_dir / "meta.json").get("parent"))
    names.append(read_json(adapter_dir / "adapter_config.json").get("base_model_name_or_path"))
    tried = []
    for name in filter(None, names):
        for candidate in (Path(name), adapter_dir.parent / Path(name).name):
            if (candidate / "config.json").exists():
                return candidate
            tried.append(str(candidate))
    raise InputError(f"cannot find the base model of adapter {adapter_dir}: tried {tried or 'nothing'} "
                     "(from meta.json 'parent' and adapter_config.json 'base_model_name_or_path'); "
                     "set one of them to the base model's directory")


def _load_adapter(adapter_dir: Path, base_dir: Path | None, base_model: torch.nn.Module | None = None
                  ) -> torch.nn.Module:
    """A peft adapter on its base (`base_dir`, default: `adapter_base_dir`), every adapted layer
    loaded. `base_model`: that base already loaded (peft injects the adapter's layers into its module
    tree, so it must not be a tree another model uses)."""
    # Imported here: peft (and transformers) load only for adapter dirs.
    import peft

    from stages.adapters.peft_files import check_adapter_fits, check_every_adapted_layer_loaded

    base_dir = Path(base_dir) if base_dir is not None else adapter_base_dir(adapter_dir)
    check_adapter_dir(adapter_dir)  # before the base loads: a bad adapter fails fast
    check_adapter_fits(adapter_dir, base_dir)
    base = base_model if base_model is not None else _load_full_model(base_dir)[0]
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    check_every_adapted_layer_loaded(model, adapter_dir)
    log.info("loaded adapter %s on base %s", adapter_dir, base_dir)
    return model


def load_variant(model_dir: str | Path, backend: str | None = None, base_dir: str | Path | None = None,
                 base_model: torch.nn.Module | None = None) -> tuple[Any, Any, str]:
    """(model in eval mode, tokenizer, kind) for whatever `model_dir` holds (see module docstring).
    `backend` None decides from the directory (model.onnx: onnxruntime); "torch" or
    "onnxruntime" insists on one and names the other when the directory needs it. `base_dir`: an
    adapter's base model, as the workflow passes it (default: `adapter_base_dir`); `base_model`:
    that base already loaded, for an adapter dir (ignored for any other)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"--model {model_dir} is not a directory; pass a stage's output directory")
    if backend not in (None, *BACKENDS):
        raise InputError(f"backend={backend!r}; valid: {', '.join(BACKENDS)}")
    onnx = is_onnx_dir(model_dir)
    if backend == "onnxruntime" and not onnx:
        raise InputError(f"--backend onnxruntime needs an exported directory with model.onnx (stages.export); "
                         f"{model_dir} has none")
    if backend == "torch" and onnx:
        raise InputError(f"{model_dir} holds an ONNX model (model.onnx); run it with --backend onnxruntime")
    if onnx:
        model, kind = OnnxCausalLM(model_dir), "onnx"
        log.info("loaded ONNX model %s on onnxruntime", model_dir)
    elif (model_dir / "adapter_config.json").exists():
        model, kind = _load_adapter(model_dir, base_dir, base_model), "adapter"
    else:
        model, kind = _load_full_model(model_dir)
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise InputError(f"{model_dir} holds no tokenizer files (tokenizer.json); every model and adapter "
                         "dir must carry its tokenizer (stages.checkpoint.hf.copy_tokenizer)")
    tokenizer = load_model_tokenizer(model_dir)
    return model.eval(), tokenizer, kind
