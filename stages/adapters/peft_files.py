"""Adapter directories in peft's format, written from whole tensors by the training engine.

The engine trains LoRA and prefix tuning on our model (every layout) or through peft on a
transformers model (data parallel and ZeRO); either way it ends with whole fp32 tensors of the
adapter under the model's own parameter names. This module turns them into what
`PeftModel.save_pretrained` writes: adapter_config.json and adapter_model.safetensors with peft's
keys, so `PeftModel.from_pretrained(base, dir)` loads them and `stages.merge` folds LoRA in.

The adapter config is peft's own: for our model it is taken from `peft.get_peft_model` over
transformers' model of the same config, built on the meta device (no memory, no weights), so every
field peft fills from the model (the expanded `all-linear` targets, a prefix's layers, KV heads and
widths) is what peft itself would write.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import peft
import torch

from stages.adapters.expert_lora import adapted_expert_parameters, is_expert_factor, peft_expert_tensors
from stages.adapters.lora import build_lora_config
from stages.adapters.lora_linear import peft_name
from stages.adapters.prefix import build_prefix_config
from stages.adapters.prefix_kv import PEFT_KEY, prefix_names, projected_table, to_peft
from stages.checkpoint.integrity import write_tensors
from stages.errors import InputError
from stages.model import LlamaForCausalLM
from stages.sections import FINETUNE
from stages.checkpoint.weights import model_weight_files, read_header

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config_for(method: str, section: Mapping[str, Any], base_dir: str | Path) -> peft.PeftConfig:
    """The adapter config peft would write for `method` on the transformers model of `base_dir`'s
    config.json (built on the meta device)."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(base_dir, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    section = FINETUNE[method].of(section)
    config = build_lora_config(section) if method == "lora" else build_prefix_config(section)
    return peft.get_peft_model(skeleton, config).peft_config["default"]


def exact_targets(config: peft.LoraConfig, wrapped: list[str], parameters: list[str] | None = None) -> peft.LoraConfig:
    """`config` naming exactly the `wrapped` layers and the expert `parameters` (full dotted names in
    transformers' model). A mixture of experts needs it: peft resolves "all-linear" per family there
    (on transformers 5's fused experts it adds `target_parameters` for the experts and the router,
    with doubled ranks for `gate_up_proj`, and drops Qwen3-MoE's dense MLPs), while our LoRA wraps
    the Linears `stages.adapters.targets.selected` picks, never a router, and the experts only where
    `target_parameters` asks (`stages.adapters.expert_lora`)."""
    config = copy.deepcopy(config)
    config.target_modules = sorted(wrapped)
    config.target_parameters = sorted(parameters) if parameters else None
    config.rank_pattern, config.alpha_pattern = {}, {}
    return config


def peft_tensors(method: str, tensors: dict[str, torch.Tensor], num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Our model's adapter tensors (whole, by our parameter names) -> peft's saved keys."""
    if method == "lora":
        return {peft_name(name): t for name, t in tensors.items()}
    if any(name.startswith("prefix_encoder.") for name in tensors):  # peft saves the projection's output
        return {PEFT_KEY: projected_table(tensors)}
    pairs = [(tensors[k], tensors[v]) for k, v in prefix_names(num_layers)]
    return {PEFT_KEY: to_peft(pairs)}


def peft_model_tensors(model: peft.PeftModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft-wrapped transformers model's adapter tensors (by its in-memory parameter names) ->
    peft's saved keys, by peft's own renaming."""
    return peft.get_peft_model_state_dict(model, state_dict=tensors)


def write_adapter(directory: Path, config: peft.PeftConfig, tensors: dict[str, torch.Tensor],
                  base_dir: str | Path) -> None:
    """adapter_config.json (inference mode, base = `base_dir`) and adapter_model.safetensors.
    Set-valued fields (peft keeps `target_modules` as a set) are written as sorted lists: peft
    writes a set in its iteration order, which changes between processes (string hashing)."""
    config = copy.deepcopy(config)
    config.inference_mode, config.base_model_name_or_path = True, str(base_dir)
    for name, value in vars(config).items():
        if isinstance(value, set):
            setattr(config, name, sorted(value))
    config.save_pretrained(directory)
    write_tensors(Path(directory) / ADAPTER_WEIGHTS, {k: v.float() for k, v in tensors.items()})


def adapted_module(name: str) -> str:
    """The base module a peft LoRA key or module name belongs to, in the base's own names:
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj`."""
    return name.removeprefix("base_model.model.").split(".lora_")[0]


def check_adapter_fits(adapter_dir: str | Path, base_dir: str | Path) -> None:
    """Raise InputError, naming both directories and what differs, when the adapter in
    `adapter_dir` was trained on a model of another shape than `base_dir`'s: a LoRA factor whose
    width is not its base layer's (or a layer the base lacks), a prefix for another number of
    layers or another key/value width. peft's own errors for these are size mismatches deep in
    `load_state_dict`, or silent garbage for a prefix."""
    import json


    adapter_dir, base_dir = Path(adapter_dir), Path(base_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = json.loads((base_dir / "config.json").read_text())
    where = f"adapter {adapter_dir} does not fit base model {base_dir}"
    if config.get("peft_type") == "PREFIX_TUNING":
        layers = base.get("num_hidden_layers", base.get("n_layer"))
        if config.get("num_layers") is not None and layers is not None and config["num_layers"] != layers:
            raise InputError(f"{where}: the prefix was trained for num_layers={config['num_layers']}, the base has "
                             f"num_hidden_layers={layers}; use the base the adapter was trained on (its meta.json "
                             "parent) or train a prefix for this model")
        heads, kv = base.get("num_attention_heads"), base.get("num_key_value_heads", base.get("num_attention_heads"))
        width = base.get("head_dim") or (base["hidden_size"] // heads if heads and base.get("hidden_size") else None)
        if config.get("token_dim") and width and kv and config["token_dim"] != kv * width:
            raise InputError(f"{where}: the prefix holds keys/values of width token_dim={config['token_dim']}, the "
                             f"base's are {kv} KV heads x {width} = {kv * width}")
        return
    if config.get("peft_type") != "LORA":
        return
    shapes = {}
    for path in model_weight_files(base_dir):
        shapes.update({name: entry["shape"] for name, entry in read_header(path).items()})
    transposed = bool(config.get("fan_in_fan_out"))
    experts = base.get("num_local_experts", base.get("num_experts"))
    for key, entry in read_header(adapter_dir / ADAPTER_WEIGHTS).items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        module = adapted_module(key)
        if module.endswith((".experts", ".experts.base_layer")):  # peft's target_parameters on fused experts
            along = entry["shape"][0] if ".lora_A." in key else entry["shape"][1]  # (E r, in) and (out, r E)
            if not experts or along % experts:
                raise InputError(f"{where}: {key} is {entry['shape']}, LoRA on experts with r x E rows, but the "
                                 f"base has {experts or 'no'} routed experts; use the base the adapter was trained on")
            continue
        weight = shapes.get(f"{module}.weight")
        if weight is None:
            raise InputError(f"{where}: it adapts {module}, which the base has no weight for (a model of "
                             "another family or naming)")
        out_features, in_features = (weight[1], weight[0]) if transposed else (weight[0], weight[1])
        expected = in_features if ".lora_A." in key else out_features
        got = entry["shape"][1] if ".lora_A." in key else entry["shape"][0]
        if got != expected:
            raise InputError(f"{where}: {key} is {entry['shape']} (trained for a layer with "
                             f"{'in' if '.lora_A.' in key else 'out'}_features={got}), but the base's "
                             f"{module}.weight is {weight}; use the base the adapter was trained on")


def check_every_adapted_layer_loaded(model: peft.PeftModel, adapter_dir: str | Path) -> None:
    """Every layer peft adapted (its adapter_config.json target_modules matched against the base) has
    its LoRA tensors in the adapter file. peft leaves a layer the file lacks at its initialisation
    (B = 0: no update at all) with only a warning, so an evaluation would score, and a merge would
    write, a model without that layer's training; this raises InputError naming the layers instead."""
    if not isinstance(model.peft_config.get("default"), peft.LoraConfig):
        return
    saved = {adapted_module(key) for key in read_header(Path(adapter_dir) / ADAPTER_WEIGHTS) if ".lora_" in key}
    adapted = [adapted_module(name) for name, module in model.named_modules()
               if isinstance(module, peft.tuners.lora.LoraLayer)]
    missing = [name for name in adapted if name not in saved]
    if missing:
        targets = model.peft_config["default"].target_modules
        targets = sorted(targets) if isinstance(targets, set) else targets
        raise InputError(f"{adapter_dir}: adapter_config.json's target_modules ({targets}) "
                         f"adapt {len(adapted)} layers of the base, but {ADAPTER_WEIGHTS} has no LoRA weights for "
                         f"{len(missing)} of them ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                         "peft would leave those untrained (B = 0). The file is incomplete (train or save the adapter "
                         "again) or target_modules names layers it was not trained on (correct it)")


def adapter_writer(method: str, section: Mapping[str, Any], model: torch.nn.Module, model_dir: str | Path):
    """What the training engine calls with the trained adapter's whole tensors (by the training
    model's names) to write them as a peft adapter dir: for our model with the config peft would
    write for `method` and `section` on `model_dir`'s model, for a peft-wrapped model with its own."""
    if isinstance(model, LlamaForCausalLM):
        peft_config = peft_config_for(method, section, model_dir)
        if method == "lora" and model.config.moe:
            peft_config = exact_targets(peft_config, [n for n, m in model.named_modules() if hasattr(m, "lora_A")],
                                        adapted_expert_parameters(model))
        num_layers = model.config.num_hidden_layers

        def write(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
            experts = {k: v for k, v in tensors.items() if is_expert_factor(k)}
            rest = {k: v for k, v in tensors.items() if k not in experts}
            peft_keys = peft_tensors(method, rest, num_layers) | peft_expert_tensors(experts, model.config)
            write_adapter(tmp, peft_config, peft_keys, model_dir)
    else:  # peft on a transformers model
        peft_config = model.peft_config["default"]

        def write(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
            write_adapter(tmp, peft_config, peft_model_tensors(model, tensors), model_dir)
    return write
