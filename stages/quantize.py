"""quantize: weight-only post-training quantization (round-to-nearest or GPTQ) of a Hugging Face
model directory.

Variants (the `quantize.variants` entries of the config):
  wint8    RTN, 8-bit, one scale and zero point per output channel (group_size is ignored)
  wint4    RTN, 4-bit, one scale and zero point per `quantize.group_size` input features of each row
           (group_size -1 means per channel)
  gptq-w4  GPTQ (`stages.quant.gptq`), `quantize.gptq.bits` (4 by default) with the options of
           `quantize.gptq` (group_size null = `quantize.group_size`; sym, desc_act, static_groups,
           damp_percent, true_sequential), calibrated layer by layer on `quantize.calibration`
           (`stages.quant.calibration`) drawn from the experiment's data (--data)

Any causal LM that transformers builds from config.json (Llama, Qwen2, Mistral, GPT-2, OPT, Bloom,
GPT-NeoX, ...): the quantized layers are the Linear / Conv1D layers of its decoder blocks, found on
the model built on the meta device (`stages.quant.layers`). GPTQ runs the float model itself
(`stages.training.families.load_causal_lm`: our Llama for our families, transformers' model for the
others), on CPU in float32; GPTQ groups need not divide the widths (a narrower last group).

Output (`quant/<variant>/`, written atomically): the GPTQ-layout safetensors
(`<layer>.qweight/qzeros/scales/g_idx`, see `stages.quant.gptq_format`: checkpoint format "gptq" for
symmetric grids, "gptq_v2" for asymmetric ones such as RTN's; embeddings, norms,
lm_head and biases stay floating point, copied from the source files), config.json with
`quantization_config`, generation_config.json, the tokenizer files and meta.json.
`stages.quant.load_quantized(dir)` reads it back on CPU.

Metrics (meta.json `metrics`):
  method                           rtn or gptq
  variant, bits, group_size        what was applied (group_size -1 = per channel)
  bits_per_weight                  bits + (16 + bits) / columns per group: codes, fp16 scale, zero
  num_quantized_layers
  size_bytes, source_size_bytes    bytes of the *.safetensors files
  compression_ratio                source_size_bytes / size_bytes
  mean_rel_weight_error            mean over layers of ||W - W_hat||_F / ||W||_F
  max_rel_weight_error             the largest of those, and max_rel_weight_error_layer its name
  quantize_seconds                 wall time of the quantization itself (not loading, not writing)
GPTQ adds:
  gptq                             the options applied (sym, desc_act, static_groups, damp_percent,
                                   true_sequential)
  calibration                      source, seed, seq_len, num_samples asked, num_windows and
                                   num_tokens used (and sft_format for SFT sources)
  mean_gptq_loss, max_gptq_loss    GPTQ's proxy loss per layer (`GPTQResult.loss`), its mean and
                                   max over layers, and max_gptq_loss_layer
  seconds_per_decoder_layer        mean wall time per decoder block (Hessians, GPTQ, next inputs),
                                   max_seconds_per_decoder_layer the slowest block's

    python -m stages.quantize --source results/llama/lora-merged --out results/llama/quant/wint4 \
        --variant wint4 --config '{"group_size": 64}'
    python -m stages.quantize --source results/llama/lora-merged --out results/llama/quant/gptq-w4 \
        --variant gptq-w4 --data results/llama/data --config "$QUANTIZE_SECTION_JSON"
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import copy_tokenizer, load_state_dict, save_state_dict
from stages.checkpoint.meta import write_meta
from stages.errors import InputError, run_cli
from stages.quant import quantization_config, quantize_model
from stages.quant.calibration import CalibrationSettings, calibration_ids
from stages.quant.gptq import GPTQConfig, gptq_quantize_model
from stages.quant.layers import decoder_blocks, decoder_linear_layers, meta_model
from stages.quant.model import check_shapes, layer_weights, pack_gptq_model

log = logging.getLogger(__name__)

VARIANT_BITS = {"wint8": 8, "wint4": 4}  # round-to-nearest
GPTQ_VARIANTS = ("gptq-w4",)
VARIANTS = (*VARIANT_BITS, *GPTQ_VARIANTS)
GPTQ_KEYS = ("bits", "group_size", "sym", "desc_act", "static_groups", "damp_percent", "true_sequential")
CALIBRATION_BATCH = 8  # windows per forward while calibrating; the Hessians do not depend on it


def _weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def _check_group_size(group_size: int, key: str = "quantize.group_size") -> None:
    if group_size == 0 or group_size < -1:
        raise InputError(f"{key}={group_size} must be a positive divisor of the layer widths or -1 (per channel)")


def resolve_variant(variant: str, group_size: int) -> tuple[int, int]:
    """(bits, group_size) of an RTN variant; raises ValueError naming the valid choices."""
    if variant not in VARIANTS:
        raise InputError(f"quantize variant {variant!r} is unknown; choose one of {sorted(VARIANTS)}")
    if variant in GPTQ_VARIANTS:
        raise InputError(f"{variant} is a GPTQ variant: its bits and group come from gptq_config")
    if variant == "wint8":
        return 8, -1  # per output channel: INT8 needs no groups to stay accurate
    _check_group_size(group_size)
    return VARIANT_BITS[variant], group_size


def gptq_config(section: dict[str, Any] | None, group_size: int) -> GPTQConfig:
    """The GPTQConfig of `quantize.gptq` (`section`; missing keys take GPTQConfig's defaults, which
    equal the schema's), its group_size null inheriting `quantize.group_size`."""
    section = dict(section or {})
    unknown = sorted(set(section) - set(GPTQ_KEYS))
    if unknown:
        raise InputError(f"quantize.gptq has unknown key(s) {unknown}; known: {list(GPTQ_KEYS)}")
    inherited = section.get("group_size") is None
    if inherited:
        section["group_size"] = group_size
    _check_group_size(section["group_size"], "quantize.group_size" if inherited else "quantize.gptq.group_size")
    return GPTQConfig(**section)


def _float_model_blocks(source_dir: Path) -> tuple[torch.nn.Module, str]:
    """The float model of `source_dir` in eval mode and the dotted path of its decoder blocks."""
    from stages.training.families import load_causal_lm

    model = load_causal_lm(source_dir).float().eval()
    # transformers' models: found by type; ours keeps its blocks in model.layers (a ModuleDict)
    blocks = decoder_blocks(model) if isinstance(model, transformers.PreTrainedModel) else "model.layers"
    return model, blocks


def _gptq(source_dir: Path, data_dir: Path | None, state: dict[str, torch.Tensor], layers: dict[str, bool],
          config: GPTQConfig, calibration: CalibrationSettings,
          checkpoint_format: str) -> tuple[dict, dict, dict[str, Any]]:
    """GPTQ of the float model in `source_dir`: (packed state in `checkpoint_format`, weight errors,
    GPTQ metrics). The calibration set and the shapes are checked before the model is loaded."""
    tokenizer = None
    if calibration.source != "corpus":
        from stages.data.tokenizer import load_model_tokenizer

        tokenizer = load_model_tokenizer(source_dir)
    ids, calibration_info = calibration_ids(calibration, data_dir, tokenizer, source_dir)  # (n, seq_len)
    check_shapes(layer_weights(state, layers), config.bits, config.group_size, ragged_groups=True)

    model, blocks_path = _float_model_blocks(source_dir)
    vocab = getattr(model.config, "vocab_size", None)  # our LlamaConfig and transformers' text configs
    if vocab is not None and int(ids.max()) >= vocab:
        raise InputError(f"quantize.calibration.source={calibration.source}: token id {int(ids.max())} is outside "
                         f"the model's vocabulary of {vocab}; the data was prepared with another tokenizer")
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    results = gptq_quantize_model(model, model.get_submodule(blocks_path), list(ids.split(CALIBRATION_BATCH)),
                                  config, prefix=blocks_path,
                                  on_block=lambda key, s, _: seconds.__setitem__(key, s))
    elapsed = time.perf_counter() - start
    packed, errors = pack_gptq_model(state, layers, results, checkpoint_format)
    losses = {name: r.loss for name, r in results.items()}
    worst = max(losses, key=losses.get)
    metrics = {
        "gptq": {k: getattr(config, k) for k in GPTQ_KEYS if k not in ("bits", "group_size")},
        "calibration": calibration_info,
        "mean_gptq_loss": sum(losses.values()) / len(losses),
        "max_gptq_loss": losses[worst],
        "max_gptq_loss_layer": worst,
        "quantize_seconds": elapsed,
        "seconds_per_decoder_layer": sum(seconds.values()) / len(seconds),
        "max_seconds_per_decoder_layer": max(seconds.values()),
    }
    return packed, errors, metrics


def run(source_dir: str | Path, out_dir: str | Path, variant: str, group_size: int,
        config: dict[str, Any] | None = None, data_dir: str | Path | None = None) -> dict[str, Any]:
    """Quantize `source_dir` (HF layout) into `out_dir` and return the metrics written to meta.json.

    `config`: the experiment's `quantize` section (its `gptq` and `calibration` sections are read
    for GPTQ variants); `data_dir`: the experiment's prepared data, for GPTQ's calibration."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = config or {}
    if variant in GPTQ_VARIANTS:
        gptq = gptq_config(config.get("gptq"), group_size)
        calibration = CalibrationSettings.from_section(config.get("calibration") or {})
        bits, group_size = gptq.bits, gptq.group_size
    else:
        bits, group_size = resolve_variant(variant, group_size)
        gptq = None
    config_path = source_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} is missing; --source must be a Hugging Face model directory")
    hf_config = json.loads(config_path.read_text())
    if "quantization_config" in hf_config:
        raise InputError(f"{source_dir} is already quantized; quantize.source must name a float model")

    layers = decoder_linear_layers(meta_model(transformers.AutoConfig.from_pretrained(
        source_dir, local_files_only=True, trust_remote_code=False)))
    # Quantize fully before opening the output: a bad group size fails without touching out_dir.
    # load_state_dict checks the weights first (meta.json's sha256, no pickle, whole safetensors).
    state = load_state_dict(source_dir)
    # sym -> "gptq", asym (RTN, GPTQ with sym false) -> "gptq_v2"; the packer stores zero points to match
    qcfg = quantization_config(bits, group_size, gptq)
    start = time.perf_counter()
    if gptq is None:
        packed, errors = quantize_model(state, layers, bits, group_size, qcfg["format"])
        extra = {"quantize_seconds": time.perf_counter() - start}
    else:
        packed, errors, extra = _gptq(source_dir, None if data_dir is None else Path(data_dir), state, layers,
                                      gptq, calibration, qcfg["format"])
    hf_config["quantization_config"] = qcfg

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
            "method": "rtn" if gptq is None else "gptq",
            "variant": variant,
            "bits": bits,
            "group_size": group_size,
            # per-channel parameters cost ~0 bits per weight on real widths; report the group case
            # exactly (a narrower last group costs slightly more than this)
            "bits_per_weight": bits + ((16 + bits) / columns if columns else 0.0),
            "num_quantized_layers": len(errors),
            "size_bytes": size,
            "source_size_bytes": source_size,
            "compression_ratio": source_size / size,
            "mean_rel_weight_error": sum(errors.values()) / len(errors),
            "max_rel_weight_error": errors[worst],
            "max_rel_weight_error_layer": worst,
            **extra,
        }
        write_meta(tmp, stage="quantize",
                   config={**config, "variant": variant, "group_size": group_size},
                   parent=source_dir, seed=None, metrics=metrics)
    log.info("%s: %.2f MB -> %.2f MB (x%.2f), mean rel. weight error %.4f", variant, source_size / 1e6,
             size / 1e6, metrics["compression_ratio"], metrics["mean_rel_weight_error"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="Hugging Face model directory to quantize")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--variant", required=True, choices=sorted(VARIANTS),
                        help="wint8: RTN 8-bit per channel; wint4: RTN 4-bit per group_size input features; "
                             "gptq-w4: GPTQ with the quantize.gptq options, calibrated on --data")
    parser.add_argument("--data", default=None,
                        help="the experiment's prepared data dir (results/<name>/data): GPTQ's calibration "
                             "source (quantize.calibration.source corpus or sft); not read by RTN variants")
    parser.add_argument("--config", required=True,
                        help="the experiment's `quantize` section as JSON, validated with defaults "
                             "filled (group_size, and for GPTQ the gptq and calibration sections, are read)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads(args.config)
    if "group_size" not in config:
        raise ValueError("--config has no 'group_size'; pass the quantize section after "
                         "stages.config.check_config filled its defaults")
    return run(args.source, args.out, args.variant, config["group_size"], config=config, data_dir=args.data)


if __name__ == "__main__":
    run_cli(main, "quantize")
