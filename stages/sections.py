"""Typed settings: one frozen dataclass per config section, built from the validated section.

The fields are the section's keys in workflow/schemas/config.schema.yaml with their types and no
defaults: `Section.of(section)` completes what it is given with the schema's defaults
(`stages.schema.complete`), checks it there (ConfigError naming the key), and only then builds
the object, so the schema stays the one source of defaults and of the rules on values.
`tests/unit/test_sections.py` keeps the fields and their types equal to the schema's.

A section is also a read-only mapping (`section["max_steps"]`, `.get`, `.items()`: what meta.json
and a run's fingerprint iterate over); code reads attributes:

    lora = LoraSettings.of({"max_steps": 20})    # every other finetune.lora key at its default
    lora.learning_rate, lora["lora_rank"]
    lora.replace(max_steps=40)                   # checked again; as does lora | {"max_steps": 40}

`training_section(mapping)` is the typed training section of a plain mapping (the class chosen by
its keys): the training engine and the memory planner convert what their callers give them once,
with it, and read attributes below.

Torch-free.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from stages import schema

S = TypeVar("S", bound="Section")


@dataclasses.dataclass(frozen=True)
class Section(Mapping[str, Any]):
    """Base of the typed sections; SECTION names the section (a key of stages.schema.SECTIONS)."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def of(cls: type[S], section: Mapping[str, Any] | None = None) -> S:
        """`section` completed with the schema's defaults and checked (ConfigError naming the key)."""
        if type(section) is cls:
            return section  # type: ignore[return-value]
        return cls(**schema.complete(section, cls.SECTION))  # complete() copies what it is given

    def replace(self: S, **changes: Any) -> S:
        """A copy with `changes`, checked against the schema like the original."""
        return type(self).of({**self, **changes})

    def __or__(self: S, other: Mapping[str, Any]) -> S:
        """`section | {"max_steps": 40}`: as for a dict, the other's values win; checked like replace."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.replace(**other)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (deep copy), in field order: what meta.json records."""
        return {key: copy.deepcopy(getattr(self, key)) for key in self}

    def __getitem__(self, key: str) -> Any:
        if key not in _field_names(type(self)):
            raise KeyError(f"{key!r} is not a {schema.key_of(self.SECTION)} setting")
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_field_names(type(self)))

    def __len__(self) -> int:
        return len(_field_names(type(self)))


@functools.cache
def _field_names(cls: type[Section]) -> dict[str, None]:
    """A section class's field names in order (a dict: ordered, O(1) membership), computed once:
    the training loop reads its section by key every step."""
    return dict.fromkeys(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class ModelSettings(Section):
    SECTION: ClassVar[str] = "model"
    flavour: str
    model_name_or_path: str | None
    hidden_size: int | None
    intermediate_size: int | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    tie_word_embeddings: bool | None
    num_experts: int | None  # a mixture of experts' (moe-* flavours)
    num_experts_per_tok: int | None
    router_aux_loss_coef: float | None
    router_z_loss_coef: float | None
    moe_capacity_factor: float | None


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
    SECTION: ClassVar[str] = "data"
    corpus: list[str]
    sft: str
    preference: str | None  # null: the builtin pairs with the builtin task (stages.data.validate.preference_source)
    vocab_size: int
    chat_template: bool
    validation_fraction: float
    num_sft_train: int
    num_sft_dev: int
    seed: int


@dataclasses.dataclass(frozen=True)
class TrainingSettings(Section):
    """What every training section has: the layout, the optimizer and schedule, checkpointing."""

    world_size: int
    sharding: str
    tensor_parallel_degree: int
    tensor_parallel_output: bool
    sequence_parallel: bool
    context_parallel_degree: int
    context_parallel_mode: str
    pipeline_parallel_degree: int
    expert_parallel_degree: int
    virtual_pp_degree: int
    recompute: bool
    torch_compile: bool
    fp16: bool
    sharding_offload: bool
    unified_checkpoint: bool
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    min_learning_rate: float
    warmup_steps: int
    max_steps: int
    lr_scheduler_type: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    max_grad_norm: float
    seed: int
    logging_steps: int
    bf16: bool | str  # true, false or auto (stages.training.capabilities: resolved_bf16, bf16_choices)
    save_steps: int
    save_total_limit: int
    async_save: bool
    resume_from_checkpoint: bool | str


@dataclasses.dataclass(frozen=True)
class PretrainSettings(TrainingSettings):
    SECTION: ClassVar[str] = "pretrain"
    enabled: bool | None
    max_length: int


@dataclasses.dataclass(frozen=True)
class SftSettings(TrainingSettings):
    """finetune.sft; LoRA and prefix tuning add their adapter's keys."""

    SECTION: ClassVar[str] = "sft"
    src_length: int
    max_length: int
    packing: bool
    eval_steps: int
    eval_with_do_generation: bool
    per_device_eval_batch_size: int
    num_eval_examples: int
    load_best_model_at_end: bool
    metric_for_best_model: str
    mix_ratio: float
    mix_datasets: list[str]
    mix_weights: list[float] | None


@dataclasses.dataclass(frozen=True)
class LoraSettings(SftSettings):
    SECTION: ClassVar[str] = "lora"
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: str | list[str]
    target_parameters: list[str] | None


@dataclasses.dataclass(frozen=True)
class PrefixSettings(SftSettings):
    SECTION: ClassVar[str] = "prefix"
    num_prefix_tokens: int
    prefix_init: str
    prefix_projection: bool
    prefix_projection_hidden_size: int | None


@dataclasses.dataclass(frozen=True)
class AlignSettings(TrainingSettings):
    """align: preference alignment (stages.align) of `source`, full or with LoRA."""

    SECTION: ClassVar[str] = "align"
    enabled: bool
    source: str
    method: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    tuning: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: str | list[str]
    target_parameters: list[str] | None
    src_length: int
    max_length: int
    per_device_eval_batch_size: int
    mix_ratio: float
    mix_datasets: list[str]
    mix_weights: list[float] | None


@dataclasses.dataclass(frozen=True)
class QuantizeSettings(Section):
    SECTION: ClassVar[str] = "quantize"
    source: str
    variants: list[str]
    custom_variants: dict[str, Any]
    group_size: int
    gptq: dict[str, Any]
    a8w8: dict[str, Any]
    awq: dict[str, Any]
    calibration: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ExportSettings(Section):
    SECTION: ClassVar[str] = "export"
    opset_version: int
    rtol: float
    min_top1_agreement: float
    int8: bool
    int8_block_size: int


@dataclasses.dataclass(frozen=True)
class DeploySettings(Section):
    SECTION: ClassVar[str] = "deploy"
    gguf: list[str]
    compressed_tensors: list[str]
    min_top1_agreement: dict[str, float]


@dataclasses.dataclass(frozen=True)
class EvaluateSettings(Section):
    SECTION: ClassVar[str] = "evaluate"
    max_new_tokens: int
    num_dev_examples: int
    num_preference_pairs: int
    ppl_max_length: int
    ppl_max_windows: int
    per_device_eval_batch_size: int
    speed_prefill_tokens: int
    speed_batch_sizes: list[int]
    speed_decode_tokens: int
    speed_repeats: int
    lm_eval_tasks: list[str]
    lm_eval_include_path: str | None
    lm_eval_limit: int | None
    lm_eval_num_fewshot: int | None


@dataclasses.dataclass(frozen=True)
class ClusterSettings(Section):
    SECTION: ClassVar[str] = "cluster"
    gpus_per_node: int
    device_memory_gb: float | None
    node_memory_gb: float | None
    tasks_per_node: int | None
    cpus_per_task: int
    partition: str | None
    account: str | None
    runtime_minutes: dict[str, Any]


# section name (stages.schema.SECTIONS) -> its class; `predict` is stages.predict.PredictSettings
BY_NAME: dict[str, type[Section]] = {cls.SECTION: cls for cls in (
    ModelSettings, DataSettings, PretrainSettings, SftSettings, LoraSettings, PrefixSettings, AlignSettings,
    QuantizeSettings, ExportSettings, DeploySettings, EvaluateSettings, ClusterSettings)}
FINETUNE: dict[str, type[SftSettings]] = {"sft": SftSettings, "lora": LoraSettings, "prefix": PrefixSettings}


def training_section(section: Mapping[str, Any]) -> TrainingSettings:
    """`section` as a typed training section: itself when it is one; a mapping completed and checked
    (`Section.of`) as the first of finetune.sft, finetune.lora, finetune.prefix and pretrain that
    has every key it has. So a LoRA or prefix key picks that method, `enabled` pretraining, and keys
    that every training section has finetune.sft's defaults for the rest (one device, no sharding);
    an unknown key is a ConfigError naming it. The training engine and the memory planner take
    typed sections and convert what their callers give them once, here."""
    if isinstance(section, TrainingSettings):
        return section
    for cls in (SftSettings, LoraSettings, PrefixSettings, PretrainSettings, AlignSettings):
        if all(key in _field_names(cls) for key in section):
            return cls.of(section)
    return SftSettings.of(section)  # the ConfigError naming the unknown key
