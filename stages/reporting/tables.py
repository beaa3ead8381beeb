"""The report's narrow tables, in units a person reads: quality, size and memory, speed, stage
timings, and alignment when an aligned variant was evaluated. Each is a pandas frame of display
strings (index `variant` or `stage`) plus the numeric frame it was formatted from (what the tables'
CSVs hold); `report.md` shows the display frames.

Every variant is compared with the starting model (`pretrain` or `base`, the model fine-tuning
started from), as a ratio (perplexity, sizes, speeds) or in percentage points (exact match, BLEU,
ROUGE): the table says what fine-tuning and quantization changed, without a calculator.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from stages.stage_logs import duration

MB = 1e6
BLEU_LABEL = "BLEU-4"  # completed from the eval file's `metric_implementations`, when it names them
ROUGE_LABEL = "ROUGE-L"


@dataclass
class Table:
    """One report table: a title, the line that says what it shows, the display frame (strings)
    and the numbers it was formatted from (plain units: MB, tokens/s, ratios)."""

    name: str
    title: str
    caption: str
    display: pd.DataFrame
    numbers: pd.DataFrame


# -- formatting ------------------------------------------------------------------------------------
def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def fmt_float(v: Any, digits: int = 4) -> str:
    """`digits` significant digits, no exponent below a million (48.65, 0.9844, 10170)."""
    if not is_number(v):
        return ""
    if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
        return f"{v:.{digits - 1}e}"
    decimals = max(digits - 1 - int(math.floor(math.log10(abs(v)))), 0) if v else 0
    return f"{v:,.{decimals}f}"


def fmt_percent(v: Any) -> str:
    return f"{100 * v:.1f}%" if is_number(v) else ""


def fmt_ratio(value: Any, reference: Any) -> str:
    """x1.22: value over reference."""
    return f"×{value / reference:.3g}" if is_number(value) and is_number(reference) and reference else ""


def fmt_points(value: Any, reference: Any) -> str:
    """+98.4 pts: the change of a 0-1 score, in percentage points."""
    return f"{100 * (value - reference):+.1f} pts" if is_number(value) and is_number(reference) else ""


def fmt_mb(v: Any) -> str:
    return f"{v / MB:,.1f}" if is_number(v) else ""


def fmt_rate(v: Any) -> str:
    """Tokens per second: whole numbers with thousands separators."""
    return f"{v:,.0f}" if is_number(v) else ""


def fmt_seconds(v: Any) -> str:
    """3.7 s, 2 min 43 s, 1 h 02 min (as the stages' progress lines write durations)."""
    return duration(v) if is_number(v) else ""


def _frame(rows: dict[str, dict[str, Any]], index_name: str) -> pd.DataFrame:
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = index_name
    return df


def metric_labels(evals: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Column labels of BLEU and ROUGE naming the library and tokenization that computed them (from
    an eval file's `metric_implementations`), so the numbers compare with published ones."""
    labels = {"bleu4": BLEU_LABEL, "rouge_l": ROUGE_LABEL}
    for metrics in evals.values():
        implementations = metrics.get("metric_implementations") or {}
        bleu, rouge = implementations.get("bleu4") or "", implementations.get("rouge_l") or ""
        if bleu.startswith("sacrebleu"):
            tokenize = re.search(r"tokenize=(\w+)", bleu)
            labels["bleu4"] = f"{BLEU_LABEL} (sacrebleu{', ' + tokenize.group(1) if tokenize else ''})"
        if rouge.startswith("rouge-score"):
            labels["rouge_l"] = f"{ROUGE_LABEL} F1 (rouge-score)"
    return labels


# -- the tables ------------------------------------------------------------------------------------
def quality_table(evals: dict[str, dict[str, Any]], order: Sequence[str], start: str) -> Table:
    ref = evals[start]
    labels = metric_labels(evals)
    numbers, display = {}, {}
    for name in order:
        m = evals[name]
        numbers[name] = {"corpus_ppl": m.get("ppl"), "corpus_ppl_ratio": _ratio(m.get("ppl"), ref.get("ppl")),
                         "dev_ppl": m.get("dev_ppl"), "exact_match": m.get("exact_match"),
                         "exact_match_change": _diff(m.get("exact_match"), ref.get("exact_match")),
                         "bleu4": m.get("bleu4"), "rouge_l": m.get("rouge_l")}
        display[name] = {"corpus ppl": fmt_float(m.get("ppl")), f"× {start}": fmt_ratio(m.get("ppl"), ref.get("ppl")),
                         "dev ppl": fmt_float(m.get("dev_ppl")), "exact match": fmt_percent(m.get("exact_match")),
                         f"EM vs {start}": fmt_points(m.get("exact_match"), ref.get("exact_match")),
                         labels["bleu4"]: fmt_score(m.get("bleu4")), labels["rouge_l"]: fmt_score(m.get("rouge_l"))}
    return Table("quality", "Quality",
                 "Corpus perplexity on held-out pretraining text (what the model still knows of the language; "
                 f"× {start} near 1 means nothing was forgotten), dev-set perplexity and exact match of greedy "
                 "answers on the task, BLEU and ROUGE on a 0-100 scale.",
                 _frame(display, "variant"), _frame(numbers, "variant"))


def fmt_score(v: Any) -> str:
    """A 0-1 overlap score on the 0-100 scale published BLEU and ROUGE numbers use."""
    return f"{100 * v:.1f}" if is_number(v) else ""


def size_table(evals: dict[str, dict[str, Any]], order: Sequence[str], start: str) -> Table:
    ref = evals[start]
    numbers, display = {}, {}
    for name in order:
        m = evals[name]
        q = m.get("quantization") or {}
        bits = q.get("bits_per_weight")
        numbers[name] = {"size_mb": _div(m.get("size_bytes"), MB), "size_ratio": _ratio(m.get("size_bytes"),
                                                                                        ref.get("size_bytes")),
                         "weights_mb": _div(m.get("model_bytes"), MB), "bits_per_weight": bits,
                         "peak_rss_mb": _div(m.get("rss_bytes"), MB)}
        display[name] = {"on disk (MB)": fmt_mb(m.get("size_bytes")),
                         f"× {start}": fmt_ratio(m.get("size_bytes"), ref.get("size_bytes")),
                         "weights in memory (MB)": fmt_mb(m.get("model_bytes")),
                         "bits per weight": fmt_float(bits, 3) if is_number(bits) else "",
                         "peak RSS (MB)": fmt_mb(m.get("rss_bytes"))}
    return Table("size", "Size and memory",
                 "Files on disk (an adapter is only its own weights), the model's parameters and buffers in "
                 "memory, bits per quantized weight (scales included) and the evaluation process's peak RSS.",
                 _frame(display, "variant"), _frame(numbers, "variant"))


def speed_table(evals: dict[str, dict[str, Any]], order: Sequence[str], start: str) -> Table:
    ref = evals[start]
    prefill = sorted({k for m in evals.values() for k in m if k.startswith("prefill_tokens_per_s_b")},
                     key=lambda k: int(k.rsplit("_b", 1)[1]))
    numbers, display = {}, {}
    for name in order:
        m = evals[name]
        numbers[name] = {**{k: m.get(k) for k in prefill}, "decode_tokens_per_s_b1": m.get("decode_tokens_per_s_b1"),
                         "decode_tokens_per_s_ratio": _ratio(m.get("decode_tokens_per_s_b1"),
                                                             ref.get("decode_tokens_per_s_b1")),
                         "gen_tokens_per_s": m.get("gen_tokens_per_s")}
        # "tokens/s" in every measured header: stages.metrics.measured knows them as measurements
        row = {f"prefill b{k.rsplit('_b', 1)[1]} (tokens/s)": fmt_rate(m.get(k)) for k in prefill}
        row["decode b1 (tokens/s)"] = fmt_rate(m.get("decode_tokens_per_s_b1"))
        row[f"decode tokens/s × {start}"] = fmt_ratio(m.get("decode_tokens_per_s_b1"),
                                                      ref.get("decode_tokens_per_s_b1"))
        row["dev generation (tokens/s)"] = fmt_rate(m.get("gen_tokens_per_s"))
        row["kernels"] = ", ".join(f"{k} ({n})" for k, n in sorted((m.get("kernels") or {}).items()))
        display[name] = row
    threads = ref.get("torch_threads")
    return Table("speed", "Speed",
                 "Prefill and decode throughput measured by the evaluation"
                 + (f" on {threads} thread{'s' if threads != 1 else ''}" if is_number(threads) else "")
                 + ", greedy generation over the dev set (batched), and the low-bit kernels that carried the "
                 "quantized layers (layers per kernel).",
                 _frame(display, "variant"), _frame(numbers, "variant"))


def alignment_table(evals: dict[str, dict[str, Any]], aligned: str, source: str, method: str | None = None) -> Table:
    """The aligned variant beside the model it was aligned from (`source`, when evaluated): how often
    each prefers the chosen answer of the held-out preference pairs and by how much, beside the
    task score and the corpus perplexity the quality table shows."""
    numbers, display = {}, {}
    for name in (v for v in (source, aligned) if v in evals):
        m = evals[name]
        numbers[name] = {"preference_accuracy": m.get("preference_accuracy"),
                         "preference_margin": m.get("preference_margin"), "preference_pairs": m.get("preference_pairs"),
                         "exact_match": m.get("exact_match"), "corpus_ppl": m.get("ppl")}
        display[name] = {"preference accuracy": fmt_percent(m.get("preference_accuracy")),
                         "preference margin (nats)": fmt_float(m.get("preference_margin")),
                         "exact match": fmt_percent(m.get("exact_match")), "corpus ppl": fmt_float(m.get("ppl"))}
    pairs = evals[aligned].get("preference_pairs")
    return Table("alignment", "Alignment",
                 f"Preference alignment{f' ({method})' if method else ''} of `{source}` into `{aligned}`: the share "
                 f"of held-out preference pairs{f' ({pairs})' if is_number(pairs) else ''} whose chosen answer the "
                 "model gives the higher log-probability, the mean log-probability margin of chosen over rejected "
                 "(nats, summed over the answer), exact match on the dev task and corpus perplexity (what "
                 "alignment cost the language).",
                 _frame(display, "variant"), _frame(numbers, "variant"))


# the stage table's row order: a rule's place in the chain, then its name
CHAIN = ("prepare", "plan", "import_base", "pretrain", "merge_tp", "finetune", "merge", "score_pairs", "align",
         "quantize", "export", "deploy", "evaluate", "report")


def chain_position(rule: str) -> tuple[int, str]:
    return next((i for i, stage in enumerate(CHAIN) if rule.startswith(stage)), len(CHAIN)), rule


def stage_table(timings: pd.DataFrame) -> Table:
    """Snakemake's benchmark TSVs (stages.report.read_benchmarks), in chain order (a fixed order:
    two runs of the same chain list the same rows)."""
    numbers, display = {}, {}
    for name in sorted(timings.index, key=chain_position):
        t = timings.loc[name]
        wall, cpu, rss = t.get("s"), t.get("cpu_time"), t.get("max_rss")
        numbers[name] = {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss}
        display[name] = {"wall time": fmt_seconds(wall), "CPU time": fmt_seconds(cpu),
                         "peak RSS (MB)": f"{rss:,.0f}" if is_number(rss) else ""}
    return Table("stages", "Stage timings",
                 "Each rule's wall time, CPU time and peak resident memory from Snakemake's benchmark files, "
                 "in chain order (rules run side by side, so the wall times do not add up to the run's; "
                 "stages.png shows them by size).",
                 _frame(display, "stage"), _frame(numbers, "stage"))


def deploy_table(manifest: dict[str, Any]) -> Table:
    """The deployable artifacts of deploy/manifest.json (stages.deploy.manifest) with their checks."""
    numbers, display = {}, {}
    for name, a in manifest["artifacts"].items():
        check = a.get("check") or {}
        top1, rel, ppl = check.get("top1_agreement"), check.get("rel_err"), check.get("ppl_ratio")
        numbers[name] = {"size_mb": _div(a.get("size_bytes"), MB), "top1_agreement": top1, "rel_err": rel,
                         "ppl_ratio": ppl}
        display[name] = {"format": a["format"], "file": Path(a["path"]).name, "MB": fmt_mb(a.get("size_bytes")),
                         "checked with": check.get("runtime", ""),
                         "against": check.get("against", "the float source"),
                         "top-1 agreement": fmt_percent(top1),
                         "rel. logit error": f"{rel:.1e}" if is_number(rel) else "",
                         "ppl ratio": f"×{ppl:.3f}" if is_number(ppl) else ""}
    return Table("deploy", "Deployment",
                 "Artifacts for runtimes outside the pipeline (results/<name>/export and deploy/), each checked "
                 "with the runtime named before it was published: top-1 agreement over validation positions "
                 "and the largest logit difference relative to the logits' scale (deploy/manifest.json).",
                 _frame(display, "artifact"), _frame(numbers, "artifact"))


def _ratio(value: Any, reference: Any) -> float | None:
    return value / reference if is_number(value) and is_number(reference) and reference else None


def _diff(value: Any, reference: Any) -> float | None:
    return value - reference if is_number(value) and is_number(reference) else None


def _div(value: Any, by: float) -> float | None:
    return value / by if is_number(value) else None
