"""Our lm-evaluation-harness model (`stages.harness.variant_lm.VariantLM`) beside lm-eval's own HF
backend (`HFLM`) on the same checkpoint, in one run, and the recovery of quantized variants.

A local lm-eval task `prose` is written to a temporary directory: `loglikelihood_rolling` over
paragraphs of the repository's Markdown (or `--prose` files), scored with lm-eval's
word_perplexity, byte_perplexity and bits_per_byte (the metrics of its wikitext task). On `--model`:
  * agreement: the largest |difference| of the per-document log-likelihoods of the two backends
    (the test demands <= 1e-5);
  * time: each backend's seconds for the same documents (load excluded), and ours / HFLM's;
  * the task's metrics through lm-eval's evaluator on both backends;
then each `--variants` directory (a quantized variant on our kernels, an adapter, an ONNX export:
what HFLM cannot load) through ours, with its recovery of `--model`'s scores
(stages.reporting.task_recovery's rule: word perplexity inverted).

    .venv/bin/python bench/lm_eval_harness.py --model ~/.cache/llm-lifecycle/smollm2-135m-instruct
    .venv/bin/python bench/lm_eval_harness.py --model results/llama/lora-merged \
        --variants results/llama/quant/wint4,results/llama/quant/gptq-w4 --documents 64
Prints a table and writes JSON (default bench/out/lm_eval_harness.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import csv_list, finish, machine_info

DEFAULT_OUT = ROOT / "bench" / "out" / "lm_eval_harness.json"
TASK = "prose"


def paragraphs(files: list[Path], count: int, min_chars: int = 200) -> list[str]:
    """The first `count` prose paragraphs (no code, tables or headings) of at least `min_chars`."""
    found = []
    for path in files:
        in_code = False
        for block in path.read_text().split("\n\n"):
            fences = block.count("```")
            if in_code or fences or block.lstrip().startswith(("|", "#", "<!--")):
                in_code = in_code != (fences % 2 == 1)
                continue
            text = " ".join(block.split())
            if len(text) >= min_chars:
                found.append(text)
            if len(found) == count:
                return found
    return found


def write_task(task_dir: Path, docs: list[str]) -> None:
    """lm-eval's wikitext-style rolling task on `docs`, in its own YAML format."""
    data = task_dir / "prose.jsonl"
    data.write_text("".join(json.dumps({"page": d}) + "\n" for d in docs))
    (task_dir / "prose.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{page}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")


def timed_rolling(lm, docs: list[str]) -> tuple[list[float], float]:
    from lm_eval.api.instance import Instance

    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(d,), idx=i)
                for i, d in enumerate(docs)]
    start = time.perf_counter()
    scores = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    return scores, time.perf_counter() - start


def measure(model_dir: Path, variants: list[Path], docs: list[str], batch_size: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    from stages.harness.tasks import run_tasks
    from stages.harness.variant_lm import VariantLM
    from stages.inference.loading import load_variant
    from stages.reporting.task_recovery import recovery

    with tempfile.TemporaryDirectory() as task_dir:
        write_task(Path(task_dir), docs)
        model, tokenizer, _ = load_variant(model_dir)
        ours = VariantLM(model, tokenizer, batch_size=batch_size)
        theirs = HFLM(pretrained=str(model_dir), device="cpu", batch_size=batch_size, dtype="float32")
        rows = {}
        ours_scores, ours_seconds = timed_rolling(ours, docs)
        theirs_scores, theirs_seconds = timed_rolling(theirs, docs)
        diff = max(abs(a - b) for a, b in zip(ours_scores, theirs_scores))
        for name, lm, seconds in (("HFLM (lm-eval)", theirs, theirs_seconds), ("ours", ours, ours_seconds)):
            result = run_tasks(lm, [TASK], data_dir=task_dir, include_path=task_dir)
            rows[name] = {"dir": str(model_dir), "rolling_seconds": seconds, "lm_eval": result}
        rows["ours"]["max_abs_loglik_diff_vs_hflm"] = diff
        rows["ours"]["seconds_ratio_vs_hflm"] = ours_seconds / theirs_seconds
        for path in variants:
            model, tokenizer, kind = load_variant(path)
            lm = VariantLM(model, tokenizer, batch_size=batch_size)
            _, seconds = timed_rolling(lm, docs)
            result = run_tasks(lm, [TASK], data_dir=task_dir, include_path=task_dir)
            rows[path.name] = {"dir": str(path), "kind": kind, "rolling_seconds": seconds, "lm_eval": result,
                               "recovery": recovery({"lm_eval": result}, {"lm_eval": rows["ours"]["lm_eval"]})}
    return rows


def report(result: dict) -> str:
    lines = [f"lm-eval task `{TASK}` ({result['documents']} paragraphs, loglikelihood_rolling) on {result['model']}",
             f"{'runtime / variant':<22} {'seconds':>8} {'word ppl':>10} {'bits/byte':>10} {'kept':>7} "
             f"{'max |Δ loglik|':>15}"]
    for name, row in result["rows"].items():
        metrics = row["lm_eval"]["tasks"][TASK]["metrics"]
        kept = (row.get("recovery") or {}).get(TASK, {}).get("word_perplexity")
        diff = row.get("max_abs_loglik_diff_vs_hflm")
        lines.append(f"{name:<22} {row['rolling_seconds']:>8.2f} {metrics['word_perplexity']:>10.3f} "
                     f"{metrics['bits_per_byte']:>10.4f} {'' if kept is None else f'{100 * kept:.1f}%':>7} "
                     f"{'' if diff is None else f'{diff:.2e}':>15}")
    ratio = result["rows"]["ours"]["seconds_ratio_vs_hflm"]
    lines.append(f"ours / HFLM time on the same documents: x{ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a float HF directory (what HFLM loads too)")
    parser.add_argument("--variants", type=csv_list, default=[],
                        help="comma-separated variant dirs scored through ours only, with their recovery")
    parser.add_argument("--prose", type=csv_list, default=[],
                        help="comma-separated text/Markdown files (default: the repository's docs/*.md)")
    parser.add_argument("--documents", type=int, default=32, help="paragraphs scored")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward, both backends")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    files = [Path(p) for p in args.prose] or sorted((ROOT / "docs").glob("*.md"))
    docs = paragraphs(files, args.documents)
    if not docs:
        parser.error(f"no prose paragraph of 200 characters in {[str(f) for f in files]}")
    rows = measure(Path(args.model), [Path(v) for v in args.variants], docs, args.batch_size)
    result = {"model": args.model, "documents": len(docs), "batch_size": args.batch_size, "rows": rows,
              "machine": machine_info("lm_eval", "transformers")}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
