"""The memory plan of an experiment: per-device memory of every training rule, checked against the
declared device memory before anything runs, and the SLURM resources derived from it.

    python -m stages.plan --experiment llama [--configfile extra.yaml ...] [--out results/llama/plan.json]

For each training rule (pretrain; finetune sft, lora, prefix; align when enabled) the memory model of
stages/planning/memory.py gives the bytes one device holds in the rule's layout: parameters,
gradients and optimizer state under its ZeRO stage and offload, activations with or without
recompute and the pipeline's in-flight micro-batches, TP-sharded and replicated parts. A layout that
does not fit `cluster.device_memory_gb` (GPU ranks) or `cluster.node_memory_gb` (CPU ranks) is a
ConfigError naming the rule's key, the numbers and the nearest layout that fits: the workflow runs
this check when it is parsed (workflow/rules/common.smk), so `snakemake` and `snakemake -n` refuse
such a layout before submitting anything. The `plan` rule writes results/<name>/plan.json, which
every training rule reads: it logs the planned memory beside the peak it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

from stages.checkpoint.atomic import write_json
from stages.checkpoint.source import read_source_config
from stages.cluster.resources import RUNTIME_ALLOWANCE_BYTES, rank_layout, single_process_resources
from stages.cluster.resources import training_resources
from stages.config import ConfigError, architecture, check_config, experiment, load_yaml
from stages.config import merge, pretrain_enabled
from stages.planning.memory import estimate_memory, host_build_bytes, nearest_fitting_layout, parameter_count
from stages.sections import FINETUNE, AlignSettings, LoraSettings, PrefixSettings, PretrainSettings, TrainingSettings
from stages.sections import training_section
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger("stages.plan")

GB = 1e9
# A GPU's memory is not all the tensors': the CUDA context, cuBLAS/NCCL workspaces and the caching
# allocator's fragmentation take their share, which the memory model does not count.
GPU_RESERVED_FRACTION = 0.10
LAYOUT_KEYS = ("world_size", "tensor_parallel_degree", "sequence_parallel", "context_parallel_degree",
               "context_parallel_mode", "pipeline_parallel_degree", "expert_parallel_degree",
               "virtual_pp_degree", "sharding", "sharding_offload", "recompute", "per_device_train_batch_size",
               "gradient_accumulation_steps", "max_length", "bf16", "fp16")
METHOD_TRAINS = {"sft": "full", "lora": "lora", "prefix": "prefix"}


def model_shape(exp: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(architecture fields, vocabulary size): the starting checkpoint's config.json, else the
    flavour with its overrides and data.vocab_size."""
    path = exp["model"]["model_name_or_path"]
    if path:
        source = read_source_config(path)
        return source, int(source["vocab_size"])
    return architecture(exp["model"]), int(exp["data"]["vocab_size"])


def training_sections(name: str, exp: dict[str, Any]) -> list[tuple[str, str, TrainingSettings, str]]:
    """(rule job name, config key, typed section, what is trained) of every training job of the experiment."""
    jobs = []
    if pretrain_enabled(exp):
        jobs.append(("pretrain", f"experiments.{name}.pretrain", PretrainSettings.of(exp["pretrain"]), "full"))
    for method, section in exp["finetune"].items():
        jobs.append((f"finetune_{method}", f"experiments.{name}.finetune.{method}", FINETUNE[method].of(section),
                     METHOD_TRAINS[method]))
    align = exp.get("align")  # the plan rule's JSON has it only when enabled
    if align and align["enabled"]:  # each micro-batch of pairs runs a chosen and a rejected row per pair
        jobs.append(("align", f"experiments.{name}.align", AlignSettings.of(align), align["tuning"]))
    return jobs


def _adapter_sizes(section: TrainingSettings, trained: str) -> dict[str, Any]:
    lora = trained == "lora" and isinstance(section, (LoraSettings, AlignSettings))
    return {"lora_rank": section.lora_rank if lora else None,
            "num_prefix_tokens": section.num_prefix_tokens
            if trained == "prefix" and isinstance(section, PrefixSettings) else None}


def _usable_per_rank(exp: dict[str, Any], section: TrainingSettings, key: str) -> tuple[float | None, str]:
    """The bytes one rank may hold and where that limit comes from (None: nothing declared)."""
    cluster = exp["cluster"]
    if cluster["gpus_per_node"]:
        if cluster["device_memory_gb"] is None:
            return None, ""
        return (cluster["device_memory_gb"] * GB * (1 - GPU_RESERVED_FRACTION),
                f"cluster.device_memory_gb={cluster['device_memory_gb']:g}, less {GPU_RESERVED_FRACTION:.0%} for the "
                "CUDA context, workspaces and fragmentation")
    if cluster["node_memory_gb"] is None:
        return None, ""
    per_node = rank_layout(exp, section, key).tasks_per_node
    usable = cluster["node_memory_gb"] * GB / per_node - RUNTIME_ALLOWANCE_BYTES
    return usable, (f"cluster.node_memory_gb={cluster['node_memory_gb']:g} shared by {per_node} CPU ranks per node, "
                    f"{RUNTIME_ALLOWANCE_BYTES / GB:.1f} GB each for the runtime")


def estimate_job(exp: dict[str, Any], section: Mapping[str, Any], trained: str) -> dict[str, Any]:
    """One training job's layout and planned per-device memory (what its training rule reads);
    `section` typed, or a mapping (`stages.sections.training_section`)."""
    section = training_section(section)
    arch, vocab = model_shape(exp)
    device = "cuda" if exp["cluster"]["gpus_per_node"] else "cpu"
    estimate = estimate_memory(arch, section, vocab_size=vocab, trained=trained, device=device,
                               **_adapter_sizes(section, trained))
    return {
        "trained": trained,
        "device": device,
        "layout": {k: getattr(section, k) for k in LAYOUT_KEYS},
        "data_parallel_degree": section.world_size // (section.tensor_parallel_degree * section.pipeline_parallel_degree
                                                       * section.context_parallel_degree),
        "per_device_bytes": estimate.as_dict(),
        "per_device_total_gb": round(estimate.total / GB, 3),
    }


def plan_job(name: str, exp: dict[str, Any], key: str, section: Mapping[str, Any], trained: str) -> dict[str, Any]:
    """The plan of one training job: its estimate, whether it fits the declared memory, the host
    memory of a rank and the SLURM resources."""
    section = training_section(section)
    entry = {"key": key, **estimate_job(exp, section, trained)}
    bytes_ = entry["per_device_bytes"]
    limit, limit_from = _usable_per_rank(exp, section, key)
    arch, vocab = model_shape(exp)
    if entry["device"] == "cpu":
        host_per_rank = bytes_["total"] + bytes_["offloaded"]
    else:  # the fp32 slice a rank builds before the engine moves it to its GPU
        host_per_rank = bytes_["offloaded"] + host_build_bytes(arch, section, vocab_size=vocab)
    rule = "pretrain" if key.endswith(".pretrain") else "align" if key.endswith(".align") else "finetune"
    return {
        **entry,
        "limit_gb": None if limit is None else round(limit / GB, 3),
        "limit_from": limit_from or None,
        "fits": None if limit is None else bytes_["total"] <= limit,
        "host_bytes_per_rank": int(host_per_rank),
        "resources": training_resources(exp, section, key, rule, int(host_per_rank)),
    }


def plan_experiment(name: str, exp: dict[str, Any],
                    sections: list[tuple[str, str, TrainingSettings, str]] | None = None) -> dict[str, Any]:
    """The whole plan of experiment `name` (validated config): model size and every training job
    (`sections`: its `training_sections`, where the caller has them already)."""
    arch, vocab = model_shape(exp)
    parameters = parameter_count(arch, vocab)
    jobs = {job: plan_job(name, exp, key, section, trained)
            for job, key, section, trained in sections or training_sections(name, exp)}
    return {
        "experiment": name,
        "model": {"parameters": parameters, "vocab_size": vocab,
                  "source": exp["model"]["model_name_or_path"] or f"flavour {exp['model']['flavour']}"},
        "cluster": exp["cluster"],
        "jobs": jobs,
        "single_process_mem_mb": single_process_resources(exp, "default", 4 * parameters)["mem_mb"],
    }


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {json.dumps(v)}" for k, v in layout.items())


def _check_host_memory(name: str, exp: dict[str, Any], key: str, section: TrainingSettings,
                       entry: dict[str, Any]) -> None:
    """A GPU job whose ranks on one node need more host memory than `cluster.node_memory_gb`
    (each builds its fp32 slice there before the engine moves it to its GPU, and keeps any
    offloaded optimizer state) is a ConfigError with the numbers."""
    node_gb = exp["cluster"]["node_memory_gb"]
    if entry["device"] != "cuda" or not node_gb:
        return
    per_node = rank_layout(exp, section, key).tasks_per_node
    need = per_node * (entry["host_bytes_per_rank"] + RUNTIME_ALLOWANCE_BYTES)
    if need > node_gb * GB:
        raise ConfigError(
            f"{key}: the {per_node} ranks of a node need {need / GB:.0f} GB of host memory "
            f"({entry['host_bytes_per_rank'] / GB:.1f} GB each: the fp32 slice it builds before moving it to "
            f"its GPU and any offloaded optimizer state, plus {RUNTIME_ALLOWANCE_BYTES / GB:.1f} GB for the "
            f"runtime), more than cluster.node_memory_gb={node_gb:g}; raise tensor_parallel_degree or "
            f"pipeline_parallel_degree, turn sharding_offload off, or declare the nodes' real memory. "
            f"(python -m stages.plan --experiment {name} prints the whole plan)")


def check_plan(name: str, exp: dict[str, Any]) -> dict[str, Any]:
    """The plan, or a ConfigError for the first training job whose layout cannot fit, with the
    estimate's parts, the limit and the nearest layout that fits (or that none does)."""
    sections = training_sections(name, exp)  # typed once: each checks its section against the schema
    plan = plan_experiment(name, exp, sections)
    for job, key, section, trained in sections:
        entry = plan["jobs"][job]
        _check_host_memory(name, exp, key, section, entry)
        if entry["fits"] is not False:
            continue
        parts = ", ".join(f"{part} {entry['per_device_bytes'][part] / GB:.2f}"
                          for part in ("parameters", "gradients", "optimizer", "activations", "buffers"))
        arch, vocab = model_shape(exp)
        limit, _ = _usable_per_rank(exp, section, key)
        per_node = rank_layout(exp, section, key).tasks_per_node
        nearest = nearest_fitting_layout(arch, section, vocab_size=vocab, device_memory=int(limit),
                                         devices_per_node=per_node, trained=trained, device=entry["device"],
                                         **_adapter_sizes(section, trained))
        if nearest:
            trial = section | nearest
            fitted = estimate_memory(arch, trial, vocab_size=vocab, trained=trained, device=entry["device"],
                                     **_adapter_sizes(section, trained)).total
            advice = (f"the nearest layout that fits: {_describe(nearest)} "
                      f"({fitted / GB:.1f} GB per device)")
        else:
            advice = ("no layout of these world_size ranks fits; add devices (world_size) or use devices "
                      "with more memory")
        raise ConfigError(
            f"{key}: the layout needs {entry['per_device_total_gb']:.1f} GB per device "
            f"({parts} GB), more than the {entry['limit_gb']:.1f} GB usable: {entry['limit_from']}; {advice}. "
            f"(python -m stages.plan --experiment {name} prints the whole plan)")
    return plan


def format_plan(plan: dict[str, Any]) -> str:
    """A table of the plan: one line per training job."""
    lines = [f"experiment {plan['experiment']}: {plan['model']['parameters'] / 1e9:.3f}B parameters "
             f"({plan['model']['source']})",
             f"{'job':<16}{'layout (dp x tp x pp, zero)':<32}{'params':>8}{'grads':>8}{'optim':>8}"
             f"{'activ':>8}{'buffers':>8}{'total GB':>10}{'limit':>8}  fits  nodes x tasks  mem/node"]
    for job, entry in plan["jobs"].items():
        lay, b = entry["layout"], entry["per_device_bytes"]
        shape = (f"{entry['data_parallel_degree']}x{lay['tensor_parallel_degree']}x"
                 f"{lay['pipeline_parallel_degree']}, {lay['sharding']}"
                 + (" +offload" if lay.get("sharding_offload") else "") + (" +recompute" if lay.get("recompute") else "")
                 + (" +sp" if lay.get("sequence_parallel") and lay["tensor_parallel_degree"] > 1 else "")
                 + (f" +cp{lay['context_parallel_degree']}" if lay.get("context_parallel_degree", 1) > 1 else "")
                 + (f" +ep{lay['expert_parallel_degree']}" if lay.get("expert_parallel_degree", 1) > 1 else ""))
        res = entry["resources"]
        limit = "-" if entry["limit_gb"] is None else f"{entry['limit_gb']:.1f}"
        fits = {None: "-", True: "yes", False: "NO"}[entry["fits"]]
        lines.append(f"{job:<16}{shape:<32}" + "".join(f"{b[p] / GB:>8.2f}" for p in
                     ("parameters", "gradients", "optimizer", "activations", "buffers"))
                     + f"{entry['per_device_total_gb']:>10.2f}{limit:>8}  {fits:<4}  "
                       f"{res['nodes']} x {res['tasks'] // res['nodes']:<10} {res['mem_mb'] / 1000:.0f} GB")
    return "\n".join(lines)


def load_config(configfiles: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for path in configfiles:
        config = merge(config, load_yaml(path))
    return check_config(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--configfile", action="append", default=None,
                        help="config files merged in order (default: config/config.yaml)")
    parser.add_argument("--experiment-json", default=None,
                        help="the validated experiment as JSON (the plan rule passes it; no config files read)")
    parser.add_argument("--job", default=None,
                        choices=["pretrain", "finetune_sft", "finetune_lora", "finetune_prefix", "align"],
                        help="only this training job's estimate (the file its training rule reads)")
    parser.add_argument("--out", default=None, help="write the plan as JSON here (atomically)")
    args = parser.parse_args(argv)
    configure_logging()
    configfiles = args.configfile or ["config/config.yaml"]
    what = f"the memory plan of {args.job or 'every training job'}"
    source = "--experiment-json" if args.experiment_json else configfiles
    log_io("plan", reads={f"experiment {args.experiment}": source},
           writes={what: [args.out, "stdout"] if args.out else "stdout"}, logger=log)
    try:
        if args.experiment_json:
            exp = json.loads(args.experiment_json)
        else:
            exp = experiment(load_config(configfiles), args.experiment)
        if args.job:
            jobs = {job: (section, trained) for job, _, section, trained in training_sections(args.experiment, exp)}
            if args.job not in jobs:
                raise ConfigError(f"experiment {args.experiment!r} has no training job {args.job!r} "
                                  f"(it has {', '.join(jobs) or 'none'})")
            plan = {"experiment": args.experiment, "job": args.job, **estimate_job(exp, *jobs[args.job])}
        else:
            plan = check_plan(args.experiment, exp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(plan, indent=1) if args.job else format_plan(plan))
    if args.out:
        write_json(args.out, plan)  # atomic, parent directories made
    return 0


if __name__ == "__main__":
    sys.exit(main())
