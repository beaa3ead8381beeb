"""stages/report.py: eval JSONs + a Snakemake benchmark TSV -> report.csv, report.md, quant_eval.json."""

import json

import pandas as pd
import pytest
import torch

from stages import report
from stages.reporting import plots, tables
from stages.checkpoint.atomic import write_json

# Snakemake 9's benchmark header (extended columns omitted); "-" marks a value not measured.
BENCH_TSV = ("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
             "12.00\t0:00:12\t100.50\t200.00\t90.00\t95.00\t0.10\t1.00\t80.00\t10.00\n"
             "14.00\t0:00:14\t120.50\t210.00\t-\t-\t0.10\t1.00\t90.00\t12.00\n")


def _eval(variant, ppl, em, size, kind="hf"):
    quantized = kind == "quantized"
    return {"variant": variant, "model_dir": f"results/llama/{variant}", "kind": kind, "ppl": ppl,
            "unigram_ppl": 50.0, "ppl_tokens": 1000, "exact_match": em, "bleu4": 0.2, "rouge_l": 0.5,
            "dev_ppl": ppl / 2, "gen_tokens_per_s": 100.0, "size_bytes": size, "num_parameters": 1000,
            "model_bytes": size + 100, "rss_bytes": 10**8, "prefill_tokens_per_s_b1": 1000.0,
            "prefill_tokens_per_s_b8": 4000.0, "decode_tokens_per_s_b1": 200.0 if quantized else 100.0,
            "torch_threads": 2, "kernels": {"int8pack": 14} if quantized else {},
            "quantization": {"method": "rtn", "bits": 8, "group_size": -1, "quantize_seconds": 0.5,
                             "num_quantized_layers": 14} if quantized else None,
            "settings": {"max_new_tokens": 32}, "samples": [{"src": "a", "reference": "b", "prediction": "c"}]}


@pytest.fixture
def experiment(tmp_path):
    exp = tmp_path / "llama"
    write_json(exp / "eval" / "lora-merged.json", _eval("lora-merged", 10.0, 0.5, 4000))
    write_json(exp / "eval" / "wint8.json", _eval("wint8", 11.0, 0.5, 1000, "quantized"))
    write_json(exp / "eval" / "wint4.json", _eval("wint4", 12.5, 0.25, 500, "quantized"))
    write_json(exp / "eval" / "sft.json", _eval("sft", 9.0, 0.0, 4000))
    (exp / "benchmarks").mkdir()
    (exp / "benchmarks" / "evaluate_wint8.tsv").write_text(BENCH_TSV)
    (exp / "benchmarks" / "prepare.tsv").write_text(BENCH_TSV.splitlines()[0] + "\n" + BENCH_TSV.splitlines()[1] + "\n")
    return exp


def _run(exp, variants=("wint8", "wint4")):
    out = exp / "out"
    result = report.run(exp, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
                        list(variants))
    return result, out


def test_quant_eval_deltas(experiment):
    result, out = _run(experiment)
    quant = json.loads((out / "quant_eval.json").read_text())
    assert quant == json.loads(json.dumps(result))
    assert quant["experiment"] == "llama" and quant["source"] == "lora-merged"
    assert quant["baseline"]["ppl"] == 10.0 and "samples" not in quant["baseline"]
    assert list(quant["variants"]) == ["wint8", "wint4"]
    w4 = quant["variants"]["wint4"]
    assert w4["ppl"] == 12.5 and w4["kind"] == "quantized"
    assert w4["delta"]["ppl"] == pytest.approx(2.5)
    assert w4["relative"]["ppl"] == pytest.approx(0.25)
    assert w4["delta"]["exact_match"] == pytest.approx(-0.25)
    assert w4["relative"]["size_bytes"] == pytest.approx(500 / 4000 - 1)
    assert quant["variants"]["wint8"]["delta"]["bleu4"] == 0.0
    assert "variant" not in w4["delta"] and "model_dir" not in w4["delta"]
    # deltas only for quality, size and speed; counts, settings and quantization timings never
    assert set(w4["delta"]) == {"ppl", "dev_ppl", "exact_match", "bleu4", "rouge_l", "size_bytes", "model_bytes",
                                "prefill_tokens_per_s_b1", "prefill_tokens_per_s_b8", "decode_tokens_per_s_b1",
                                "gen_tokens_per_s"}
    assert w4["relative"]["decode_tokens_per_s_b1"] == pytest.approx(1.0)
    assert w4["kernels"] == {"int8pack": 14} and quant["baseline"]["kernels"] == {}
    assert w4["quantization"] == {"method": "rtn", "bits": 8, "group_size": -1, "quantize_seconds": 0.5}
    assert quant["baseline"]["quantization"] is None and quant["schema_version"] == 3
    prov = quant["provenance"]
    assert prov["versions"]["torch"] == torch.__version__.split("+")[0] or prov["versions"]["torch"] == torch.__version__
    assert prov["machine"]["cores"] >= 1 and prov["evaluate"] == {"max_new_tokens": 32}
    assert len(prov["commit"]) == 40  # the tests run inside the repository


def test_csv_has_one_row_per_variant(experiment):
    _, out = _run(experiment)
    df = pd.read_csv(out / "report.csv", index_col="variant")
    # the reference (here the source), the fine-tuned variants in chain order, the quantized ones
    assert list(df.index) == ["lora-merged", "sft", "wint8", "wint4"]
    assert df.loc["wint4", "ppl"] == 12.5 and df.loc["sft", "size_bytes"] == 4000
    assert "samples" not in df.columns and "settings" not in df.columns


def test_benchmarks_and_markdown(experiment):
    timings = report.read_benchmarks(experiment)
    assert list(timings.index) == ["evaluate_wint8", "prepare"]
    row = timings.loc["evaluate_wint8"]
    assert row["runs"] == 2 and row["s"] == pytest.approx(13.0) and row["max_rss"] == pytest.approx(120.5)
    assert row["max_uss"] == pytest.approx(90.0)  # "-" is missing, not zero
    _, out = _run(experiment)
    md = (out / "report.md").read_text()
    # narrow tables in human units, every variant against the reference (here the source)
    assert "| variant | corpus ppl | × lora-merged | dev ppl | exact match | EM vs lora-merged |" in md
    assert "| wint4 | 12.50 | ×1.25 | 6.250 | 25.0% | -25.0 pts | 20.0 | 50.0 |" in md
    assert "| wint4 | 0.0 | ×0.125 | 0.0 |  | 100.0 |" in md  # MB on disk, ratio, in memory, bits, peak RSS
    assert "| wint8 | 1,000 | 4,000 | 200 | ×2 | 100 | int8pack (14) |" in md
    assert "| evaluate_wint8 | 13.0 s | 11.0 s | 120 |" in md  # mean of the repeats, the peak memory
    assert md.index("| prepare |") < md.index("| evaluate_wint8 |")  # chain order


def test_markdown_table_escapes_and_formats():
    df = pd.DataFrame({"a": [1.23456789, float("nan")], "b": ["x|y", "z"]}, index=pd.Index(["r1", "r2"], name="k"))
    assert report.markdown_table(df).splitlines() == [
        "| k | a | b |", "|---|---|---|", "| r1 | 1.235 | x\\|y |", "| r2 |  | z |"]


def test_missing_eval_json_is_named(experiment):
    (experiment / "eval" / "wint4.json").unlink()
    with pytest.raises(ValueError, match=r"eval/wint4\.json is missing"):
        _run(experiment)
    assert not (experiment / "out").exists()  # nothing half-written


def test_source_listed_as_variant_is_an_error(experiment):
    with pytest.raises(ValueError, match="also listed"):
        _run(experiment, variants=["wint8", "lora-merged"])


def test_cli_without_benchmarks(experiment, tmp_path):
    import shutil

    shutil.rmtree(experiment / "benchmarks")
    out = tmp_path / "cli"
    report.main(["--experiment-dir", str(experiment), "--source", "lora-merged", "--variants", "wint8",
                 "--csv", str(out / "r.csv"), "--md", str(out / "r.md"), "--quant-eval", str(out / "q.json")])
    assert "No benchmark files found." in (out / "r.md").read_text()
    assert list(json.loads((out / "q.json").read_text())["variants"]) == ["wint8"]


def test_summary_sets_forgetting_beside_the_task(experiment):
    write_json(experiment / "eval" / "pretrain.json", _eval("pretrain", 6.0, 0.0, 4000))
    write_json(experiment / "eval" / "lora.json", _eval("lora", 12.0, 0.4, 100))
    write_json(experiment / "eval" / "sft.json", _eval("sft", 9.0, 0.5, 4000))
    out = experiment / "out"
    quant = report.run(experiment, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
                       ["wint8"], start_variant="pretrain")
    summary = json.loads((out / "quant_eval.json").read_text())["summary"]
    assert summary == json.loads(json.dumps(quant["summary"]))
    assert summary["start"] == "pretrain" and summary["start_ppl"] == 6.0
    assert list(summary["variants"]) == ["sft", "lora", "lora-merged"]  # fine-tuned only, in chain order
    assert summary["variants"]["sft"]["ppl_ratio"] == pytest.approx(1.5)
    assert summary["variants"]["lora-merged"]["ppl_ratio"] == pytest.approx(10 / 6)
    assert summary["variants"]["lora"]["exact_match_ratio"] == pytest.approx(0.8)
    md = (out / "report.md").read_text()
    assert md.index("## Fine-tuning: the task learned, the language kept") < md.index("## Quality")
    assert "| lora | 40.0% | 80.0% | 6.000 | 12.00 | ×2 |" in md
    assert "Every variant against the starting model `pretrain`" in md
    quality = md[md.index("## Quality"):md.index("## Size and memory")]
    assert quality.index("| pretrain |") < quality.index("| sft |") < quality.index("| lora |") \
        < quality.index("| lora-merged |") < quality.index("| wint8 |")


def test_no_summary_without_a_start(experiment):
    quant, out = _run(experiment)
    assert quant["summary"] is None and "## Fine-tuning" not in (out / "report.md").read_text()


def test_human_units():
    assert [tables.fmt_float(v) for v in (48.6512, 0.98437, 10170.4, 2.15e6, None)] == \
        ["48.65", "0.9844", "10,170", "2.150e+06", ""]
    assert tables.fmt_seconds(3.71) == "3.7 s" and tables.fmt_seconds(163.4) == "2 min 43 s"
    assert tables.fmt_seconds(3725) == "1 h 02 min"
    assert tables.fmt_ratio(59.21, 48.65) == "×1.22" and tables.fmt_ratio(1.0, 0) == ""
    assert tables.fmt_points(0.984375, 0.0) == "+98.4 pts" and tables.fmt_percent(0.5) == "50.0%"
    assert tables.fmt_mb(20198496) == "20.2" and tables.fmt_rate(13899.4) == "13,899"


def test_bleu_and_rouge_labels_name_their_implementation(experiment):
    evals = report.read_evals(experiment, [])
    plain = tables.quality_table(evals, ["lora-merged", "wint8"], "lora-merged")
    assert "BLEU-4" in plain.display.columns and "ROUGE-L" in plain.display.columns  # eval files of before
    from stages.metrics.text import metric_implementations

    evals["wint8"]["metric_implementations"] = metric_implementations()
    quality = tables.quality_table(evals, ["lora-merged", "wint8"], "lora-merged")
    assert "BLEU-4 (sacrebleu, 13a)" in quality.display.columns
    assert "ROUGE-L F1 (rouge-score)" in quality.display.columns


def _train_log(path, steps, eval_every=0):
    from stages.training.log import COLUMNS

    rows = [",".join(COLUMNS)]
    for step in range(1, steps + 1):
        evaluation = f"{3.0 - step / steps:.6f},0.5,0.1,0.2" if eval_every and step % eval_every == 0 else ",,,"
        rows.append(f"{step},{4.0 - step / steps:.6f},{1e-3 * step / steps:.6e},1.0,100,1000.0,,{step * 0.1:.3f},"
                    + evaluation)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR width, height


def test_figures_and_table_csvs(experiment):
    _train_log(experiment / "sft" / "train_log.csv", 40, eval_every=10)
    out = experiment / "out"
    report.run(experiment, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
               ["wint8", "wint4"], figures_dir=out / "report")
    md = (out / "report.md").read_text()
    for name in report.FIGURES:
        assert f"](report/{name})" in md  # linked relative to report.md
        width, height = _png_size(out / "report" / name)
        assert width > 300 and height > 200
    one_stage_width = _png_size(out / "report" / "training.png")[0]
    _train_log(experiment / "pretrain" / "train_log.csv", 60)
    _train_log(experiment / "lora" / "train_log.csv", 30)
    assert list(plots.training_logs(experiment)) == ["pretrain", "sft", "lora"]  # chain order
    sft_log = plots.training_logs(experiment)["sft"]
    assert sft_log["eval_loss"].notna().sum() == 4 and sft_log["loss"].iloc[-1] == pytest.approx(3.0)
    report.run(experiment, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
               ["wint8", "wint4"], figures_dir=out / "report")
    assert _png_size(out / "report" / "training.png")[0] > 2 * one_stage_width  # a column per stage
    quality = pd.read_csv(out / "report" / "quality.csv", index_col="variant")
    assert quality.loc["wint4", "corpus_ppl"] == 12.5
    assert quality.loc["wint4", "corpus_ppl_ratio"] == pytest.approx(1.25)
    size = pd.read_csv(out / "report" / "size.csv", index_col="variant")
    assert size.loc["wint8", "size_mb"] == pytest.approx(1000 / 1e6)
    speed = pd.read_csv(out / "report" / "speed.csv", index_col="variant")
    assert speed.loc["wint8", "decode_tokens_per_s_ratio"] == pytest.approx(2.0)
    stages = pd.read_csv(out / "report" / "stages.csv", index_col="stage")
    assert stages.loc["evaluate_wint8", "wall_s"] == pytest.approx(13.0)


def test_figures_without_training_logs_or_benchmarks(experiment, tmp_path):
    import shutil

    shutil.rmtree(experiment / "benchmarks")
    out = tmp_path / "bare"
    report.run(experiment, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
               ["wint8"], figures_dir=out / "figures")
    assert all(_png_size(out / "figures" / name)[0] > 0 for name in report.FIGURES)
    assert "](figures/training.png)" in (out / "report.md").read_text()


def test_measured_columns_are_known_as_measurements(experiment):
    """Two runs of the same chain must write the same report apart from what stages.metrics.measured
    names (the rerun test drops those): every speed and memory column, nothing else."""
    from stages.metrics.measured import is_measured

    evals = report.read_evals(experiment, [])
    order = ["lora-merged", "wint8"]
    speed = tables.speed_table(evals, order, "lora-merged")
    assert [c for c in speed.display.columns if not is_measured(c)] == ["kernels"]
    assert all(is_measured(c) for c in speed.numbers.columns)
    stages = tables.stage_table(report.read_benchmarks(experiment))
    assert all(is_measured(c) for c in (*stages.display.columns, *stages.numbers.columns))
    size = tables.size_table(evals, order, "lora-merged")
    assert [c for c in (*size.display.columns, *size.numbers.columns) if is_measured(c)] == \
        ["peak RSS (MB)", "peak_rss_mb"]
    quality = tables.quality_table(evals, order, "lora-merged")
    assert not any(is_measured(c) for c in (*quality.display.columns, *quality.numbers.columns))


def _aligned(experiment, meta_config):
    """eval/align.json (and, with `meta_config`, the align model's meta.json) beside the experiment's."""
    for name, accuracy, margin in (("sft", 0.625, 1.5), ("align", 0.96875, 12.25)):
        metrics = json.loads((experiment / "eval" / "sft.json").read_text()) if name == "sft" else \
            _eval("align", 9.5, 0.75, 4000)
        metrics.update(preference_accuracy=accuracy, preference_margin=margin, preference_pairs=64,
                       model_dir=str(experiment / name))
        write_json(experiment / "eval" / f"{name}.json", metrics)
    if meta_config is not None:
        write_json(experiment / "align" / "meta.json", {"stage": "align", "config": meta_config})


@pytest.mark.parametrize("meta_config, flag, source", [
    ({"source": "sft", "method": "dpo"}, None, "sft"),  # from the align model's meta.json
    (None, None, "sft"),  # no meta.json: align.source's default
    ({"source": "lora-merged", "method": "simpo"}, None, "lora-merged"),
    ({"source": "lora-merged"}, "sft", "sft"),  # --align-source wins
])
def test_alignment_table_sets_align_beside_its_source(experiment, meta_config, flag, source):
    _aligned(experiment, meta_config)
    out = experiment / "out"
    report.run(experiment, "lora-merged", out / "report.csv", out / "report.md", out / "quant_eval.json",
               ["wint8"], figures_dir=out / "report", align_source=flag)
    md = (out / "report.md").read_text()
    table = md[md.index("## Alignment"):md.index("## Quality")]
    assert "| variant | preference accuracy | preference margin (nats) | exact match | corpus ppl |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "variant" not in line]
    sft_row, merged_row = "| sft | 62.5% | 1.500 | 0.0% | 9.000 |", "| lora-merged |  |  | 50.0% | 10.00 |"
    assert rows == [sft_row if source == "sft" else merged_row, "| align | 96.9% | 12.25 | 75.0% | 9.500 |"]
    assert f"of `{source}` into `align`" in table and "(64)" in table
    assert ("(simpo)" in table) == (meta_config == {"source": "lora-merged", "method": "simpo"})
    numbers = pd.read_csv(out / "report.csv", index_col="variant")  # no alignment.csv: not a declared output
    assert numbers.loc["align", "preference_margin"] == 12.25 and numbers.loc["align", "ppl"] == 9.5
    assert not (out / "report" / "alignment.csv").exists()
    assert list(pd.read_csv(out / "report.csv", index_col="variant").index)[:3] == ["lora-merged", "sft", "align"]


def test_no_alignment_table_without_an_align_variant(experiment):
    _, out = _run(experiment)
    assert "## Alignment" not in (out / "report.md").read_text()


def _lm_eval(acc, em, ppl):
    """An eval JSON's lm_eval with one higher-is-better and one lower-is-better metric."""
    return {"version": "0.4.13", "limit": 8, "num_fewshot": None, "chat_template": False, "wall_seconds": 1.0,
            "tasks": {"lifecycle_pairs": {"metrics": {"acc": acc, "acc_norm": acc}, "samples": 8, "num_fewshot": 0,
                                          "higher_is_better": {"acc": True, "acc_norm": True}},
                      "lifecycle_qa": {"metrics": {"exact_match": em}, "samples": 8, "num_fewshot": 0,
                                       "higher_is_better": {"exact_match": True}},
                      "prose": {"metrics": {"word_perplexity": ppl}, "samples": 8, "num_fewshot": 0,
                                "higher_is_better": {"word_perplexity": False}}}}


def test_lm_eval_scores_and_their_recovery(experiment):
    """quant_eval.json: each entry's lm-eval scores, each quantized variant's recovery of the
    source's (inverted for a lower-is-better metric, null against a zero); report.md's table."""
    for name, scores in (("lora-merged", (0.8, 0.5, 20.0)), ("wint8", (0.8, 0.5, 20.0)), ("wint4", (0.6, 0.0, 25.0))):
        path = experiment / "eval" / f"{name}.json"
        write_json(path, {**json.loads(path.read_text()), "lm_eval": _lm_eval(*scores)})
    result, out = _run(experiment)
    assert result["baseline"]["lm_eval"]["lifecycle_pairs"] == {"acc": 0.8, "acc_norm": 0.8}
    w4 = result["variants"]["wint4"]["recovery"]
    assert w4["lifecycle_pairs"]["acc"] == pytest.approx(0.75)
    assert w4["lifecycle_qa"]["exact_match"] == 0.0
    assert w4["prose"]["word_perplexity"] == pytest.approx(20.0 / 25.0)
    assert result["variants"]["wint8"]["recovery"]["lifecycle_qa"]["exact_match"] == 1.0
    md = (out / "report.md").read_text()
    assert "## Standard tasks (lm-evaluation-harness)" in md and "lm-evaluation-harness 0.4.13" in md
    section = md.split("## Standard tasks")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| wint4"))
    assert "60.0%" in row and "75.0%" in row and "80.0%" in row  # acc, its recovery, perplexity kept


def test_no_task_table_without_lm_eval(experiment):
    result, out = _run(experiment)
    assert result["baseline"]["lm_eval"] is None and result["variants"]["wint4"]["recovery"] is None
    assert "Standard tasks" not in (out / "report.md").read_text()
