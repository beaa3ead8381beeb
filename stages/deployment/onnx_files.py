"""An ONNX model directory as onnxruntime-genai opens it: `model.onnx` (+ `model.onnx.data` when
the weights pass protobuf's 2 GB), `genai_config.json` and the tokenizer files.

genai_config.json follows what onnxruntime-genai's own model builder writes (0.18), with the
decoder's input and output names of `stages.deployment.onnx_decoder`:

    model.type             config.json's model_type where onnxruntime-genai has it ("llama",
                           "mistral", "qwen2", "qwen3"), else its generic decoder-only type
                           "decoder" (GLM, GLM-4: it has no "glm" / "glm4" and refuses them);
                           either way it runs the graph by the names below
    model.context_length   max_position_embeddings
    model.bos/eos/pad_token_id, model.vocab_size
    model.decoder          filename, head_size, hidden_size, num_attention_heads,
                           num_hidden_layers, num_key_value_heads, inputs, outputs (names; the
                           per-layer ones as printf patterns, "past_key_values.%d.key")
    search                 greedy defaults (do_sample false, num_beams 1), max_length =
                           context_length, past_present_share_buffer false: present is past + new
                           tokens long, not a preallocated buffer of max_length
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.checkpoint.atomic import write_json
from stages.model.config import LlamaConfig
from stages.model.registry import FAMILIES

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
INT8_DIR = "int8"  # the INT8 variant's own directory inside an export directory
GENAI_CONFIG = "genai_config.json"
# model_types that onnxruntime-genai 0.18 runs under their own name (ModelType::IsLLM) and a test
# opens; the other families of our model get its generic decoder-only type
GENAI_MODEL_TYPES = tuple(sorted(f.model_type for f in FAMILIES if f.genai_named))  # stages/model/registry.py
GENAI_GENERIC_TYPE = "decoder"


def onnx_opset(path: Path) -> int:
    """The default-domain opset a written ONNX file declares."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def onnx_files(directory: Path, name: str = ONNX_NAME) -> list[Path]:
    """`name` and its external data files (`name*`) directly in `directory`."""
    return sorted(f for f in Path(directory).glob(f"{name}*") if f.is_file())


def _first(token_id: int | list[int] | None) -> int | None:
    return token_id[0] if isinstance(token_id, list) and token_id else token_id


def genai_config(config: LlamaConfig, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, bos_token_id: int | None = None,
                 filename: str = ONNX_NAME) -> dict[str, Any]:
    """genai_config.json of a decoder exported from `config` (see the module docstring).
    The token ids given override the config's (the tokenizer's eos is the one stages.predict
    stops at); pad falls back to eos, as the predictor pads. An id that is None in both is left
    out (onnxruntime-genai refuses a null); eos is required."""
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    bos = bos_token_id if bos_token_id is not None else config.bos_token_id
    if eos is None:
        raise ValueError("neither the tokenizer nor config.json names an eos token; onnxruntime-genai "
                         "needs model.eos_token_id to stop generating")
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    pad = pad if pad is not None else _first(eos)
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": config.head_dim,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }
    return {
        "model": {**({"bos_token_id": bos} if bos is not None else {}),
                  "context_length": config.max_position_embeddings, "decoder": decoder, "eos_token_id": eos,
                  "pad_token_id": pad, "type": genai_model_type(config.model_type), "vocab_size": config.vocab_size},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": config.max_position_embeddings, "min_length": 0, "no_repeat_ngram_size": 0,
                   "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
                   "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def genai_model_type(model_type: str) -> str:
    """genai_config.json's model.type for config.json's `model_type` (see the module docstring)."""
    return model_type if model_type in GENAI_MODEL_TYPES else GENAI_GENERIC_TYPE


def write_genai_config(directory: Path, config: LlamaConfig, **kwargs: Any) -> dict[str, Any]:
    """Write `directory/genai_config.json` (see `genai_config`) and return it."""
    content = genai_config(config, **kwargs)
    write_json(Path(directory) / GENAI_CONFIG, content)
    return content


def read_genai_config(directory: Path) -> dict[str, Any] | None:
    """genai_config.json of `directory`, None when it has none."""
    path = Path(directory) / GENAI_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def export_with_fallback(module: Any, example: tuple, path: Path, names: dict[str, Any], *, dynamic_shapes: Any,
                         dynamic_axes: dict[str, dict[int, str]], external_data: bool,
                         after_dynamo: Callable[[Path], None] | None = None) -> str:
    """`torch.onnx.export` of `module` to `path`: the dynamo exporter first (`dynamic_shapes`, then
    `after_dynamo(path)`), else the TorchScript exporter (`dynamic_axes`); returns the route that
    succeeded ("dynamo" or "torchscript"). `names`: input_names, output_names, opset_version."""
    import torch

    opset_version = names["opset_version"]
    try:
        torch.onnx.export(module, example, str(path), dynamo=True, external_data=external_data,
                          dynamic_shapes=dynamic_shapes, **names)
        if after_dynamo is not None:
            after_dynamo(path)
        got = onnx_opset(path)
        if got == opset_version:
            return "dynamo"
        # The dynamo exporter builds opset 18 and converts down; when the conversion fails it
        # only logs and keeps opset 18, so check the file rather than trust the argument.
        log.warning("dynamo exporter wrote opset %d instead of %d; trying the TorchScript exporter",
                    got, opset_version)
    except Exception as e:  # noqa: BLE001 - any exporter failure falls back to the other route
        log.warning("dynamo ONNX export failed (%s: %s); trying the TorchScript exporter", type(e).__name__, e)
    for f in path.parent.glob(f"{path.name}*"):
        f.unlink()
    torch.onnx.export(module, example, str(path), dynamo=False, dynamic_axes=dynamic_axes, **names)
    return "torchscript"
