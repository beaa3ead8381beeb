"""Write an A8W8 variant of the quantize stage in the compressed-tensors INT8 W8A8 format.

The input is our "a8w8" layout (`stages.quant.a8w8`); the output has quant_method
"compressed-tensors", format "int-quantized": the checkpoint that vLLM and transformers (with the
`compressed-tensors` package) load.

For each quantized layer `<name>` (every nn.Linear of the decoder blocks):

    ours                                    compressed-tensors
    <name>.weight        int8 (out, in)     <name>.weight        int8 (out, in), the same codes
    <name>.weight_scale  float32 (out,)     <name>.weight_scale  float32 (out, 1)   strategy "channel"
    <name>.input_scale   float32 ()         <name>.input_scale   float32 (1,)       activation "static"
    <name>.smooth_scale  float32 (in,)      folded into the producer of the input (`smooth_fold`)
    <name>.input_shift   float32 (in,)      refused: no equivalent
    <name>.bias          float32 (out,)     <name>.bias (kept as is)

Both grids are symmetric, so no zero points are stored (compressed-tensors drops them for
symmetric schemes too). Activations: "dynamic" is one scale per token computed at run time
(strategy "token", dynamic true), "static" one calibrated scale per layer (strategy "tensor").
The runtime computes dynamic scales itself: compressed-tensors' fake quantization uses
max|x| / 127.5 on codes [-128, 127], vLLM's kernel max|x| / 127; ours is max|x| / 127 on
[-127, 127], so dynamic activations are not bit-identical to `stages.quant.load_quantized`.

Every other Linear (lm_head, anything outside the decoder blocks) is listed in `ignore` and stays
float. The layers must be nn.Linear in the model transformers builds from config.json: GPT-2's
Conv1D, for one, is refused by name, as are shifted variants and smoothing that cannot be folded.

CLI: python -m stages.deployment.compressed_tensors --model quant/a8w8-smooth --out deploy/ct
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import load_state_dict, save_state_dict
from stages.checkpoint.meta import write_meta
from stages.checkpoint.tokenizer_files import copy_tokenizer
from stages.deployment.smooth_fold import fold_smoothing, refuse_shift
from stages.errors import InputError, run_cli
from stages.quant.layers import checkpoint_model, linear_layers
from stages.quant.loader import read_quantization_config
from stages.stage_logs import configure_logging

log = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FORMAT = "int-quantized"
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
INPUT_ACTIVATIONS = {
    "dynamic": {**_INT8, "strategy": "token", "dynamic": True},
    "static": {**_INT8, "strategy": "tensor", "dynamic": False},
}


def quantization_config(activation: str, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config`: one group, INT8 per-channel symmetric weights and
    INT8 symmetric inputs (`activation` "dynamic": per token, "static": per tensor), on every
    Linear but those of `ignore`; the checkpoint is stored compressed (int8 codes)."""
    if activation not in INPUT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {list(INPUT_ACTIVATIONS)}")
    scheme = {"targets": ["Linear"], "weights": {**_INT8, "strategy": "channel", "dynamic": False},
              "input_activations": dict(INPUT_ACTIVATIONS[activation]), "output_activations": None,
              "format": FORMAT}
    return {"quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": list(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def check_layers(config: dict[str, Any], names: list[str]) -> list[str]:
    """The `ignore` list for the quantized layers `names`: every other Linear of the model built
    from `config` (config.json without quantization_config). InputError when a name is not an
    nn.Linear of that model (GPT-2's Conv1D, say)."""
    config = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    meta = checkpoint_model(config)  # a mixture of experts: one Linear per expert, as checkpoints name them
    transposed = linear_layers(meta)
    for name in names:
        if name not in transposed:
            raise InputError(f"quantized layer {name} is no Linear of {type(meta).__name__} built from config.json")
        if transposed[name]:
            raise InputError(
                f"{name} is a {type(meta.get_submodule(name)).__name__} (model_type={config.get('model_type')!r}, "
                "GPT-2 style, weight stored (in, out)): compressed-tensors quantizes nn.Linear only, so runtimes "
                "would load it as float; export a Llama-style family, or use a GPTQ variant for this one")
    return sorted(n for n in transposed if n not in set(names))


def compressed_state(state: dict[str, torch.Tensor], names: list[str], activation: str
                     ) -> dict[str, torch.Tensor]:
    """Our A8W8 tensors (smoothing already folded, no shift) in compressed-tensors' names and shapes."""
    out = dict(state)
    for name in names:
        has_input_scale = f"{name}.input_scale" in state
        if has_input_scale != (activation == "static"):
            raise InputError(f"quantization_config says activation {activation!r} but {name}.input_scale is "
                             f"{'present' if has_input_scale else 'missing'}; re-run the quantize stage")
        if state[f"{name}.weight"].dtype != torch.int8:
            raise InputError(f"{name}.weight is {state[f'{name}.weight'].dtype}, not the int8 codes of an A8W8 layer")
        out[f"{name}.weight_scale"] = state[f"{name}.weight_scale"].float().reshape(-1, 1)  # (out, 1)
        if has_input_scale:
            out[f"{name}.input_scale"] = state[f"{name}.input_scale"].float().reshape(1)  # (1,)
    return out


def write_compressed_tensors(a8w8_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write the A8W8 directory `a8w8_dir` as a compressed-tensors directory `out_dir` (replaced
    atomically): safetensors weights, config.json with `quantization_config`, generation_config.json,
    the tokenizer files and meta.json. Returns the metrics recorded in meta.json. InputError for a
    directory that is not A8W8 or holds what the format cannot express (see the module docstring)."""
    a8w8_dir, out_dir = Path(a8w8_dir), Path(out_dir)
    config, qcfg = read_quantization_config(a8w8_dir)
    if qcfg["quant_method"] != "a8w8":
        raise InputError(f"{a8w8_dir} is a {qcfg['quant_method']!r} checkpoint; the compressed-tensors export takes "
                         "an a8w8 variant of the quantize stage (a8w8, a8w8-static, a8w8-smooth, ...)")
    activation = qcfg.get("activation")
    if activation not in INPUT_ACTIVATIONS:
        raise InputError(f"{a8w8_dir}/config.json: quantization_config activation={activation!r} is not one of "
                         f"{list(INPUT_ACTIVATIONS)}; re-run the quantize stage")
    state = load_state_dict(a8w8_dir)  # meta.json's sha256, safetensors only
    names = [k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale")]
    refuse_shift(state)
    ignore = check_layers(config, names)
    folded, folds = fold_smoothing(state, config)
    tensors = compressed_state(folded, names, activation)

    with atomic_dir(out_dir) as tmp:
        save_state_dict(tensors, tmp)
        write_json(tmp / "config.json", {**config, "quantization_config": quantization_config(activation, ignore)})
        if (a8w8_dir / "generation_config.json").exists():
            shutil.copy2(a8w8_dir / "generation_config.json", tmp / "generation_config.json")
        tokenizer = copy_tokenizer(a8w8_dir, tmp)
        metrics = {
            "format": f"{QUANT_METHOD}/{FORMAT}",
            "activation": activation,
            "num_quantized_layers": len(names),
            "ignore": ignore,
            "folded_norms": folds["norms"],
            "folded_row_producers": folds["row_producers"],
            "size_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
            "tokenizer_files": tokenizer,
        }
        write_meta(tmp, stage="compressed_tensors", config={"model": str(a8w8_dir), "a8w8": qcfg},
                   parent=a8w8_dir, seed=None, metrics=metrics)
    log.info("%s -> %s: %d layers, activation %s, %d norms and %d row producers folded", a8w8_dir, out_dir,
             len(names), activation, folds["norms"], folds["row_producers"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.deployment.compressed_tensors",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an a8w8 variant written by the quantize stage")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    args = parser.parse_args(argv)
    configure_logging()
    metrics = write_compressed_tensors(args.model, args.out)
    print(json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    run_cli(main, "compressed_tensors")
