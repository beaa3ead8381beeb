"""A mixture of experts from raw text by the DAG: a `moe-debug` experiment (Mixtral blocks, top 2 of
4 experts) pretrains with ZeRO-1 and expert parallelism over two processes (two experts per rank) on the
project's tokenizer and corpus, writes a Mixtral checkpoint with its routers' load logged, and its corpus
perplexity ends far below the unigram model's. config/moe.yaml (the README's command) plans the whole
chain, without the GGUF and compressed-tensors deployments a mixture does not get."""

import json

import pytest
import yaml

from workflow_helpers import ROOT, planned_jobs, snakemake

pytestmark = pytest.mark.slow


def test_moe_flavour_pretrains_with_zero1_and_expert_parallelism(tmp_path):
    experiment = {"model": {"flavour": "moe-debug"},
                  "data": {"vocab_size": 512, "num_sft_train": 50},
                  "pretrain": {"world_size": 2, "sharding": "stage1", "expert_parallel_degree": 2,
                               "per_device_train_batch_size": 4,
                               "max_length": 64, "max_steps": 120, "warmup_steps": 10, "learning_rate": 3e-3},
                  "deploy": {"gguf": [], "compressed_tensors": []},
                  "evaluate": {"num_dev_examples": 4, "max_new_tokens": 8, "ppl_max_length": 64, "ppl_max_windows": 16}}
    extra = tmp_path / "moe.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"moeci": experiment}}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/moeci/eval/pretrain.json")
    config = json.loads((tmp_path / "results/moeci/pretrain/config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    meta = json.loads((tmp_path / "results/moeci/pretrain/meta.json").read_text())["metrics"]
    assert meta["expert_parallel_degree"] == 2
    loads = meta["tokens_per_expert"]  # (layers, experts): every (token, choice) of the run
    assert len(loads) == 2 and all(len(layer) == 4 and sum(layer) == 120 * 8 * 64 * 2 for layer in loads)
    e = json.loads((tmp_path / "results/moeci/eval/pretrain.json").read_text())
    assert e["ppl"] < e["unigram_ppl"] / 2, (e["ppl"], e["unigram_ppl"])  # it learned more than word counts


def test_the_moe_config_plans_the_whole_chain(tmp_path):
    plan = planned_jobs(snakemake(tmp_path, "--configfile", str(ROOT / "config/moe.yaml"), "-n",
                                  "results/moe/quant_eval.json").stdout)
    assert plan["pretrain"] == 1 and plan["finetune"] == 3 and plan["quantize"] == 5
    assert "deploy_gguf" not in plan and "deploy_compressed_tensors" not in plan
