"""Compare experiments: a sweep's members (stages/sweeps.py) or a listed comparison, side by side.

`python -m stages.compare --spec JSON --out-dir results/sweeps/<name>`

The spec (written by the workflow from the config's `sweeps:` / `comparisons:`): members (experiment
names), columns ({member: {swept key: value}}), variants, metrics, starts ({member: the variant
fine-tuning started from}). A metric is a key of results/<member>/eval/<variant>.json, or
`<key>_ratio` (e.g. ppl_ratio: the variant's ppl over its starting model's, forgetting).

Writes, atomically:
  compare.csv   one row per member and variant: the swept values, then each metric
  compare.md    that table, then the mean and spread (sample standard deviation, min, max, n) of
                each metric over seeds for every combination of the other swept values
  compare.png   one panel per metric and variant: every member a point, the means a line
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from stages.checkpoint.atomic import atomic_file
from stages.errors import InputError, run_cli
from stages.reporting.markdown import markdown_table
from stages.reporting.tables import fmt_float, is_number
from stages.stage_logs import configure_logging, log_io
from stages.sweeps import SEED_KEY

log = logging.getLogger(__name__)


def _eval(results: Path, member: str, variant: str) -> dict[str, Any]:
    path = results / member / "eval" / f"{variant}.json"
    if not path.is_file():
        raise InputError(f"{path} is missing: variant {variant!r} of experiment {member!r} was not evaluated; "
                         f"run `snakemake --cores all {path}`")
    return json.loads(path.read_text())


def metric_value(evals: dict[str, Any], start: dict[str, Any] | None, metric: str) -> float | None:
    """A metric of one evaluation; `<key>_ratio` is key over the starting model's key."""
    if metric.endswith("_ratio") and metric not in evals:
        key = metric.removesuffix("_ratio")
        value, reference = evals.get(key), (start or {}).get(key)
        return value / reference if is_number(value) and is_number(reference) and reference else None
    value = evals.get(metric)
    return value if is_number(value) else None


def comparison_table(spec: dict[str, Any], results: Path) -> pd.DataFrame:
    """One row per member and variant: `experiment`, the swept columns, `variant`, the metrics."""
    rows = []
    needs_start = any(m.endswith("_ratio") for m in spec["metrics"])
    for member in spec["members"]:
        start_name = spec.get("starts", {}).get(member)
        start = _eval(results, member, start_name) if needs_start and start_name else None
        for variant in spec["variants"]:
            evals = _eval(results, member, variant)
            rows.append({"experiment": member, **spec["columns"].get(member, {}), "variant": variant,
                         **{m: metric_value(evals, start, m) for m in spec["metrics"]}})
    return pd.DataFrame(rows)


def over_seeds(table: pd.DataFrame, spec: dict[str, Any]) -> pd.DataFrame:
    """Mean, sample standard deviation, min, max and count of every metric over the seeds of each
    combination of the other swept values (and variant); without a seed column, over the rows of
    each combination."""
    swept = [c for c in table.columns if c not in ("experiment", "variant", *spec["metrics"])]
    keys = [c for c in swept if c != SEED_KEY] + ["variant"]
    grouped = table.groupby(keys, sort=False, dropna=False)[list(spec["metrics"])]
    stats = grouped.agg(["mean", "std", "min", "max", "count"])
    stats.columns = [f"{metric}_{stat}" for metric, stat in stats.columns]
    return stats.reset_index()


def _spread_cell(row: pd.Series, metric: str) -> str:
    mean, std, low, high, n = (row[f"{metric}_{s}"] for s in ("mean", "std", "min", "max", "count"))
    if not is_number(mean):
        return ""
    if n < 2 or not is_number(std):
        return f"{fmt_float(mean)} (n={int(n)})"
    return f"{fmt_float(mean)} ± {fmt_float(std, 2)} ({fmt_float(low)}–{fmt_float(high)}, n={int(n)})"


def markdown(spec: dict[str, Any], table: pd.DataFrame, stats: pd.DataFrame) -> str:
    kind = "Sweep" if spec["kind"] == "sweeps" else "Comparison"
    shown = table.set_index("experiment")
    parts = [f"# {kind}: {spec['name']}", "",
             f"{len(spec['members'])} experiments; variant(s) {', '.join(spec['variants'])}; metrics "
             f"{', '.join(spec['metrics'])} (`_ratio`: over the experiment's starting model's). One row per "
             "experiment and variant:", "", markdown_table(shown), ""]
    if spec["kind"] == "sweeps" and len(stats) < len(table):
        keys = [c for c in stats.columns if not any(c.startswith(f"{m}_") for m in spec["metrics"])]
        display = stats[keys].copy()
        for metric in spec["metrics"]:
            display[metric] = [_spread_cell(row, metric) for _, row in stats.iterrows()]
        display = display.set_index(keys[0])
        parts += ["## Over seeds", "", "Mean ± sample standard deviation (min–max, n seeds) of each metric for "
                  "every combination of the other swept values:", "", markdown_table(display), ""]
    return "\n".join(parts)


def plot(spec: dict[str, Any], table: pd.DataFrame, out: Path) -> None:
    """One panel per metric (and variant): x = the combination of the non-seed swept values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = [c for c in table.columns if c not in ("experiment", "variant", *spec["metrics"])]
    keys = [c for c in swept if c != SEED_KEY]
    labels = (table[keys].astype(str).apply(lambda r: ", ".join(f"{k}={v}" for k, v in r.items()), axis=1)
              if keys else table["experiment"])
    panels = [(m, v) for m in spec["metrics"] for v in spec["variants"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (metric, variant) in zip(axes[0], panels):
        rows = table["variant"] == variant
        order = list(dict.fromkeys(labels[rows]))
        x = [order.index(label) for label in labels[rows]]
        ax.scatter(x, table.loc[rows, metric], color="tab:blue", alpha=0.7, label="experiment")
        means = table[rows].groupby(labels[rows], sort=False)[metric].mean().reindex(order)
        ax.plot(range(len(order)), means.values, "o-", color="tab:red", label="mean over seeds")
        ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize="small")
        ax.set_title(f"{variant}: {metric}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{spec['kind'].rstrip('s')} {spec['name']}")
    with atomic_file(out, mode="wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def run(spec: dict[str, Any], out_dir: str | Path, results: str | Path = "results") -> pd.DataFrame:
    """Write compare.csv, compare.md and compare.png of `spec` into out_dir; return the table."""
    out_dir = Path(out_dir)
    members = f"evaluations of {len(spec['members'])} experiments"
    log_io("compare", reads={members: Path(results) / "<experiment>" / "eval"},
           writes={"comparison": [out_dir / "compare.csv", out_dir / "compare.md", out_dir / "compare.png"]},
           logger=log)
    table = comparison_table(spec, Path(results))
    stats = over_seeds(table, spec)
    with atomic_file(out_dir / "compare.csv") as f:
        table.to_csv(f, index=False)
    with atomic_file(out_dir / "compare.md") as f:
        f.write(markdown(spec, table, stats))
    plot(spec, table, out_dir / "compare.png")
    log.info("compared %d experiments (%s) -> %s", len(spec["members"]), ", ".join(spec["metrics"]), out_dir)
    return table


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m stages.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="the comparison as JSON (the workflow writes it from the config)")
    parser.add_argument("--out-dir", required=True, help="where compare.csv, compare.md and compare.png go")
    parser.add_argument("--results", default="results", help="the directory holding results/<experiment>/")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        spec = json.loads(args.spec)
    except json.JSONDecodeError as e:
        raise InputError(f"--spec is not valid JSON ({e.msg})") from None
    return run(spec, args.out_dir, args.results)


if __name__ == "__main__":
    run_cli(main, "compare")
