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
  report.csv        the metrics table: one row per variant, scalar metrics as columns
  report.md         markdown: metrics table, stage timings, quantization deltas
  quant_eval.json   {"experiment": name of the experiment dir,
                     "source": source variant,
                     "baseline": {scalar metrics of the source},
                     "variants": {v: {scalar metrics of v...,
                                      "delta": {metric: v - baseline},
                                      "relative": {metric: v / baseline - 1, null when baseline is 0}}}}
                    for every v in `variants` (the quantized variants compared with the source).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from stages.checkpoint.atomic import atomic_file, write_json
from stages.errors import InputError, run_cli

log = logging.getLogger(__name__)

# Metrics whose quantization delta is worth a column in report.md, in display order.
_DELTA_COLUMNS = ("ppl", "dev_ppl", "exact_match", "bleu4", "rouge_l", "gen_tokens_per_s", "size_bytes")
# Identity fields: carried into quant_eval.json but never differenced.
_ID_FIELDS = ("variant", "model_dir", "kind")
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
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def quant_eval(evals: dict[str, dict[str, Any]], experiment: str, source: str,
               variants: Sequence[str]) -> dict[str, Any]:
    """The quant_eval.json object (see the module docstring)."""
    baseline = _scalars(evals[source])
    out: dict[str, Any] = {"experiment": experiment, "source": source, "baseline": baseline, "variants": {}}
    for name in variants:
        metrics = _scalars(evals[name])
        delta, relative = {}, {}
        for key, value in metrics.items():
            base = baseline.get(key)
            if key in _ID_FIELDS or not (_is_number(value) and _is_number(base)):
                continue
            delta[key] = value - base
            relative[key] = value / base - 1.0 if base != 0 else None
        out["variants"][name] = {**metrics, "delta": delta, "relative": relative}
    return out


# -- markdown ------------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        # iterrows widens int columns to float; byte and token counts should still read as integers.
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table of `df` with its index as the first column (pandas' to_markdown
    needs `tabulate`, which the environment does not carry)."""
    header = [df.index.name or ""] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for idx, row in df.iterrows():
        lines.append("| " + " | ".join([_cell(idx)] + [_cell(v) for v in row.tolist()]) + " |")
    return "\n".join(lines)


def start_deltas(table: pd.DataFrame, start: str) -> pd.DataFrame:
    """Every other variant's change in the headline metrics against the starting model `start`
    (what fine-tuning gained, and quantization lost, relative to it)."""
    columns = [c for c in _DELTA_COLUMNS if c in table.columns]
    base = table.loc[start, columns]
    rows = {name: {f"Δ {c}": (row[c] - base[c]) if _is_number(row[c]) and _is_number(base[c]) else None
                   for c in columns}
            for name, row in table[columns].iterrows() if name != start}
    deltas = pd.DataFrame.from_dict(rows, orient="index")
    deltas.index.name = "variant"
    return deltas


def _markdown_report(experiment: str, table: pd.DataFrame, timings: pd.DataFrame, quant: dict[str, Any],
                     start: str | None = None) -> str:
    parts = [f"# Report: {experiment}", "", "## Metrics per variant", "",
             markdown_table(table.drop(columns=[c for c in ("model_dir",) if c in table.columns])), ""]
    if start is not None and start in table.index:
        parts += [f"## Change against the starting model `{start}`", "",
                  markdown_table(start_deltas(table, start)), ""]
    parts += ["## Stage timings (Snakemake benchmarks)", ""]
    parts.append(markdown_table(timings) if len(timings) else "No benchmark files found.")
    parts += ["", f"## Quantization: change against `{quant['source']}`", ""]
    if quant["variants"]:
        rows = {name: {f"Δ {k}": v["delta"].get(k) for k in _DELTA_COLUMNS}
                for name, v in quant["variants"].items()}
        deltas = pd.DataFrame.from_dict(rows, orient="index")
        deltas.index.name = "variant"
        parts.append(markdown_table(deltas))
    else:
        parts.append("No quantized variants.")
    return "\n".join(parts) + "\n"


# -- the stage -----------------------------------------------------------------------------------
def run(experiment_dir: str | Path, source_variant: str, out_csv: str | Path, out_md: str | Path,
        out_quant_eval: str | Path, variants: list[str], start_variant: str | None = None) -> dict[str, Any]:
    """Write report.csv, report.md and quant_eval.json; return the quant_eval object. With
    `start_variant` (the model fine-tuning started from: `base` or `pretrain`), report.md also
    shows every variant's change against it."""
    experiment_dir = Path(experiment_dir)
    if source_variant in variants:
        raise InputError(f"source variant {source_variant!r} is also listed in variants {list(variants)}; "
                         "variants are the ones compared against the source")
    evals = read_evals(experiment_dir, [source_variant, *variants, *([start_variant] if start_variant else [])])
    table = metrics_table(evals, first=[*([start_variant] if start_variant else []), source_variant, *variants])
    timings = read_benchmarks(experiment_dir)
    quant = quant_eval(evals, experiment_dir.name, source_variant, variants)

    with atomic_file(out_csv) as f:
        table.to_csv(f)
    with atomic_file(out_md) as f:
        f.write(_markdown_report(experiment_dir.name, table, timings, quant, start_variant))
    write_json(out_quant_eval, quant)
    log.info("report of %d variants and %d benchmarks -> %s, %s, %s", len(table), len(timings),
             out_csv, out_md, out_quant_eval)
    return quant


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(args.experiment, args.source, args.csv, args.md, args.quant_eval, args.variants, args.start)


if __name__ == "__main__":
    run_cli(main, "report")
