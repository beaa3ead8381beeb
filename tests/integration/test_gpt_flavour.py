"""GPT-2 blocks from raw text by the DAG: a `gpt-debug` experiment pretrains in Colossal-AI's
hybrid layout (pipeline 2 x ZeRO-1, two processes) on the project's tokenizer and corpus, writes a
GPT-2 checkpoint, and its corpus perplexity ends far below the unigram model's. config/gpt2.yaml
(the README's GPT-2 command) plans the whole chain: fine-tuning, quantization, export and the
evaluations through transformers' GPT2LMHeadModel, without the ONNX int8 evaluation GPT-2's
cache-free export does not write."""

import json

import pytest
import yaml

from workflow_helpers import ROOT, planned_jobs, snakemake

pytestmark = pytest.mark.slow


def test_gpt_flavour_pretrains_in_the_hybrid_layout(tmp_path):
    experiment = {"model": {"flavour": "gpt-debug", "num_hidden_layers": 4},
                  "data": {"vocab_size": 512, "num_sft_train": 50},
                  "pretrain": {"world_size": 2, "pipeline_parallel_degree": 2, "sharding": "stage1",
                               "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                               "max_length": 64, "max_steps": 240, "warmup_steps": 20, "learning_rate": 3e-3},
                  "evaluate": {"num_dev_examples": 4, "max_new_tokens": 8, "ppl_max_length": 64, "ppl_max_windows": 16}}
    extra = tmp_path / "gpt.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"gptci": experiment}}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/gptci/eval/pretrain.json")
    config = json.loads((tmp_path / "results/gptci/pretrain/config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 4
    meta = json.loads((tmp_path / "results/gptci/pretrain/meta.json").read_text())["metrics"]
    assert meta["pipeline_parallel_degree"] == 2
    e = json.loads((tmp_path / "results/gptci/eval/pretrain.json").read_text())
    assert e["ppl"] < e["unigram_ppl"] / 2, (e["ppl"], e["unigram_ppl"])  # it learned more than word counts


def test_the_gpt2_config_plans_the_whole_chain(tmp_path):
    plan = planned_jobs(snakemake(tmp_path, "--configfile", str(ROOT / "config/gpt2.yaml"), "-n",
                                  "results/gpt2/quant_eval.json").stdout)
    assert plan["pretrain"] == 1 and plan["finetune"] == 3 and plan["quantize"] == 4
    assert plan["evaluate"] == 9  # pretrain, 3 fine-tuned, lora-merged, 4 quantized; no onnx-int8
