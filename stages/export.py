"""export: the float model to ONNX, checked against torch with onnxruntime.

The Hugging Face directory is loaded into the project's own Llama (`stages.checkpoint.hf.load_pretrained`),
whose forward is a plain `input_ids (batch, seq) int64 -> logits (batch, seq, vocab) float32`
with no KV cache, so the graph has one input and one output with dynamic batch and sequence axes.

Exporter: `torch.onnx.export(..., dynamo=True)` (torch.export + onnxscript) works with torch 2.13
and is used first. It builds opset 18 and converts down; when that conversion fails (opset 14 with
this model: the Reduce* axes adapter) it keeps opset 18 with only a log line, so the file's opset
is checked. If dynamo raises or wrote another opset, the TorchScript exporter (`dynamo=False`,
`dynamic_axes`, also working with torch 2.13) is used; the route taken and the opset actually
written are recorded in the metrics. Weights go to external data (`model.onnx.data`)
only when they exceed protobuf's 2 GB limit.

Check: onnxruntime (CPUExecutionProvider) runs a fixed, seeded probe batch at two sequence lengths
(both different from the export example, so the dynamic axes are exercised); the stage fails if
max |logits_ort - logits_torch| > atol.

Metrics (meta.json `metrics`): exporter ("dynamo" | "torchscript"), opset_version, max_abs_diff,
atol, probe_shapes, onnx_size_bytes (model.onnx plus external data), external_data (bool),
ort_latency_ms (mean wall time of one onnxruntime forward on the longer probe).

    python -m stages.export --model results/llama/lora-merged --out results/llama/export \
        --config '{"opset_version": 18, "atol": 1e-4}'
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer, load_pretrained
from stages.checkpoint.meta import write_meta

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
_PROTOBUF_LIMIT = 2 * 1024**3  # bytes a single .onnx protobuf may hold
_EXAMPLE_SHAPE = (2, 16)  # (batch, seq) traced; sizes 0/1 would be specialised by torch.export
_PROBE_BATCH = 3
_PROBE_SEQ_LENGTHS = (7, 23)
_LATENCY_REPEATS = 5


class _LogitsOnly(torch.nn.Module):
    """forward(input_ids) -> logits: the graph signature, with no optional labels argument."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def probe_batches(vocab_size: int, max_len: int, seed: int = 0) -> list[torch.Tensor]:
    """Seeded int64 token batches (batch 3, each probe length clipped to max_len)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (_PROBE_BATCH, min(t, max_len)), generator=g)
            for t in _PROBE_SEQ_LENGTHS]


def export_onnx(model: torch.nn.Module, path: Path, opset_version: int, vocab_size: int,
                external_data: bool) -> str:
    """Write `path`; returns the exporter that succeeded ("dynamo" or "torchscript")."""
    wrapped = _LogitsOnly(model).eval()
    example = (torch.randint(0, vocab_size, _EXAMPLE_SHAPE, generator=torch.Generator().manual_seed(1)),)
    names = dict(input_names=["input_ids"], output_names=["logits"], opset_version=opset_version)
    try:
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
        torch.onnx.export(wrapped, example, str(path), dynamo=True, external_data=external_data,
                          dynamic_shapes={"input_ids": dims}, **names)
        got = onnx_opset(path)
        if got == opset_version:
            return "dynamo"
        # The dynamo exporter builds opset 18 and converts down; when the conversion fails it
        # only logs and keeps opset 18, so check the file rather than trust the argument.
        log.warning("dynamo exporter wrote opset %d instead of %d; trying the TorchScript exporter",
                    got, opset_version)
    except Exception as e:  # noqa: BLE001 - any exporter failure falls back to the other route
        log.warning("dynamo ONNX export failed (%s: %s); trying the TorchScript exporter",
                    type(e).__name__, e)
    for f in path.parent.glob(f"{path.name}*"):
        f.unlink()
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    torch.onnx.export(wrapped, example, str(path), dynamo=False, dynamic_axes=axes, **names)
    return "torchscript"


def onnx_opset(path: Path) -> int:
    """The default-domain opset a written ONNX file declares."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def check_onnx(model: torch.nn.Module, path: Path, probes: list[torch.Tensor]) -> tuple[float, float]:
    """(max |ort - torch| over all probes, mean ms per ort forward on the last probe)."""
    import onnxruntime as ort  # imported here: only this stage needs it

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    max_diff = 0.0
    for ids in probes:
        got = session.run(["logits"], {"input_ids": ids.numpy()})[0]
        with torch.no_grad():
            want = model(ids).float().numpy()
        if got.shape != want.shape:
            raise ValueError(f"{path}: onnxruntime logits have shape {got.shape}, torch {want.shape}")
        max_diff = max(max_diff, float(np.abs(got - want).max()))
    feed = {"input_ids": probes[-1].numpy()}
    session.run(["logits"], feed)  # warm-up: first run allocates
    start = time.perf_counter()
    for _ in range(_LATENCY_REPEATS):
        session.run(["logits"], feed)
    return max_diff, (time.perf_counter() - start) * 1000 / _LATENCY_REPEATS


def run(model_dir: str | Path, out_dir: str | Path, opset_version: int, atol: float,
        config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export `model_dir` to `out_dir/model.onnx`, verify it with onnxruntime, return the metrics.

    Raises ValueError (and leaves out_dir untouched) if the ONNX logits differ by more than atol.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (model_dir / "config.json").exists() and "quantization_config" in json.loads(
            (model_dir / "config.json").read_text()):
        raise ValueError(f"{model_dir} is a quantized checkpoint; export takes the float source model")
    model = load_pretrained(model_dir).eval()
    cfg = model.config
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = n_bytes > _PROTOBUF_LIMIT

    with atomic_dir(out_dir) as tmp:
        onnx_path = tmp / ONNX_NAME
        exporter = export_onnx(model, onnx_path, opset_version, cfg.vocab_size, external)
        probes = probe_batches(cfg.vocab_size, cfg.max_position_embeddings)
        max_diff, latency = check_onnx(model, onnx_path, probes)
        if not max_diff <= atol:  # also catches nan
            raise ValueError(f"onnxruntime logits differ from torch by {max_diff:.3g} > "
                             f"export.atol={atol:g}; raise export.atol or check the exported graph")
        copy_tokenizer(model_dir, tmp)
        metrics = {
            "exporter": exporter,
            "opset_version": onnx_opset(onnx_path),
            "max_abs_diff": max_diff,
            "atol": atol,
            "probe_shapes": [list(p.shape) for p in probes],
            "onnx_size_bytes": sum(f.stat().st_size for f in tmp.glob(f"{ONNX_NAME}*")),
            "external_data": any(f.name != ONNX_NAME for f in tmp.glob(f"{ONNX_NAME}*")),
            "ort_latency_ms": latency,
        }
        used = {**(config or {}), "opset_version": opset_version, "atol": atol}
        write_meta(tmp, stage="export", config=used, parent=model_dir, seed=None, metrics=metrics)
    log.info("exported %s with %s exporter: max |diff| %.2e, %.1f ms per forward", model_dir, exporter,
             max_diff, latency)
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.export", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="float Hugging Face model directory to export")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--config", required=True,
                        help="the experiment's `export` section as JSON (opset_version, atol), "
                             "validated with defaults filled")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads(args.config)
    missing = [k for k in ("opset_version", "atol") if k not in config]
    if missing:
        raise ValueError(f"--config lacks {missing}; pass the export section after "
                         "stages.config.check_config filled its defaults")
    return run(args.model, args.out, config["opset_version"], config["atol"], config=config)


if __name__ == "__main__":
    main()
