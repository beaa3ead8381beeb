"""Validation of config/config.yaml against workflow/schemas/config.schema.yaml.

The schema is the one source of truth for defaults. `check_config` runs when Snakemake parses the
workflow, before any job starts: it names an unknown key together with the closest valid one,
reports a wrong type with the key's full path, and fills every missing key with its default.
Every message names the key path; stages/config_sources.py finds the file and line that set it.
Kept free of torch so that parsing the workflow stays fast.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from stages.adapters.targets import expert_parameters_selected
from stages.checkpoint.source import FAMILIES, ModelSourceError, family_of, read_source_config
from stages.config_sources import ConfigSyntaxError, config_keys, display_path, located, yaml_error
from stages.data.validate import check_data_section, preference_source
from stages.deployment.gguf_types import GGUF_MODEL_TYPES
from stages.errors import ConfigError, InputError, run_cli
from stages.model import gpt2_layout
from stages.model.attention_shapes import ulysses_head_conflict
from stages.model.config import FLAVOURS, LlamaConfig, config_for_flavour
from stages.model.moe_layouts import expert_parallel_without_experts, moe_layout_problem
from stages.model.registry import BY_MODEL_TYPE
from stages.quant.variants import resolve_variant
from stages.schema import SCHEMA_PATH, resolve_ref  # noqa: F401 (their users import them from here too)
from stages.schema import check_keys, fill_defaults, load_schema, validate
from stages.sweeps import expand
from stages.training import capabilities  # torch-free until asked about the device



def load_yaml(path: str | Path) -> Any:
    """A config file's content; a YAML syntax error is a ConfigSyntaxError naming `file:line:column`
    (Snakemake's own loader reports only that the file is not valid YAML)."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigSyntaxError(yaml_error(path, e)) from None


def check_yaml_syntax(*paths: str | Path) -> None:
    """`load_yaml` each of `paths` that exists (ConfigSyntaxError with file:line:column)."""
    for path in paths:
        if Path(path).is_file():
            load_yaml(display_path(path))


def _check_warmup(key: str, section: dict[str, Any]) -> None:
    if section["warmup_steps"] > section["max_steps"]:
        raise ConfigError(f"{key}: warmup_steps={section['warmup_steps']} exceeds max_steps={section['max_steps']}")


def _check_lengths(key: str, section: dict[str, Any]) -> None:
    if section["src_length"] >= section["max_length"]:
        raise ConfigError(f"{key}: src_length={section['src_length']} must be smaller than "
                          f"max_length={section['max_length']} (room is needed for the target)")


def _check_relations(name: str, exp: dict[str, Any]) -> None:
    """Constraints between keys that a JSON schema cannot express."""
    for method, section in exp["finetune"].items():
        _check_lengths(f"experiments.{name}.finetune.{method}", section)
    predict = exp["predict"]
    if predict["src_length"] >= predict["max_length"]:
        raise ConfigError(f"experiments.{name}.predict: src_length={predict['src_length']} must be smaller than "
                          f"max_length={predict['max_length']} (prompt + generated tokens)")
    _check_warmup(f"experiments.{name}.pretrain", exp["pretrain"])
    for method, section in exp["finetune"].items():
        _check_warmup(f"experiments.{name}.finetune.{method}", section)


# The align methods that compare the policy with a reference model's log-probs (the score_pairs rule
# writes them once); stages.model.preference_loss.REFERENCE_FREE are the others (torch-side, not
# imported here; tests/unit/test_config.py keeps the two in step).
REFERENCE_METHODS = ("dpo", "ipo")
LABEL_SMOOTHING_METHODS = ("dpo", "simpo")  # the losses with a mislabelled-pair share (the schema's description)


def align_enabled(exp: dict[str, Any]) -> bool:
    """Whether the experiment runs preference alignment (`align.enabled`)."""
    return bool((exp.get("align") or {}).get("enabled"))


def needs_reference(align: dict[str, Any]) -> bool:
    """Whether the align section's method reads the reference model's log-probs (dpo, ipo)."""
    return align["method"] in REFERENCE_METHODS


def check_align_section(key: str, section: dict[str, Any]) -> None:
    """The relations a complete `align` section must keep on its own (for a stage run outside
    Snakemake too); ConfigError naming `key`."""
    _check_lengths(key, section)
    _check_warmup(key, section)
    smoothing, method = section["label_smoothing"], section["method"]
    if smoothing and method not in LABEL_SMOOTHING_METHODS:
        raise ConfigError(f"{key}: label_smoothing={smoothing:g} with method={method}: only "
                          f"{' and '.join(LABEL_SMOOTHING_METHODS)} have a share of mislabelled pairs; set "
                          "label_smoothing: 0 (or method: dpo)")
    mixing = mixing_conflict(section)
    if mixing:
        raise ConfigError(f"{key}: {mixing}")
    experts = expert_lora_conflict(section) if section["tuning"] == "lora" else None
    if experts:
        raise ConfigError(f"{key}: {experts}")
    cp = section["context_parallel_degree"]
    if cp > 1:
        raise ConfigError(f"{key}: context_parallel_degree={cp}: preference alignment sums each sequence's "
                          "log-probability, which a context-parallel split does not yet gather; set "
                          "context_parallel_degree: 1 (tensor_parallel_degree with sequence_parallel also "
                          "splits long sequences' activations)")
    pp = section["pipeline_parallel_degree"]
    if pp > 1 and section["tuning"] == "lora":
        raise ConfigError(f"{key}: pipeline_parallel_degree={pp} with tuning: lora: LoRA trains under data parallel, "
                          "ZeRO and tensor parallelism (its frozen base needs no pipeline to fit; the adapter is "
                          "small); set pipeline_parallel_degree: 1 and use tensor_parallel_degree to split the base, "
                          "or tuning: full")


def expert_lora_conflict(sec: dict[str, Any]) -> str | None:
    """Why a LoRA section's `target_parameters` (LoRA on a mixture of experts' routed experts) cannot
    be trained as written, whatever the model; None when it can (or names none)."""
    names = sec.get("target_parameters")
    if not names:
        return None
    try:
        expert_parameters_selected(names)
    except ValueError as e:
        return str(e)
    if sec["lora_dropout"]:
        return (f"target_parameters={names} with lora_dropout={sec['lora_dropout']:g}: LoRA on the experts' "
                "parameters has no dropout (peft's rule: B A dropout(x) cannot be folded into a weight per "
                "expert); set lora_dropout: 0")
    return None


def _check_expert_lora(key: str, sec: dict[str, Any], exp: dict[str, Any], source: dict[str, Any] | None) -> None:
    """LoRA on experts (`target_parameters`) needs a mixture of experts, on our model."""
    if not sec.get("target_parameters"):
        return
    family = family_of(source) if source is not None else BY_MODEL_TYPE[architecture(exp["model"]).get(
        "model_type", "llama")]
    if not family.moe:
        where = "its checkpoint" if source is not None else f"flavour {exp['model']['flavour']!r}"
        raise ConfigError(f"{key}.target_parameters={sec['target_parameters']}: LoRA on experts needs a mixture "
                          f"of experts, and {where} is {family.name}, a dense model; remove target_parameters "
                          "(target_modules adapts its Linears)")


def check_finetune_section(key: str, method: str, section: dict[str, Any]) -> None:
    """The relations a complete `finetune.<method>` section must keep, as the workflow checks them
    (for a stage run outside Snakemake); ConfigError naming `key`."""
    _check_lengths(key, section)
    _check_warmup(key, section)
    _check_finetune(key, method, section, None)


ARCH_OVERRIDES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "tie_word_embeddings",
                  # a mixture of experts' (the moe-* flavours; refused for a dense one by LlamaConfig)
                  "num_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_z_loss_coef",
                  "moe_capacity_factor")


def architecture(model_section: dict[str, Any]) -> dict[str, Any]:
    """The flavour's architecture fields with the section's non-null overrides applied."""

    arch = dict(FLAVOURS[model_section["flavour"]])
    arch.update({k: model_section[k] for k in ARCH_OVERRIDES if model_section.get(k) is not None})
    arch.setdefault("num_key_value_heads", arch["num_attention_heads"])
    return arch


def _check_architecture(name: str, exp: dict[str, Any]) -> None:
    """The relations our model enforces when it is built (stages/model/config.py), checked for a
    random-init flavour with its overrides, so that a bad head count stops Snakemake with the key
    instead of failing inside the pretrain job."""

    model = exp["model"]
    arch = architecture(model)
    key = f"experiments.{name}.model"

    def named(field: str) -> str:  # the key the user wrote, or the flavour that set the value
        if model.get(field) is not None:
            return f"{key}.{field}={arch[field]}"
        return f"{field}={arch[field]} (flavour {model['flavour']!r})"

    hidden, heads, kv = arch["hidden_size"], arch["num_attention_heads"], arch["num_key_value_heads"]
    if hidden % heads:
        raise ConfigError(f"{named('num_attention_heads')} does not divide {named('hidden_size')}: every "
                          "attention head gets hidden_size / num_attention_heads channels")
    if (hidden // heads) % 2:
        raise ConfigError(f"{named('hidden_size')} / {named('num_attention_heads')} = head_dim {hidden // heads} "
                          "is odd; rotary embeddings rotate pairs of channels, so head_dim must be even")
    if heads % kv:
        raise ConfigError(f"{named('num_key_value_heads')} does not divide {named('num_attention_heads')}: "
                          "grouped-query attention shares each KV head among num_attention_heads / "
                          "num_key_value_heads query heads")
    try:  # every other rule of the model's own config (one source of truth)
        config_for_flavour(model["flavour"], vocab_size=exp["data"]["vocab_size"],
                           **{k: model[k] for k in ARCH_OVERRIDES if model.get(k) is not None})
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_quantize(name: str, exp: dict[str, Any]) -> None:
    """Every listed variant resolves (a known name, its method's settings valid), and the group of
    each group-wise variant fits the flavour's layer widths: round-to-nearest groups must tile every
    input width (AWQ's too), GPTQ groups (a narrower last group is allowed) must not exceed one. Pretrained
    checkpoints are checked again by the quantize stage, which knows their real shapes."""

    quant = exp["quantize"]
    key = f"experiments.{name}.quantize"
    specs = []
    for variant in quant["variants"]:
        try:
            specs.append(resolve_variant(variant, quant))
        except InputError as e:
            raise ConfigError(f"{key}: {e}") from None
    if exp["model"]["model_name_or_path"]:
        return
    arch = architecture(exp["model"])
    widths = sorted({arch["hidden_size"], arch["intermediate_size"]})
    for spec in specs:
        group = spec.settings.get("group_size", -1)
        if group == -1:
            continue
        too_wide = [w for w in widths if group > w]
        bad = [w for w in widths if w % group] if spec.method in ("rtn", "awq") else too_wide
        if bad:
            raise ConfigError(f"{key}: variant {spec.name} has group_size={group}, which "
                              f"{'exceeds' if too_wide else 'does not divide'} the input width(s) {bad} of flavour "
                              f"{exp['model']['flavour']!r}; choose a divisor of {widths} or -1 (per channel)")


def _check_deploy(name: str, exp: dict[str, Any], source: dict[str, Any] | None) -> None:
    """deploy.gguf needs a model the GGUF writer takes (the starting checkpoint's or the flavour's
    model_type); each deploy.compressed_tensors entry is an A8W8 variant of quantize.variants without
    the shift, which the compressed-tensors format cannot express."""

    if exp["deploy"]["gguf"]:
        model_type = (source or FLAVOURS[exp["model"]["flavour"]]).get("model_type", "llama")
        if model_type not in GGUF_MODEL_TYPES:
            what = "the starting checkpoint" if source else f"flavour {exp['model']['flavour']!r}"
            raise ConfigError(f"experiments.{name}.deploy.gguf={exp['deploy']['gguf']}: {what} is model_type "
                              f"{model_type!r}, which the GGUF writer does not write (it writes "
                              f"{', '.join(GGUF_MODEL_TYPES)}); remove deploy.gguf and deploy it as ONNX "
                              "(export/) or compressed-tensors")
        head_dim = (source or {}).get("head_dim")
        if model_type == "qwen3" and head_dim not in (None, 128):
            raise ConfigError(f"experiments.{name}.deploy.gguf={exp['deploy']['gguf']}: the starting checkpoint is a "
                              f"Qwen3 with head_dim={head_dim}, whose GGUF file the deploy stage cannot check: "
                              "transformers' GGUF loader reads a qwen3 file at head_dim 128 only (it ignores "
                              "attention.key_length). Write it with python -m stages.deployment.gguf_writer and "
                              "remove deploy.gguf here")
        capacity = exp["model"].get("moe_capacity_factor")
        if capacity is not None:
            raise ConfigError(f"experiments.{name}.deploy.gguf={exp['deploy']['gguf']}: model.moe_capacity_factor="
                              f"{capacity} drops tokens past an expert's capacity, which llama.cpp does not (it runs "
                              "every token on its chosen experts); set it to null or remove deploy.gguf")

    quant, key = exp["quantize"], f"experiments.{name}.deploy.compressed_tensors"
    for variant in exp["deploy"]["compressed_tensors"]:
        if variant not in quant["variants"]:
            raise ConfigError(f"{key}: {variant!r} is not one of experiments.{name}.quantize.variants "
                              f"{quant['variants']}; add it there or remove it here")
        spec = resolve_variant(variant, quant)
        if spec.method != "a8w8":
            raise ConfigError(f"{key}: {variant!r} is a {spec.method} variant; the compressed-tensors export takes "
                              "A8W8 variants (a8w8, a8w8-static, a8w8-smooth, ...)")
        if spec.settings.get("shift"):
            raise ConfigError(f"{key}: {variant!r} has shift: true, which the compressed-tensors format cannot "
                              "express (no per-channel input shift); deploy an A8W8 variant with shift: false, "
                              "e.g. a8w8-smooth")
        model_type = (source or FLAVOURS[exp["model"]["flavour"]]).get("model_type", "llama")
        family = BY_MODEL_TYPE.get(model_type)
        if family is not None and family.moe:
            raise ConfigError(f"{key}: model_type {model_type!r} is a mixture of experts, whose compressed-tensors "
                              "checkpoint (one int8 Linear per expert) transformers 5.23 cannot load: it fuses the "
                              "experts on load and its converter finds no float weights to fuse; remove "
                              "deploy.compressed_tensors (the A8W8 variants still run and are evaluated)")


def _check_parallel(name: str, exp: dict[str, Any], source: dict[str, Any] | None) -> None:
    """The layouts of pretraining and every fine-tuning method, checked before any process starts
    against the flavour or the starting checkpoint's config.json `source` (the training engine
    checks the real shapes again)."""
    sections = [("pretrain", exp["pretrain"]), *((f"finetune.{m}", sec) for m, sec in exp["finetune"].items())]
    for where, sec in sections:
        _check_layout(f"experiments.{name}.{where}", sec, exp, source,
                      full_training=where in ("pretrain", "finetune.sft"))
    for method, sec in exp["finetune"].items():
        _check_finetune(f"experiments.{name}.finetune.{method}", method, sec, source)
    _check_expert_lora(f"experiments.{name}.finetune.lora", exp["finetune"]["lora"], exp, source)


def ulysses_conflict(sec: dict[str, Any], heads: int | None, kv_heads: int | None) -> str | None:
    """Why Ulysses context parallelism cannot split the heads of a section's layout, or None: cp must
    divide each tensor-parallel rank's query and key-value heads (unknown counts are not checked)."""
    cp = sec["context_parallel_degree"]
    if cp == 1 or sec["context_parallel_mode"] != "ulysses":
        return None
    return ulysses_head_conflict(cp, sec["tensor_parallel_degree"], heads, kv_heads)


def prefix_projection_conflict(sec: dict[str, Any]) -> str | None:
    """Why a `finetune.prefix` section's prefix_projection cannot run in it, or None: the one MLP
    is not split by tensor parallelism, and `prefix_init: tokens` would set what it computes."""
    if not sec.get("prefix_projection"):
        return None
    if sec["tensor_parallel_degree"] > 1:
        return (f"prefix_projection=true with tensor_parallel_degree={sec['tensor_parallel_degree']}: the "
                "projection MLP computes every layer's and KV head's prefix from one table, which tensor "
                "parallelism does not split; set prefix_projection: false (the prefix then splits by KV head) "
                "or train under data parallel and ZeRO")
    if sec.get("prefix_init") == "tokens":
        return ("prefix_init=tokens with prefix_projection=true: `tokens` sets the prefix itself, which a "
                "projection computes from its MLP; use prefix_init: random or prefix_projection: false")
    return None


def mixing_conflict(sec: dict[str, Any]) -> str | None:
    """What is wrong with a fine-tuning or align section's data mixing (mix_ratio, mix_datasets,
    mix_weights), or None."""
    names, weights = sec["mix_datasets"], sec["mix_weights"]
    if weights is not None and len(weights) != len(names):
        return (f"mix_weights has {len(weights)} entries but mix_datasets has {len(names)} ({names}); "
                "give one weight per dataset, or mix_weights: null for equal weights")
    if "builtin:sft_targets" in names:
        return ("mix_datasets lists builtin:sft_targets, the task's own answers, not general text; use corpus "
                "(the pretraining split) or text files")
    return None


def _check_finetune(key: str, method: str, sec: dict[str, Any], source: dict[str, Any] | None) -> None:
    """What a fine-tuning method cannot combine: the pipeline schedule trains full SFT only, and
    neither packs rows nor evaluates; a prefix projection is neither split by TP nor set from
    tokens; the best model needs evaluations of the metric compared."""
    pp = sec["pipeline_parallel_degree"]
    if pp > 1 and method != "sft":
        raise ConfigError(f"{key}: pipeline_parallel_degree={pp}: {method} trains under data parallel, ZeRO and "
                          "tensor parallelism (its frozen base needs no pipeline to fit; the adapter is small); "
                          "set pipeline_parallel_degree: 1 and use tensor_parallel_degree to split the base")
    for flag, what in (("packing", "packed rows (the stages pass hidden states only, not the example "
                                   "boundaries)"), ("eval_steps", "evaluation while training")):
        if pp > 1 and sec[flag]:
            raise ConfigError(f"{key}: {flag}={sec[flag]} with pipeline_parallel_degree={pp}: the pipeline "
                              f"schedule does not support {what}; set pipeline_parallel_degree: 1 or {flag}: "
                              f"{'false' if flag == 'packing' else 0}")
    conflict = prefix_projection_conflict(sec) if method == "prefix" else expert_lora_conflict(sec)
    if conflict:
        raise ConfigError(f"{key}: {conflict}")
    if method == "prefix" and sec["context_parallel_degree"] > 1 and sec["context_parallel_mode"] == "ulysses":
        raise ConfigError(f"{key}: context_parallel_mode=ulysses with prefix tuning: a prefix is per head, which "
                          "Ulysses moves between ranks; use context_parallel_mode: all_gather")
    if method == "prefix" and sec["context_parallel_degree"] > 1 and sec["context_parallel_mode"] == "ring":
        raise ConfigError(f"{key}: context_parallel_mode=ring with prefix tuning: ring attention passes only the "
                          "tokens' keys and values around; use context_parallel_mode: all_gather")
    mixing = mixing_conflict(sec)
    if mixing:
        raise ConfigError(f"{key}: {mixing}")
    if sec["load_best_model_at_end"] and not sec["eval_steps"]:
        raise ConfigError(f"{key}: load_best_model_at_end=true needs eval_steps > 0 (the evaluations it "
                          "chooses from)")
    if sec["metric_for_best_model"] != "eval_loss" and sec["load_best_model_at_end"] \
            and not sec["eval_with_do_generation"]:
        raise ConfigError(f"{key}: metric_for_best_model={sec['metric_for_best_model']} is measured on "
                          "generations: set eval_with_do_generation: true, or use eval_loss")
    if sec["packing"] and source is not None:

        family = family_of(source)
        if not (family.full_training_on_ours if method == "sft" else family.ours):
            ours = ", ".join(f.name for f in FAMILIES.values() if f.ours)
            raise ConfigError(f"{key}: packing=true with a {family.name} checkpoint: packed rows need the "
                              f"project's own model ({ours}), whose attention keeps the examples apart; set "
                              "packing: false")


def pretrain_enabled(exp: dict[str, Any]) -> bool:
    """Whether the experiment pretrains: `pretrain.enabled`, where null means "only when there is no
    starting checkpoint" (a random-init flavour must be pretrained; a checkpoint is fine-tuned as is)."""
    enabled = exp["pretrain"]["enabled"]
    return not exp["model"]["model_name_or_path"] if enabled is None else bool(enabled)


def sharded_output(pretrain: dict[str, Any]) -> bool:
    """Whether pretraining writes tensor/pipeline-parallel slices (for the `merge_tp` rule) instead of
    the HF layout: unified_checkpoint off with tensor or pipeline parallelism."""
    return not pretrain["unified_checkpoint"] and (pretrain["tensor_parallel_degree"] > 1
                                                   or pretrain["pipeline_parallel_degree"] > 1)


def finetune_source(exp: dict[str, Any]) -> str:
    """The artifact fine-tuning starts from: `pretrain` when pretraining runs, else `base`."""
    return "pretrain" if pretrain_enabled(exp) else "base"


def _check_model_source(name: str, exp: dict[str, Any]) -> dict[str, Any] | None:
    """A starting checkpoint is checked here, before any job: it exists, holds config.json, a
    supported architecture, safetensors weights and a tokenizer; and the experiment's other keys
    agree with it (no pretraining without weights to start from, a quantize source that exists).
    Returns its config.json (None without a starting checkpoint)."""

    path = exp["model"]["model_name_or_path"]
    key = f"experiments.{name}.model.model_name_or_path"
    if path is None:
        if exp["pretrain"]["enabled"] is False:
            raise ConfigError(f"experiments.{name}.pretrain.enabled=false needs {key}: a random-init model "
                              "must be pretrained before it can be fine-tuned")
        if exp["quantize"]["source"] == "base":
            raise ConfigError(f"experiments.{name}.quantize.source=base needs {key} (the imported checkpoint)")
        return None
    try:
        source = read_source_config(path, key)
    except ModelSourceError as e:  # every message names the key (family_of names only the file)
        raise ConfigError(str(e) if str(e).startswith(key) else f"{key}={path!r}: {e}") from None
    family = family_of(source)
    if exp["pretrain"]["enabled"] and not family.full_training_on_ours:
        pretrainable = ", ".join(f.name for f in FAMILIES.values() if f.full_training_on_ours)
        raise ConfigError(f"experiments.{name}.pretrain.enabled=true with a {family.name} checkpoint: "
                          f"continued pretraining runs on the project's own model ({pretrainable}); "
                          "fine-tune it directly (pretrain.enabled: null)")
    if family.full_training_on_ours:  # our model must honour every field, or refuse it now (imports torch)

        try:
            LlamaConfig.from_hf_dict(source, source=f"{path}/config.json")
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if exp["quantize"]["source"] == "pretrain" and not pretrain_enabled(exp):
        raise ConfigError(f"experiments.{name}.quantize.source=pretrain, but pretraining is skipped for a "
                          f"starting checkpoint; use source: base (the checkpoint as imported), lora-merged or "
                          f"sft, or set pretrain.enabled: true for continued pretraining")
    return source


def _check_device(key: str, sec: dict[str, Any]) -> None:
    """Mixed precision this machine cannot run is refused here, not inside the job. Skipped with
    LLM_LIFECYCLE_DEVICE_CHECK=0 (a SLURM login node without the compute nodes' GPU)."""
    if os.environ.get("LLM_LIFECYCLE_DEVICE_CHECK", "1") == "0" or not (sec["fp16"] or sec["bf16"] is True):
        return

    for flag, reason in (("fp16", sec["fp16"] and capabilities.fp16_unsupported_reason()),
                         ("bf16", sec["bf16"] is True and capabilities.bf16_unsupported_reason())):
        if reason:
            raise ConfigError(f"{key}.{flag}=true: {reason}")


def _check_layout(key: str, sec: dict[str, Any], exp: dict[str, Any], source: dict[str, Any] | None,
                  full_training: bool = False) -> None:
    world, tp, pp, vpp = (sec["world_size"], sec["tensor_parallel_degree"], sec["pipeline_parallel_degree"],
                          sec["virtual_pp_degree"])
    cp = sec["context_parallel_degree"]
    if world % (tp * cp * pp):
        raise ConfigError(f"{key}: world_size={world} is not divisible by tensor_parallel_degree={tp} x "
                          f"context_parallel_degree={cp} x pipeline_parallel_degree={pp} = {tp * cp * pp}; the "
                          "data-parallel degree is world_size / (tp x cp x pp)")
    ep = sec["expert_parallel_degree"]
    if (world // (tp * cp * pp)) % ep:
        raise ConfigError(f"{key}: expert_parallel_degree={ep} does not divide the data-parallel degree "
                          f"world_size / (tp x cp x pp) = {world // (tp * cp * pp)}: expert parallelism splits "
                          "the data-parallel ranks")
    if pp > 1 and sec["sharding"] in ("stage2", "stage3"):
        raise ConfigError(f"{key}: sharding={sec['sharding']} with pipeline_parallel_degree={pp}: ZeRO-2/3 "
                          "partition gradients during backward, which the pipeline schedule runs outside "
                          "DeepSpeed; use sharding: stage1 (or none) with pipeline parallelism")
    if sec["bf16"] and sec["fp16"]:
        raise ConfigError(f"{key}: bf16={str(sec['bf16']).lower()} and fp16=true; choose one mixed-precision mode")
    if pp > 1 and sec["fp16"]:
        raise ConfigError(f"{key}: fp16 with pipeline_parallel_degree={pp}: fp16's loss scaling lives in "
                          "DeepSpeed's backward, which the pipeline schedule bypasses; use bf16 or fp32")
    _check_device(key, sec)
    if sec["sharding_offload"] and sec["sharding"] == "none":
        raise ConfigError(f"{key}: sharding_offload needs a ZeRO stage (sharding: stage1, stage2 or stage3)")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{key}: virtual_pp_degree={vpp} needs pipeline_parallel_degree > 1")
    accum = sec["gradient_accumulation_steps"]
    if pp > 1 and accum < pp:
        raise ConfigError(f"{key}: gradient_accumulation_steps={accum} (the pipeline's micro-batches) must be "
                          f">= pipeline_parallel_degree={pp} for the 1F1B schedules")
    if vpp > 1 and accum % max(1, accum // pp):
        raise ConfigError(f"{key}: interleaved 1F1B needs gradient_accumulation_steps={accum} to be a "
                          f"multiple of gradient_accumulation_steps // pipeline_parallel_degree = {accum // pp}")
    if source is not None:
        _check_layout_for_source(key, sec, source, full_training)
        return
    arch = architecture(exp["model"])
    layers = arch["num_hidden_layers"]
    model_type = arch.get("model_type", "llama")
    problem = moe_layout_problem(model_type, tp, pp, cp, sec["sequence_parallel"], ep=ep,
                                 num_experts=arch.get("num_experts"), sharding=sec["sharding"],
                                 capacity_factor=exp["model"].get("moe_capacity_factor")) \
        if BY_MODEL_TYPE[model_type].moe else expert_parallel_without_experts(ep, model_type)
    if problem:
        raise ConfigError(f"{key}: {problem} (flavour {exp['model']['flavour']!r})")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = arch[field]
        if value % tp:
            raise ConfigError(f"{key}: tensor_parallel_degree={tp} does not divide {field}={value} of flavour "
                              f"{exp['model']['flavour']!r}")
    conflict = ulysses_conflict(sec, arch["num_attention_heads"], arch["num_key_value_heads"])
    if conflict:
        raise ConfigError(f"{key}: {conflict} of flavour {exp['model']['flavour']!r}")
    vocab = exp["data"]["vocab_size"]
    if vocab % tp:
        raise ConfigError(f"{key}: tensor_parallel_degree={tp} does not divide data.vocab_size={vocab}: the "
                          "embedding and lm_head are split by vocabulary rows (not padded); choose a multiple "
                          f"of {tp}")
    if pp * vpp > layers:
        raise ConfigError(f"{key}: pipeline_parallel_degree={pp} x virtual_pp_degree={vpp} = {pp * vpp} "
                          f"chunks exceed num_hidden_layers={layers} of flavour {exp['model']['flavour']!r}")
    if pp > 1 and arch.get("tie_word_embeddings"):
        raise ConfigError(f"{key}: flavour {exp['model']['flavour']!r} ties lm_head to the embedding, which "
                          "pipeline parallelism does not support yet (they would live on two stages)")


def _check_layout_for_source(key: str, sec: dict[str, Any], source: dict[str, Any], full_training: bool) -> None:
    """Tensor/pipeline parallelism needs our own model (every stage of the families it implements,
    pretraining and full SFT also for GPT-2) and degrees that divide the checkpoint's real head
    counts and layers."""

    tp, pp, cp = sec["tensor_parallel_degree"], sec["pipeline_parallel_degree"], sec["context_parallel_degree"]
    ep = sec["expert_parallel_degree"]
    if tp == 1 and pp == 1 and cp == 1 and ep == 1:
        return
    family = family_of(source)
    experts = source.get("num_local_experts", source.get("num_experts"))
    problem = moe_layout_problem(family.model_type, tp, pp, cp, sec["sequence_parallel"], ep=ep, num_experts=experts,
                                 sharding=sec["sharding"]) if family.moe else \
        expert_parallel_without_experts(ep, family.model_type)
    if problem:
        raise ConfigError(f"{key}: {problem}")
    if not (family.full_training_on_ours if full_training else family.ours):
        ours = ", ".join(f.name for f in FAMILIES.values() if f.ours)
        also = [f.name for f in FAMILIES.values() if f.trains_ours and not f.ours]
        raise ConfigError(f"{key}: tensor_parallel_degree={tp} / pipeline_parallel_degree={pp} / "
                          f"context_parallel_degree={cp} with a "
                          f"{family.name} checkpoint: model parallelism runs on the project's own model "
                          f"({ours}; for pretraining and full SFT also {', '.join(also)}); {family.name} "
                          f"{'trains adapters' if family.trains_ours else 'trains'} through transformers with "
                          "data parallel and ZeRO (world_size + sharding) only")
    if family.model_type == "gpt2":  # GPT2Config's own key names, and its defaults
        source = {field: source.get(key, gpt2_layout.DEFAULTS[key]) for key, field in gpt2_layout.CONFIG_KEYS.items()}
    heads = source.get("num_attention_heads")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = source.get(field, heads if field == "num_key_value_heads" else None)
        if value is not None and value % tp:
            raise ConfigError(f"{key}: tensor_parallel_degree={tp} does not divide {field}={value} of the "
                              "starting checkpoint")
    conflict = ulysses_conflict(sec, heads, source.get("num_key_value_heads", heads))
    if conflict:
        raise ConfigError(f"{key}: {conflict} of the starting checkpoint")
    layers = source.get("num_hidden_layers")
    if layers is not None and pp * sec["virtual_pp_degree"] > layers:
        raise ConfigError(f"{key}: pipeline_parallel_degree={pp} x virtual_pp_degree={sec['virtual_pp_degree']} "
                          f"chunks exceed num_hidden_layers={layers} of the starting checkpoint")
    if pp > 1 and source.get("tie_word_embeddings"):
        raise ConfigError(f"{key}: the starting checkpoint ties lm_head to the embedding, which pipeline "
                          "parallelism does not support yet (they would live on two stages)")


def align_source_missing(name: str, exp: dict[str, Any]) -> str | None:
    """Why the experiment does not make `align.source`, or None: `base` needs a starting checkpoint,
    `pretrain` a pretraining run."""
    source, key = exp["align"]["source"], f"experiments.{name}.align.source"
    if source == "base" and not exp["model"]["model_name_or_path"]:
        return (f"{key}=base needs experiments.{name}.model.model_name_or_path (the imported checkpoint); a "
                "random-init model is aligned after fine-tuning: use source: sft or lora-merged")
    if source == "pretrain" and not pretrain_enabled(exp):
        return (f"{key}=pretrain, but experiment {name!r} does not pretrain (pretrain.enabled is "
                f"{str(exp['pretrain']['enabled']).lower()} with model.model_name_or_path); use source: base "
                "(the checkpoint as imported), sft or lora-merged, or set pretrain.enabled: true")
    return None


def _check_align(name: str, exp: dict[str, Any], source: dict[str, Any] | None) -> None:
    """The align section of an experiment that runs it (its source exists in the experiment, its
    relations and layout hold), and a quantize.source of `align` that can be quantized."""
    key = f"experiments.{name}.align"
    align = exp["align"]
    quantized = exp["quantize"]["source"]
    if quantized in ("align", "align-merged"):
        if not align["enabled"]:
            raise ConfigError(f"experiments.{name}.quantize.source={quantized} needs {key}.enabled: true (the "
                              "aligned model it quantizes)")
        if quantized == "align" and align["tuning"] == "lora":
            raise ConfigError(f"experiments.{name}.quantize.source=align with {key}.tuning=lora: the aligned "
                              "variant is then a LoRA adapter, which quantize, export and deploy do not take; "
                              "set quantize.source: align-merged (the adapter folded into align.source)")
        if quantized == "align-merged" and align["tuning"] != "lora":
            raise ConfigError(f"experiments.{name}.quantize.source=align-merged with {key}.tuning={align['tuning']}: "
                              "only a LoRA alignment is merged; set quantize.source: align")
    if not align["enabled"]:
        return
    missing = align_source_missing(name, exp)
    if missing:
        raise ConfigError(missing)
    data = exp["data"]
    if preference_source(data["preference"], data["sft"]) is None:
        raise ConfigError(f"{key}.enabled=true needs preference pairs, and experiment {name!r} has none: "
                          f"data.preference is null with data.sft {data['sft']!r} (the builtin pairs are made "
                          "of the builtin task); set data.preference to a directory of pairs (train.json and "
                          "dev.json, one {\"src\", \"chosen\", \"rejected\"} per line)")
    check_align_section(key, align)
    _check_layout(key, align, exp, source, full_training=align["tuning"] == "full")
    if align["tuning"] == "lora":
        _check_expert_lora(key, align, exp, source)


def _check_evaluate(name: str, exp: dict[str, Any]) -> None:
    """lm-eval's lifecycle_pairs needs the preference pairs it is built from."""
    data = exp["data"]
    if "lifecycle_pairs" in exp["evaluate"]["lm_eval_tasks"] and preference_source(data["preference"],
                                                                                   data["sft"]) is None:
        raise ConfigError(f"experiments.{name}.evaluate.lm_eval_tasks names lifecycle_pairs, built from the "
                          f"preference dev pairs, and experiment {name!r} has none (data.preference is null with "
                          f"data.sft {data['sft']!r}); drop the task or set data.preference to a directory of pairs")


def check_config(config: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate `config` and return a copy with every default filled in.

    Raises ConfigError naming the offending key: unknown keys (with the closest valid name),
    wrong types or values, and inconsistent combinations.
    """
    schema = schema or load_schema()
    config = copy.deepcopy(config)
    if not isinstance(config, dict) or "experiments" not in config:
        raise ConfigError("the config has no 'experiments' mapping; see config/config.yaml for the layout")
    check_keys(config, schema, schema, [])
    fill_defaults(config, schema, schema)
    validate(config, schema)
    for name, exp in config["experiments"].items():
        _check_relations(name, exp)
        source = _check_model_source(name, exp)
        if source is None:
            _check_architecture(name, exp)
        _check_quantize(name, exp)
        _check_deploy(name, exp, source)
        _check_parallel(name, exp, source)
        _check_align(name, exp, source)
        _check_evaluate(name, exp)
    return config


def experiment(config: dict[str, Any], name: str) -> dict[str, Any]:
    """One experiment's settings, with a clear error for an unknown name."""
    experiments = config["experiments"]
    if name not in experiments:
        close = difflib.get_close_matches(name, list(experiments), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"experiment {name!r} is not in config 'experiments'{hint} "
                          f"(defined: {', '.join(sorted(experiments))})")
    return experiments[name]


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` deep-merged into a copy of `base`, as Snakemake merges several --configfile files."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def main(argv: list[str] | None = None) -> int:
    """Check config files without Snakemake: YAML syntax (file:line:column), then the merged config
    as the workflow checks it (sweeps expanded), each mistake at the file and line that set it."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m stages.config", description=main.__doc__)
    parser.add_argument("configfiles", nargs="+", help="config files, merged in order as Snakemake's --configfile")
    args = parser.parse_args(argv)

    merged: dict[str, Any] = {}
    try:
        for path in args.configfiles:
            content = load_yaml(path)
            if not isinstance(content, dict):
                raise ConfigError(f"{path}: a config file is a mapping (experiments: ...), not {type(content).__name__}")
            merged = merge(merged, content)
        for name, exp in check_config(expand(merged)[0])["experiments"].items():
            check_data_section(exp["data"], name, Path.cwd())  # as the workflow does, relative to the cwd
    except ValueError as e:  # ConfigError, DataConfigError: at the file and line, as the workflow says it
        print(located(e, config_keys([], args.configfiles, None)), file=sys.stderr)
        return 1
    print(f"{', '.join(args.configfiles)}: valid ({', '.join(merged['experiments'])})")
    return 0


if __name__ == "__main__":
    run_cli(main, "config")

