"""An experiment that starts from a local checkpoint (`model.model_name_or_path`), through Snakemake:
the checkpoint is imported as results/<name>/base, its own tokenizer (and chat template) tokenizes
the data, pretraining is skipped, fine-tuning starts from it, and it is evaluated as the `base`
variant the report compares every other variant with."""

import json
import shutil
import sys
from pathlib import Path

import yaml

from workflow_helpers import planned_jobs, snakemake

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from checkpoint_fixtures import chat_tokenizer, save_checkpoint, save_tiny_tokenizer  # noqa: E402

SMALL = {"max_steps": 12, "warmup_steps": 2, "per_device_train_batch_size": 8, "src_length": 48, "max_length": 64}


def test_checkpoint_experiment_skips_pretraining_and_reports_against_base(tmp_path):
    tokenizer = chat_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))
    checkpoint = save_checkpoint(tmp_path / "published", tokenizer)
    extra = tmp_path / "ck.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"ck": {
        "model": {"model_name_or_path": str(checkpoint)},
        "data": {"corpus": ["builtin:sft_targets"], "num_sft_train": 120, "num_sft_dev": 8},
        "finetune": {"sft": SMALL, "lora": {**SMALL, "lora_rank": 4}, "prefix": {**SMALL, "num_prefix_tokens": 4}},
        "quantize": {"variants": ["wint8"]},
        "evaluate": {"num_dev_examples": 8, "max_new_tokens": 8, "ppl_max_length": 32, "ppl_max_windows": 4},
    }}}))
    target = "results/ck/quant_eval.json"
    plan = planned_jobs(snakemake(tmp_path, "--configfile", str(extra), "-n", target).stdout)
    # evaluate: base, sft, lora, prefix, lora-merged, wint8, and onnx-int8 (a Llama exports with a KV cache)
    assert "pretrain" not in plan and plan["import_base"] == 1 and plan["evaluate"] == 7, plan
    # dynamic RoPE: exported without a cache, so without int8/ and its evaluation
    dynamic = tmp_path / "published-dynamic"
    shutil.copytree(checkpoint, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "dynamic", "factor": 2.0}
    (dynamic / "config.json").write_text(json.dumps(config))
    dyn = tmp_path / "dyn.yaml"
    dyn.write_text(extra.read_text().replace(str(checkpoint), str(dynamic)))
    assert planned_jobs(snakemake(tmp_path, "--configfile", str(dyn), "-n", target).stdout)["evaluate"] == 6
    # GPT-2 and OPT checkpoints (their own config.json key names) are planned too, exported cache-free
    for family, fields in (("gpt2", {}), ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, word_embed_proj_dim=64))):
        other = tmp_path / f"{family}.yaml"
        other.write_text(extra.read_text().replace(str(checkpoint), str(save_checkpoint(
            tmp_path / family, tokenizer, family, **fields))))
        assert planned_jobs(snakemake(tmp_path, "--configfile", str(other), "-n", target).stdout)["evaluate"] == 6

    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", target)
    results = tmp_path / "results" / "ck"
    assert not (results / "pretrain").exists()
    index = json.loads((results / "data" / "index.json").read_text())
    assert index["sft_format"] == "chat_template" and index["vocab_size"] == len(tokenizer) + 3
    for artifact in ("sft", "lora", "lora-merged", "quant/wint8"):  # every artifact carries the same tokenizer
        assert (results / artifact / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
        assert (results / artifact / "chat_template.jinja").exists(), artifact
    assert json.loads((results / "lora" / "meta.json").read_text())["parent"] == "results/ck/base"
    base_eval = json.loads((results / "eval" / "base.json").read_text())
    assert base_eval["kind"] == "hf" and base_eval["sft_format"] == "chat_template"
    sft_config = json.loads((results / "sft" / "config.json").read_text())
    assert sft_config["rope_parameters"]["rope_theta"] == 100000.0  # the source's config, kept
    report = (results / "report.md").read_text()
    assert "Every variant against the starting model `base`" in report
    assert "| base |" in (results / "report.md").read_text()
