"""An exported ONNX directory behind the small part of a transformers causal LM that the
torch-facing stages call, so that stages.evaluate and stages.predict score and generate with it
exactly as with every other variant:

    model(input_ids=..., attention_mask=...).logits   torch float32 (B, T, V), no cache
    model.generate(input_ids=..., attention_mask=..., max_new_tokens=..., eos_token_id=...,
                   pad_token_id=..., min_new_tokens=..., stopping_criteria=...)
                                                      greedy only (do_sample=False, num_beams=1)
    model.parameters()                                the graph's weight initializers as CPU
                                                      tensors (int8 stays int8), read on demand
    model.config                                      vocab_size, max_position_embeddings, token ids
                                                      (from genai_config.json when present)

As optimum's ORTModelForCausalLM, but without transformers' GenerationMixin: the greedy loop is
`stages.deployment.onnx_generate.greedy_generate`, whose outputs equal `generate`'s token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from stages.deployment.onnx_files import ONNX_NAME, read_genai_config
from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate

# Initializer types that hold weights (the graph's int64 initializers are shapes and indices).
_WEIGHT_TYPES = {"FLOAT", "FLOAT16", "BFLOAT16", "INT8", "UINT8", "INT4", "UINT4"}


def is_onnx_dir(directory: str | Path) -> bool:
    """Whether `directory` holds an exported decoder (model.onnx)."""
    return (Path(directory) / ONNX_NAME).is_file()


class OnnxCausalLM:
    """`OnnxCausalLM(directory)`: the model.onnx of `directory` on onnxruntime's CPU provider."""

    def __init__(self, directory: str | Path, intra_op_num_threads: int = 0):
        self.directory = Path(directory)
        self.decoder = OnnxDecoder(self.directory / ONNX_NAME, intra_op_num_threads=intra_op_num_threads)
        model = (read_genai_config(self.directory) or {}).get("model", {})
        self.config = SimpleNamespace(
            vocab_size=self.decoder.vocab_size, max_position_embeddings=model.get("context_length"),
            eos_token_id=model.get("eos_token_id"), pad_token_id=model.get("pad_token_id"),
            bos_token_id=model.get("bos_token_id"), model_type=model.get("type"))
        self.device = torch.device("cpu")

    def eval(self) -> "OnnxCausalLM":
        return self

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **_: Any) -> SimpleNamespace:
        """`.logits` (B, T, V) float32 of whole sequences (use_cache and the like are ignored)."""
        mask = None if attention_mask is None else attention_mask.cpu().numpy()
        return SimpleNamespace(logits=torch.from_numpy(self.decoder.logits(input_ids.cpu().numpy(), mask)))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 min_new_tokens: int = 0, stopping_criteria=None, do_sample: bool = False, num_beams: int = 1,
                 **_: Any) -> torch.Tensor:
        """(B, T + new) greedy continuations of left-padded `input_ids`, as `transformers`' generate
        returns them; `stopping_criteria` are called as transformers calls them (ids, scores)."""
        if do_sample or num_beams != 1:
            raise ValueError(f"the onnxruntime backend generates greedily only (asked do_sample={do_sample}, "
                             f"num_beams={num_beams})")
        eos = eos_token_id if eos_token_id is not None else self.config.eos_token_id
        pad = pad_token_id if pad_token_id is not None else self.config.pad_token_id
        pad = pad if pad is not None else int(np.atleast_1d(eos)[0])
        ids = input_ids.cpu().numpy()
        mask = np.ones_like(ids) if attention_mask is None else attention_mask.cpu().numpy()

        def stop(sequences: np.ndarray, scores: np.ndarray) -> np.ndarray:
            seq, sc = torch.from_numpy(sequences), torch.from_numpy(scores)
            return np.any([np.broadcast_to(np.asarray(c(seq, sc)), (len(seq),)) for c in stopping_criteria], axis=0)

        out = greedy_generate(self.decoder, ids, mask, max_new_tokens, eos, pad, min_new_tokens,
                              stop if stopping_criteria else None)
        return torch.from_numpy(out)

    def parameters(self) -> Iterator[torch.Tensor]:
        """The weight initializers of the graph as CPU tensors, read one at a time (external data
        from its file); what num_parameters and model_bytes count."""
        import onnx
        from onnx import numpy_helper

        proto = onnx.load(str(self.decoder.path), load_external_data=False)
        for init in proto.graph.initializer:
            if onnx.TensorProto.DataType.Name(init.data_type) in _WEIGHT_TYPES and len(init.dims) >= 1:
                yield torch.from_numpy(numpy_helper.to_array(init, base_dir=str(self.directory)).copy())

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(())
