"""Which model trains a family on the training engine, and what the engine does differently for it.

The families our Llama implements (`stages/model/registry.py` marks them `ours`: Llama,
Qwen2, Mistral, Qwen3, GLM, GLM-4) train through our model in every layout: data parallel, ZeRO
1/2/3, tensor and pipeline parallelism; GPT-2 too for full training (pretraining, full SFT:
`Family.trains_ours`, `load_causal_lm(..., families="all")`), its adapters on transformers' model.
Every other causal LM that transformers supports (OPT, Bloom, GPT-NeoX, ...) trains through
transformers' own model with data parallel and ZeRO 1/2/3 only: our tensor-parallel plan and
pipeline split are written against our model's module names.

The engine tells the two apart by the model it is given; the helpers here take either. This module
imports neither torch nor transformers at import time: `stages.config` asks
`supports_model_parallel` while it parses the config, before any job starts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from stages.model.registry import model_types
from stages.sections import TrainingSettings

log = logging.getLogger(__name__)


# -- which families may be split --------------------------------------------------------------------
def own_families() -> tuple[str, ...]:
    """config.json `model_type`s our model implements (sorted)."""
    return tuple(sorted(model_types(ours=True)))


def model_parallel_families() -> tuple[str, ...]:
    """The families tensor and pipeline parallelism both split: ours, less the mixtures of experts
    (tensor parallelism of their attention only: stages/model/moe_layouts.py)."""
    return tuple(sorted(set(own_families()) - set(model_types(moe=True))))


def supports_model_parallel(model_type: str) -> bool:
    """Whether tensor/pipeline parallelism is available for `model_type` (config.json's key):
    only for the dense families our model implements."""
    return model_type in model_parallel_families()


def check_model_parallel(model_type: str, tensor_parallel_degree: int, pipeline_parallel_degree: int) -> None:
    """Raise ValueError, naming `model_type` and the families that support it, when a family that
    trains through transformers' model is given tensor or pipeline parallelism (config-time check)."""
    if not supports_model_parallel(model_type):
        _refuse_model_parallel(model_type, tensor_parallel_degree, pipeline_parallel_degree)


def check_transformers_model(model, section: TrainingSettings, tensor_parallel_degree: int,
                             pipeline_parallel_degree: int) -> None:
    """Refuse what the engine cannot do for a transformers `model` with the training `section`:
    tensor/pipeline parallelism (whatever the family: ours may have declined a variant of its own,
    e.g. a Llama with another activation) and activation recompute where the model has none."""
    model_type = model.config.model_type
    _refuse_model_parallel(model_type, tensor_parallel_degree, pipeline_parallel_degree,
                           model_class=type(model).__name__)
    if section.recompute and not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"recompute=true: transformers' {type(model).__name__} (model_type={model_type!r}) "
                         "has no gradient checkpointing; set recompute: false")


def _refuse_model_parallel(model_type: str, tp: int, pp: int, model_class: str = "model") -> None:
    if tp > 1 or pp > 1:
        raise ValueError(
            f"tensor_parallel_degree={tp}, pipeline_parallel_degree={pp}: model_type={model_type!r} trains "
            f"through transformers' {model_class}, with data parallel and ZeRO only; tensor and pipeline "
            f"parallelism need a dense family our model implements ({', '.join(model_parallel_families())}). Set both "
            "degrees to 1 and shard over world_size with sharding: stage1, stage2 or stage3")


# -- loading ------------------------------------------------------------------------------------------
def load_causal_lm(model_dir: str | Path, lazy: bool = False, families: str = "ours"):
    """The fp32 model of a local HF directory for the training engine: our LlamaForCausalLM when our
    config reader takes its config.json (the families we implement), else transformers'
    `AutoModelForCausalLM` (no hub, no remote code, safetensors only). Raises FileNotFoundError
    without config.json, `WeightsError` (a ValueError) for weights that fail the checks of
    `stages.checkpoint.weights`, and ValueError when our loader takes the config but the weights
    do not match it. With `lazy`, our model comes on the meta device, to be filled with each rank's
    slice by the engine (`stages.training.materialize`); a transformers model is always whole.
    `families="all"` (full training: pretraining, full SFT) also takes GPT-2 into our model
    (`stages.model.registry.Family.trains_ours`)."""
    # torch and safetensors: this module is torch-free at import (see its docstring)
    from stages.checkpoint.hf import load_config, load_pretrained
    from stages.training.materialize import lazy_pretrained

    try:
        load_config(model_dir, families)
    except ValueError as exc:  # a family (or a variant) our model does not implement
        declined = str(exc)
    else:
        return lazy_pretrained(model_dir, families) if lazy else load_pretrained(model_dir, families=families)
    import torch
    import transformers

    from stages.checkpoint.weights import check_model_dir  # torch: torch-free at import

    check_model_dir(model_dir)  # outside the except: a refusal here is not "during" the decline
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=False, use_safetensors=True)
    # A family of ours whose config.json our model declines (a variant) is worth a warning.
    level = logging.WARNING if supports_model_parallel(model.config.model_type) else logging.INFO
    log.log(level, "%s: training transformers' %s (data parallel and ZeRO only): %s", model_dir,
            type(model).__name__, declined)
    return model


# -- what the engine writes and hashes ----------------------------------------------------------------
def is_own_config(config) -> bool:
    """Our LlamaConfig (it writes its HF config.json itself) rather than a transformers config."""
    return hasattr(config, "to_hf_dict")


def config_identity(config) -> dict[str, Any]:
    """The model config as JSON for the run's fingerprint: every field of config.json, less the
    transformers version and the directory it was read from (neither changes the training)."""
    if is_own_config(config):
        return config.to_hf_dict()
    fields = json.loads(config.to_json_string(use_diff=False))
    return {k: v for k, v in fields.items() if k not in ("transformers_version", "_name_or_path")}


def write_config(config, directory: str | Path, generation_config=None) -> None:
    """config.json (and generation_config.json) into `directory`: ours with HF's names
    (`stages.checkpoint.hf.save_config`), a transformers config by its own `save_pretrained`, so
    every field of the source config.json stays. The weights beside it are fp32."""
    if is_own_config(config):
        from stages.checkpoint.hf import save_config  # torch: torch-free at import

        save_config(config, directory)
        return
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)


def estimated_flops_per_token(model, seq_len: int) -> dict[str, int]:
    """Training FLOPs per token of a transformers model (or a peft model around one), generically:
    6 x N_trained + 4 x N_frozen + 12 x L x d x T. N counts the parameters a token is multiplied
    by (all of them, less the input embedding, which is a lookup, unless lm_head shares it); a
    frozen weight (LoRA's base, prefix tuning's model) costs its forward and the backward to its
    input, 4 FLOPs, not the 2 more of its own gradient. L x d from the config's standard names.
    Position tables, norms and biases count as matmul weights: an estimate within a few percent,
    for MFU only."""
    from stages.training.flops import trained_and_frozen  # not at the top: this module imports no torch

    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    trained, frozen = trained_and_frozen(p for p in model.parameters() if tied or p is not embedding)
    config = model.config
    layers, width = getattr(config, "num_hidden_layers", 0) or 0, getattr(config, "hidden_size", 0) or 0
    attention = 12 * layers * width * seq_len
    dense = 6 * trained + 4 * frozen
    return {"n_matmul_params": trained + frozen, "trained_matmul_params": trained, "dense": dense,
            "attention": attention, "total": dense + attention}


def prepare_transformers_model(model, section: TrainingSettings) -> None:
    """Apply the section's `recompute` (transformers' gradient checkpointing, non-reentrant) and
    `torch_compile` (the whole model compiled in place, so parameter names do not change)."""
    if section.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if section.torch_compile:
        model.compile()
