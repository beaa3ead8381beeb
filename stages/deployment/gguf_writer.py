"""A Hugging Face-layout checkpoint written as a GGUF file (llama.cpp's format): f32, f16, q8_0, q4_0.

Contract: `write_gguf(model_dir, out_path, file_type)` reads `model_dir` (config.json through
`stages.checkpoint.hf.load_config`, weights through the safetensors loader, never pickle, and the
tokenizer through `stages.deployment.gguf_tokenizer`), writes `out_path` atomically, and returns
metrics. The file loads in llama.cpp and in transformers' GGUF reader
(`from_pretrained(dir, gguf_file=...)`); `stages.checkpoint.gguf` reads it back.

What is written, following llama.cpp's convert_hf_to_gguf.py:
- tensors under llama.cpp's names (`TENSOR_NAMES`); a tied lm_head is omitted (llama.cpp then uses
  token_embd as the output matrix);
- for arch "llama", the rows of attn_q and attn_k permuted per head from Hugging Face's rotate-half
  RoPE layout to llama.cpp's interleaved one (`permute_qk`, the inverse of what transformers' and
  our reader undo); Qwen2 (arch "qwen2", NEOX RoPE in llama.cpp) is written unpermuted, with its
  q/k/v biases;
- 1-D tensors (norms, biases, llama3 rope factors) in f32 whatever the file type, as the converter
  keeps them; 2-D ones in the file type. A matrix whose rows are not a whole number of 32-weight
  blocks falls back to f16 (the converter's fallback). q4_0 keeps the output matrix (token_embd when
  tied) at q8_0: llama-quantize keeps it at q6_K, for which the gguf package has no quantizer;
- hyperparameters under `{arch}.*`, rope scaling "linear" as metadata and "llama3" as the
  `rope_freqs` tensor (how llama.cpp's converter expresses it);
- Mixtral (a mixture of experts) as llama.cpp's converter writes it: arch "llama" with
  `expert_count` and `expert_used_count`, the router as `ffn_gate_inp` (kept f32, as the converter
  keeps it) and each layer's experts stacked into 3-D `ffn_gate_exps` (w1), `ffn_up_exps` (w3) and
  `ffn_down_exps` (w2), expert-major; llama.cpp routes them as Mixtral does (softmax, top k, the k
  weights renormalised), dropless;
- Qwen3 as arch "qwen3" and Qwen3-MoE as arch "qwen3moe" (NEOX RoPE: unpermuted), with their per-head
  q/k norms as `attn_q_norm` / `attn_k_norm` and the head width as `attention.key_length` where it is
  not hidden / heads; Qwen3-MoE's experts stacked as Mixtral's, their width as
  `expert_feed_forward_length`, routed by softmax and top k with the k weights renormalised;
- Qwen2-MoE as arch "qwen2moe" and OLMoE as arch "olmoe" (NEOX RoPE in llama.cpp: unpermuted), their
  experts stacked the same way, routed by softmax and top k without renormalising; Qwen2-MoE with its
  q/k/v biases, each expert's width as `expert_feed_forward_length` and its shared expert as
  `ffn_{gate,up,down}_shexp` (width `expert_shared_feed_forward_length`) scaled by
  sigmoid(`ffn_gate_inp_shexp`, stored 1-D f32 as llama.cpp declares it); OLMoE with its q/k norms
  over the whole projections as `attn_q_norm` / `attn_k_norm`. Both architectures require an
  `output` matrix, so a tied head is written out as a copy of token_embd.

Refused by name (ValueError): other model types than llama / mistral / qwen2 / qwen3 / mixtral /
qwen2_moe / qwen3_moe / olmoe (those our config reader does not take by config.json's own check; GLM
and GLM-4, which it takes, by `gguf_arch`: llama.cpp has architectures of their own for them, not
written here), a mixture of experts trained with a capacity factor (llama.cpp runs every routed
token), Qwen2-MoE or OLMoE with `norm_topk_prob` (their llama.cpp graphs never renormalise) and
Qwen3-MoE without it (its graph always does), Qwen2-MoE and Qwen3-MoE with dense layers
(`decoder_sparse_step` > 1 or `mlp_only_layers`), OLMoE with `clip_qkv` or grouped KV heads, Qwen3,
Qwen3-MoE and OLMoE with attention biases (their graphs' biases are not tested here), llama
attention/MLP biases, sliding windows shorter than the context (llama.cpp's llama and qwen2 attend to
the whole context), rope types other than default / linear / llama3 (llama3 on arch llama only), and
tokenizers GGUF cannot describe (see gguf_tokenizer). Qwen3 and Qwen3-MoE are checked through
transformers' GGUF loader only: the llama.cpp in the tests predates both architectures.

    python -m stages.deployment.gguf_writer --model results/sft --out model.q8_0.gguf --type q8_0
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.checkpoint.atomic import atomic_file
from stages.checkpoint.gguf_names import TENSOR_NAMES, permute_qk
from stages.checkpoint.hf import load_config, load_state_dict
from stages.deployment.gguf_tokenizer import gguf_tokenizer
from stages.deployment.gguf_types import GGUF_MODEL_TYPES
from stages.model.config import LlamaConfig
from stages.model.rope_types import rope_type

log = logging.getLogger(__name__)

FILE_TYPES = ("f32", "f16", "q8_0", "q4_0")
# The routed experts: one tensor per projection and layer, the experts stacked along a new first dimension
EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",  # Mixtral's names
                "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# llama.cpp's graphs of these architectures read an output matrix even when the checkpoint ties it
OUTPUT_REQUIRED = ("qwen2moe", "olmoe")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
SKIPPED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed by every reader


def gguf_arch(config: LlamaConfig) -> str:
    """llama.cpp's architecture for a config: "qwen2" for Qwen2, "llama" for Llama and Mistral (as
    llama.cpp's converter writes Mistral), after refusing what llama.cpp would run differently."""
    if config.model_type not in GGUF_MODEL_TYPES:
        raise ValueError(f"model_type={config.model_type!r} is not written to GGUF by this writer; supported: "
                         f"{', '.join(GGUF_MODEL_TYPES)}. llama.cpp has architectures of their own for GLM and "
                         "GLM-4 (a fused gate_up_proj, partial interleaved RoPE), which this writer does not "
                         "implement; deploy this model as ONNX or compressed-tensors instead")
    if config.moe and config.moe_capacity_factor is not None:
        raise ValueError(f"moe_capacity_factor={config.moe_capacity_factor}: llama.cpp runs every token on its "
                         "chosen experts (no capacity), so it would compute other outputs than this model; "
                         "set moe_capacity_factor: null in config.json to deploy it dropless")
    _refuse_what_llama_cpp_computes_otherwise(config)
    if config.model_type == "llama" and (config.attention_bias or config.mlp_bias):
        raise ValueError(f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias}: Llama biases "
                         "are not written by this GGUF writer (not implemented: the q/k biases would need the "
                         "RoPE permutation too, and no checkpoint here has them to test against)")
    context = config.max_position_embeddings
    short = [(i, w) for i, w in enumerate(config.layer_windows()) if w is not None and w < context]
    if short:
        raise ValueError(f"layer {short[0][0]} has sliding_window={short[0][1]} < max_position_embeddings="
                         f"{context}; llama.cpp's {config.model_type} attends to the whole context, so it "
                         "would compute other outputs on long inputs")
    arch = config.family.gguf_arch
    kind = rope_type(config.rope_scaling)
    if kind not in ("default", "linear", "llama3") or (kind == "llama3" and arch != "llama"):
        raise ValueError(f"rope_type={kind!r} on model_type={config.model_type!r} is not written to GGUF; "
                         "supported: default, linear, and llama3 for llama/mistral")
    return arch


def _refuse_what_llama_cpp_computes_otherwise(config: LlamaConfig) -> None:
    """Qwen3, Qwen2-MoE, Qwen3-MoE and OLMoE settings llama.cpp's qwen3 / qwen2moe / qwen3moe / olmoe
    graphs do not compute (ValueError)."""
    if config.model_type not in ("qwen3", "qwen2_moe", "qwen3_moe", "olmoe"):
        return
    arch = config.family.gguf_arch
    if config.model_type in ("qwen2_moe", "olmoe") and config.norm_topk_prob:
        raise ValueError(f"norm_topk_prob=true on model_type={config.model_type!r}: llama.cpp's {arch} graph "
                         "weights the top-k experts by their softmax probabilities without renormalising them, so "
                         "it would compute other outputs than this model")
    if config.model_type == "qwen3_moe" and not config.norm_topk_prob:
        raise ValueError("norm_topk_prob=false on model_type='qwen3_moe': llama.cpp's qwen3moe graph renormalises "
                         "the top-k experts' weights to sum to one, so it would compute other outputs than this model")
    if config.model_type in ("qwen2_moe", "qwen3_moe") and not all(config.sparse_layers()):
        raise ValueError(f"decoder_sparse_step={config.decoder_sparse_step}, mlp_only_layers="
                         f"{config.mlp_only_layers}: llama.cpp's {arch} graph runs a sparse block in every layer; "
                         "a mixture with dense layers is not written to GGUF")
    if config.model_type in ("qwen3", "qwen3_moe", "olmoe") and config.attention_bias:
        raise ValueError(f"attention_bias=true on model_type={config.model_type!r}: attention biases of llama.cpp's "
                         f"{arch} graph are not written by this GGUF writer (not tested here)")
    if config.model_type == "olmoe":
        if config.clip_qkv is not None:
            raise ValueError(f"clip_qkv={config.clip_qkv}: llama.cpp's olmoe graph does not clamp q, k and v, so "
                             "it would compute other outputs than this model")
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError(f"num_key_value_heads={config.num_key_value_heads} < num_attention_heads="
                             f"{config.num_attention_heads}: llama.cpp's olmoe graph holds its k norm at the full "
                             "width (no grouped KV heads)")


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name of a Hugging Face parameter; None for buffers readers recompute."""
    if hf_name.endswith(SKIPPED):
        return None
    match = _LAYER.match(hf_name)
    key = f"model.layers.{{i}}.{match.group(2)}" if match else hf_name
    if key not in TENSOR_NAMES:
        raise ValueError(f"parameter {hf_name!r} has no llama.cpp tensor name; this writer maps "
                         "Llama/Mistral/Qwen2/Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE decoder parameters only")
    return TENSOR_NAMES[key].format(i=match.group(1)) if match else TENSOR_NAMES[key]


def llama3_rope_factors(config: LlamaConfig) -> torch.Tensor:
    """(head_dim/2,) per-frequency divisors of llama3 RoPE scaling, as convert_hf_to_gguf.py computes
    the `rope_freqs` tensor (llama.cpp divides each base frequency by its factor)."""
    s, dim = config.rope_scaling, config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def add_hparams(writer: Any, config: LlamaConfig, file_type: str) -> None:
    """The `{arch}.*` and `general.*` keys llama.cpp reads for this config."""
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.moe:  # Mixtral, OLMoE: feed_forward_length above is each expert's width
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if config.moe_intermediate_size is not None:  # Qwen2-MoE, Qwen3-MoE: the experts' own width
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if rope_type(config.rope_scaling) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(config.rope_scaling["factor"]))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tensor_type(name: str, shape: tuple[int, ...], file_type: str, tied: bool) -> str:
    """The GGML type a tensor is stored in: "f32", "f16", "q8_0" or "q4_0" (see the module docstring)."""
    if len(shape) == 1 or file_type == "f32" or name.endswith("ffn_gate_inp.weight"):  # norms, biases, routers
        return "f32"
    if file_type != "f16" and shape[-1] % 32:
        return "f16"
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    return "q8_0" if file_type == "q4_0" and is_output else file_type


def encode(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, Any, float]:
    """(data for GGUFWriter.add_tensor, its raw GGML type or None, relative RMS error of the stored
    values against `weight`)."""
    import gguf

    array = weight.detach().to(torch.float32).numpy()
    if kind == "f32":
        return array, None, 0.0
    if kind == "f16":
        data, stored = array.astype(np.float16), array.astype(np.float16).astype(np.float32)
        qtype = None
    else:
        qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
        data = gguf.quants.quantize(array, qtype)
        stored = gguf.quants.dequantize(data, qtype)
    norm = float(np.linalg.norm(array)) or 1.0
    return data, qtype, float(np.linalg.norm(stored - array)) / norm


def gguf_tensors(state: dict[str, torch.Tensor], config: LlamaConfig, arch: str) -> dict[str, torch.Tensor]:
    """llama.cpp name -> tensor, Q/K permuted for arch llama, the tied head dropped (written out as a copy
    of the embedding for the architectures in OUTPUT_REQUIRED), llama3 rope factors added."""
    tied = config.tie_word_embeddings
    if not tied and "lm_head.weight" not in state:
        raise ValueError("lm_head.weight is missing and tie_word_embeddings is false")
    if tied and arch in OUTPUT_REQUIRED:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        tied = False
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, projection) -> expert -> weight
    for hf_name, tensor in state.items():
        match = _EXPERT.match(hf_name)
        if match:
            layer, expert, projection = match.groups()
            experts.setdefault((layer, projection), {})[int(expert)] = tensor
            continue
        name = gguf_name(hf_name)
        if name is None or (tied and name == "output.weight"):
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            tensor = permute_qk(tensor, heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            tensor = tensor.reshape(-1)  # (1, hidden) -> (hidden,): llama.cpp declares it 1-D
        out[name] = tensor
    for (layer, projection), by_expert in experts.items():
        if sorted(by_expert) != list(range(config.num_experts)):
            raise ValueError(f"layer {layer}: experts {sorted(by_expert)} of {projection}, expected 0 to "
                             f"{config.num_experts - 1}")
        out[f"blk.{layer}.{EXPERT_NAMES[projection]}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if rope_type(config.rope_scaling) == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    return out


def write_gguf(model_dir: str | Path, out_path: str | Path, file_type: str) -> dict[str, Any]:
    """Write the checkpoint in `model_dir` to `out_path` (replaced atomically) with 2-D weights in
    `file_type` (one of FILE_TYPES). Returns metrics: arch, file_type, bytes, tensor counts per
    stored type, the pre-tokenizer name, vocabulary size, the largest and mean relative RMS error of
    the stored weights, write_seconds."""
    import gguf

    start = time.perf_counter()
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type={file_type!r} is not supported; choose one of {', '.join(FILE_TYPES)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = load_config(model_dir)
    arch = gguf_arch(config)
    vocab = gguf_tokenizer(model_dir, config.vocab_size)
    tensors = gguf_tensors(load_state_dict(model_dir), config, arch)

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_name(model_dir.resolve().name)
    add_hparams(writer, config, file_type)
    vocab.write(writer)
    kinds, errors = Counter(), []
    tied_in_file = config.tie_word_embeddings and arch not in OUTPUT_REQUIRED  # token_embd is the output matrix
    for name, tensor in tensors.items():
        kind = tensor_type(name, tuple(tensor.shape), file_type, tied_in_file)
        data, raw_dtype, error = encode(tensor, kind)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        kinds[kind] += 1
        if tensor.dim() > 1:
            errors.append(error)
    with atomic_file(out_path, "wb") as f:
        # GGUFWriter opens its own path; handing it our temporary file instead is the state its
        # open_output_file accepts as "already open" (EMPTY with fout set).
        writer.fout, writer.state = [f], gguf.gguf_writer.WriterState.EMPTY
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=sum(t.numel() for t in tensors.values()) > 500_000_000)
    metrics = {
        "arch": arch, "file_type": file_type, "gguf_bytes": out_path.stat().st_size,
        "tensor_types": dict(kinds), "pre_tokenizer": vocab.pre, "vocab_size": config.vocab_size,
        "max_relative_error": max(errors, default=0.0), "mean_relative_error": float(np.mean(errors or [0.0])),
        "write_seconds": round(time.perf_counter() - start, 2),
    }
    log.info("wrote %s (%s, %.1f MB) in %.1f s", out_path, file_type, metrics["gguf_bytes"] / 1e6,
             metrics["write_seconds"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.deployment.gguf_writer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True,
                        help="Hugging Face-layout checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--out", type=Path, required=True, help="output .gguf file (replaced atomically)")
    parser.add_argument("--type", dest="file_type", choices=FILE_TYPES, default="f16",
                        help="storage type of the 2-D weights (1-D tensors stay f32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return write_gguf(args.model, args.out, args.file_type)


if __name__ == "__main__":
    main()
