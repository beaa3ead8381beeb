"""deploy: artifacts for runtimes outside the pipeline, each checked before it is published.

    python -m stages.deploy gguf --model results/llama/lora-merged --type q8_0 \
        --data results/llama/data --out results/llama/deploy/gguf-q8_0
    python -m stages.deploy compressed-tensors --model results/llama/quant/a8w8-smooth \
        --data results/llama/data --out results/llama/deploy/compressed-tensors-a8w8-smooth
    python -m stages.deploy manifest --experiment-dir results/llama --out results/llama/deploy/manifest.json

Each artifact directory is written under a temporary name, checked there with the runtime users
deploy with, and renamed into place only when the check passes (nothing half-written, and a failed
check leaves the previous artifact where it was):

- gguf-<type> (`model-<type>.gguf`, stages.deployment.gguf_writer; f32, f16, q8_0, q4_0) for
  llama.cpp, Ollama, LM Studio: transformers' GGUF loader (`from_pretrained(dir, gguf_file=...)`,
  which dequantizes to float; for a mixture of experts, whose experts it does not read, the float
  model stages.checkpoint.gguf_mixture reads from the file, loaded by transformers) must keep the
  source's top-1 token on the experiment's validation text (`deploy.min_top1_agreement.<type>`; f32
  also within 1e-5 of the logits' scale), and its tokenizer, read from the GGUF metadata, must
  encode the probe strings of stages.deployment.checks as the source's does;
- compressed-tensors-<variant> (stages.deployment.compressed_tensors) for vLLM and transformers:
  transformers with the compressed-tensors package loads it and must keep the top-1 token of our
  loader's model of the same A8W8 variant (`deploy.min_top1_agreement.compressed_tensors`).

meta.json of each artifact: `metrics` holds what the writer reports and `check` (runtime, top-1
agreement, relative error, positions, tokenizer probes); `manifest` lists every artifact of an
experiment (deploy/ and the ONNX graphs of export/) with its file, size and check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from stages import settings
from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.gguf_mixture import is_mixture_file, mixture_tokenizer, write_mixture
from stages.checkpoint.meta import write_meta
from stages.checkpoint.weights import check_model_dir
from stages.data.corpus import read_index
from stages.data.sft_format import recorded_chat_format
from stages.deployment import checks
from stages.deployment.gguf_writer import write_gguf
from stages.errors import run_cli
from stages.sections import DeploySettings
from stages.stage_logs import configure_logging, log_io
from stages.data.tokenizer import load_model_tokenizer

log = logging.getLogger(__name__)

GGUF_MAX_REL_ERR = 1e-5  # f32: the same weights, only the arithmetic's order may differ


def _transformers_model(model_dir: Path, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=False, **kwargs)


def _source_logits(model_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    check_model_dir(model_dir)  # meta.json's sha256, safetensors only
    return checks.logits_of(_transformers_model(model_dir, use_safetensors=True), windows)


def _read_gguf(path: Path, scratch: Path) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, what read them) of the GGUF check: transformers' GGUF loader, or for a mixture
    of experts, whose experts that loader does not read (Mixtral, OLMoE) or reads at its config classes'
    default widths only (Qwen2-MoE, Qwen3-MoE), the float model stages.checkpoint.gguf_mixture reads
    from the file into `scratch` (the gguf package dequantizes), loaded by transformers. That reading
    computes what llama.cpp computes from the same file (tests/unit/test_gguf_writer.py)."""
    import transformers

    version = transformers.__version__
    if not is_mixture_file(path):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        return _transformers_model(path.parent, gguf_file=path.name), tokenizer, f"transformers {version} GGUF loader"
    tokenizer = mixture_tokenizer(path)
    write_mixture(path, scratch, tokenizer)
    runtime = (f"transformers {version} on the float model stages.checkpoint.gguf_mixture reads from it "
               f"(gguf {importlib.metadata.version('gguf')})")
    return _transformers_model(scratch, use_safetensors=True), tokenizer, runtime


def gguf(model_dir: str | Path, file_type: str, data_dir: str | Path, out_dir: str | Path,
         config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write and check deploy/gguf-<type>/; return its meta.json metrics."""
    from stages.checkpoint.gguf import repair_pre_tokenizer  # transformers: only the GGUF check needs it

    section = DeploySettings.of(config)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    name = f"model-{file_type}.gguf"
    log_io("deploy", reads={"float model": model_dir, "validation text": data_dir}, writes={name: out_dir},
           logger=log)
    min_top1 = section.min_top1_agreement[file_type]
    windows = checks.probe_windows(data_dir)
    with atomic_dir(out_dir) as tmp, tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".gguf-read-") as scratch:
        metrics = write_gguf(model_dir, tmp / name, file_type)
        gguf_model, gguf_tok, runtime = _read_gguf(tmp / name, Path(scratch))
        got = checks.logits_of(gguf_model, windows)
        del gguf_model
        found = checks.agreement(_source_logits(model_dir, windows), got)
        what = f"{out_dir / name} read by {runtime}"
        checks.require(found, min_top1, what, f"deploy.min_top1_agreement.{file_type}",
                       GGUF_MAX_REL_ERR if file_type == "f32" else None)
        source_tok = load_model_tokenizer(model_dir)  # tokenizer.json's own split (AutoTokenizer may swap it)
        # transformers 5.23 maps pre-tokenizer names it does not know (smollm) to GPT-2's split;
        # llama.cpp splits by the name, so the check reads the file as llama.cpp does
        repaired = repair_pre_tokenizer(gguf_tok, metrics["pre_tokenizer"])
        mismatches = checks.tokenizer_mismatches(source_tok, gguf_tok)
        if mismatches:
            raise ValueError(f"{what}: its tokenizer encodes {len(mismatches)} probe string(s) differently from "
                             f"{model_dir}'s, first {mismatches[0]!r}: the GGUF vocabulary or pre-tokenizer "
                             f"({metrics['pre_tokenizer']}) does not describe the source's tokenizer")
        chat = recorded_chat_format(read_index(data_dir))
        prompts = checks.report_prompt_text(checks.prompt_text_mismatches(source_tok, gguf_tok, chat), what)
        check = {"runtime": runtime, **found.as_dict(),
                 "min_top1_agreement": min_top1, "tokenizer_probes": len(checks.TOKENIZER_PROBES),
                 "tokenizer_mismatches": 0, "tokenizer_split_set_from_pre_name": repaired, **prompts}
        metrics = {**metrics, "format": "gguf", "file": name, "size_bytes": (tmp / name).stat().st_size,
                   "check": check}
        write_meta(tmp, stage="deploy", config={"format": "gguf", "type": file_type, **section.as_dict()},
                   parent=model_dir, seed=None, metrics=metrics)
    log.info("%s: top-1 agreement %.4f, rel. error %.2e over %d positions; tokenizer equal on %d probes",
             out_dir / name, found.top1_agreement, found.rel_err, found.positions, len(checks.TOKENIZER_PROBES))
    return metrics


def compressed_tensors(a8w8_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
                       config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write and check deploy/compressed-tensors-<variant>/; return its meta.json metrics."""
    import compressed_tensors as ct_package
    import transformers

    # transformers: only the compressed-tensors check needs them
    from stages.deployment.compressed_tensors import write_compressed_tensors
    from stages.quant import load_quantized

    section = DeploySettings.of(config)
    a8w8_dir, out_dir = Path(a8w8_dir), Path(out_dir)
    log_io("deploy", reads={"A8W8 variant": a8w8_dir, "validation text": data_dir},
           writes={"compressed-tensors checkpoint": out_dir}, logger=log)
    min_top1 = section.min_top1_agreement["compressed_tensors"]
    windows = checks.probe_windows(data_dir)
    want = checks.logits_of(load_quantized(a8w8_dir), windows)
    with atomic_dir(out_dir) as tmp:
        write_compressed_tensors(a8w8_dir, tmp)
        metrics = json.loads((tmp / "meta.json").read_text())["metrics"]
        found = checks.agreement(want, checks.logits_of(_transformers_model(tmp, use_safetensors=True), windows))
        checks.require(found, min_top1, f"{out_dir} read by transformers with compressed-tensors",
                       "deploy.min_top1_agreement.compressed_tensors")
        users_tok = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        chat = recorded_chat_format(read_index(data_dir))
        prompts = checks.report_prompt_text(checks.prompt_text_mismatches(load_model_tokenizer(a8w8_dir), users_tok,
                                                                          chat), f"{out_dir} read by transformers")
        check = {"runtime": f"transformers {transformers.__version__}, compressed-tensors {ct_package.__version__}",
                 "against": "our A8W8 loader (int8 kernels)", **found.as_dict(), "min_top1_agreement": min_top1,
                 **prompts}
        metrics = {**metrics, "check": check}
        write_meta(tmp, stage="deploy", config={"format": "compressed-tensors", **section.as_dict()},
                   parent=a8w8_dir, seed=None, metrics=metrics)
    log.info("%s: top-1 agreement %.4f with our A8W8 loader over %d positions", out_dir, found.top1_agreement,
             found.positions)
    return metrics


def manifest(experiment_dir: str | Path, out_path: str | Path) -> dict[str, Any]:
    """deploy/manifest.json: every deployable artifact of the experiment with its file, size and check."""
    experiment_dir = Path(experiment_dir)
    artifacts = {}
    export = experiment_dir / "export"
    if (export / "meta.json").exists():
        m = json.loads((export / "meta.json").read_text())["metrics"]
        artifacts["onnx"] = {"path": str(export / "model.onnx"), "format": "onnx", "kv_cache": m.get("kv_cache"),
                             "size_bytes": m["onnx_size_bytes"], "genai_config": m.get("genai_config"),
                             "check": {"runtime": "onnxruntime", "top1_agreement": m["top1_agreement"],
                                       "rel_err": m["rel_err"], "generation_tokens_compared":
                                       m.get("generation_tokens_compared"),
                                       "prompt_text_mismatches": m.get("prompt_text_mismatches")}}
        if m.get("int8_onnx_size_bytes"):
            artifacts["onnx-int8"] = {"path": str(export / "int8" / "model.onnx"), "format": "onnx",
                                      "kv_cache": True, "size_bytes": m["int8_onnx_size_bytes"],
                                      "check": {"runtime": "onnxruntime", "against": "the float graph",
                                                "top1_agreement": m["int8_top1_agreement"],
                                                "ppl_ratio": m["int8_ppl_ratio"]}}
    for meta_path in sorted((experiment_dir / "deploy").glob("*/meta.json")):
        m = json.loads(meta_path.read_text())["metrics"]
        path = meta_path.parent / m["file"] if "file" in m else meta_path.parent
        artifacts[meta_path.parent.name] = {"path": str(path), "format": m["format"], "size_bytes": m["size_bytes"],
                                            "check": m["check"]}
    out = {"experiment": experiment_dir.name, "artifacts": artifacts}
    write_json(out_path, out)
    log.info("%d deployable artifacts of %s -> %s", len(artifacts), experiment_dir, out_path)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.deploy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="artifact", required=True)
    g = sub.add_parser("gguf", help="a GGUF file of a float model, checked by transformers' GGUF loader")
    g.add_argument("--model", required=True, help="float Hugging Face model directory (the quantization source)")
    g.add_argument("--type", required=True, choices=["f32", "f16", "q8_0", "q4_0"], help="GGUF weight type")
    c = sub.add_parser("compressed-tensors", help="an A8W8 variant in the compressed-tensors format, checked by "
                                                  "transformers against our loader")
    c.add_argument("--model", required=True, help="A8W8 variant directory written by the quantize stage")
    for p in (g, c):
        p.add_argument("--data", required=True, help="data dir written by prepare (its validation text is the probe)")
        p.add_argument("--out", required=True, help="artifact directory (replaced atomically once checked)")
        p.add_argument("--config", metavar="JSON", help="the experiment's `deploy` section as one JSON object")
        settings.add_arguments(p, "deploy")
    m = sub.add_parser("manifest", help="deploy/manifest.json: every deployable artifact with its check")
    m.add_argument("--experiment-dir", required=True, help="results/<experiment>")
    m.add_argument("--out", required=True, help="the manifest JSON to write")
    args = parser.parse_args(argv)
    configure_logging()
    if args.artifact == "manifest":
        return manifest(args.experiment_dir, args.out)
    config = settings.from_arguments(args, "deploy", args.config).as_dict()
    if args.artifact == "gguf":
        return gguf(args.model, args.type, args.data, args.out, config)
    return compressed_tensors(args.model, args.data, args.out, config)


if __name__ == "__main__":
    run_cli(main, "deploy")
