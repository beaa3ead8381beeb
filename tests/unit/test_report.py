"""stages/report.py: eval JSONs + a Snakemake benchmark TSV -> report.csv, report.md, quant_eval.json."""

import json

import pandas as pd
import pytest
import torch

from stages import report
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
    assert list(df.index) == ["lora-merged", "wint8", "wint4", "sft"]  # source, compared, then the rest
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
    assert "## Metrics per variant" in md and "| variant | kind | ppl |" in md
    assert "| evaluate_wint8 | 2 | 13 |" in md
    assert "| wint4 | 2.5 |" in md  # the Δ ppl column


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
    assert md.index("## Fine-tuning: the task learned, the language kept") < md.index("## Metrics per variant")
    assert "| lora | 0.4 | 0.8 | 6 | 12 | 2 |" in md


def test_no_summary_without_a_start(experiment):
    quant, out = _run(experiment)
    assert quant["summary"] is None and "## Fine-tuning" not in (out / "report.md").read_text()
