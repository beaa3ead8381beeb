"""The workflow through real Snakemake runs: lint, dry run, the whole DAG on the debug flavour (twice
from scratch, writing the same bytes; its models served over HTTP answer as the predictor does), a
rerun that finds nothing to do, a LoRA change that reruns only the LoRA branch, and code edits that
rerun exactly the jobs whose code they touch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from served_answers import served_and_predicted
from workflow_helpers import (
    DEBUG_CONFIG,
    TARGET,
    artifact_hashes,
    debug_config_with_align,
    planned_jobs,
    repo_copy,
    snakemake,
)

def test_lint_is_clean(tmp_path):
    """Snakemake's linter finds nothing, the conda environment of every rule (environment.yml) included."""
    proc = snakemake(tmp_path, "--lint", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Congratulations, your workflow is in a good condition!" in out, out
    assert "Lints for" not in out, out


def test_dry_run_plans_every_stage(tmp_path):
    proc = snakemake(tmp_path, "-n", "results/llama/quant_eval.json")
    jobs = planned_jobs(proc.stdout)
    # evaluate: pretrain, sft, lora, prefix, lora-merged, align, 4 quantized and onnx-int8; deploy: config.yaml's
    assert jobs == {"prepare": 1, "plan_job": 5, "plan": 1, "pretrain": 1, "finetune": 3, "score_pairs": 1, "align": 1,
                    "merge_lora": 1, "quantize": 4, "export": 1, "evaluate": 11, "deploy_gguf": 2,
                    "deploy_compressed_tensors": 1, "deploy_manifest": 1, "report": 1}, proc.stdout


# The debug experiment's jobs (align off); with align on, ALIGN_JOBS instead of these counts.
CI_JOBS = {"prepare": 1, "plan_job": 4, "plan": 1, "pretrain": 1, "finetune": 3, "merge_lora": 1, "quantize": 5,
           "export": 1, "evaluate": 11, "deploy_gguf": 2, "deploy_compressed_tensors": 1, "deploy_manifest": 1,
           "report": 1}
ALIGN_JOBS = {"plan_job": 5, "evaluate": 12, "score_pairs": 1, "align": 1}


def _job_lines(stdout: str, rule: str) -> list[str]:
    """The shell commands of a dry run's jobs of `rule`."""
    blocks = re.split(r"\n(?=(?:local)?rule \S+:)", stdout)
    return [re.search(r"Shell command: (.*)", b).group(1) for b in blocks if b.startswith(f"rule {rule}:")]


def test_align_joins_the_chain_when_enabled(tmp_path):
    """align.enabled adds its plan, the reference scores (dpo and ipo only), the training and the
    `align` variant's evaluation to the default target, and a comparison may name the variant; the
    scores' params hold only what changes them (a new beta reruns `align` alone)."""
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text(yaml.safe_dump({"experiments": {"ci": {"align": {"enabled": True, "beta": 0.2}}},
                                   "comparisons": {"aligned": {"experiments": ["ci"], "variants": ["sft", "align"]}}}))
    proc = snakemake(tmp_path, "--configfile", str(DEBUG_CONFIG), str(dpo), "-n", TARGET,
                     "results/comparisons/aligned/compare.md")
    assert planned_jobs(proc.stdout) == {**CI_JOBS, **ALIGN_JOBS, "compare": 1}, proc.stdout
    [score] = _job_lines(proc.stdout, "score_pairs")
    assert "--model results/ci/sft " in score
    # which pairs are drawn (the defaults: 100 steps of 8 pairs, one process), not beta or the learning rate
    assert json.loads(re.search(r"--config '(.*?)'", score).group(1)) == {
        "source": "sft", "src_length": 64, "max_length": 128, "per_device_eval_batch_size": 32, "seed": 42,
        "max_steps": 100, "per_device_train_batch_size": 8}
    layout = tmp_path / "layout.yaml"  # the same global batch of pairs on two ranks: the same scoring
    layout.write_text(yaml.safe_dump({"experiments": {"ci": {"align": {
        "enabled": True, "beta": 0.2, "world_size": 2, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2}}}}))
    [same] = _job_lines(snakemake(tmp_path, "--configfile", str(DEBUG_CONFIG), str(layout), "-n", TARGET).stdout,
                        "score_pairs")
    assert re.search(r"--config '(.*?)'", same).group(1) == re.search(r"--config '(.*?)'", score).group(1)
    [align] = _job_lines(proc.stdout, "align")
    assert "-- stages.align --model results/ci/sft --data results/ci/data --reference results/ci/align_reference " \
           "--out results/ci/align " in align and "--plan results/ci/plan/align.json" in align
    assert any("--out results/ci/eval/align.json" in line for line in _job_lines(proc.stdout, "evaluate"))

    pairs = tmp_path / "pairs"  # the user's own pairs: inputs of prepare, so that editing them reruns it
    pairs.mkdir()
    for split in ("train", "dev"):
        (pairs / f"{split}.jsonl").write_text(json.dumps({"src": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    general = tmp_path / "general.txt"  # text mixed into the alignment: an input, so that editing it reruns it
    general.write_text("Some general text.\n")
    # reference-free, a LoRA adapter on lora-merged, merged and quantized
    simpo = tmp_path / "simpo.yaml"
    simpo.write_text(yaml.safe_dump({"experiments": {"ci": {"data": {"preference": str(pairs)}, "align": {
        "enabled": True, "method": "simpo", "tuning": "lora", "source": "lora-merged", "mix_ratio": 0.2,
        "mix_datasets": ["corpus", str(general)]}, "quantize": {"source": "align-merged"}}}}))
    proc = snakemake(tmp_path, "--configfile", str(DEBUG_CONFIG), str(simpo), "-n", TARGET)
    assert planned_jobs(proc.stdout) == {**CI_JOBS, "plan_job": 5, "evaluate": 13, "align": 1,
                                         "merge_align": 1}, proc.stdout
    [merge] = _job_lines(proc.stdout, "merge_align")
    assert "--adapter results/ci/align --base results/ci/lora-merged --out results/ci/align-merged " in merge
    assert all("--source results/ci/align-merged " in line for line in _job_lines(proc.stdout, "quantize"))
    prepare = re.search(r"rule prepare:\n\s+input: (.*)", proc.stdout).group(1)
    assert f"{pairs}/train.jsonl" in prepare and f"{pairs}/dev.jsonl" in prepare
    assert str(general) in re.search(r"rule align:\n\s+input: (.*)", proc.stdout).group(1)
    [evaluate] = [line for line in _job_lines(proc.stdout, "evaluate") if "--variant align " in line]
    assert "--model results/ci/align --base results/ci/lora-merged " in evaluate
    [report] = _job_lines(proc.stdout, "report")
    assert "--align-source lora-merged " in report  # the alignment table's reference row


def test_the_plain_command_uses_the_default_profile(tmp_path):
    """workflow/profiles/default/ is in force without any flag: its printshellcmds shows each job's command
    in a dry run, which Snakemake's own default does not."""
    proc = snakemake(tmp_path, "-n", "results/llama/data")
    assert "workflow/profiles/default for setting default command line arguments" in proc.stdout + proc.stderr
    assert "python -m stages.prepare --out results/llama/data" in proc.stdout
    plain = snakemake(tmp_path, "--workflow-profile", "none", "-n", "results/llama/data")
    assert "python -m stages.prepare" not in plain.stdout  # the setting comes from the profile


def test_unknown_config_key_fails_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"experiments": {"x": {"finetune": {"lora": {"lora_rnak": 4}}}}}))
    proc = snakemake(tmp_path, "--configfile", str(bad), "-n", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "lora_rnak" in out and "lora_rank" in out
    assert not (tmp_path / "results").exists()


def test_missing_data_path_fails_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"experiments": {"x": {"data": {"corpus": ["no/such/*.txt"]}}}}))
    proc = snakemake(tmp_path, "--configfile", str(bad), "-n", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "no/such/*.txt" in out and "data.corpus" in out


def _mtimes(workdir: Path) -> dict[str, float]:
    base = workdir / "results" / "ci"
    return {p.relative_to(base).as_posix(): p.stat().st_mtime
            for p in base.rglob("*") if p.is_file() and "logs" not in p.parts and "benchmarks" not in p.parts}


def test_whole_dag_on_debug_then_nothing_then_only_the_lora_branch(tmp_path):
    # run from a copy of the workflow and its code, which the end of the test edits
    repo = repo_copy(tmp_path / "repo")
    work = tmp_path / "work"
    work.mkdir()
    config = debug_config_with_align(tmp_path)  # debug.yaml with DPO after SFT

    def sm(workdir: Path, *args: str, **kwargs):
        return snakemake(workdir, *args, root=repo, **kwargs)

    sm(work, "--configfile", str(config), "--cores", "2", TARGET)
    exp = work / "results" / "ci"

    # Every stage's artifact exists and follows its contract.
    for d in ["data", "pretrain", "sft", "lora", "prefix", "lora-merged", "align_reference", "align", "export",
              "quant/wint8", "quant/wint4",
              "quant/gptq-w4", "quant/awq-w4", "quant/a8w8-smooth", "deploy/gguf-f32", "deploy/gguf-q8_0",
              "deploy/compressed-tensors-a8w8-smooth"]:
        assert (exp / d / "meta.json").exists(), d
    for stage in ["pretrain", "sft", "lora", "prefix", "align"]:
        log = pd.read_csv(exp / stage / "train_log.csv")
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(log.columns), stage
        # means of 5 steps: one step's loss swings with its batch (prefix tuning on the barely
        # pretrained debug model moves the loss by ~0.02 only, see debug.yaml)
        assert log["loss"].iloc[-5:].mean() < log["loss"].iloc[:5].mean(), stage
    from transformers import AutoModelForCausalLM

    # DPO (DEBUG_ALIGN: two ranks, ZeRO-2) logs the preference statistics; its first policy is its reference
    align_log = pd.read_csv(exp / "align" / "train_log.csv")
    assert align_log["loss"].iloc[0] == pytest.approx(0.693147, abs=1e-5)
    assert align_log["rewards_margin"].iloc[-5:].mean() > 0 and align_log["rewards_accuracy"].iloc[-5:].mean() > 0.5
    align_eval = json.loads((exp / "eval" / "align.json").read_text())
    assert align_eval["preference_pairs"] == 16 and align_eval["preference_accuracy"] is not None
    assert "## Alignment" in (exp / "report.md").read_text()
    AutoModelForCausalLM.from_pretrained(exp / "align")  # HF layout, no project code
    AutoModelForCausalLM.from_pretrained(exp / "pretrain")
    from stages.training.capabilities import native_bf16

    # bf16: auto, decided in the job: bf16 where this machine multiplies it natively
    assert json.loads((exp / "pretrain" / "meta.json").read_text())["metrics"]["bf16"] is (native_bf16() is not None)
    # save_steps 10: checkpoints kept outside the outputs, complete, and themselves HF-loadable
    saved = sorted(p.parent.name for p in (exp / "checkpoints").glob("*/*/checkpoint-*/checkpoint_complete.json"))
    # (pretrain: 10 and 20 of 30; sft and align: 10 of 20: the last step is the output itself)
    assert saved == ["checkpoint-0000010", "checkpoint-0000010", "checkpoint-0000010", "checkpoint-0000020"], saved
    AutoModelForCausalLM.from_pretrained(next((exp / "checkpoints" / "pretrain").glob("*/checkpoint-0000020")))
    quant_eval = json.loads((exp / "quant_eval.json").read_text())
    assert quant_eval["source"] == "lora-merged"
    assert set(quant_eval["variants"]) == {"wint8", "wint4", "gptq-w4", "awq-w4", "a8w8-smooth"}
    # every quantized variant ran on its low-bit kernels (stages.quant.load_quantized), none dequantized
    kernels = {name: v["kernels"] for name, v in quant_eval["variants"].items()}
    assert kernels == {"wint8": {"int8pack": 14}, "wint4": {"int4pack": 14}, "gptq-w4": {"int4pack": 14},
                       "awq-w4": {"int4pack": 14}, "a8w8-smooth": {"int_mm": 14}}, kernels
    for v in quant_eval["variants"].values():
        assert v["quantization"]["quantize_seconds"] > 0 and v["delta"]["decode_tokens_per_s_b1"] is not None
        # the lm-eval local tasks (debug.yaml: 8 documents each), scored and recovered against the source
        assert set(v["lm_eval"]) == set(v["recovery"]) == {"lifecycle_qa", "lifecycle_pairs"}
        assert 0 <= v["lm_eval"]["lifecycle_pairs"]["acc"] <= 1 and "exact_match" in v["recovery"]["lifecycle_qa"]
    lm_eval = json.loads((exp / "eval" / "onnx-int8.json").read_text())["lm_eval"]
    assert lm_eval["limit"] == 8 and lm_eval["tasks"]["lifecycle_pairs"]["samples"] == 8
    assert "## Standard tasks (lm-evaluation-harness)" in (exp / "report.md").read_text()
    # forgetting beside the task score: every fine-tuned variant against the pretrained model
    summary = quant_eval["summary"]
    assert summary["start"] == "pretrain" and set(summary["variants"]) == {"sft", "lora", "prefix", "lora-merged"}
    assert all(v["ppl_ratio"] == v["ppl"] / summary["start_ppl"] for v in summary["variants"].values())
    for method in ("sft", "lora"):  # mix_ratio 0.5 (debug.yaml): half the learned tokens were corpus text
        meta = json.loads((exp / method / "meta.json").read_text())
        assert meta["metrics"]["mix_token_share"] == pytest.approx(0.5, abs=0.02), method
    report = pd.read_csv(exp / "report.csv")
    assert len(report) == 12  # pretrain, sft, lora, prefix, lora-merged, align, 5 quantized, onnx-int8
    # deployable artifacts, each checked by the runtime users deploy with (stages/deploy.py)
    manifest = json.loads((exp / "deploy" / "manifest.json").read_text())["artifacts"]
    assert set(manifest) == {"onnx", "onnx-int8", "gguf-f32", "gguf-q8_0", "compressed-tensors-a8w8-smooth"}
    assert manifest["gguf-f32"]["check"]["rel_err"] <= 1e-5 and manifest["gguf-f32"]["check"]["top1_agreement"] == 1
    assert all(Path(a["path"]).exists() or (work / a["path"]).exists() for a in manifest.values())
    assert "## Deployment" in (exp / "report.md").read_text()
    assert "## Fine-tuning: the task learned, the language kept" in (exp / "report.md").read_text()
    # the plots and narrow tables, and Snakemake's HTML report with the plots embedded
    for name in ("training.png", "quantization.png", "stages.png", "quality.csv", "size.csv", "speed.csv",
                 "stages.csv"):
        assert (exp / "report" / name).stat().st_size > 0, name
    assert set(pd.read_csv(exp / "report" / "quality.csv")["variant"]) == set(report["variant"])
    sm(work, "--configfile", str(config), "--report", "report.html", TARGET)
    html = (work / "report.html").read_text()
    assert all(f"filename={name}" in html for name in ("training.png", "quantization.png", "stages.png"))

    # The run's models served over HTTP answer as the predictor does (stages.serve, the openai client):
    # the merged model, a GPTQ variant on its int4 kernels, and the LoRA adapter on its base.
    for variant, kind in (("lora-merged", "hf"), ("quant/gptq-w4", "quantized"), ("lora", "adapter")):
        for served, predicted in served_and_predicted(exp, variant, tmp_path):
            assert served["kind"] == kind
            assert served["output"] == served["streamed"] == predicted["output"], variant
            assert served["prompt_tokens"] == predicted["prompt_tokens"], variant
            assert served["output_tokens"] == predicted["output_tokens"], variant

    # A second run from scratch writing the same bytes: tests/integration/test_portable_workflow.py
    # (slow), whose module and S3 runs are two runs of this DAG.

    # A second run finds nothing to do.
    proc = sm(work, "--configfile", str(config), "-n", TARGET)
    assert planned_jobs(proc.stdout) == {}, proc.stdout

    # Changing a LoRA hyperparameter reruns the LoRA branch and what depends on it, nothing else
    # (LoRA's memory estimate and the whole plan are redone; the other jobs' estimates are not). The
    # plan is the claim; running these 23 jobs would add minutes to CI and prove only that Snakemake
    # runs the jobs it planned (the run below, after DPO's beta changes, shows that the others stay).
    cfg = yaml.safe_load(config.read_text())
    lora = cfg["experiments"]["ci"]["finetune"]["lora"]
    rank, lora["lora_rank"] = lora["lora_rank"], 8
    changed = work / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    proc = sm(work, "--configfile", str(changed), "-n", TARGET)
    # evaluate: lora, lora-merged, the 5 quantized, onnx-int8; every deployable artifact is made of lora-merged
    assert planned_jobs(proc.stdout) == {"plan_job": 1, "plan": 1, "finetune": 1, "merge_lora": 1, "quantize": 5,
                                         "export": 1, "evaluate": 8, "deploy_gguf": 2, "deploy_compressed_tensors": 1,
                                         "deploy_manifest": 1, "report": 1}, proc.stdout
    lora["lora_rank"] = rank  # back to debug.yaml's LoRA

    # Changing DPO's beta reruns the alignment (its memory estimate and the plan too, as for LoRA above; its
    # evaluation and the report), not the reference log-probs, and leaves every other job's files alone.
    before = _mtimes(work)
    cfg["experiments"]["ci"]["align"]["beta"] = 0.2
    changed.write_text(yaml.safe_dump(cfg))
    proc = sm(work, "--configfile", str(changed), "-n", TARGET)
    assert planned_jobs(proc.stdout) == {"plan_job": 1, "plan": 1, "align": 1, "evaluate": 1, "report": 1}, proc.stdout
    sm(work, "--configfile", str(changed), "--cores", "2", TARGET)
    after = _mtimes(work)
    untouched = [k for k in before
                 if k.split("/")[0] in ("data", "pretrain", "sft", "lora", "prefix", "align_reference")]
    assert untouched and all(before[k] == after[k] for k in untouched)
    assert after["align/meta.json"] > before["align/meta.json"]
    assert json.loads((exp / "align" / "meta.json").read_text())["config"]["beta"] == 0.2
    for v in ("pretrain", "sft", "lora", "prefix"):
        assert before[f"eval/{v}.json"] == after[f"eval/{v}.json"]

    # Code is an input (stages/provenance/code.py). Editing docs or tests reruns nothing.
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nAn edit.\n")
    (repo / "tests" / "test_config.py").write_text((repo / "tests" / "test_config.py").read_text() + "\n# an edit\n")
    assert planned_jobs(sm(work, "--configfile", str(changed), "-n", TARGET).stdout) == {}
    # Editing the model reruns training and everything after it (not prepare, nor the memory plans).
    llama = repo / "stages" / "model" / "llama.py"
    source = llama.read_text()
    llama.write_text(source + "\n# an edit\n")
    proc = sm(work, "--configfile", str(changed), "-n", TARGET)
    assert planned_jobs(proc.stdout) == {"pretrain": 1, "finetune": 3, "score_pairs": 1, "align": 1, "merge_lora": 1,
                                         "quantize": 5, "export": 1, "evaluate": 12, "deploy_gguf": 2, "deploy_compressed_tensors": 1,
                                         "deploy_manifest": 1, "report": 1}, proc.stdout
    assert "code stages/model/llama.py" in proc.stdout  # the reason names the file
    llama.write_text(source)
    assert planned_jobs(sm(work, "--configfile", str(changed), "-n", TARGET).stdout) == {}
    # Editing the GPTQ algorithm reruns the GPTQ variant's quantization and what reads it, nothing else.
    hashes = artifact_hashes(work / "results")
    gptq = repo / "stages" / "quant" / "gptq.py"
    gptq.write_text(gptq.read_text() + "\n# an edit\n")
    proc = sm(work, "--configfile", str(changed), "-n", TARGET)
    assert planned_jobs(proc.stdout) == {"quantize": 1, "evaluate": 1, "report": 1}, proc.stdout
    assert "code stages/quant/gptq.py" in proc.stdout and "wildcards: experiment=ci, variant=gptq-w4" in proc.stdout
    sm(work, "--configfile", str(changed), "--cores", "2", TARGET)
    rerun = artifact_hashes(work / "results")
    moved = {f for f in hashes if rerun.get(f) != hashes[f]}
    assert moved and all(f.startswith(("ci/quant/gptq-w4/", "ci/eval/gptq-w4.json", "ci/report", "ci/quant_eval.json"))
                         for f in moved), sorted(moved)
    assert "ci/quant/gptq-w4/meta.json" in moved  # its `code` digest
    assert json.loads((exp / "quant" / "gptq-w4" / "meta.json").read_text())["code"] != \
        json.loads((exp / "quant" / "wint4" / "meta.json").read_text())["code"]
