"""Loading a quantized checkpoint as a `transformers` causal LM on CPU, with no GPTQ runtime, in one of
two ways:

- kernels=True (the default, what evaluation measures): every quantized layer becomes a module that
  computes on the packed low-bit weights (`stages.quant.weight_only`: int8pack / int4pack, or a
  dequantized nn.Linear where the kernels cannot take a layer), and A8W8 layers become
  `stages.quant.a8w8`'s int_mm modules. The model's parameters and buffers then hold the quantized
  weights, not a float copy.
- kernels=False (the reference): every GPTQ `<name>.qweight/qzeros/scales/g_idx` group is
  dequantized back to a float32 `<name>.weight` (transposed back to (in, out) where `<name>` is a
  Conv1D, as in GPT-2); A8W8 layers are simulated in float.

Either way the float tensors (embeddings, norms, lm_head, biases) are loaded by transformers itself
(`from_pretrained(None, config=..., state_dict=...)`), so its checkpoint-name conversions (e.g.
GPT-NeoX's `embed_out` -> `lm_head`) and weight tying apply exactly as for an unquantized
directory. With kernels the quantized layers' weights are given to it as zero-stride placeholders
(no memory, no random init) and the layers replaced afterwards.

A mixture of experts (Mixtral, Qwen-MoE, OLMoE) quantizes its experts one Linear per expert and
projection, as checkpoints name them; transformers 5 fuses them on load, so they are split back into
Linears before the quantized ones are put in (`stages.quant.moe_experts`).

Any `g_idx` is honoured (GPTQ's act-order, a narrower last group), codes of 2, 3, 4 or 8 bits, and
both checkpoint formats, "gptq" (zero points stored minus one) and "gptq_v2" (stored as is), read
from quantization_config's `format`, else `checkpoint_format` (`gptq_format.format_of`).

The model records {layer name: kernel} as `model.quant_kernels` ("int8pack", "int4pack",
"dequantized"; A8W8: "int_mm" or "simulated"), for the evaluator's report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers

from stages.checkpoint.hf import load_state_dict
from stages.errors import InputError
from stages.quant.gptq_format import QUANT_SUFFIXES, dequantize_packed, format_of
from stages.quant.layers import checkpoint_model, linear_layers, meta_model
from stages.quant.moe_experts import is_moe, module_name, unfuse_experts
from stages.quant.weight_only import apply_weight_only_kernels

log = logging.getLogger(__name__)

QUANT_METHODS = ("gptq", "a8w8")
_MARKER = {"gptq": "qweight", "a8w8": "weight_scale"}  # the key suffix that names a quantized layer


def read_quantization_config(model_dir: str | Path) -> tuple[dict, dict]:
    """(config.json without quantization_config, quantization_config); raises InputError naming the
    file if it is missing, its quant_method is not one of QUANT_METHODS, or a GPTQ one declares a
    checkpoint format other than "gptq" / "gptq_v2"."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; expected a quantized Hugging Face checkpoint directory")
    config = json.loads(path.read_text())
    qcfg = config.pop("quantization_config", None)
    if qcfg is None:
        raise InputError(f"{path} has no quantization_config with quant_method in {list(QUANT_METHODS)}; "
                         "load an unquantized directory with AutoModelForCausalLM.from_pretrained")
    method = qcfg.get("quant_method")
    if method not in QUANT_METHODS:
        raise InputError(f"{path}: quantization_config quant_method {method!r} is not supported; "
                         f"valid methods: {list(QUANT_METHODS)}")
    if method == "gptq":
        try:
            format_of(qcfg)
        except ValueError as e:
            raise InputError(f"{path}: quantization_config {e}") from None
    return config, qcfg


def dequantize_state_dict(state: dict[str, torch.Tensor], bits: int, checkpoint_format: str,
                          transposed: dict[str, bool] | None = None) -> dict[str, torch.Tensor]:
    """Turn each `<name>.qweight` group (zero points stored as `checkpoint_format` says) into a
    float32 `<name>.weight`, (out, in), or (in, out) when `transposed[name]` is True (a Conv1D);
    every other tensor becomes float32."""
    transposed = transposed or {}
    prefixes = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    packed_keys = {f"{p}.{s}" for p in prefixes for s in QUANT_SUFFIXES}
    out = {k: v.float() for k, v in state.items() if k not in packed_keys}
    for p in prefixes:
        w = dequantize_packed({s: state[f"{p}.{s}"] for s in QUANT_SUFFIXES}, bits, checkpoint_format)  # (out, in)
        out[f"{p}.weight"] = w.t().contiguous() if transposed.get(p, False) else w
    return out


def split_quantized(state: dict[str, torch.Tensor], method: str
                    ) -> tuple[list[str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(quantized layer names, their tensors, every other tensor as float32) of a checkpoint.

    A GPTQ layer's tensors are its QUANT_SUFFIXES (its bias stays with the float tensors, loaded into
    the model by transformers); an A8W8 layer's are every `<name>.*` key (its bias b' is A8W8's)."""
    names = [k.removesuffix(f".{_MARKER[method]}") for k in state if k.endswith(f".{_MARKER[method]}")]
    if method == "gptq":
        quant_keys = {f"{n}.{s}" for n in names for s in QUANT_SUFFIXES}
    else:
        layer_set = set(names)
        quant_keys = {k for k in state if k.rpartition(".")[0] in layer_set}
    quantized = {k: state[k] for k in quant_keys if k in state}
    rest = {k: v.float() for k, v in state.items() if k not in quant_keys}
    return names, quantized, rest


def _placeholders(meta: torch.nn.Module, names: list[str], present: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """Zero-stride float32 zeros for every parameter of the `names` modules that `present` lacks:
    transformers takes them as loaded (no memory, no random init), the modules are replaced after."""
    out = {}
    for name in names:
        for pname, p in meta.get_submodule(name).named_parameters(recurse=False):
            key = f"{name}.{pname}"
            if key not in present:
                out[key] = torch.zeros((), dtype=torch.float32).expand(p.shape)
    return out


def _from_state(model_dir: Path, config: transformers.PretrainedConfig,
                state: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """transformers' model of `config` holding `state`; ValueError when the tensors do not fill it exactly."""
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32,
                                              output_loading_info=True)
    problems = {k: sorted(v)[:5] for k, v in info.items()
                if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{model_dir}: dequantized weights do not match config.json: {problems}")
    return model


def load_quantized(model_dir: str | Path, kernels: bool = True) -> transformers.PreTrainedModel:
    """A `transformers` causal LM (e.g. LlamaForCausalLM, GPT2LMHeadModel) of a quantized directory
    (quant_method "gptq" or "a8w8"), float32 outside the quantized layers, in eval mode, with
    `model.quant_kernels` = {layer: kernel}. kernels=True: the quantized layers run on low-bit
    kernels (see the module docstring); kernels=False: the float reference (GPTQ dequantized, A8W8
    simulated). Built from config.json with its quantization_config removed; weights read with
    safetensors only, after the checks of `stages.checkpoint.weights` (meta.json's sha256, whole
    files; `WeightsError` naming the file otherwise). ValueError when the tensors do not fill the
    model exactly."""
    model_dir = Path(model_dir)
    config_dict, qcfg = read_quantization_config(model_dir)
    config_dict.pop("torch_dtype", None)
    config_dict.pop("dtype", None)
    config = transformers.AutoConfig.for_model(**config_dict)
    packed = load_state_dict(model_dir)  # checked before transformers sees a tensor
    method = qcfg["quant_method"]
    model_type = config_dict.get("model_type")
    meta = checkpoint_model(config_dict) if is_moe(model_type) else meta_model(config)  # checkpoint names
    transposed = linear_layers(meta)
    if method == "gptq" and not kernels:
        state = dequantize_state_dict(packed, int(qcfg["bits"]), format_of(qcfg), transposed)
        names = [k.removesuffix(".qweight") for k in packed if k.endswith(".qweight")]
        model = _from_state(model_dir, config, state)
        model.quant_kernels = dict.fromkeys(names, "dequantized")
    else:
        names, quantized, rest = split_quantized(packed, method)
        unknown = [n for n in names if n not in transposed]
        if unknown:
            raise ValueError(f"{model_dir}: quantized tensors {unknown[0]}.* name no Linear / Conv1D of the "
                             f"model built from config.json ({len(unknown)} of {len(names)} layers)")
        model = _from_state(model_dir, config, {**rest, **_placeholders(meta, names, rest)})
        if is_moe(model_type):  # per-expert Linears again, under transformers' module paths
            unfuse_experts(model, model_type)
            names = [module_name(n, model_type) for n in names]
            quantized = {module_name(k, model_type): v for k, v in quantized.items()}
            transposed = {module_name(k, model_type): v for k, v in transposed.items()}
        if method == "gptq":
            model.quant_kernels = apply_weight_only_kernels(model, quantized, qcfg, transposed)
        else:
            from stages.quant.a8w8 import apply_a8w8_state  # lazy: only A8W8 directories need its kernels

            # the float tensors as transformers loaded them (names converted, ties kept), plus A8W8's
            layer_set = set(names)
            floats = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in layer_set}
            model.quant_kernels = apply_a8w8_state(model, {**floats, **quantized}, qcfg, simulate=not kernels)
    log.info("loaded %s: %d quantized layers (%s), kernels %s", model_dir, len(model.quant_kernels), method,
             sorted(set(model.quant_kernels.values())))
    return model.eval()
