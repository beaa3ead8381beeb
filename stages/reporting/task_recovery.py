"""Standard-task scores (evaluate's `lm_eval`, from lm-evaluation-harness) and their recovery: the
share of the quantization source's score a variant keeps, as llm-compressor and GPTQModel report a
quantized model (GSM8K 0.728 of the float score, say).

recovery = variant / source for a metric lm-eval marks higher-is-better (acc, exact_match), source /
variant for one it marks lower-is-better (word_perplexity): 1.0 keeps everything, 0.95 lost 5%.
None where the source scores 0 or a side lacks the metric.
"""

from __future__ import annotations

from typing import Any, Sequence

from stages.reporting.tables import Table, _frame, fmt_float, fmt_percent, is_number


def task_scores(metrics: dict[str, Any]) -> dict[str, dict[str, float | None]] | None:
    """{task: {metric: value}} of one eval JSON's `lm_eval`; None when it ran no tasks."""
    lm_eval = metrics.get("lm_eval")
    if not lm_eval:
        return None
    return {task: dict(result["metrics"]) for task, result in lm_eval["tasks"].items()}


def _higher_is_better(metrics: dict[str, Any], task: str, metric: str) -> bool | None:
    return ((metrics.get("lm_eval") or {}).get("tasks", {}).get(task, {}).get("higher_is_better") or {}).get(metric)


def recovery(variant: dict[str, Any], source: dict[str, Any]) -> dict[str, dict[str, float | None]] | None:
    """{task: {metric: recovery}} of `variant`'s eval JSON against `source`'s, over the tasks and
    metrics both ran; None when either ran none."""
    mine, theirs = task_scores(variant), task_scores(source)
    if mine is None or theirs is None:
        return None
    out: dict[str, dict[str, float | None]] = {}
    for task in (t for t in mine if t in theirs):
        out[task] = {}
        for metric in (m for m in mine[task] if m in theirs[task]):
            value, base = mine[task][metric], theirs[task][metric]
            better = _higher_is_better(source, task, metric)
            if not (is_number(value) and is_number(base)) or better is None:
                out[task][metric] = None
            elif better:
                out[task][metric] = value / base if base else None
            else:
                out[task][metric] = base / value if value else None
    return out


def _score(metric: str, value: Any) -> str:
    """Accuracies and matches as percentages, anything else (perplexities, BLEU) as a number."""
    if is_number(value) and metric.split(",")[0] in ("acc", "acc_norm", "exact_match", "f1", "mc1", "mc2"):
        return fmt_percent(value)
    return fmt_float(value)


def task_table(evals: dict[str, dict[str, Any]], order: Sequence[str], source: str) -> Table | None:
    """The standard-task table: each variant's lm-eval scores and, beside each, its recovery of
    `source`'s; None when no variant ran lm-eval tasks."""
    ran = [name for name in order if task_scores(evals[name])]
    if not ran:
        return None
    numbers, display = {}, {}
    for name in ran:
        kept = recovery(evals[name], evals[source]) if source in evals and name != source else None
        numbers[name], display[name] = {}, {}
        for task, scores in task_scores(evals[name]).items():
            for metric, value in scores.items():
                ratio = (kept or {}).get(task, {}).get(metric)
                numbers[name][f"{task}/{metric}"] = value
                numbers[name][f"{task}/{metric}/recovery"] = ratio
                display[name][f"{task} {metric}"] = _score(metric, value)
                display[name][f"{task} {metric} kept"] = fmt_percent(ratio)
    versions = sorted({str((evals[n].get("lm_eval") or {}).get("version")) for n in ran})
    limits = {(evals[n].get("lm_eval") or {}).get("limit") for n in ran}
    limit = f"; at most {limits.pop()} documents a task" if len(limits) == 1 and None not in limits else ""
    return Table("tasks", "Standard tasks (lm-evaluation-harness)",
                 f"Scores of lm-evaluation-harness {', '.join(versions)} tasks (evaluate.lm_eval_tasks{limit}); "
                 f"`kept` is the recovery, the share of `{source}`'s score a variant keeps, as quantization "
                 "toolkits publish it (a lower-is-better metric inverted).",
                 _frame(display, "variant"), _frame(numbers, "variant"))
