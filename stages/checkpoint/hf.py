"""Hugging Face layout on disk: config.json, safetensors (sharded with an index when large),
generation_config.json and the tokenizer files, loadable by `AutoModelForCausalLM.from_pretrained`
with no project code. Weights are read with safetensors only (no pickle), through the checks of
`stages.checkpoint.weights`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from stages.checkpoint import weights
from stages.checkpoint.atomic import write_json
from stages.checkpoint.tokenizer_files import copy_tokenizer
from stages.checkpoint.source import FAMILIES
from stages.model import LlamaConfig, LlamaForCausalLM, build_model, gpt2_layout

WEIGHTS_NAME, INDEX_NAME = weights.WEIGHTS_NAME, weights.INDEX_NAME


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    return shards


def save_state_dict(state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write tensors as model.safetensors, or numbered shards plus an index when larger than a shard."""
    # safetensors refuses shared storage (tied weights); HF drops lm_head when tied, so do we.
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    write_json(out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of an HF-layout directory (single file or sharded with an index), after
    the checks of `stages.checkpoint.weights` (meta.json's sha256, no pickle, whole files)."""
    return weights.load_state_dict(model_dir)


def save_pretrained(
    model: LlamaForCausalLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Save our model in HF layout into `out_dir` (which must exist; callers use `atomic_dir`)."""
    out_dir = Path(out_dir)
    config: LlamaConfig = model.config
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_state_dict(to_hf_layout(state, config), out_dir)
    save_config(config, out_dir, dtype)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)


def save_config(config: LlamaConfig, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json (HF names; the source checkpoint's fields and layout, see `LlamaConfig.to_hf_dict`)
    and generation_config.json. The dtype of the stored weights goes into whichever of `dtype`
    (transformers 5) and `torch_dtype` (4, still read by 5) the config has, `torch_dtype` if neither."""
    hf = config.to_hf_dict()
    for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["torch_dtype"]:
        hf[key] = str(dtype).removeprefix("torch.")
    write_json(Path(out_dir) / "config.json", hf)
    write_json(Path(out_dir) / "generation_config.json", {
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "do_sample": False,
    })


def to_hf_layout(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict in the names and layouts transformers' class of `config` reads (the same
    dict for the Llama families; GPT-2's names and Conv1D weights, stages.model.gpt2_layout)."""
    return gpt2_layout.to_hf(state) if config.gpt2_blocks else state


def from_hf_layout(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_layout`."""
    return gpt2_layout.from_hf(state) if config.gpt2_blocks else state


def load_config(model_dir: str | Path, families: str = "ours") -> LlamaConfig:
    """The LlamaConfig of an HF checkpoint directory; ValueError naming config.json's path and the
    key for any field our model cannot honour (see stages.model.config), and for a family the chain
    runs on transformers' model (`stages.checkpoint.source.FAMILIES`, e.g. GPT-2) unless `families`
    is "all" (our model reads GPT-2 too: pretraining and full SFT ask for it, `Family.trains_ours`)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; expected a Hugging Face checkpoint directory")
    d = json.loads(path.read_text())
    if families != "all":
        family = FAMILIES.get((d.get("architectures") or [None])[0])
        if family is not None and not family.ours:
            raise ValueError(f"{path}: {family.name} ({d['architectures'][0]}) runs on transformers' model in this "
                             "chain (stages.checkpoint.source.FAMILIES)")
    return LlamaConfig.from_hf_dict(d, source=path)


def load_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    families: str = "ours") -> LlamaForCausalLM:
    """Build our model from an HF-layout directory (ours or a real checkpoint of a family we
    implement; `families` as for `load_config`)."""
    config = load_config(model_dir, families)
    model = build_model(config, device="meta")
    state = from_hf_layout(load_state_dict(model_dir), config)
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: checkpoint does not match the config: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype)
