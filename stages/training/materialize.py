"""Each rank holds only its own slice of the model: built on the meta device, filled after slicing.

A training rank used to build the whole fp32 model in host memory and then keep its
tensor/pipeline-parallel slice: a 70B model is 276 GB per rank, 2.2 TB for 8 ranks of a node.
Here our model is built on the meta device (shapes, no memory), `stages.training.parallelize` slices it
there exactly as it slices a real one (tensor-parallel modules take meta slices, a pipeline rank
keeps its own stages), and `materialize` then allocates only this rank's parameters and fills
them from a weight source, one whole tensor at a time, sliced along the parameter's
`partition_dim` for this rank's tensor-parallel coordinate. The host memory of a rank is its slice
plus the largest single tensor of the model.

Weight sources, each giving the whole tensors by single-device name:
- `SeededInit`: the weights `LlamaForCausalLM.init_weights` draws from a seed, drawn in the same
  order from the same generator, so the result is bit-identical to `build_model(config, seed)`
  followed by slicing (every rank draws every tensor and keeps its own: time, not memory).
- `CheckpointWeights`: the tensors of a local Hugging Face directory (ours or a real Llama/Qwen2/
  Mistral), after the checks of `stages.checkpoint.weights`, read one at a time.
- `ResumeWeights`: the master weights of the checkpoint a run resumes from (and, for an adapter
  run, its frozen base from the base's source).

An adapter (LoRA factors, prefix keys/values) attached to a lazy model is created real, with its
usual initial values from the global RNG; only the meta parameters are filled.

`lazy_model(config, source)` is the full model on the meta device with its source attached; the
engine materializes such a model after parallelising it (`engine.setup`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from stages.checkpoint.hf import load_config
from stages.checkpoint.weights import check_model_dir, open_safetensors, read_header, read_tensor
from stages.model import LlamaConfig, LlamaForCausalLM, build_model
from stages.model.gpt2_layout import from_hf, our_name
from stages.parallel.tensor import partition_chunks, partition_dim, shard_tensor


def lazy_model(config: LlamaConfig, source: "WeightSource | None" = None, *,
               seed: int | None = None) -> LlamaForCausalLM:
    """Our model on the meta device, to be filled from `source` (or from `seed`'s initialisation)."""
    model = build_model(config, device="meta")
    model.weight_source = source if source is not None else SeededInit(model, seed)
    return model


def lazy_pretrained(model_dir: str | Path, families: str = "ours") -> LlamaForCausalLM:
    """`stages.checkpoint.hf.load_pretrained`, deferred: the model on the meta device, its tensors
    read from `model_dir` when this rank's slice is known. The directory is checked now (config,
    safetensors files, tensor names against the model), so a bad input fails before any slicing.
    `families` as for `stages.checkpoint.hf.load_config` ("all": GPT-2 too, for pretraining)."""
    config = load_config(model_dir, families)
    model = build_model(config, device="meta")
    model.weight_source = CheckpointWeights(model_dir, model)
    return model


def is_lazy(model: nn.Module) -> bool:
    return getattr(model, "weight_source", None) is not None and any(p.is_meta for p in model.parameters())


class WeightSource:
    """Whole tensors by single-device name, for `materialize`."""

    def tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:  # pragma: no cover - interface
        raise NotImplementedError


class SeededInit(WeightSource):
    """`LlamaForCausalLM.init_weights(torch.Generator().manual_seed(seed))`, one tensor at a time:
    the model's `init_order`, recorded by name from the full meta model before it is sliced, drawn
    from the same generator. A tied lm_head draws again into the embedding's tensor, as
    `init_weights` does (the second draw is the one that stays)."""

    def __init__(self, model: LlamaForCausalLM, seed: int | None):
        if seed is None:
            raise ValueError("SeededInit needs a seed: the initialisation must repeat on every rank")
        self.seed, self.std = seed, model.config.initializer_range
        names = {id(p): name for name, p in model.named_parameters()}  # a tied lm_head: the embedding's name
        self.order = [(names[id(param)], param.shape, kind) for param, kind in model.init_order()]

    def tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        for name, shape, kind in self.order:
            if kind == "normal":
                full = torch.empty(shape).normal_(0.0, self.std, generator=generator)
            else:
                full = torch.zeros(shape) if kind == "zeros" else torch.ones(shape)
            if name in names:
                yield name, full


class CheckpointWeights(WeightSource):
    """The tensors of an HF-layout directory, by our name, read one at a time (converted to fp32;
    GPT-2's names and Conv1D weights translated by `stages.model.gpt2_layout`)."""

    def __init__(self, model_dir: str | Path, model: LlamaForCausalLM):
        self.model_dir = Path(model_dir)
        self.gpt2 = model.config.gpt2_blocks
        self.where: dict[str, tuple[Path, str]] = {}  # our name -> (file, its key there)
        for path in check_model_dir(self.model_dir):
            for key in read_header(path):
                ours = self._our_name(key) if key != "__metadata__" else None
                if ours is not None:
                    self.where[ours] = (path, key)
        expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        if model.config.tie_word_embeddings and "model.embed_tokens.weight" in self.where:
            self.where.setdefault("lm_head.weight", self.where["model.embed_tokens.weight"])
        missing, unexpected = sorted(expected - set(self.where)), sorted(set(self.where) - expected)
        if missing or unexpected:
            raise ValueError(f"{self.model_dir}: checkpoint does not match the config: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]}")

    def _our_name(self, key: str) -> str | None:
        if not self.gpt2:
            return key

        try:
            return our_name(key)
        except KeyError:
            return key  # reported as unexpected

    def tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name in sorted(names):
            by_file.setdefault(self.where[name][0], []).append(name)
        for path, names_here in by_file.items():
            with open_safetensors(path) as handle:
                for name in names_here:
                    key = self.where[name][1]
                    tensor = read_tensor(handle, path, key).float()
                    if self.gpt2:  # GPT-2's name and Conv1D layout -> ours (a tied lm_head: the embedding)
                        tensor = from_hf({key: tensor})[self._our_name(key)]
                    yield name, tensor


class ResumeWeights(WeightSource):
    """The master weights of a checkpoint (`stages.training.checkpointing.StateReader`); the
    tensors it does not hold (an adapter run's frozen base) from `base`."""

    def __init__(self, reader, base: WeightSource):
        self.reader, self.base = reader, base

    def tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        saved = {name for name in names if self.reader.has(name)}
        for name in sorted(saved):
            yield name, self.reader.get(name).float()
        yield from self.base.tensors(names - saved)


def _allocate(module: nn.Module) -> None:
    """Replace every meta parameter by an uninitialised CPU one of the same shape, keeping its
    attributes (`partition_dim`, `tensor_model_parallel`, `requires_grad`) and ties (one new tensor
    per old one)."""
    new: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in new:
                fresh = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
                fresh.__dict__.update(param.__dict__)
                new[id(param)] = fresh
            sub._parameters[key] = new[id(param)]
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise ValueError(f"buffer {key!r} of {type(sub).__name__} is on the meta device: materialize "
                                 "fills parameters only")


def materialize(module: nn.Module, source: WeightSource, names: dict[str, str] | None = None,
                tp_rank: int = 0, tp: int = 1) -> None:
    """Allocate this rank's meta parameters of the sliced `module` on the CPU and fill them from
    `source`: the whole tensor of each parameter's single-device name (`names` maps local names,
    e.g. a pipeline rank's chunks, to those), sliced along its `partition_dim` for `tp_rank` of
    `tp`. Parameters that are already real (an adapter's, created with their initial values) are
    kept. Raises ValueError for a parameter the source does not give."""
    names = names or {}
    lazy = {local for local, param in module.named_parameters() if param.is_meta}
    _allocate(module)
    targets = {names.get(local, local): param for local, param in module.named_parameters() if local in lazy}
    filled: set[str] = set()
    with torch.no_grad():
        for name, full in source.tensors(set(targets)):
            param = targets[name]
            dim = partition_dim(param)
            split = dim is not None and tp > 1
            local = shard_tensor(full, dim, tp_rank, tp, partition_chunks(param)) if split else full
            if local.shape != param.shape:
                raise ValueError(f"{name}: the source's tensor {tuple(full.shape)} gives {tuple(local.shape)} on "
                                 f"tensor-parallel rank {tp_rank} of {tp}, the model holds {tuple(param.shape)}")
            param.copy_(local)
            filled.add(name)
    missing = sorted(set(targets) - filled)
    if missing:
        raise ValueError(f"{type(source).__name__} gives no tensor for {missing[:5]} ({len(missing)} in all)")
