"""export: the float model to ONNX with a KV cache, checked against torch with onnxruntime.

Which torch model is exported (`load_for_export`):
  * the project's own Llama (`stages.checkpoint.hf.load_pretrained`) when it implements the
    directory's config.json (Llama, Qwen2, Mistral, Qwen3, GLM, GLM-4), as the decoder with a KV
    cache of `stages.deployment.onnx_decoder` (inputs input_ids, attention_mask, position_ids,
    past_key_values.{i}.key/value; outputs logits, present.{i}.key/value: optimum's and
    onnxruntime-genai's names; left padding through the mask). A config the cache graph cannot
    compute (dynamic RoPE) is exported without a cache, with a warning;
  * otherwise transformers' own model (`AutoModelForCausalLM`, attn_implementation="eager", the one
    implementation every family has and torch.export traces), called as
    `model(input_ids=..., use_cache=False).logits`: GPT-2, OPT, Bloom, GPT-NeoX, ... These keep the
    cache-free graph `input_ids (batch, seq) int64 -> logits (batch, seq, vocab)` (no mask).
Either way the weights pass `stages.checkpoint.weights` first (meta.json's sha256, no pickle, whole
safetensors files).

Output directory: model.onnx (+ model.onnx.data past 2 GB), the tokenizer files, meta.json and,
for the cache graph, genai_config.json (`stages.deployment.onnx_files`): onnxruntime-genai opens
the directory as written; `python -m stages.predict --backend onnxruntime` and stages.evaluate run
it too. With the `int8` setting (`--int8`), `int8/` holds the same with int8 MatMul weights
(`stages.deployment.onnx_int8`).

Exporter: `torch.onnx.export(..., dynamo=True)` (torch.export + onnxscript) works with torch 2.13
and is used first. It builds opset 18 and converts down; when that conversion fails (opset 14 with
this model: the Reduce* axes adapter) it keeps opset 18 with only a log line, so the file's opset
is checked. If dynamo raises or wrote another opset, the TorchScript exporter (`dynamo=False`,
`dynamic_axes`, also working with torch 2.13) is used; the route taken and the opset actually
written are recorded in the metrics. Weights go to external data (`model.onnx.data`)
only when they exceed protobuf's 2 GB limit.

Check: onnxruntime (CPUExecutionProvider) runs a fixed, seeded probe batch at two sequence lengths
(both different from the export example, so the dynamic axes are exercised; 3 x 7 + 3 x 37 = 132
positions). Two conditions must hold, both scale-free so one setting serves a debug model and a
7B model alike (an absolute bound does not: a correct 135M fp32 graph differs by 3e-3 while a
debug model's logits are below 1):
  rel_err        = max |ort - torch| / max |torch|        <= rtol
  top1_agreement = share of positions where argmax over the vocabulary agrees
                                                          >= min_top1_agreement
The first bounds the numerical drift against the logits' own scale; the second checks what the
logits mean. At 0.99 one flip among the 132 positions (a near-tie that fp32 reordering decides the
other way) is tolerated, two are not. A cache graph is also checked generating: 3 left-padded
prompts of 7, 5 and 3 probe tokens, 16 greedy tokens each with the cache, against torch
recomputing each prompt alone without one (`stages.deployment.onnx_checks`; a divergence passes
only at a near-tie within rtol of the logit scale).

Metrics (meta.json `metrics`): torch_model ("project" | "transformers"), kv_cache (bool),
genai_config (bool: written), exporter ("dynamo" | "torchscript"), opset_version, max_abs_diff,
logit_scale (max |torch logits|), rel_err, rtol, top1_agreement, min_top1_agreement,
probe_shapes, generation_rows, generation_new_tokens, generation_tokens_compared,
generation_near_ties (null without a cache), onnx_size_bytes (model.onnx plus external data),
external_data (bool), ort_latency_ms (mean wall time of one onnxruntime forward on the longer
probe); with int8: int8_top1_agreement, int8_ppl_float, int8_ppl_int8, int8_ppl_ratio,
int8_greedy_agreement, int8_greedy_tokens (on the float graph's greedy continuations of the
generation prompts, see onnx_int8), int8_block_size, int8_onnx_size_bytes.

    python -m stages.export --model results/llama/lora-merged --out results/llama/export \
        --config '{"opset_version": 18, "rtol": 1e-3, "min_top1_agreement": 0.99}' [--no-int8]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages import settings
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer, load_config, load_pretrained
from stages.checkpoint.meta import write_meta
from stages.checkpoint.tokenizer_files import TOKENIZER_FILES
from stages.checkpoint.weights import check_model_dir, refuse_quantized
from stages.data.tokenizer import load_model_tokenizer
from stages.deployment.onnx_checks import GenerationAgreement, generation_agreement, left_pad
from stages.deployment.onnx_decoder import CachedDecoder, export_decoder
from stages.deployment.onnx_files import (GENAI_CONFIG, INT8_DIR, ONNX_NAME, export_with_fallback, onnx_files,
                                          onnx_opset, write_genai_config)
from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate
from stages.deployment.onnx_int8 import int8_quality, quantize_int8
from stages.errors import run_cli
from stages.metrics.logit_agreement import LogitAgreement, logit_agreement
from stages.sections import ExportSettings
from stages.model.config import LlamaConfig
from stages.stage_logs import Progress, configure_logging, log_io
from stages.data.sft import uses_chat_template
from stages.deployment import checks

log = logging.getLogger(__name__)

_PROTOBUF_LIMIT = 2 * 1024**3  # bytes a single .onnx protobuf may hold
_EXAMPLE_SHAPE = (2, 16)  # (batch, seq) traced; sizes 0/1 would be specialised by torch.export
_PROBE_BATCH = 3
_PROBE_SEQ_LENGTHS = (7, 37)
_LATENCY_REPEATS = 5
_GENERATION_TOKENS = 16  # greedy tokens per prompt in the generation check and the int8 comparison


class _ProjectLogits(torch.nn.Module):
    """forward(input_ids) -> logits of the project's Llama, with no optional labels argument."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


class _TransformersLogits(torch.nn.Module):
    """forward(input_ids) -> logits of a transformers causal LM: no cache, no attention mask."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@dataclass
class ExportModel:
    """What is exported (`module`, in eval mode) and what the checks compare it with: `logits`,
    forward(input_ids) -> logits of the torch model itself."""

    module: torch.nn.Module  # a CachedDecoder, or forward(input_ids) -> logits (no cache)
    logits: torch.nn.Module
    torch_model: str  # "project" or "transformers"
    vocab_size: int
    max_positions: int | None  # None: no position limit (e.g. Bloom's ALiBi)
    config: LlamaConfig | None = None  # the project's config (genai_config.json needs it)

    @property
    def cached(self) -> bool:
        return isinstance(self.module, CachedDecoder)


def load_for_export(model_dir: Path) -> ExportModel:
    """The project's Llama when it implements config.json (as a CachedDecoder when
    `check_exportable` allows, else cache-free), else transformers' model (see docstring)."""
    try:
        config = load_config(model_dir)
    except ValueError as e:  # a family (or a setting) our model does not implement
        log.info("%s: exporting transformers' model without a KV cache (the project's Llama does not load it: "
                 "%s)", model_dir, e)
    else:
        model = load_pretrained(model_dir).eval()
        logits = _ProjectLogits(model).eval()
        try:
            module: torch.nn.Module = CachedDecoder(model).eval()
        except ValueError as e:
            log.warning("%s: exporting without a KV cache: %s", model_dir, e)
            module = logits
        return ExportModel(module, logits, "project", config.vocab_size, config.max_position_embeddings, config)
    import transformers

    check_model_dir(model_dir)  # load_pretrained above runs the same checks itself
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True,
        trust_remote_code=False, use_safetensors=True)
    config = model.config.get_text_config()
    logits = _TransformersLogits(model).eval()
    return ExportModel(logits, logits, "transformers", config.vocab_size,
                       getattr(config, "max_position_embeddings", None))


def probe_batches(vocab_size: int, max_len: int | None, seed: int = 0) -> list[torch.Tensor]:
    """Seeded int64 token batches (batch 3, each probe length clipped to max_len)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (_PROBE_BATCH, min(t, max_len or t)), generator=g)
            for t in _PROBE_SEQ_LENGTHS]


def export_onnx(model: torch.nn.Module, path: Path, opset_version: int, vocab_size: int,
                external_data: bool) -> str:
    """Write `path` from `model`: a CachedDecoder as the cache graph (onnx_decoder.export_decoder),
    any other module (forward(input_ids) -> logits) as the cache-free graph; returns the exporter
    that succeeded ("dynamo" or "torchscript")."""
    if isinstance(model, CachedDecoder):
        return export_decoder(model, path, opset_version, external_data)
    example = (torch.randint(0, vocab_size, _EXAMPLE_SHAPE, generator=torch.Generator().manual_seed(1)),)
    names = dict(input_names=["input_ids"], output_names=["logits"], opset_version=opset_version)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    return export_with_fallback(model, example, path, names, dynamic_shapes={"input_ids": dims}, dynamic_axes=axes,
                                external_data=external_data)


def compare_logits(got: list[np.ndarray], want: list[np.ndarray]) -> LogitAgreement:
    """Compare pairs of (..., vocab) logits, onnxruntime's against torch's, over all of them
    (`stages.metrics.logit_agreement`); nan in onnxruntime's makes max_abs_diff and rel_err nan."""
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            raise ValueError(f"onnxruntime logits have shape {g.shape}, torch {w.shape}")
    # every position of every pair, (positions, vocab); float64 differences the float32 logits without rounding
    return logit_agreement(np.concatenate([w.reshape(-1, w.shape[-1]) for w in want]),
                           np.concatenate([g.reshape(-1, g.shape[-1]) for g in got]).astype(np.float64))


def check_agreement(agreement: LogitAgreement, rtol: float, min_top1_agreement: float) -> None:
    """Raise ValueError with the numbers unless rel_err <= rtol and top1 >= min_top1_agreement."""
    a = agreement
    problems = []
    if not a.rel_err <= rtol:  # also catches nan
        problems.append(f"max |ort - torch| = {a.max_abs_diff:.3g} is {a.rel_err:.3g} of the logit scale "
                        f"{a.logit_scale:.3g} > export.rtol={rtol:g}")
    if not a.top1_agreement >= min_top1_agreement:
        problems.append(f"the top-1 token agrees at {a.top1_agreement:.4f} of {a.positions} positions "
                        f"< export.min_top1_agreement={min_top1_agreement:g}")
    if problems:
        raise ValueError("onnxruntime disagrees with torch: " + "; ".join(problems)
                         + ". The exported graph is wrong, or export.rtol / export.min_top1_agreement "
                           "are stricter than this model's float arithmetic allows")


def check_onnx(target: ExportModel, path: Path, probes: list[torch.Tensor]) -> tuple[LogitAgreement, float]:
    """(agreement of onnxruntime with the torch model over all probes, mean ms per ort forward on
    the last); a cache graph runs with an empty past and an all-ones mask."""
    decoder = OnnxDecoder(path)
    got, want = [], []
    for ids in probes:
        got.append(decoder.logits(ids.numpy()))
        with torch.no_grad():
            want.append(target.logits(ids).float().numpy())
    agreement = compare_logits(got, want)
    decoder.logits(probes[-1].numpy())  # warm-up: first run allocates
    start = time.perf_counter()
    for _ in range(_LATENCY_REPEATS):
        decoder.logits(probes[-1].numpy())
    return agreement, (time.perf_counter() - start) * 1000 / _LATENCY_REPEATS


def generation_prompts(probe: torch.Tensor) -> list[list[int]]:
    """Prompts of different lengths from a (B, T) probe: row r keeps its last T - 2r tokens, so the
    batch is left-padded (and one row is not)."""
    T = probe.shape[1]
    return [probe[r, min(2 * r, T - 1):].tolist() for r in range(len(probe))]


def check_generation(target: ExportModel, path: Path, probe: torch.Tensor, rtol: float) -> GenerationAgreement:
    """onnxruntime's cached, left-padded greedy generation against torch's (onnx_checks); raises
    ValueError with the rows that diverged other than at a near-tie."""
    result = generation_agreement(target.logits, OnnxDecoder(path), generation_prompts(probe), _GENERATION_TOKENS,
                                  rtol)
    if result.mismatches:
        raise ValueError(f"onnxruntime's greedy generation with the KV cache differs from torch's without one: "
                         f"{'; '.join(result.mismatches)} (a gap beyond export.rtol={rtol:g} of the logit scale, "
                         "so not a near-tie). The cache, mask or position ids of the graph are wrong")
    return result


def _token_ids(model_dir: Path) -> dict[str, int | None]:
    """eos/pad/bos of the tokenizer `model_dir` ships (the ones stages.predict uses); empty (the
    config's ids decide) when it ships none that loads."""
    try:
        tok = load_model_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - a missing or partial tokenizer leaves config.json's ids
        log.info("%s: no tokenizer to read token ids from (%s); genai_config.json takes config.json's", model_dir, e)
        return {}
    return {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}


def _prompt_text_check(model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """`checks.prompt_text_mismatches` of the tokenizer written to `out_dir`, read as transformers'
    users read it, against the predictor's prompts from `model_dir`'s (chat template when it has
    one, as the predictor decides without a data directory); the metrics are None without a
    tokenizer that loads."""
    from transformers import AutoTokenizer


    try:
        project = load_model_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - no tokenizer: nothing a user could encode text with
        log.info("%s: no tokenizer, no prompt-text check (%s)", model_dir, e)
        return {"prompt_texts": None, "prompt_text_mismatches": None, "first_prompt_text_mismatch": None}
    users = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    mismatches = checks.prompt_text_mismatches(project, users, uses_chat_template(project, True))
    return checks.report_prompt_text(mismatches, f"{out_dir}'s tokenizer read by transformers")


def _write_genai(out_dir: Path, config: LlamaConfig, model_dir: Path) -> bool:
    """genai_config.json with the tokenizer's token ids; False (and a warning) when no eos is known."""
    try:
        write_genai_config(out_dir, config, **_token_ids(model_dir))
    except ValueError as e:
        log.warning("%s: no %s written (%s)", model_dir, GENAI_CONFIG, e)
        return False
    return True


def write_int8(target: ExportModel, out_dir: Path, probe: torch.Tensor, block_size: int,
               external: bool) -> dict[str, Any]:
    """`out_dir/int8/` (model.onnx, genai_config.json, tokenizer): the INT8 graph of
    `out_dir/model.onnx`, and its quality against the float graph as metrics."""
    int8_dir = out_dir / INT8_DIR
    int8_dir.mkdir()
    quantize_int8(out_dir / ONNX_NAME, int8_dir / ONNX_NAME, block_size, external)
    for name in (GENAI_CONFIG, *TOKENIZER_FILES):
        if (out_dir / name).is_file():
            shutil.copy2(out_dir / name, int8_dir / name)
    float_decoder, int8_decoder = OnnxDecoder(out_dir / ONNX_NAME), OnnxDecoder(int8_dir / ONNX_NAME)
    ids, mask = left_pad(generation_prompts(probe), 0)
    # scored on the float graph's own continuations: text the model finds likely, unlike random ids
    sequences = greedy_generate(float_decoder, ids, mask, _GENERATION_TOKENS, None, 0)
    full_mask = np.concatenate([mask, np.ones((len(mask), _GENERATION_TOKENS), np.int64)], axis=1)
    quality = int8_quality(float_decoder, int8_decoder, sequences, full_mask, ids, mask, _GENERATION_TOKENS, 0)
    return {"int8_" + k: v for k, v in asdict(quality).items()} | {
        "int8_block_size": block_size,
        "int8_onnx_size_bytes": sum(f.stat().st_size for f in onnx_files(int8_dir)),
    }


@dataclass
class _Checked:
    """What onnxruntime measured against torch on the probes."""

    probes: list[torch.Tensor]
    agreement: LogitAgreement
    latency_ms: float  # mean ms per onnxruntime forward on the longer probe
    generation: GenerationAgreement | None  # None: no cache graph, no generation check


def _check_graph(target: ExportModel, onnx_path: Path, rtol: float, min_top1_agreement: float) -> _Checked:
    """onnxruntime against torch on the seeded probes: the logits (check_agreement) and, for a cache
    graph, the greedy generation (check_generation); ValueError with the numbers when they disagree."""
    probes = probe_batches(target.vocab_size, target.max_positions)
    agreement, latency = check_onnx(target, onnx_path, probes)
    check_agreement(agreement, rtol, min_top1_agreement)
    generation = check_generation(target, onnx_path, probes[0], rtol) if target.cached else None
    return _Checked(probes, agreement, latency, generation)


def _metrics(target: ExportModel, config: ExportSettings, out_dir: Path, exporter: str, checked: _Checked,
             genai: bool, prompts: dict[str, Any]) -> dict[str, Any]:
    """meta.json's metrics of the float graph written to `out_dir` (the module docstring lists them)."""
    generation = checked.generation
    return {
        "torch_model": target.torch_model,
        "kv_cache": target.cached,
        "genai_config": genai,
        "exporter": exporter,
        "opset_version": onnx_opset(out_dir / ONNX_NAME),
        **{k: v for k, v in asdict(checked.agreement).items() if k != "positions"},
        "rtol": config.rtol,
        "min_top1_agreement": config.min_top1_agreement,
        "probe_shapes": [list(p.shape) for p in checked.probes],
        "generation_rows": generation.rows if generation else None,
        "generation_new_tokens": generation.new_tokens if generation else None,
        "generation_tokens_compared": generation.tokens_compared if generation else None,
        "generation_near_ties": generation.near_ties if generation else None,
        "onnx_size_bytes": sum(f.stat().st_size for f in onnx_files(out_dir)),
        "external_data": any(f.name != ONNX_NAME for f in onnx_files(out_dir)),
        "ort_latency_ms": checked.latency_ms,
        **prompts,
    }


def _int8(target: ExportModel, config: ExportSettings, out_dir: Path, probe: torch.Tensor, external: bool,
          model_dir: Path) -> dict[str, Any]:
    """With the `int8` setting, `out_dir/int8/` (write_int8) and its metrics; without a cache graph
    a warning and no metrics."""
    if config.int8 and target.cached:
        return write_int8(target, out_dir, probe, config.int8_block_size, external)
    if config.int8:  # the int8 graph is made of the cache graph
        log.warning("export.int8: no int8/ for %s: its graph has no KV cache (only the project's Llama "
                    "family exports one)", model_dir)
    return {}


def run(model_dir: str | Path, out_dir: str | Path, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Export `model_dir` to `out_dir/model.onnx` (+ genai_config.json, tokenizer, meta.json, and
    `int8/` with the `int8` setting), verify it with onnxruntime, return the metrics.
    `config` is the `export` section (opset_version, rtol, min_top1_agreement, int8,
    int8_block_size); what it lacks takes the default (rtol 1e-3: fp32 graphs are
    observed at 1e-7 (debug models) to ~1e-4 (135M) of the logit scale).

    Raises ValueError (and leaves out_dir untouched) if onnxruntime's logits are off by more than
    `rtol` of the logit scale, agree on the top-1 token at fewer than `min_top1_agreement` of
    the probe positions, or (cache graph) generate other tokens than torch beyond a near-tie.
    """
    config = ExportSettings.of(config)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    log_io("export", reads={"float model": model_dir},
           writes={f"{ONNX_NAME}, {GENAI_CONFIG}, tokenizer, meta.json": out_dir}, logger=log)
    refuse_quantized(model_dir, lambda method: f"--model {model_dir} is a quantized checkpoint (quant_method="
                                               f"{method!r}); export takes the float source model")
    steps = Progress(log, "export steps", 4, lines=4, min_interval_s=0, eta=False)
    target = load_for_export(model_dir)
    n_bytes = sum(p.numel() * p.element_size() for p in target.module.parameters())
    external = n_bytes > _PROTOBUF_LIMIT
    steps.advance(detail=f"loaded the {target.torch_model} model ({n_bytes / 1e6:.1f} MB); next: the ONNX export")

    with atomic_dir(out_dir) as tmp:
        exporter = export_onnx(target.module, tmp / ONNX_NAME, config.opset_version, target.vocab_size, external)
        steps.advance(detail=f"exported {ONNX_NAME} with the {exporter} exporter; next: the onnxruntime check")
        checked = _check_graph(target, tmp / ONNX_NAME, config.rtol, config.min_top1_agreement)
        steps.advance(detail="onnxruntime agrees with torch on the probes; next: genai_config, tokenizer, int8")
        copy_tokenizer(model_dir, tmp)
        prompts = _prompt_text_check(model_dir, tmp)
        genai = target.cached and _write_genai(tmp, target.config, model_dir)
        metrics = _metrics(target, config, tmp, exporter, checked, genai, prompts)
        metrics |= _int8(target, config, tmp, checked.probes[0], external, model_dir)
        steps.advance(detail="wrote the directory; next: meta.json")
        write_meta(tmp, stage="export", config=config, parent=model_dir, seed=None,
                   metrics=metrics)
    log.info("exported %s (%s model, KV cache: %s) with %s exporter: rel. error %.2e, top-1 agreement %.4f, "
             "%.1f ms per forward", model_dir, target.torch_model, target.cached, exporter, checked.agreement.rel_err,
             checked.agreement.top1_agreement, checked.latency_ms)
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.export", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="float Hugging Face model directory to export")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--config", metavar="JSON", help="the experiment's `export` section as one JSON object")
    settings.add_arguments(parser, "export")
    args = parser.parse_args(argv)
    configure_logging()
    return run(args.model, args.out, settings.from_arguments(args, "export", args.config))


if __name__ == "__main__":
    run_cli(main, "export")
