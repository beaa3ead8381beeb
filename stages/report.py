"""Aggregate an experiment's evaluations and stage timings into report.csv, report.md and
quant_eval.json.

`python -m stages.report --experiment-dir DIR --source NAME --variants A B ... --csv FILE --md FILE
 --quant-eval FILE`

Inputs, all under the experiment dir (results/<experiment>/):
  eval/<variant>.json      one per evaluated variant (schema in stages/evaluate.py); every file
                           present becomes a row of the metrics table. `eval/<source>.json` and
                           `eval/<v>.json` for every v in `variants` must exist.
  benchmarks/**/*.tsv      Snakemake `benchmark:` files (`<rule>.tsv` or `<rule>_<wildcard>.tsv`;
                           columns s, h:m:s, max_rss, max_vms, ..., cpu_time; times in seconds,
                           memory in MB); "-" or "NA" mean not measured. One row per file in the timing table (mean over repeats,
                           max of memory).

Outputs (each written atomically):
  report.csv        the metrics table: one row per variant, every scalar metric as a column
  report.md         markdown for a person: what fine-tuning did (task score beside forgetting), then
                    narrow tables in human units (stages.reporting.tables: alignment when the variant
                    `align` was evaluated, quality, standard tasks when evaluate.lm_eval_tasks ran
                    (stages.reporting.task_recovery: scores and recovery against the source), size and
                    memory, speed, stage timings), each variant against the starting model, and the plots
  --figures-dir     (optional) training.png, quantization.png, stages.png (stages.reporting.plots)
                    and the narrow tables' numbers as quality.csv, size.csv, speed.csv, stages.csv
                    (the alignment table's are report.csv's preference_* columns, the standard tasks'
                    quant_eval.json's lm_eval and recovery)
  quant_eval.json   the quantization comparison, one object (schema_version 3):
    schema_version  3
    experiment      name of the experiment dir
    source          the variant the quantized ones are made of and compared with (quantize.source)
    provenance      commit (git HEAD of the working dir, null outside a repository), dirty (tracked
                    files modified), versions (python, torch, transformers, peft, deepspeed,
                    safetensors, snakemake, pandas), machine (cpu model, cores), quantize (the
                    experiment's quantize section, from --quantize-config), evaluate (the settings the
                    evaluations used)
    baseline        the source's entry
    variants        {name: entry + "delta" and "relative"} for each quantized variant
    summary         what fine-tuning did (null without --start): start (the variant fine-tuning
                    started from), start_ppl (its corpus perplexity), and per fine-tuned variant
                    (sft, lora, prefix, lora-merged, those evaluated) {ppl, ppl_ratio (ppl / start_ppl:
                    1 means nothing of the language was forgotten), dev_ppl, exact_match,
                    exact_match_ratio (against sft's, null without sft)}
  An entry holds, from eval/<variant>.json (stages/evaluate.py documents each):
    kind, model_dir
    quality         ppl, dev_ppl, exact_match, bleu4, rouge_l
    size            size_bytes (on disk), model_bytes (resident parameters and buffers), rss_bytes
    speed           prefill_tokens_per_s_b1, prefill_tokens_per_s_b8 (one per evaluate.speed_batch_sizes),
                    decode_tokens_per_s_b1, gen_tokens_per_s (batched greedy dev generation),
                    speed_tokens (the lengths used), torch_threads
    counts          num_parameters, num_dev_examples, dev_ppl_tokens, ppl_tokens, gen_tokens
    kernels         {kernel: layers} the variant ran on (int8pack, int4pack, int_mm, dequantized)
    lm_eval         {task: {metric: value}} of the lm-evaluation-harness tasks the variant ran
                    (evaluate.lm_eval_tasks), null without them
    quantization    null for the baseline; for variants, from quant/<v>/meta.json: method, spec (every
                    setting applied), bits, group_size, bits_per_weight, compression_ratio,
                    mean_rel_weight_error, quantize_seconds, seconds_per_decoder_layer (calibrated
                    methods), calibration (source, seed, seq_len, num_samples, num_windows,
                    num_tokens, memory_bytes)
  delta = variant - baseline and relative = variant / baseline - 1 (null when the baseline is 0) for
  the quality, size and speed metrics only (never counts, settings or timings of the quantization).
  recovery = {task: {metric: variant / baseline}} for the lm-eval tasks both ran (baseline / variant
  for a lower-is-better metric; stages.reporting.task_recovery), null when either ran none.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from stages.checkpoint.atomic import atomic_file, write_json
from stages.errors import InputError, run_cli
from stages.reporting import tables
from stages.reporting.markdown import markdown_table
from stages.reporting.tables import is_number
from stages.reporting.task_recovery import recovery, task_scores, task_table
from stages.sections import AlignSettings
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger(__name__)

QUANT_EVAL_VERSION = 3
FINETUNED = ("sft", "lora", "prefix", "lora-merged")  # the fine-tuned variants, in report order
ALIGNED = "align"  # the preference-aligned variant (stages.align), after the fine-tuned ones
QUALITY = ("ppl", "dev_ppl", "exact_match", "bleu4", "rouge_l")
SIZE = ("size_bytes", "model_bytes", "rss_bytes")
SPEED_FIXED = ("decode_tokens_per_s_b1", "gen_tokens_per_s", "speed_tokens", "torch_threads")
COUNTS = ("num_parameters", "num_dev_examples", "dev_ppl_tokens", "ppl_tokens", "gen_tokens")
_QUANTIZATION_KEYS = ("method", "spec", "bits", "group_size", "bits_per_weight", "compression_ratio",
                      "mean_rel_weight_error", "quantize_seconds", "seconds_per_decoder_layer", "calibration")
_VERSIONED = ("torch", "transformers", "peft", "deepspeed", "safetensors", "snakemake", "pandas")
FIGURES = ("training.png", "quantization.png", "stages.png")  # written by --figures-dir
_TIMING_COLUMNS = ("s", "cpu_time", "max_rss", "max_uss", "mean_load", "io_in", "io_out")


# -- reading -------------------------------------------------------------------------------------
def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The flat part of a metrics JSON (drops nested `settings`, `samples`)."""
    return {k: v for k, v in metrics.items() if v is None or isinstance(v, (str, int, float, bool))}


def read_evals(experiment_dir: str | Path, required: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{variant: metrics} from every eval/*.json; a missing required variant is a ValueError."""
    eval_dir = Path(experiment_dir) / "eval"
    for name in required:
        if not (eval_dir / f"{name}.json").exists():
            raise InputError(f"{eval_dir / (name + '.json')} is missing: variant {name!r} was not evaluated; "
                             f"run `python -m stages.evaluate --variant {name} --out {eval_dir / (name + '.json')} ...` "
                             "or remove it from the report's variants")
    evals = {}
    for path in sorted(eval_dir.glob("*.json")):
        try:
            metrics = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-run its evaluation") from None
        if metrics.get("variant", path.stem) != path.stem:
            # The file name is the contract (eval/<variant>.json); the field is informative.
            log.warning("%s says variant=%r; using the file name %r", path, metrics["variant"], path.stem)
        evals[path.stem] = {**metrics, "variant": path.stem}
    return evals


def metrics_table(evals: dict[str, dict[str, Any]], first: Sequence[str] = ()) -> pd.DataFrame:
    """One row per variant (index `variant`), scalar metrics as columns; `first` rows lead."""
    order = [v for v in first if v in evals] + sorted(v for v in evals if v not in first)
    df = pd.DataFrame([_scalars(evals[v]) for v in order])
    return df.set_index("variant")


def read_benchmarks(experiment_dir: str | Path) -> pd.DataFrame:
    """Stage timings from Snakemake benchmark TSVs; an empty frame when there are none."""
    bench_dir = Path(experiment_dir) / "benchmarks"
    rows = []
    for path in sorted(bench_dir.rglob("*.tsv")) if bench_dir.is_dir() else []:
        df = pd.read_csv(path, sep="\t", na_values=["-", "NA"])
        if "s" not in df.columns:
            raise InputError(f"{path} has no 's' column (columns: {list(df.columns)}); expected a Snakemake "
                             "benchmark file")
        row: dict[str, Any] = {"benchmark": str(path.relative_to(bench_dir).with_suffix("")), "runs": len(df)}
        for col in _TIMING_COLUMNS:
            if col in df.columns:
                values = pd.to_numeric(df[col], errors="coerce")
                # Memory is a peak: the worst repeat matters; times and loads are averaged.
                row[col] = values.max() if col.startswith("max_") else values.mean()
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=["benchmark", "runs", "s"]).set_index("benchmark")
    return pd.DataFrame(rows).set_index("benchmark")


# -- quantization deltas -------------------------------------------------------------------------
def _speed_keys(metrics: dict[str, Any]) -> list[str]:
    prefill = sorted((k for k in metrics if k.startswith("prefill_tokens_per_s_b")),
                     key=lambda k: int(k.rsplit("_b", 1)[1]))
    return [*prefill, *SPEED_FIXED]


def entry(metrics: dict[str, Any]) -> dict[str, Any]:
    """One variant's quant_eval.json entry (see the module docstring) from its eval JSON."""
    quantization = metrics.get("quantization")
    out: dict[str, Any] = {"kind": metrics.get("kind"), "model_dir": metrics.get("model_dir")}
    for key in (*QUALITY, *SIZE, *_speed_keys(metrics), *COUNTS):
        out[key] = metrics.get(key)
    out["kernels"] = metrics.get("kernels") or {}
    out["lm_eval"] = task_scores(metrics)
    out["quantization"] = None if quantization is None else \
        {k: quantization[k] for k in _QUANTIZATION_KEYS if k in quantization}
    return out


def provenance(quantize_config: dict[str, Any] | None, evaluate_settings: dict[str, Any] | None) -> dict[str, Any]:
    """Where the numbers come from: commit, library versions, machine and the settings used."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=True)
            return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = platform.processor() or None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "versions": versions, "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": sys.platform},
            "quantize": quantize_config, "evaluate": evaluate_settings}


def quant_eval(evals: dict[str, dict[str, Any]], experiment: str, source: str, variants: Sequence[str],
               quantize_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The quant_eval.json object (see the module docstring)."""
    baseline = entry(evals[source])
    out: dict[str, Any] = {"schema_version": QUANT_EVAL_VERSION, "experiment": experiment, "source": source,
                           "provenance": provenance(quantize_config, evals[source].get("settings")),
                           "baseline": baseline, "variants": {}}
    compared = (*QUALITY, *SIZE[:2], *[k for k in _speed_keys(baseline) if k not in ("torch_threads", "speed_tokens")])
    for name in variants:
        metrics = entry(evals[name])
        delta, relative = {}, {}
        for key in compared:
            value, base = metrics.get(key), baseline.get(key)
            if is_number(value) and is_number(base):
                delta[key] = value - base
                relative[key] = value / base - 1.0 if base != 0 else None
        out["variants"][name] = {**metrics, "delta": delta, "relative": relative,
                                 "recovery": recovery(evals[name], evals[source])}
    return out


def finetune_summary(evals: dict[str, dict[str, Any]], start: str | None) -> dict[str, Any] | None:
    """quant_eval.json's `summary`: each fine-tuned variant's corpus perplexity against the model
    it started from (forgetting) beside its task score (see the module docstring)."""
    if start is None or start not in evals:
        return None
    start_ppl = evals[start].get("ppl")
    sft_em = evals.get("sft", {}).get("exact_match")
    variants = {}
    for name in (v for v in FINETUNED if v in evals):
        m = evals[name]
        ppl, em = m.get("ppl"), m.get("exact_match")
        variants[name] = {
            "ppl": ppl, "ppl_ratio": ppl / start_ppl if is_number(ppl) and is_number(start_ppl) and start_ppl else None,
            "dev_ppl": m.get("dev_ppl"), "exact_match": em,
            "exact_match_ratio": em / sft_em if is_number(em) and is_number(sft_em) and sft_em else None}
    return {"start": start, "start_ppl": start_ppl, "variants": variants}


def _summary_markdown(summary: dict[str, Any]) -> list[str]:
    start = summary["start"]
    rows = {name: {"exact match": tables.fmt_percent(v["exact_match"]),
                   "of SFT's": tables.fmt_percent(v["exact_match_ratio"]), "dev ppl": tables.fmt_float(v["dev_ppl"]),
                   "corpus ppl": tables.fmt_float(v["ppl"]),
                   f"× {start}'s": "" if v["ppl_ratio"] is None else f"×{v['ppl_ratio']:.3g}"}
            for name, v in summary["variants"].items()}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "variant"
    return ["## Fine-tuning: the task learned, the language kept", "",
            f"Exact match on the dev task, and corpus perplexity against `{start}`'s "
            f"({tables.fmt_float(summary['start_ppl'])}): a ratio near 1 means the model is still the language "
            "model it started as.", "", markdown_table(table), ""]


def align_config(evals: dict[str, dict[str, Any]], source: str | None = None) -> tuple[str, str | None]:
    """(source, method) of the aligned variant: `source` when given, else the `config` of its
    meta.json (beside the model dir its eval JSON names), else the align section's default source."""
    path = Path(evals[ALIGNED].get("model_dir") or ".") / "meta.json"
    config = {}
    if path.is_file():
        config = json.loads(path.read_text()).get("config") or {}
    elif source is None:
        log.warning("%s is missing: the alignment table assumes align.source's default", path)
    return source or config.get("source") or AlignSettings.of({}).source, config.get("method")


# -- markdown ------------------------------------------------------------------------------------
def variant_order(evals: dict[str, dict[str, Any]], reference: str, source: str, variants: Sequence[str]) -> list[str]:
    """The report's row order: the starting model, the fine-tuned variants in chain order, the aligned
    one and its merge, the quantization source, its quantized variants, then anything else evaluated (sorted)."""
    first = [reference, *FINETUNED, ALIGNED, f"{ALIGNED}-merged", source, *variants]
    order = list(dict.fromkeys(v for v in first if v in evals))
    return order + sorted(v for v in evals if v not in order)


def _table_markdown(table: tables.Table) -> list[str]:
    return [f"## {table.title}", "", table.caption, "", markdown_table(table.display), ""]


def _markdown_report(experiment: str, quant: dict[str, Any], report_tables: Sequence[tables.Table],
                     reference: str, figures: Sequence[str] = ()) -> str:
    source = quant["source"]
    parts = [f"# Report: {experiment}", "",
             f"Every variant against the starting model `{reference}`; the quantized variants are made of "
             f"`{source}`. All metrics of every variant: `report.csv`; the quantization comparison: "
             "`quant_eval.json`.", ""]
    if quant.get("summary") and quant["summary"]["variants"]:
        parts += _summary_markdown(quant["summary"])
    for table in report_tables:
        empty = [f"## {table.title}", "", "No benchmark files found.", ""]
        parts += _table_markdown(table) if len(table.display) else empty
    if figures:
        parts += ["## Plots", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    return "\n".join(parts)


# -- the stage -----------------------------------------------------------------------------------
def run(experiment_dir: str | Path, source_variant: str, out_csv: str | Path, out_md: str | Path,
        out_quant_eval: str | Path, variants: list[str], start_variant: str | None = None,
        quantize_config: dict[str, Any] | None = None, figures_dir: str | Path | None = None,
        deploy_manifest: str | Path | None = None, align_source: str | None = None) -> dict[str, Any]:
    """Write report.csv, report.md and quant_eval.json; return the quant_eval object. Every
    variant is compared with `start_variant` (the model fine-tuning started from: `base` or
    `pretrain`), or with the source without one. With `figures_dir`, also the plots
    (stages.reporting.plots) and each narrow table as CSV there, linked from report.md. With
    `deploy_manifest` (stages.deploy.manifest), a table of the deployable artifacts and their checks.
    When `align` was evaluated, an Alignment table sets it beside the variant it was aligned from:
    `align_source`, else the align directory's meta.json `config.source` (`align_config`)."""
    experiment_dir = Path(experiment_dir)
    log_io("report", reads={"evaluations": experiment_dir / "eval", "benchmarks": experiment_dir / "benchmarks",
                            "training logs": experiment_dir / "*" / "train_log.csv"},
           writes={"tables": [out_csv, out_md], "quantization comparison": out_quant_eval,
                   "plots and table CSVs": figures_dir}, logger=log)
    if source_variant in variants:
        raise InputError(f"source variant {source_variant!r} is also listed in variants {list(variants)}; "
                         "variants are the ones compared against the source")
    evals = read_evals(experiment_dir, [source_variant, *variants, *([start_variant] if start_variant else [])])
    reference = start_variant or source_variant
    order = variant_order(evals, reference, source_variant, variants)
    table = metrics_table(evals, first=order)
    timings = read_benchmarks(experiment_dir)
    quant = quant_eval(evals, experiment_dir.name, source_variant, variants, quantize_config)
    quant["summary"] = finetune_summary(evals, start_variant)
    report_tables = [tables.quality_table(evals, order, reference), tables.size_table(evals, order, reference),
                     tables.speed_table(evals, order, reference), tables.stage_table(timings)]
    standard_tasks = task_table(evals, order, source_variant)
    if standard_tasks is not None:
        report_tables.insert(1, standard_tasks)
    if ALIGNED in evals:
        report_tables.insert(0, tables.alignment_table(evals, ALIGNED, *align_config(evals, align_source)))
    if deploy_manifest is not None:
        report_tables.append(tables.deploy_table(json.loads(Path(deploy_manifest).read_text())))

    figures: list[str] = []
    if figures_dir is not None:
        figures = _write_figures(Path(figures_dir), experiment_dir, evals, [source_variant, *variants], timings)
        for t in report_tables:
            # not declared outputs (they exist only with align / lm-eval tasks): report.csv and
            # quant_eval.json hold their numbers
            if t.name in ("alignment", "tasks"):
                continue
            with atomic_file(Path(figures_dir) / f"{t.name}.csv") as f:
                t.numbers.to_csv(f)
        figures = [os.path.relpath(Path(figures_dir) / f, Path(out_md).parent) for f in figures]
    with atomic_file(out_csv) as f:
        table.to_csv(f)
    with atomic_file(out_md) as f:
        f.write(_markdown_report(experiment_dir.name, quant, report_tables, reference, figures))
    write_json(out_quant_eval, quant)
    log.info("report of %d variants and %d benchmarks -> %s, %s, %s%s", len(table), len(timings),
             out_csv, out_md, out_quant_eval, f", {figures_dir}" if figures_dir else "")
    return quant


def _write_figures(figures_dir: Path, experiment_dir: Path, evals: dict[str, dict[str, Any]],
                   quantized: Sequence[str], timings: pd.DataFrame) -> list[str]:
    """The three plots (stages.reporting.plots) under figures_dir; their file names. `quantized`:
    the float source first, then its quantized variants."""
    from stages.reporting import plots  # matplotlib only where figures are asked for

    experiment = experiment_dir.name
    plots.plot_training(plots.training_logs(experiment_dir), figures_dir / "training.png", experiment)
    plots.plot_quantization(evals, quantized, figures_dir / "quantization.png", experiment, marked=quantized[:1])
    plots.plot_stages(timings, figures_dir / "stages.png", experiment)
    return list(FIGURES)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.report", description=__doc__.split("\n")[0])
    parser.add_argument("--experiment-dir", "--experiment", dest="experiment", required=True, help="experiment dir (results/<name>) holding eval/ and benchmarks/")
    parser.add_argument("--source", required=True, help="variant the quantized ones are compared with (e.g. lora-merged)")
    parser.add_argument("--variants", nargs="*", default=[], help="quantized variants to compare (eval/<name>.json each)")
    parser.add_argument("--start", default=None,
                        help="the variant fine-tuning started from (base or pretrain); report.md shows every "
                             "variant's change against it")
    parser.add_argument("--csv", required=True, help="per-variant metrics table to write (report.csv)")
    parser.add_argument("--md", required=True, help="markdown report to write (report.md)")
    parser.add_argument("--quant-eval", required=True, help="quantization comparison JSON to write (quant_eval.json)")
    parser.add_argument("--figures-dir", default=None,
                        help="directory for the plots (training.png, quantization.png, stages.png) and the "
                             "report's tables as CSV (quality, size, speed, stages)")
    parser.add_argument("--deploy-manifest", default=None,
                        help="deploy/manifest.json (python -m stages.deploy manifest): adds the Deployment table")
    parser.add_argument("--align-source", default=None,
                        help="the variant align started from (align.source); default: the align model's "
                             "meta.json, else align.source's default (sft)")
    parser.add_argument("--quantize-config", default=None,
                        help="the experiment's quantize section as JSON, recorded in quant_eval.json's provenance")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        quantize_config = None if args.quantize_config is None else json.loads(args.quantize_config)
    except json.JSONDecodeError as e:
        raise InputError(f"--quantize-config is not valid JSON ({e.msg}); pass the quantize section as one object") from None
    return run(args.experiment, args.source, args.csv, args.md, args.quant_eval, args.variants, args.start,
               quantize_config, args.figures_dir, args.deploy_manifest, args.align_source)


if __name__ == "__main__":
    run_cli(main, "report")
