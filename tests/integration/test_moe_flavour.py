"""A mixture of experts from raw text by the DAG: a `moe-debug` experiment (Mixtral blocks, top 2 of
4 experts) pretrains with ZeRO-1 and expert parallelism over two processes (two experts per rank) on the
project's tokenizer and corpus, writes a Mixtral checkpoint with its routers' load logged, its corpus
perplexity ends far below the unigram model's, and its GGUF file (checked by the deploy stage through our
reading of it) runs in llama.cpp. config/moe.yaml (the README's command) plans the whole chain, with its
GGUF file and without the compressed-tensors deployment transformers cannot load for a mixture."""

import json

import numpy as np
import pytest
import torch
import yaml

from workflow_helpers import ROOT, planned_jobs, snakemake

pytestmark = pytest.mark.slow


def test_moe_flavour_pretrains_with_zero1_and_expert_parallelism(tmp_path):
    experiment = {"model": {"flavour": "moe-debug"},
                  "data": {"vocab_size": 512, "num_sft_train": 50},
                  "pretrain": {"world_size": 2, "sharding": "stage1", "expert_parallel_degree": 2,
                               "per_device_train_batch_size": 4,
                               "max_length": 64, "max_steps": 120, "warmup_steps": 10, "learning_rate": 3e-3},
                  "quantize": {"source": "pretrain"},
                  "deploy": {"gguf": ["q8_0"], "compressed_tensors": []},
                  "evaluate": {"num_dev_examples": 4, "max_new_tokens": 8, "ppl_max_length": 64, "ppl_max_windows": 16}}
    extra = tmp_path / "moe.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"moeci": experiment}}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/moeci/eval/pretrain.json",
              "results/moeci/deploy/gguf-q8_0")
    config = json.loads((tmp_path / "results/moeci/pretrain/config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    meta = json.loads((tmp_path / "results/moeci/pretrain/meta.json").read_text())["metrics"]
    assert meta["expert_parallel_degree"] == 2
    loads = meta["tokens_per_expert"]  # (layers, experts): every (token, choice) of the run
    assert len(loads) == 2 and all(len(layer) == 4 and sum(layer) == 120 * 8 * 64 * 2 for layer in loads)
    e = json.loads((tmp_path / "results/moeci/eval/pretrain.json").read_text())
    assert e["ppl"] < e["unigram_ppl"] / 2, (e["ppl"], e["unigram_ppl"])  # it learned more than word counts

    gguf_dir = tmp_path / "results/moeci/deploy/gguf-q8_0"
    check = json.loads((gguf_dir / "meta.json").read_text())["metrics"]["check"]
    assert "stages.checkpoint.gguf_mixture" in check["runtime"] and check["top1_agreement"] >= 0.97, check
    _llama_cpp_runs_it(tmp_path / "results/moeci/pretrain", gguf_dir / "model-q8_0.gguf")


def _llama_cpp_runs_it(model_dir, gguf_file):
    """llama.cpp's logits on the DAG's q8_0 file after a prompt: the trained model's greedy token, within 2% of
    the logits' scale (q8_0 weights; llama.cpp also rounds activations to 8 bits in its q8_0 products)."""
    from transformers import AutoModelForCausalLM

    from bench.llama_cpp_runtime import LlamaCppUnavailable, open_gguf
    from stages.data.tokenizer import load_model_tokenizer

    try:
        runtime = open_gguf(gguf_file, n_ctx=128, threads=2, f32_cache=True)
    except LlamaCppUnavailable as err:
        pytest.skip(str(err))
    prompt = load_model_tokenizer(model_dir)("the colour of the sky is")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1].numpy()
    _, got = runtime.greedy(prompt, 1)
    scale = np.abs(want).max()
    print(f"llama.cpp on the DAG's q8_0 mixture: max |logit diff| / scale {np.abs(got - want).max() / scale:.4f}")
    assert got.argmax() == want.argmax()
    np.testing.assert_allclose(got, want, atol=0.02 * scale, rtol=0)


def test_the_moe_config_plans_the_whole_chain(tmp_path):
    plan = planned_jobs(snakemake(tmp_path, "--configfile", str(ROOT / "config/moe.yaml"), "-n",
                                  "results/moe/quant_eval.json").stdout)
    assert plan["pretrain"] == 1 and plan["finetune"] == 3 and plan["quantize"] == 5
    assert plan["deploy_gguf"] == 2 and "deploy_compressed_tensors" not in plan  # q8_0 and q4_0
