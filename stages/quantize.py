"""quantize: post-training quantization of a Hugging Face model directory into one named variant.

A variant is a method plus its settings (`stages.quant.variants`: built-in names such as wint8,
wint4, gptq-w4, gptq-w4g128, gptq-w3g64, a8w8, a8w8-smooth, awq-w4, or `quantize.custom_variants`):
  rtn    round-to-nearest weight-only, `bits` 4 or 8, one scale (and zero point unless `sym`) per
         `group_size` input features of each row (-1: per output channel)
  gptq   GPTQ (`stages.quant.gptq`) with the options of `quantize.gptq`, bits 2/3/4/8, calibrated
         layer by layer on `quantize.calibration` (`stages.quant.calibration`) drawn from --data
  a8w8   INT8 weights per output channel and INT8 activations (per token, or per tensor from
         calibration), with SmoothQuant (`smooth`) and Outlier Suppression+ (`shift`) from
         `quantize.a8w8` (`stages.quant.smoothquant`, `stages.quant.a8w8`), calibrated as gptq
  awq    AWQ (`stages.quant.awq`, `quantize.awq`): activation-aware input scales folded into the
         norms and producer rows, clipping, then round-to-nearest codes (4 or 8 bits, groups);
         calibrated as gptq

Any causal LM that transformers builds from config.json (Llama, Qwen2, Mistral, Qwen3, GLM, GLM-4,
GPT-2, OPT, Bloom, GPT-NeoX, ...): the quantized layers are the Linear / Conv1D layers of its decoder
blocks (GLM's fused gate_up_proj is one layer), found on the model built on the meta device
(`stages.quant.layers`). Calibrated methods run the float model
itself (`stages.training.families.load_causal_lm`: our Llama for our families, transformers' model
for the others), on CPU, its weights in float32 and its forwards in `quantize.calibration.dtype`
(auto by default: bf16 autocast where native, else float32; or either set), after an estimate of the
memory they need is checked against the memory available.

Output (`quant/<variant>/`, written atomically): rtn, gptq and awq write the GPTQ-layout safetensors
(`<layer>.qweight/qzeros/scales/g_idx`, see `stages.quant.gptq_format`: checkpoint format "gptq" for
symmetric grids, "gptq_v2" for asymmetric ones), a8w8 its INT8 layout (`stages.quant.a8w8`);
embeddings, norms and lm_head stay floating point, copied from the source files (awq: the norms and
biases it folded its scales into, changed); config.json with
`quantization_config`, generation_config.json, the tokenizer files and meta.json.
`stages.quant.load_quantized(dir)` reads either back on CPU with real low-bit kernels.

Metrics (meta.json `metrics`):
  method                           rtn, gptq, a8w8 or awq
  variant, spec                    the name and every setting applied (stages.quant.variants)
  bits, group_size                 weight code width and group (-1 = per channel)
  bits_per_weight                  bits + (16 + bits) / columns per group: codes, fp16 scale, zero
                                   (a8w8: 8 + 32 / in_features, its float32 per-channel scale)
  num_quantized_layers
  size_bytes, source_size_bytes    bytes of the *.safetensors files
  compression_ratio                source_size_bytes / size_bytes
  mean_rel_weight_error            mean over layers of ||W - W_hat||_F / ||W||_F
  max_rel_weight_error             the largest of those, and max_rel_weight_error_layer its name
  quantize_seconds                 wall time of the quantization itself (not loading, not writing)
Calibrated methods add:
  calibration                      source, seed, seq_len, num_samples asked, num_windows and
                                   num_tokens used (and sft_format for SFT sources), dtype: the
                                   calibration forwards' precision as resolved here, memory_bytes:
                                   the estimate checked against the available memory before the
                                   model was loaded (`calibration.calibration_memory_bytes`)
  seconds_per_decoder_layer        mean wall time per decoder block, max_seconds_per_decoder_layer
                                   the slowest block's
GPTQ adds `gptq` (sym, desc_act, static_groups, damp_percent, true_sequential), mean_gptq_loss and
max_gptq_loss (GPTQ's proxy loss per layer, `GPTQResult.loss`), max_gptq_loss_layer; a8w8 adds `a8w8`
(its settings), mean_output_mse and max_output_mse (each layer's output error on its calibration
inputs) and smooth_alphas (the alpha applied per smoothed layer); awq adds `awq` (its settings),
awq_scaled_layers, awq_folded_tensors and awq_error_vs_rtn (the mean over layers of its group's
calibration output error at the chosen scale over RTN's, before clipping; its rel_weight_error
is of the scaled weights).

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from stages import settings
from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import copy_tokenizer, load_state_dict, save_state_dict
from stages.checkpoint.meta import write_meta
from stages.checkpoint.weights import refuse_quantized
from stages.errors import InputError, run_cli
from stages.quant import quantization_config, quantize_model
from stages.quant.awq import AWQConfig, awq_quantize_model, awq_settings, folded_tensors
from stages.quant.block_calibration import FORWARD_DTYPES
from stages.quant.calibration import CalibrationSettings, calibration_ids, check_calibration_memory
from stages.quant.gptq import GPTQConfig, gptq_quantize_model
from stages.quant.layers import checkpoint_model, decoder_blocks, decoder_linear_layers
from stages.quant.model import check_shapes, layer_weights, pack_codes, pack_gptq_model
from stages.quant.variants import BUILTIN_VARIANTS, GPTQ_KEYS, VariantSpec, resolve_variant, variant_settings
from stages.sections import QuantizeSettings
from stages.stage_logs import configure_logging, log_io
from stages.quant.a8w8 import A8W8Config, a8w8_quantization_config, pack_a8w8
from stages.quant.smoothquant import a8w8_quantize_model
from stages.training.capabilities import native_bf16
from stages.training.families import load_causal_lm
from stages.data.tokenizer import load_model_tokenizer

log = logging.getLogger(__name__)

CALIBRATION_BATCH = 8  # windows per forward while calibrating; the statistics do not depend on it


def _weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def gptq_config(section: dict[str, Any] | None, group_size: int) -> GPTQConfig:
    """The GPTQConfig of a `quantize.gptq`-shaped dict (missing keys take GPTQConfig's defaults,
    which equal the schema's), its group_size null inheriting `group_size`."""
    section = dict(section or {})
    unknown = sorted(set(section) - set(GPTQ_KEYS))
    if unknown:
        raise InputError(f"quantize.gptq has unknown key(s) {unknown}; known: {list(GPTQ_KEYS)}")
    inherited = section.get("group_size") is None
    if inherited:
        section["group_size"] = group_size
    value = section["group_size"]
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
        key = "quantize.group_size" if inherited else "quantize.gptq.group_size"
        raise InputError(f"{key}={value!r} must be a positive integer (input features per scale) or -1 (per channel)")
    try:
        return GPTQConfig(**section)
    except ValueError as e:
        raise InputError(str(e)) from None


def _float_model_blocks(source_dir: Path) -> tuple[torch.nn.Module, str]:
    """The float model of `source_dir` in eval mode and the dotted path of its decoder blocks."""
    model = load_causal_lm(source_dir).float().eval()
    # transformers' models: found by type; ours keeps its blocks in model.layers (a ModuleDict)
    blocks = decoder_blocks(model) if isinstance(model, transformers.PreTrainedModel) else "model.layers"
    return model, blocks


def _calibrated_model(source_dir: Path, data_dir: Path | None, calibration: CalibrationSettings,
                      weights: dict[str, torch.Tensor], num_parameters: int
                      ) -> tuple[torch.nn.Module, str, list[torch.Tensor], dict[str, Any]]:
    """(float model, its blocks' path, calibration batches, calibration description) for a
    calibrated method. The calibration set and the memory it needs are checked before the model
    is loaded."""
    tokenizer = None
    if calibration.source != "corpus":

        tokenizer = load_model_tokenizer(source_dir)
    ids, info = calibration_ids(calibration, data_dir, tokenizer, source_dir)  # (n, seq_len)
    info["memory_bytes"] = check_calibration_memory(
        num_parameters=num_parameters, widths=[tuple(w.shape) for w in weights.values()],
        num_windows=ids.shape[0], seq_len=ids.shape[1], batch=CALIBRATION_BATCH)
    model, blocks_path = _float_model_blocks(source_dir)
    vocab = getattr(model.config, "vocab_size", None)  # our LlamaConfig and transformers' text configs
    if vocab is not None and int(ids.max()) >= vocab:
        raise InputError(f"quantize.calibration.source={calibration.source}: token id {int(ids.max())} is outside "
                         f"the model's vocabulary of {vocab}; the data was prepared with another tokenizer")
    return model, blocks_path, list(ids.split(CALIBRATION_BATCH)), info


def calibration_dtype(setting: str) -> str:
    """`quantize.calibration.dtype` resolved on this machine: auto is bfloat16 where bf16 is native
    (AVX512-BF16, AMX, a GPU with bf16: 2-3x faster products), else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16() is not None else "float32"


def _calibration_reads(calibration: CalibrationSettings | None, data_dir: str | Path | None) -> dict[str, Any]:
    """{what: path} of the calibration input for the stage's first log line (none for rtn)."""
    if calibration is None:
        return {}
    if calibration.source == "corpus":
        return {"calibration: the training tokens": data_dir}
    if calibration.source == "sft":
        return {"calibration: sft/train.json": data_dir}
    return {"calibration records": calibration.source}


def _calibrate(quantize_model: Callable[..., dict[str, Any]], config: Any, source_dir: Path, data_dir: Path | None,
               calibration: CalibrationSettings, state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               ) -> tuple[dict[str, Any], dict[str, Any], dict[str, float], torch.nn.Module]:
    """Quantize the float model in `source_dir` block by block with `quantize_model` (GPTQ's, A8W8's
    or AWQ's driver) and its `config` on the calibration set: (its results by layer name, the
    calibration description, the timing metrics, the model as the driver left it)."""
    model, blocks_path, batches, calibration_info = _calibrated_model(
        source_dir, data_dir, calibration, weights, sum(t.numel() for t in state.values()))
    dtype = calibration_dtype(calibration.dtype)
    calibration_info["dtype"] = dtype
    seconds: dict[str, float] = {}  # block -> wall time
    start = time.perf_counter()
    results = quantize_model(model, model.get_submodule(blocks_path), batches, config, prefix=blocks_path,
                             on_block=lambda key, s, _: seconds.__setitem__(key, s),
                             forward_dtype=FORWARD_DTYPES[dtype])
    timing = {"quantize_seconds": time.perf_counter() - start,
              "seconds_per_decoder_layer": sum(seconds.values()) / len(seconds),
              "max_seconds_per_decoder_layer": max(seconds.values())}
    return results, calibration_info, timing, model


def _mean_and_worst(values: dict[str, float], what: str) -> dict[str, Any]:
    """mean_<what>, max_<what> and max_<what>_layer of the layers' `values` ({layer: value})."""
    worst = max(values, key=values.get)
    return {f"mean_{what}": sum(values.values()) / len(values), f"max_{what}": values[worst],
            f"max_{what}_layer": worst}


def _gptq(spec: VariantSpec, source_dir: Path, data_dir: Path | None, state: dict[str, torch.Tensor],
          layers: dict[str, bool], calibration: CalibrationSettings,
          ) -> tuple[dict, dict, dict[str, Any], dict[str, Any]]:
    """GPTQ of the float model in `source_dir`: (packed state, weight errors, quantization_config,
    metrics)."""
    config = gptq_config(spec.settings, spec.settings["group_size"])
    weights = layer_weights(state, layers)
    check_shapes(weights, config.bits, config.group_size, ragged_groups=True)
    results, calibration_info, timing, _ = _calibrate(gptq_quantize_model, config, source_dir, data_dir, calibration,
                                                      state, weights)
    qcfg = quantization_config(config.bits, config.group_size, config)
    packed, errors = pack_gptq_model(state, layers, results, qcfg["format"])
    metrics = {
        "bits": config.bits,
        "group_size": config.group_size,
        "gptq": {k: getattr(config, k) for k in GPTQ_KEYS if k not in ("bits", "group_size")},
        "calibration": calibration_info,
        **_mean_and_worst({name: r.loss for name, r in results.items()}, "gptq_loss"),
        **timing,
    }
    return packed, errors, qcfg, metrics


def _a8w8(spec: VariantSpec, source_dir: Path, data_dir: Path | None, state: dict[str, torch.Tensor],
          layers: dict[str, bool], calibration: CalibrationSettings,
          ) -> tuple[dict, dict, dict[str, Any], dict[str, Any]]:
    """A8W8 (with SmoothQuant / shift as the spec says) of the float model in `source_dir`."""
    settings = dict(spec.settings)
    if "smooth_alpha_grid" in settings:
        settings["smooth_alpha_grid"] = tuple(settings["smooth_alpha_grid"])
    try:
        config = A8W8Config(**settings)
    except ValueError as e:
        raise InputError(f"quantize variant {spec.name}: {e}") from None
    results, calibration_info, timing, _ = _calibrate(a8w8_quantize_model, config, source_dir, data_dir, calibration,
                                                      state, layer_weights(state, layers))
    packed, errors = pack_a8w8(state, layers, results)
    metrics = {
        "bits": 8,
        "group_size": -1,
        "a8w8": settings,
        "calibration": calibration_info,
        **_mean_and_worst({name: r.output_mse for name, r in results.items()}, "output_mse"),
        "smooth_alphas": {name: r.alpha for name, r in results.items() if r.smooth_scale is not None},
        **timing,
    }
    return packed, errors, a8w8_quantization_config(config), metrics


def _awq(spec: VariantSpec, source_dir: Path, data_dir: Path | None, state: dict[str, torch.Tensor],
         layers: dict[str, bool], calibration: CalibrationSettings,
         ) -> tuple[dict, dict, dict[str, Any], dict[str, Any]]:
    """AWQ of the float model in `source_dir`: round-to-nearest codes of the scaled weights and the
    norms / producers the scales were folded into, in the GPTQ layout."""
    try:
        config = AWQConfig(**spec.settings)
    except ValueError as e:
        raise InputError(f"quantize variant {spec.name}: {e}") from None
    weights = layer_weights(state, layers)
    check_shapes(weights, config.bits, config.group_size)
    results, calibration_info, timing, model = _calibrate(awq_quantize_model, config, source_dir, data_dir,
                                                          calibration, state, weights)
    qcfg = quantization_config(config.bits, config.group_size, sym=config.sym)
    folded = folded_tensors(model, state, results)
    packed = pack_codes(state, layers, {name: r.quantized for name, r in results.items()}, qcfg["format"], folded)
    scaled = [r for r in results.values() if r.scale is not None]
    metrics = {
        "bits": config.bits,
        "group_size": config.group_size,
        "awq": {k: v for k, v in awq_settings(config).items() if k not in ("bits", "group_size")},
        "calibration": calibration_info,
        "awq_scaled_layers": len(scaled),
        "awq_folded_tensors": len(folded),
        "awq_error_vs_rtn": sum(r.error / r.rtn_error for r in results.values() if r.rtn_error > 0) / len(results),
        **timing,
    }
    return packed, {name: r.weight_error for name, r in results.items()}, qcfg, metrics


def _rtn(spec: VariantSpec, state: dict[str, torch.Tensor], layers: dict[str, bool],
         ) -> tuple[dict, dict, dict[str, Any], dict[str, Any]]:
    bits, group_size, sym = spec.settings["bits"], spec.settings["group_size"], spec.settings["sym"]
    qcfg = quantization_config(bits, group_size, sym=sym)
    start = time.perf_counter()
    packed, errors = quantize_model(state, layers, bits, group_size, qcfg["format"], sym=sym)
    return packed, errors, qcfg, {"bits": bits, "group_size": group_size,
                                  "quantize_seconds": time.perf_counter() - start}


def _float_config(source_dir: Path) -> dict[str, Any]:
    """config.json of the float model in `source_dir`; InputError when it is missing or the model
    is already quantized."""
    config_path = source_dir / "config.json"
    if not config_path.exists():
        raise InputError(f"{config_path} is missing; --source must be a Hugging Face model directory")
    refuse_quantized(source_dir, lambda method: f"--source {source_dir} (quant_method={method!r}) is already "
                                                "quantized; quantize.source must name a float model")
    return json.loads(config_path.read_text())


def _quantize(spec: VariantSpec, variant: str, source_dir: Path, data_dir: str | Path | None,
              state: dict[str, torch.Tensor], layers: dict[str, bool], calibration: CalibrationSettings | None,
              ) -> tuple[dict, dict, dict[str, Any], dict[str, Any]]:
    """(packed state, weight errors, quantization_config, method metrics) of `spec`'s method; a
    ValueError of shapes the method cannot take becomes an InputError naming the variant."""
    data = None if data_dir is None else Path(data_dir)
    try:
        if spec.method == "rtn":
            return _rtn(spec, state, layers)
        if spec.method == "gptq":
            return _gptq(spec, source_dir, data, state, layers, calibration)
        if spec.method == "awq":
            return _awq(spec, source_dir, data, state, layers, calibration)
        return _a8w8(spec, source_dir, data, state, layers, calibration)
    except ValueError as e:  # shapes the method cannot take: the user's group size or variant
        if isinstance(e, InputError):
            raise
        raise InputError(f"quantize variant {variant} on {source_dir}: {e}") from None


def _write_model(out_dir: Path, packed: dict[str, torch.Tensor], hf_config: dict[str, Any], source_dir: Path) -> None:
    """The quantized weights, config.json, and the source's generation_config.json and tokenizer files."""
    save_state_dict(packed, out_dir)
    write_json(out_dir / "config.json", hf_config)
    if (source_dir / "generation_config.json").exists():
        shutil.copy2(source_dir / "generation_config.json", out_dir / "generation_config.json")
    copy_tokenizer(source_dir, out_dir)


def _bits_per_weight(method: str, bits: int, group: int, state: dict[str, torch.Tensor],
                     layers: dict[str, bool]) -> float:
    """Bits stored per quantized weight: codes plus the scale (and zero) of its row or group."""
    if method == "a8w8":
        in_features = min(w.shape[1] for w in layer_weights(state, layers).values())
        return 8 + 32 / in_features  # one float32 scale per row
    columns = None if group == -1 else group
    # per-channel parameters cost ~0 bits per weight on real widths; report the group case
    # exactly (a narrower last group costs slightly more than this)
    return bits + ((16 + bits) / columns if columns else 0.0)


def _metrics(spec: VariantSpec, variant: str, out_dir: Path, source_dir: Path, state: dict[str, torch.Tensor],
             layers: dict[str, bool], errors: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
    """meta.json's metrics (the module docstring lists them) of the variant written to `out_dir`;
    `extra`, the method's own metrics, gives up its bits and group_size to the front."""
    size, source_size = _weights_bytes(out_dir), _weights_bytes(source_dir)
    bits, group = extra.pop("bits"), extra.pop("group_size")
    return {
        "method": spec.method,
        "variant": variant,
        "spec": {"method": spec.method, **spec.settings},
        "bits": bits,
        "group_size": group,
        "bits_per_weight": _bits_per_weight(spec.method, bits, group, state, layers),
        "num_quantized_layers": len(errors),
        "size_bytes": size,
        "source_size_bytes": source_size,
        "compression_ratio": source_size / size,
        **_mean_and_worst(errors, "rel_weight_error"),
        **extra,
    }


def run(source_dir: str | Path, out_dir: str | Path, variant: str, group_size: int | None = None,
        config: Mapping[str, Any] | None = None, data_dir: str | Path | None = None) -> dict[str, Any]:
    """Quantize `source_dir` (HF layout) into `out_dir` as `variant` and return the metrics written
    to meta.json.

    `config`: the experiment's `quantize` section (group_size, custom_variants, gptq, a8w8, awq and
    calibration are read; what it lacks takes the schema's default); `group_size`, when given,
    replaces its group_size; `data_dir`: the experiment's prepared data, the calibration source of
    gptq, a8w8 and awq variants."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    section = QuantizeSettings.of(config)
    if group_size is not None:
        section = section.replace(group_size=group_size)
    spec = resolve_variant(variant, section)
    calibration = CalibrationSettings.from_section(section.calibration) if spec.calibrated else None
    log_io("quantize", reads={"float model": source_dir, **_calibration_reads(calibration, data_dir)},
           writes={f"variant {variant}, method {spec.method}": out_dir}, logger=log)
    hf_config = _float_config(source_dir)

    layers = decoder_linear_layers(checkpoint_model(transformers.AutoConfig.from_pretrained(
        source_dir, local_files_only=True, trust_remote_code=False)))
    # Quantize fully before opening the output: a bad group size fails without touching out_dir.
    # load_state_dict checks the weights first (meta.json's sha256, no pickle, whole safetensors).
    state = load_state_dict(source_dir)
    packed, errors, qcfg, extra = _quantize(spec, variant, source_dir, data_dir, state, layers, calibration)
    hf_config["quantization_config"] = qcfg

    with atomic_dir(out_dir) as tmp:
        _write_model(tmp, packed, hf_config, source_dir)
        metrics = _metrics(spec, variant, tmp, source_dir, state, layers, errors, extra)
        write_meta(tmp, stage="quantize", config={**variant_settings(variant, section), "variant": variant},
                   parent=source_dir, seed=None, metrics=metrics)
    log.info("%s: %.2f MB -> %.2f MB (x%.2f), mean rel. weight error %.4f", variant,
             metrics["source_size_bytes"] / 1e6, metrics["size_bytes"] / 1e6, metrics["compression_ratio"],
             metrics["mean_rel_weight_error"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="Hugging Face model directory to quantize")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--variant", required=True,
                        help=f"a variant name: built-in ({', '.join(BUILTIN_VARIANTS)}) or one of the config's "
                             "custom_variants")
    parser.add_argument("--data", default=None,
                        help="the experiment's prepared data dir (results/<name>/data): the calibration "
                             "source of gptq, a8w8 and awq variants (quantize.calibration.source corpus or sft); "
                             "not read by rtn variants")
    parser.add_argument("--config", metavar="JSON",
                        help="the experiment's `quantize` section as one JSON object (group_size, custom_variants, "
                             "gptq, a8w8, awq and calibration are read)")
    settings.add_arguments(parser, "quantize")
    args = parser.parse_args(argv)
    configure_logging()
    config = settings.from_arguments(args, "quantize", args.config)
    return run(args.source, args.out, args.variant, config=config, data_dir=args.data)


if __name__ == "__main__":
    run_cli(main, "quantize")
