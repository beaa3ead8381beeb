"""quantize: weight-only round-to-nearest quantization of a Hugging Face model directory.

Variants (the `quantize.variants` entries of the config):
  wint8  8-bit, one scale and zero point per output channel (group_size is ignored)
  wint4  4-bit, one scale and zero point per `quantize.group_size` input features of each row
         (group_size -1 means per channel)

Any causal LM that transformers builds from config.json (Llama, Qwen2, Mistral, GPT-2, OPT, Bloom,
GPT-NeoX, ...): the quantized layers are the Linear / Conv1D layers of its decoder blocks, found on
the model built on the meta device (`stages.quant.layers`).

Output (`quant/<variant>/`, written atomically): the GPTQ-layout safetensors
(`<layer>.qweight/qzeros/scales/g_idx`, see `stages.quant.gptq_format`; embeddings, norms,
lm_head and biases stay floating point), config.json with `quantization_config`, generation_config.json,
the tokenizer files and meta.json. `stages.quant.load_quantized(dir)` reads it back on CPU.

Metrics (meta.json `metrics`):
  variant, bits, group_size        what was applied (group_size -1 = per channel)
  bits_per_weight                  bits + (16 + bits) / columns per group: codes, fp16 scale, zero
  num_quantized_layers
  size_bytes, source_size_bytes    bytes of the *.safetensors files
  compression_ratio                source_size_bytes / size_bytes
  mean_rel_weight_error            mean over layers of ||W - W_hat||_F / ||W||_F
  max_rel_weight_error             the largest of those, and max_rel_weight_error_layer its name

    python -m stages.quantize --source results/llama/lora-merged --out results/llama/quant/wint4 \
        --variant wint4 --config '{"group_size": 64}'
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import transformers

from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import copy_tokenizer, load_state_dict, save_state_dict
from stages.checkpoint.meta import write_meta
from stages.errors import run_cli
from stages.quant import quantization_config, quantize_model
from stages.quant.layers import decoder_linear_layers, meta_model

log = logging.getLogger(__name__)

VARIANT_BITS = {"wint8": 8, "wint4": 4}


def _weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def resolve_variant(variant: str, group_size: int) -> tuple[int, int]:
    """(bits, group_size) of a variant; raises ValueError naming the valid choices."""
    if variant not in VARIANT_BITS:
        raise ValueError(f"quantize variant {variant!r} is unknown; choose one of {sorted(VARIANT_BITS)}")
    if variant == "wint8":
        return 8, -1  # per output channel: INT8 needs no groups to stay accurate
    if group_size == 0 or group_size < -1:
        raise ValueError(f"quantize.group_size={group_size} must be a positive divisor of the layer "
                         "widths or -1 (per channel)")
    return VARIANT_BITS[variant], group_size


def run(source_dir: str | Path, out_dir: str | Path, variant: str, group_size: int,
        config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Quantize `source_dir` (HF layout) into `out_dir` and return the metrics written to meta.json."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    bits, group_size = resolve_variant(variant, group_size)
    config_path = source_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} is missing; --source must be a Hugging Face model directory")
    hf_config = json.loads(config_path.read_text())
    if "quantization_config" in hf_config:
        raise ValueError(f"{source_dir} is already quantized; quantize.source must name a float model")

    layers = decoder_linear_layers(meta_model(transformers.AutoConfig.from_pretrained(
        source_dir, local_files_only=True, trust_remote_code=False)))
    # Quantize fully before opening the output: a bad group size fails without touching out_dir.
    # load_state_dict checks the weights first (meta.json's sha256, no pickle, whole safetensors).
    packed, errors = quantize_model(load_state_dict(source_dir), layers, bits, group_size)
    hf_config["quantization_config"] = quantization_config(bits, group_size)

    with atomic_dir(out_dir) as tmp:
        save_state_dict(packed, tmp)
        write_json(tmp / "config.json", hf_config)
        if (source_dir / "generation_config.json").exists():
            shutil.copy2(source_dir / "generation_config.json", tmp / "generation_config.json")
        copy_tokenizer(source_dir, tmp)
        size, source_size = _weights_bytes(tmp), _weights_bytes(source_dir)
        worst = max(errors, key=errors.get)
        columns = None if group_size == -1 else group_size
        metrics = {
            "variant": variant,
            "bits": bits,
            "group_size": group_size,
            # per-channel parameters cost ~0 bits per weight on real widths; report the group case exactly
            "bits_per_weight": bits + ((16 + bits) / columns if columns else 0.0),
            "num_quantized_layers": len(errors),
            "size_bytes": size,
            "source_size_bytes": source_size,
            "compression_ratio": source_size / size,
            "mean_rel_weight_error": sum(errors.values()) / len(errors),
            "max_rel_weight_error": errors[worst],
            "max_rel_weight_error_layer": worst,
        }
        write_meta(tmp, stage="quantize",
                   config={**(config or {}), "variant": variant, "group_size": group_size},
                   parent=source_dir, seed=None, metrics=metrics)
    log.info("%s: %.2f MB -> %.2f MB (x%.2f), mean rel. weight error %.4f", variant, source_size / 1e6,
             size / 1e6, metrics["compression_ratio"], metrics["mean_rel_weight_error"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="Hugging Face model directory to quantize")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--variant", required=True, choices=sorted(VARIANT_BITS),
                        help="wint8: 8-bit per channel; wint4: 4-bit per group_size input features")
    parser.add_argument("--config", required=True,
                        help="the experiment's `quantize` section as JSON, validated with defaults "
                             "filled (group_size is read from it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads(args.config)
    if "group_size" not in config:
        raise ValueError("--config has no 'group_size'; pass the quantize section after "
                         "stages.config.check_config filled its defaults")
    return run(args.source, args.out, args.variant, config["group_size"], config=config)


if __name__ == "__main__":
    run_cli(main, "quantize")
