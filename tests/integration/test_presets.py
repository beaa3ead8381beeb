"""The cluster presets (config/presets/*.yaml) as a user tries them: `snakemake -n` through the slurm
profile lists every job with its nodes, tasks, GPUs, memory and time limit, and the planner accepts
each preset's layouts and refuses a 70B layout that cannot fit 80 GB devices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from workflow_helpers import ROOT, planned_jobs, snakemake

from stages.config import ConfigError, check_config, load_yaml
from stages.plan import check_plan

PRESETS = ROOT / "config" / "presets"
PROFILE = ROOT / "workflow" / "profiles" / "slurm"
# Llama-2-7b-hf's config.json (meta-llama/Llama-2-7b-hf), for a checkpoint directory the dry run can
# parse: the preset names models/Llama-2-7b-hf, whose weights a dry run never reads.
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}
CASES = {
    "llama2-7b-sft-lora-gptq.yaml": ("llama2-7b", "results/llama2-7b/quant_eval.json",
                                     {"finetune": 3, "merge_lora": 1, "quantize": 3, "plan_job": 3, "plan": 1}),
    "llama2-13b-pretrain.yaml": ("llama2-13b", "results/llama2-13b/pretrain", {"pretrain_sharded": 1, "merge_tp": 1, "plan_job": 1}),
    "llama2-70b-pretrain.yaml": ("llama2-70b", "results/llama2-70b/pretrain", {"pretrain_sharded": 1, "merge_tp": 1, "plan_job": 1}),
}


def _fake_7b_checkpoint(workdir: Path) -> None:
    model = workdir / "models" / "Llama-2-7b-hf"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(LLAMA2_7B))
    (model / "model.safetensors").write_bytes(b"")  # never read by a dry run
    (model / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("preset", sorted(CASES))
def test_a_preset_dry_runs_through_the_slurm_profile_with_its_resources(tmp_path, preset):
    name, target, expected = CASES[preset]
    _fake_7b_checkpoint(tmp_path)
    proc = snakemake(tmp_path, "--configfile", str(PRESETS / preset), "--workflow-profile", str(PROFILE),
                     "-n", target)
    jobs = planned_jobs(proc.stdout)
    for rule, count in expected.items():
        assert jobs.get(rule) == count, (rule, jobs)
    blocks = re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=\n\n)", proc.stdout, re.M | re.S)
    assert len(blocks) == sum(jobs.values())
    local = {"plan", "plan_job", "deploy_manifest"}  # local rules: a JSON file each, where Snakemake runs
    for rule, block in blocks:
        if rule in local:  # no cluster resources asked for
            assert "nodes=" not in re.search(r"resources: (.*)", block).group(1), (rule, block)
            continue
        resources = dict(re.findall(r"(\w+)=([^,\s]+)", re.search(r"resources: (.*)", block).group(1)))
        for key in ("nodes", "tasks", "mem_mb", "runtime", "cpus_per_task"):
            assert key in resources, (rule, resources)
        if rule in ("pretrain_sharded", "finetune"):
            assert resources["gres"] == "gpu:8" and resources["tasks_per_gpu"] == "1"
    training = [dict(re.findall(r"(\w+)=([^,\s]+)", re.search(r"resources: (.*)", b).group(1)))
                for r, b in blocks if r in ("pretrain_sharded", "finetune")]
    world = {"llama2-7b": 8, "llama2-13b": 64, "llama2-70b": 128}[name]
    assert all(int(r["tasks"]) == world and int(r["nodes"]) == world // 8 for r in training)


def _preset_experiment(preset: str, name: str, **pretrain) -> dict:
    config = load_yaml(PRESETS / preset)
    config["experiments"][name]["pretrain"].update(pretrain)
    return check_config(config)["experiments"][name]


def test_the_planner_refuses_a_70b_layout_that_cannot_fit_80gb_and_names_one_that_does():
    # tp 8 alone: 8.6B parameters per GPU with their bf16 gradients and ZeRO-1 optimizer shard
    with pytest.raises(ConfigError) as err:
        check_plan("llama2-70b", _preset_experiment("llama2-70b-pretrain.yaml", "llama2-70b", world_size=64,
                                                    pipeline_parallel_degree=1, virtual_pp_degree=1,
                                                    recompute=False, sequence_parallel=False,
                                                    gradient_accumulation_steps=8))
    message = str(err.value)
    print(message)
    assert message.startswith("experiments.llama2-70b.pretrain: the layout needs")
    assert "more than the 72.0 GB usable: cluster.device_memory_gb=80, less 10%" in message
    assert "the nearest layout that fits: sequence_parallel: true" in message
    plan = check_plan("llama2-70b", _preset_experiment("llama2-70b-pretrain.yaml", "llama2-70b"))
    job = plan["jobs"]["pretrain"]
    print(json.dumps({k: job[k] for k in ("per_device_total_gb", "limit_gb", "fits")}))
    assert job["fits"] is True and job["per_device_total_gb"] < 72


def test_the_planner_refuses_ranks_whose_host_memory_exceeds_the_node():
    # each of the 8 ranks of a node builds its fp32 slice of 70B at tp 8 (34.5 GB) plus the largest
    # tensor before moving it to its GPU: ~300 GB a node
    exp = _preset_experiment("llama2-70b-pretrain.yaml", "llama2-70b")
    plan = check_plan("llama2-70b", exp)
    assert 9 < plan["jobs"]["pretrain"]["host_bytes_per_rank"] / 1e9 < 11  # tp 8 x pp 4: a 32nd, not 276 GB
    exp["cluster"]["node_memory_gb"] = 200
    with pytest.raises(ConfigError) as err:
        check_plan("llama2-70b", exp)
    message = str(err.value)
    print(message)
    assert message.startswith("experiments.llama2-70b.finetune.sft: the 8 ranks of a node need 296 GB of host memory")
    assert "more than cluster.node_memory_gb=200" in message


def long_sequence_experiment(pretrain: dict, device_memory_gb: int, node_memory_gb: int) -> dict:
    """A validated Llama-2-7B experiment pretraining in `pretrain`'s layout on nodes of 8 GPUs,
    fine-tuning on one node with tp 8 and sequence parallelism."""
    exp = {"model": {"flavour": "7b"}, "data": {"vocab_size": 32000}, "pretrain": pretrain,
           "finetune": {method: dict(world_size=8, tensor_parallel_degree=8, sequence_parallel=True, bf16=True,
                                     recompute=True, max_length=2048, src_length=1024,
                                     per_device_train_batch_size=1, gradient_accumulation_steps=16)
                        for method in ("sft", "lora", "prefix")},
           "cluster": {"gpus_per_node": 8, "device_memory_gb": device_memory_gb, "node_memory_gb": node_memory_gb}}
    return check_config({"experiments": {"long": exp}})["experiments"]["long"]


def test_a_long_sequence_layout_fits_24gb_devices_only_with_sequence_parallelism():
    """Llama-2-7B pretraining at 32k tokens on one node of 8 x 24 GB, tp 8 with recompute: the
    layers' saved inputs (32 x 32,768 x 4,096 bf16 values a rank) fit only split over the tensor-
    parallel ranks; without sequence_parallel the planner refuses the layout, naming the numbers."""
    def experiment(sequence_parallel: bool) -> dict:
        return long_sequence_experiment(
            dict(world_size=8, tensor_parallel_degree=8, sequence_parallel=sequence_parallel,
                 tensor_parallel_output=True, sharding="stage1", recompute=True, bf16=True, max_length=32768,
                 per_device_train_batch_size=1, gradient_accumulation_steps=8),
            device_memory_gb=24, node_memory_gb=1000)

    job = check_plan("long", experiment(True))["jobs"]["pretrain"]
    assert job["fits"] is True and job["per_device_total_gb"] < 0.9 * 24
    with pytest.raises(ConfigError, match="experiments.long.pretrain: the layout needs") as err:
        check_plan("long", experiment(False))
    print(err.value)


def test_a_128k_token_layout_fits_80gb_devices_with_context_parallelism():
    """Llama-2-7B at 128k tokens on 2 nodes of 8 x 80 GB, tp 4 with sequence parallelism, ZeRO-3
    and recompute: each rank's layers keep 32 x 131,072 x 4,096 bf16 inputs / (tp x cp). Split over
    4 context-parallel ranks a device needs ~26 GB; with cp 1 (the 16 ranks then 4 data-parallel
    replicas) 73 GB, over the 72 GB the planner allows, and it refuses, naming the numbers and the
    nearest layout it finds by its own knobs (tp 8: 68.3 GB; context parallelism is not one of them,
    it changes how the global batch is split)."""
    def experiment(cp: int) -> dict:
        return long_sequence_experiment(
            dict(world_size=16, tensor_parallel_degree=4, sequence_parallel=True, context_parallel_degree=cp,
                 sharding="stage3", recompute=True, bf16=True, max_length=131072, per_device_train_batch_size=1,
                 gradient_accumulation_steps=8),
            device_memory_gb=80, node_memory_gb=2000)

    job = check_plan("long", experiment(4))["jobs"]["pretrain"]
    assert job["fits"] is True and job["per_device_total_gb"] < 30
    with pytest.raises(ConfigError, match="experiments.long.pretrain: the layout needs 73.0 GB") as err:
        check_plan("long", experiment(1))
    print(err.value)
