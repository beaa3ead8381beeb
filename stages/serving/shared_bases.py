"""Several models loaded for one server, the adapters of one base sharing one copy of its weights.

Loaded one by one, a LoRA adapter and a prefix-tuning adapter of `pretrain`, with `pretrain`
served too, would hold three copies of the same base weights (load_variant loads an adapter's base
from disk). Here each distinct base (its resolved directory) is loaded once: the served model when
the base is served itself, else a model of its own that no id answers as. Each adapter then gets
its own module tree, since peft injects LoRA's layers into the tree it is given and the served base
must stay without them, whose parameters and buffers are the base's very tensors (`sharing_copy`).
Sharing is safe because nothing writes to them: the server only runs inference, and peft keeps
LoRA's weights beside the base layer, never merged into it.

Full models (sft, lora-merged, quantized variants) have weights of their own and load as before.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from stages.inference.loading import adapter_base_dir, load_variant
from stages.serving.served_model import ServedModel, load_served_model
from stages.serving.variants import ModelSpec

log = logging.getLogger(__name__)


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A new module tree of `model` whose parameters and buffers are `model`'s own tensors (no
    weight is copied): a deepcopy with every tensor entered in its memo beforehand, so the copy
    takes the original wherever the tree holds one (tied embeddings stay tied)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def is_adapter_dir(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file()


def load_served_models(specs: Sequence[ModelSpec], *, chat_template: str = "auto",
                       max_length: int | None = None) -> list[ServedModel]:
    """A ServedModel for each spec, in the specs' order; adapters of the same base share its
    weights (module docstring)."""
    loaded: dict[Path, torch.nn.Module] = {}  # resolved model dir -> a loaded full model adapters may share
    served: dict[str, ServedModel] = {}
    for spec in sorted(specs, key=lambda s: is_adapter_dir(s.model_dir)):  # full models first: a served base is shared
        if not is_adapter_dir(spec.model_dir):
            served[spec.model_id] = load_served_model(spec.model_dir, model_id=spec.model_id,
                                                      chat_template=chat_template, max_length=max_length)
            loaded.setdefault(spec.model_dir.resolve(), served[spec.model_id].model)
            continue
        base_dir = adapter_base_dir(spec.model_dir).resolve()
        if base_dir not in loaded:
            log.info("loading %s once as the base of the adapters served", base_dir)
            loaded[base_dir] = load_variant(base_dir)[0]
        served[spec.model_id] = load_served_model(spec.model_dir, model_id=spec.model_id, chat_template=chat_template,
                                                  max_length=max_length, base_model=sharing_copy(loaded[base_dir]))
    return [served[spec.model_id] for spec in specs]


def weight_bytes(models: Sequence[torch.nn.Module]) -> tuple[int, int]:
    """(bytes of the tensors of `models` summed model by model, bytes of the distinct storages among
    them): what the models would hold each in a process of its own, against what they hold together."""
    separate, together = 0, {}
    for model in models:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in itertools.chain(model.parameters(), model.buffers())}
        separate += sum(storages.values())
        together.update(storages)
    return separate, sum(together.values())
