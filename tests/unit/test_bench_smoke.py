"""The bench scripts run end to end on the smallest settings and write their JSON.

Checks the shape of the report only: timings on a shared CPU are noise, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "train_throughput.py"
SMALLEST = ["--flavour", "debug", "--steps", "2", "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--vocab-size", "512", "--no-compile"]


def run_script(name: str, out: Path, *args: str) -> tuple[str, dict]:
    """Runs bench/<name> with `args` and `--out out`; its printed report and the JSON it wrote."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc.stdout, json.loads(out.read_text())


def run_bench(out: Path, *extra: str) -> dict:
    stdout, result = run_script(SCRIPT.name, out, *SMALLEST, *extra)
    assert "ratio ours/hf" in stdout
    return result


def test_throughput_report_has_its_keys(tmp_path):
    result = run_bench(tmp_path / "bench.json", "--skip-memory", "--no-dag-layout", "--profile", "--profile-steps", "1")
    for key in ("machine", "settings", "flops_per_token", "mfu_formula", "peak_flops", "runs", "ours", "hf",
                "ratio", "ratios", "memory"):
        assert key in result, key
    assert {"cpu", "cores", "torch"} <= result["machine"].keys()
    assert {"ours (eager)", "hf trainer (eager)"} <= result["runs"].keys()
    for run in result["runs"].values():
        assert len(run["step_times_s"]) == 2
        assert {"tokens_per_s", "mfu", "median_step_s", "first_step_s"} <= run.keys()
    assert result["peak_flops"] > 0 and result["ratio"] > 0
    assert result["memory"] == []
    # the Trainer trains its model itself: not wrapped in DDP by the engine's world of one
    assert result["runs"]["hf trainer (eager)"]["trained_module"] == "LlamaForCausalLM"
    assert result["settings"]["keep_freed_host_memory"] is sys.platform.startswith("linux")
    profile = result["profile"]
    assert list(profile["runs"]) == ["stage step", "hf trainer (eager)"]
    for run in profile["runs"].values():
        kinds = run["ms_per_step"]
        assert list(kinds) == ["matmul", "attention", "loss", "other"]
        assert kinds["matmul"] > 0 and kinds["attention"] > 0  # both models ran mm and SDPA
        assert run["ops_ms_per_step"] == pytest.approx(sum(kinds.values()))
    assert profile["ceiling_matmul_attention"] > 0


@pytest.mark.multiproc
def test_layout_and_memory_reports_have_their_keys(tmp_path):
    """The 2-rank parts: the stage step in the default run's layout against the Trainer in the same
    ranks (one round), and per-rank memory."""
    result = run_bench(tmp_path / "bench.json", "--layout-rounds", "1",
                       "--memory-flavour", "debug", "--shardings", "none", "stage3")
    stage, trainer = result["runs"]["stage, 2 ranks stage1"], result["runs"]["hf trainer, 2 ranks ddp"]
    assert stage["trained_module"] == "DeepSpeedEngine" and trainer["trained_module"] == "DistributedDataParallel"
    for run in (stage, trainer):
        assert run["world_size"] == 2 and run["threads_per_rank"] == 1 and run["rounds"] == 1
        assert len(run["step_times_s"]) == 2  # --steps, rank 0's, after --warmup-steps
        assert run["tokens_per_step"] == 2 * 2 * 32  # ranks x --batch-size x --seq-len
    assert stage["sharding"] == "stage1" and stage["torch_compile"] is False  # config/config.yaml, the schema
    assert len(stage["losses"][0]) == 3 and all(loss > 0 for loss in stage["losses"][0])
    assert {"stage in the DAG's layout/hf in the same layout (tokens/s)",
            "stage in the DAG's layout/hf's faster layout (tokens/s)"} <= result["ratios"].keys()
    assert result["settings"]["dag_layout_rounds"] == 1
    assert [(r["sharding"], r["rank"]) for r in result["memory"]] == [("none", 0), ("none", 1), ("stage3", 0), ("stage3", 1)]
    for row in result["memory"]:
        assert row["peak_rss_bytes"] > 0
        assert {"params", "grads", "master_params", "optimizer_state", "buffers", "total"} <= row["held"].keys()


def test_quant_bench_report_has_its_keys(tmp_path):
    """bench/quant.py on the debug flavour: one RTN, one GPTQ and one A8W8 variant beside fp32 and
    bf16, each with timings, weight bytes, a peak RSS from its own process and the targets."""
    out = tmp_path / "quant.json"
    stdout, result = run_script("quant.py", out, "--sizes", "debug", "--vocab-size", "512", "--variants",
                                "wint4,gptq-w4,a8w8", "--repeats", "1", "--warmup", "1", "--prefill-tokens", "16",
                                "--decode-prompt", "8", "--decode-tokens", "2", "--calib-samples", "2",
                                "--calib-seq-len", "32", "--calib-seed", "3")
    assert "| gptq-w4" in stdout and "(seed 3)" in stdout
    assert {"cpu", "cores", "torch_threads", "torch", "transformers"} <= result["machine"].keys()
    size = result["sizes"]["debug"]
    assert list(size["rows"]) == ["fp32", "bf16", "wint4", "gptq-w4", "a8w8"]
    for name, row in size["rows"].items():
        assert {"prefill_b1_ms", "prefill_b8_ms", "decode_ms_per_token", "model_bytes", "linear_bytes",
                "ratio_to_fp32", "kernels"} <= row.keys(), name
        assert row["memory"]["peak_rss_bytes"] >= row["memory"]["baseline_rss_bytes"] > 0
        assert len(row["samples_s"]["decode"]) == 1
    assert size["rows"]["fp32"]["ratio_to_fp32"]["decode"] == 1.0
    assert size["rows"]["wint4"]["linear_bytes"] < size["rows"]["fp32"]["linear_bytes"]  # bytes, not time
    assert size["rows"]["gptq-w4"]["quantization"]["metrics"]["seconds_per_decoder_layer"] > 0
    assert result["settings"]["calib_seed"] == size["rows"]["gptq-w4"]["quantization"]["metrics"]["calibration"][
        "seed"] == 3  # --calib-seed reaches the stage's calibration windows
    assert {"wint4", "gptq-w4", "a8w8"} == size["targets"].keys()


def test_sft_packing_bench_report_has_its_keys(tmp_path):
    """bench/sft_packing.py --quick: full SFT and LoRA, padded and packed, each with rows per epoch,
    fill, effective tokens/s and losses, and the packed/padded ratio with its target."""
    out = tmp_path / "sft_packing.json"
    stdout, result = run_script("sft_packing.py", out, "--quick", "--threads", "1")
    assert "packed/padded" in stdout
    assert {"cpu", "cores", "torch_threads", "torch"} <= result["machine"].keys()
    assert result["settings"]["quick"] and result["model"]["flavour"] == "debug"
    assert list(result["methods"]) == ["sft", "lora"]
    for method, r in result["methods"].items():
        assert list(r["modes"]) == ["padded", "packed"], method
        for mode, d in r["modes"].items():
            assert {"rows_per_epoch", "fill", "effective_tokens_per_s", "examples_per_s", "final_loss", "dev_loss",
                    "median_step_s", "epoch_s_estimate"} <= d.keys(), (method, mode)
            assert 0 < d["fill"] <= 1 and 0 < d["fill_trained"] <= 1, (method, mode)
            assert d["effective_tokens_per_s"] > 0 and d["final_loss"] > 0
            settings = result["settings"]
            assert d["measured_steps"] == settings["repeats"] * (settings["steps"] - settings["warmup_steps"])
        padded, packed = r["modes"]["padded"], r["modes"]["packed"]
        assert padded["rows_per_epoch"] == r["num_examples"] > packed["rows_per_epoch"]  # counts, not time
        assert packed["examples_per_row"] > 1 and packed["fill"] > padded["fill"]
        assert r["ratio"]["effective_tokens_per_s"] > 0 and isinstance(r["target"]["pass"], bool)


def test_learned_logits_bench_report_has_its_keys(tmp_path):
    """bench/learned_logits.py --quick: each case's shape, its learned share as the default data's,
    both ways timed, and the same loss both ways."""
    out = tmp_path / "learned_logits.json"
    stdout, result = run_script("learned_logits.py", out, "--quick")
    assert "| speedup |" in stdout
    assert {"cpu", "cores", "torch_threads", "torch"} <= result["machine"].keys()
    assert list(result["cases"]) == ["sft", "lora-shape", "pretrain"]
    shares = {name: c["learned_share"] for name, c in result["cases"].items()}
    assert shares["sft"] == pytest.approx(0.653, abs=0.01) and shares["lora-shape"] == pytest.approx(0.370, abs=0.01)
    for name, c in result["cases"].items():
        assert c["learned_positions"] == round(c["learned_share"] * c["rows"] * c["tokens_per_row"]), name
        assert c["ms_all_logits"] > 0 and c["ms_learned_logits"] > 0 and c["speedup"] > 0, name
        assert c["loss_rel_diff"] < 1e-5, name


def test_attention_precision_bench_report_has_its_keys(tmp_path):
    """bench/attention_precision.py --quick: both kernels timed per shape, the rule's pick beside the
    faster one, and the rule's pick is what stages.model.attention_precision says for the shape."""
    from stages.model.attention_precision import CPU_HAS_AMX

    out = tmp_path / "attention_precision.json"
    stdout, result = run_script("attention_precision.py", out, "--quick")
    assert "| rule picks |" in stdout
    assert result["cpu_has_amx"] == CPU_HAS_AMX
    assert [(r["head_dim"], r["tokens"]) for r in result["shapes"]] == [(32, 64), (32, 1024)]
    picks = [r["rule_picks"] for r in result["shapes"]]
    assert picks == (["bf16", "bf16"] if CPU_HAS_AMX else ["fp32", "bf16"])
    for r in result["shapes"]:
        assert r["ms_bf16"] > 0 and r["ms_fp32"] > 0 and r["rule_cost"] >= 1.0
        assert r["rows"] * r["tokens"] == 4096


def test_lazy_build_bench_report_has_its_keys(tmp_path):
    out = tmp_path / "lazy.json"
    stdout, result = run_script("lazy_build.py", out, "--flavour", "debug", "--layouts", "tp2")
    assert "lazy/eager" in stdout
    assert {(r["layout"], r["mode"]) for r in result["rows"]} == {("tp2", "eager"), ("tp2", "lazy")}
    for row in result["rows"]:
        assert row["peak_above_start_bytes"] >= 0 and 0 < row["kept_bytes"] < row["whole_model_bytes"]
    assert [s["layout"] for s in result["summary"]] == ["tp2"]


def test_finetune_quality_judges_every_seed_and_the_forgetting():
    """bench/finetune_quality.py's verdicts from eval results (no Snakemake run): a target met on
    the mean but missed on one seed fails `pass_every_seed`; forgetting is ppl over the start's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import finetune_quality as fq

    def rec(em, ppl_ratio=1.0):
        return {"exact_match": em, "ppl": 50.0 * ppl_ratio, "ppl_ratio": ppl_ratio, "bleu4": None, "rouge_l": None,
                "dev_ppl": None, "finetune": None, "train_log": None}

    per_method = {"start": {"1": rec(0.0), "2": rec(0.0)},
                  "sft": {"1": rec(1.0, 1.2), "2": rec(0.8, 1.1)},
                  "lora": {"1": rec(1.0, 1.4), "2": rec(0.7, 1.3)},
                  "prefix": {"1": rec(0.0), "2": rec(0.0)},
                  "lora-merged": {"1": rec(1.0, 1.4), "2": rec(0.7, 1.6)}}
    summary = fq.summarise({"per_method": per_method}, [1, 2])
    assert summary["ratios"]["lora"]["pass"] and not summary["ratios"]["lora"]["pass_every_seed"]  # 0.944, 0.875
    assert summary["sft_floor"]["per_seed"] == {"1": 1.0, "2": 0.8} and not summary["sft_floor"]["pass_every_seed"]
    assert summary["forgetting"]["sft"]["pass_every_seed"]
    assert not summary["forgetting"]["lora-merged"]["pass_every_seed"]  # 1.6 > 1.5
    result = {"settings": {"seeds": [1, 2], "start": "pretrain"}, "per_method": per_method, "summary": summary}
    text = fq.format_report(result)
    assert "lora-merged ppl <= 1.5x pretrain's on every seed: FAIL" in text
    assert "sft exact match >= 0.85 on every seed: FAIL" in text


def test_finetune_quality_is_a_sweep_over_seeds(tmp_path):
    """The bench writes a sweep of the base experiment over the seeds; the workflow expands it into
    the experiments the bench then reads, each seed's upstream shared by name."""
    sys.path.insert(0, str(ROOT / "bench"))
    import finetune_quality as fq

    args = fq.parse_args(["--seeds", "1", "7", "--prefix", "t", "--generated", str(tmp_path / "sweep.yaml"),
                          "--overrides", str(ROOT / "bench" / "recipes" / "no_mixing.yaml")])
    path, recipe, shared = fq.write_sweep(args)
    generated = yaml.safe_load(path.read_text())
    assert generated["sweeps"]["qt"]["grid"] == {"seed": [1, 7]} and generated["sweeps"]["qt"]["base"] == "qt-base"
    assert recipe["finetune"]["lora"]["mix_ratio"] == 0.0  # the overrides are in the swept base
    assert set(shared) == {fq.experiment_name("t", 1), fq.experiment_name("t", 7)} == {"qt.seed-1", "qt.seed-7"}
    assert len(set(shared.values())) == 2  # each seed pretrains its own model
    assert fq.snakemake_command(args, path)[-4:] == ["results/sweeps/qt/compare.md", "--configfile",
                                                     "config/config.yaml", str(path)]


@pytest.mark.multiproc
def test_stop_check_bench_report_has_its_keys(tmp_path):
    out = tmp_path / "stop_check.json"
    stdout, result = run_script("stop_check.py", out, "--flavour", "debug", "--steps", "2", "--checks", "20", "--batch",
                                "2", "--seq", "32")
    assert "stop check (all-reduce of one integer)" in stdout
    result = result["result"]
    assert result["steps"] == 2 and result["checks"] == 20
    assert result["step_median_s"] > 0 and result["check_median_s"] > 0 and result["check_over_step"] > 0


def test_serve_bench_report_has_its_keys(tmp_path, tiny_tokenizer_dir):
    from checkpoint_fixtures import chat_tokenizer, save_checkpoint

    model = save_checkpoint(tmp_path / "model", chat_tokenizer(tiny_tokenizer_dir))
    out = tmp_path / "serve.json"
    stdout, result = run_script("serve.py", out, "--model", str(model), "--concurrency", "1,2", "--requests", "1",
                                "--max-tokens", "8", "--repeats", "1")
    assert "generate on a batch, tokens/s" in stdout
    result = result["result"]
    assert [v["clients"] for v in result["levels"]] == [1, 2]
    assert [v["requests"] for v in result["levels"]] == [1, 2]
    assert all(v["tokens"] > 0 and v["latency_p95_s"] >= v["latency_p50_s"] > 0 for v in result["levels"])
    single = result["single_request"]
    assert single["tokens"] == single["whole_tokens"] == single["peer_tokens"]


def test_gguf_decode_bench_report_has_its_keys(tmp_path):
    from bench.llama_cpp_runtime import installed

    if not installed():
        pytest.skip("neither llama-cpp-python nor llama-cpp-cffi is installed")
    out = tmp_path / "gguf_decode.json"
    _, result = run_script("gguf_decode.py", out, "--flavour", "debug", "--repeats", "1", "--decode-tokens", "4",
                           "--types", "f32,q4_0")
    assert list(result["runs"]) == ["torch eager f32", "llama.cpp f32", "llama.cpp q4_0"]
    for row in result["runs"].values():
        assert {"tokens_per_s", "ratio_to_torch", "same_prefix", "seconds", "gguf_bytes"} <= row.keys()
        assert 0 <= row["same_prefix"] <= 4  # random weights: near ties, so no equality is asserted here


def test_deploy_decode_bench_report_has_its_keys(tmp_path):
    out = tmp_path / "deploy_decode.json"
    _, result = run_script("deploy_decode.py", out, "--flavour", "debug", "--repeats", "1", "--new-tokens", "4",
                           "--batch-sizes", "1")
    rows = result["runs"]["1"]
    assert {"torch", "wint4 (ours)", "onnx fp32", "onnx int8"} <= set(rows)
    assert all(row["decode_tokens_per_s"] > 0 for row in rows.values())
    assert result["ratios"]["onnx int8/torch b1"] == rows["onnx int8"]["decode_tokens_per_s"] / rows["torch"][
        "decode_tokens_per_s"]


def test_prompt_lookup_bench_report_has_its_keys(tmp_path, debug_model_dir):
    """bench/prompt_lookup.py on the debug model (no chat template: the prompts are plain text): every
    runtime's tokens equal generate's; the engine's forwards and drafts are counted."""
    out = tmp_path / "prompt_lookup.json"
    stdout, result = run_script("prompt_lookup.py", out, "--model", str(debug_model_dir), "--prompts", "1",
                                "--words", "12", "--new-tokens", "8", "--repeats", "1")
    assert "engine + lookup / generate + lookup" in stdout and result["num_prompts"] == 3
    rows = result["runs"]
    assert set(rows) == {"generate", "generate + lookup", "engine", "engine + lookup"}
    assert all(row["equal_to_generate"] and row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["engine"]["forwards_per_token"] == 1.0
    assert rows["engine + lookup"]["forwards_per_token"] <= 1.0


def test_from_text_bench_report_has_its_keys(tmp_path, debug_model_dir):
    """bench/from_text.py on the debug model with the prepared tokenizer and a GGUF of it: every
    runtime with special tokens gives the project's prompt ids; without them, none does."""
    import shutil

    from checkpoint_fixtures import save_prepared_tokenizer

    from stages.data.sft import SftRecord, write_sft_file
    from stages.deployment.gguf_writer import write_gguf

    model = tmp_path / "model"
    shutil.copytree(debug_model_dir, model)
    save_prepared_tokenizer(model)
    write_sft_file(tmp_path / "data" / "sft" / "dev.json",
                   [SftRecord(src=["sky"], tgt=["blue"]), SftRecord(src=["the colour of grass is"], tgt=["green"])])
    write_gguf(model, tmp_path / "m.gguf", "f32")
    out = tmp_path / "from_text.json"
    stdout, result = run_script("from_text.py", out, "--model", str(model), "--data", str(tmp_path / "data"),
                                "--gguf", str(tmp_path / "m.gguf"), "--max-new-tokens", "4")
    assert "same answers" in stdout and result["records"] == 2
    rows = result["runtimes"]
    from bench.llama_cpp_runtime import installed

    gguf = ["GGUF (transformers)", *(["GGUF (llama.cpp)"] if installed() else [])]  # llama.cpp where a binding is
    assert set(rows) == {"project (encode_prompt)", "transformers", "transformers, no special tokens",
                         *gguf, *(f"{g}, no special tokens" for g in gguf)}
    assert rows["transformers"]["same_prompt_ids"] == 2 and all(rows[g]["same_prompt_ids"] == 2 for g in gguf)
    assert rows["transformers, no special tokens"]["same_prompt_ids"] == 0
    assert all(rows[f"{g}, no special tokens"]["same_prompt_ids"] == 0 for g in gguf)


def test_lm_eval_harness_bench_report_has_its_keys(tmp_path, debug_model_dir):
    """bench/lm_eval_harness.py on the debug model, its wint8 variant scored through ours only."""
    from stages import quantize

    quantize.run(debug_model_dir, tmp_path / "wint8", "wint8")
    out = tmp_path / "lm_eval_harness.json"
    stdout, result = run_script("lm_eval_harness.py", out, "--model", str(debug_model_dir), "--documents", "3",
                                "--variants", str(tmp_path / "wint8"))
    assert "ours / HFLM time" in stdout and result["documents"] == 3
    assert set(result["rows"]) == {"HFLM (lm-eval)", "ours", "wint8"}
    assert result["rows"]["ours"]["max_abs_loglik_diff_vs_hflm"] <= 1e-5
    ours, theirs = (result["rows"][k]["lm_eval"]["tasks"]["prose"]["metrics"] for k in ("ours", "HFLM (lm-eval)"))
    assert ours["word_perplexity"] == pytest.approx(theirs["word_perplexity"], rel=1e-5)
    assert result["rows"]["wint8"]["recovery"]["prose"]["word_perplexity"] > 0.5


def test_one_row_linear_bench_report_has_its_keys(tmp_path):
    """bench/one_row_linear.py on one small shape: each way's GB/s, its ratio to eager and its
    difference from F.linear (the check the bench makes of what it times)."""
    out = tmp_path / "one_row_linear.json"
    stdout, result = run_script("one_row_linear.py", out, "--shapes", "64x32", "--megabytes", "0.1",
                                "--per-call", "2", "--repeats", "1")
    assert "one-row x eager" in stdout
    row = result["shapes"]["64x32"]
    assert row["matrices"] % 2 == 0 and row["matrices"] >= 2
    for way in ("eager", "compiled", "compiled one-row"):
        assert row[f"{way} GB/s"] > 0 and row[f"{way} max_abs_diff"] < 1e-4
    assert {"compiled x eager", "compiled one-row x eager"} <= row.keys()


@pytest.mark.multiproc
def test_gpu_stage_resume_trains_and_resumes_bit_identically_on_the_cpu(tmp_path):
    """bench/gpu_stage_resume.py (a step of bench/gpu_checks.sh) on this machine: the pretrain stage and
    its resume from checkpoint-15, the same losses and weights."""
    _, result = run_script("gpu_stage_resume.py", tmp_path / "stage_resume.json")
    assert result["device"] == "cpu" and result["first"]["rc"] == 0 and result["resumed"]["rc"] == 0
    assert result["resumed"]["resumed_from_step"] == 15
    assert result["max_loss_diff"] == 0.0 and result["max_weight_diff"] == 0.0
