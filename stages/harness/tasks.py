"""lm-evaluation-harness tasks on a loaded variant: the project's two local tasks, and any task in
lm-eval's own YAML format whose data lies on local files.

    results = run_tasks(VariantLM(model, tokenizer), ["lifecycle_pairs", "lifecycle_qa"],
                        data_dir="results/llama/data", limit=64)

Local tasks, built from a prepare data dir at run time (nothing downloaded, nothing written beside
the data; each record's last round, its system prompt and earlier rounds left out):
  lifecycle_qa      generate_until on data/sft/dev.json: the question, greedy answer up to
                    `max_gen_toks` tokens (evaluate.max_new_tokens), exact_match after stripping
                    whitespace on both sides: evaluate's exact_match through lm-eval's path
  lifecycle_pairs   multiple_choice on data/preference/dev.json: the chosen and the rejected answer
                    (their order alternating from document to document, so a tie is not a win),
                    acc (summed log-prob) and acc_norm (per byte, lm-eval's); evaluate's
                    preference_accuracy through lm-eval's path
Both put the answer right after the question (`target_delimiter: ""`), as the plain SFT format
does; with `chat` the question goes through the tokenizer's chat template (lm-eval's
`apply_chat_template`).

Other tasks are looked up by name in `include_path` (a directory of lm-eval task YAML files, e.g. a
copy of lm-eval's arc_easy.yaml with `dataset_path: json` and `dataset_kwargs.data_files` on local
files), then in lm-eval's own task registry. Tasks run offline (`offline()`: the hub's and
datasets' offline mode): a registry task whose data is on the hub fails at once, with an error
that says how to point it at local files.

What comes back (evaluate's `lm_eval`): {"version", "limit", "num_fewshot", "chat_template",
"wall_seconds" (a measurement, stages.metrics.measured: a rerun does not reproduce it), "tasks":
{task: {"metrics": {metric: value}, "higher_is_better": {metric: bool}, "samples": documents
scored, "num_fewshot": shots}}}; a metric under a filter other than lm-eval's `none` keeps its
`metric,filter` name. Standard errors are not computed (bootstrap_iters 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets.config
import huggingface_hub.constants
import lm_eval
from lm_eval.evaluator import simple_evaluate
from lm_eval.tasks import TaskManager

from stages.data.preference import read_preference_file
from stages.data.sft import read_sft_file, target_text
from stages.errors import InputError
from stages.harness.variant_lm import VariantLM

log = logging.getLogger(__name__)

QA_TASK = "lifecycle_qa"
PAIRS_TASK = "lifecycle_pairs"
LOCAL_TASKS = (QA_TASK, PAIRS_TASK)
SEED = 1234  # lm-eval's default seeds (few-shot sampling, numpy, torch)
_OFFLINE = ((huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
            (datasets.config, "HF_DATASETS_OFFLINE"))


# -- the local tasks -----------------------------------------------------------------------------
def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _dataset(task: str, data_file: Path, cache_dir: Path) -> dict[str, Any]:
    return {"task": task, "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(cache_dir)},
            "target_delimiter": "", "metadata": {"version": 1.0}}


def qa_task(data_dir: Path, work_dir: Path, max_gen_toks: int) -> dict[str, Any]:
    """lifecycle_qa's lm-eval config, its documents written to `work_dir` (see the module docstring)."""
    path = data_dir / "sft" / "dev.json"
    if not path.exists():
        raise InputError(f"{path} is missing: the lm-eval task {QA_TASK} is built from prepare's SFT dev records")
    rows = [{"question": r.src[-1], "answer": target_text(r)} for r in read_sft_file(path)]
    return {**_dataset(QA_TASK, _write_jsonl(work_dir / f"{QA_TASK}.jsonl", rows), work_dir / "cache"),
            "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": [], "max_gen_toks": max_gen_toks, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "regexes_to_ignore": [r"^\s+", r"\s+$"]}]}


def pairs_task(data_dir: Path, work_dir: Path) -> dict[str, Any]:
    """lifecycle_pairs's lm-eval config, its documents written to `work_dir` (see the module docstring)."""
    path = data_dir / "preference" / "dev.json"
    if not path.exists():
        raise InputError(f"{path} is missing: the lm-eval task {PAIRS_TASK} is built from prepare's preference "
                         f"dev pairs (data.preference); drop {PAIRS_TASK} from evaluate.lm_eval_tasks or turn "
                         "the pairs on")
    rows = []
    for i, r in enumerate(read_preference_file(path)):
        choices = [r.chosen, r.rejected] if i % 2 == 0 else [r.rejected, r.chosen]
        rows.append({"question": r.src[-1], "choices": choices, "label": i % 2})
    return {**_dataset(PAIRS_TASK, _write_jsonl(work_dir / f"{PAIRS_TASK}.jsonl", rows), work_dir / "cache"),
            "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}


# -- finding the tasks ---------------------------------------------------------------------------
def _task_manager(names: Sequence[str], include_path: Path | None) -> TaskManager:
    """The TaskManager that knows every name that is not a local task: `include_path` alone when it
    has them all (indexing lm-eval's registry takes seconds), else with the registry too."""
    wanted = [n for n in names if n not in LOCAL_TASKS]
    if include_path is not None and not include_path.is_dir():
        raise InputError(f"evaluate.lm_eval_include_path {include_path} is not a directory of lm-eval task YAML files")
    manager = TaskManager(include_path=None if include_path is None else str(include_path), include_defaults=False)
    if any(n not in manager.all_tasks for n in wanted):
        manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [n for n in wanted if n not in manager.all_tasks]
    if unknown:
        where = f"in {include_path} or " if include_path is not None else ""
        raise InputError(f"evaluate.lm_eval_tasks names {unknown}, found {where}in neither the local tasks "
                         f"{list(LOCAL_TASKS)} nor lm-eval {lm_eval.__version__}'s registry; put the task's YAML in "
                         "the directory evaluate.lm_eval_include_path names")
    return manager


def _metrics(results: dict[str, Any], task: str) -> dict[str, Any]:
    """{"metrics", "higher_is_better", "samples", "num_fewshot"} of one task from simple_evaluate's results."""
    better = results.get("higher_is_better", {}).get(task, {})
    metrics = {}
    for key, value in results["results"][task].items():
        metric, _, where = key.partition(",")
        if metric not in better or not isinstance(value, (int, float)):  # alias, stderrs, sample_len
            continue
        metrics[metric if where == "none" else key] = None if math.isnan(value) else float(value)
    counts = results.get("n-samples", {}).get(task, {})
    return {"metrics": metrics, "higher_is_better": {m: better.get(m.split(",")[0]) for m in metrics},
            "samples": counts.get("effective"), "num_fewshot": results.get("n-shot", {}).get(task)}


# -- running them --------------------------------------------------------------------------------
@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The hub's and datasets' offline mode, set in the libraries already imported (they read the
    environment once, at import) and restored afterwards: nothing is fetched, a hub dataset fails
    at once instead of after its connection timeouts."""
    saved = [(module, name, getattr(module, name)) for module, name in _OFFLINE]
    try:
        for module, name in _OFFLINE:
            setattr(module, name, True)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def no_environment_report() -> Iterator[None]:
    """simple_evaluate without the environment report it adds to its results: `add_env_info` runs
    torch's `collect_env` (subprocesses for pip, conda, nvidia-smi and the compilers: 0.26 s with
    torch already imported, on a 2-core CPU, 2026-12-01) and `get_git_commit_hash` runs `git
    describe`, which prints "fatal: not a git repository" to a job's log outside a checkout. We read
    only the metrics; the job's meta.json records the code and package versions itself."""
    import lm_eval.evaluator

    saved = {name: getattr(lm_eval.evaluator, name) for name in ("add_env_info", "get_git_commit_hash")}
    try:
        lm_eval.evaluator.add_env_info = lambda storage: None
        lm_eval.evaluator.get_git_commit_hash = lambda: None
        yield
    finally:
        for name, value in saved.items():
            setattr(lm_eval.evaluator, name, value)


def run_tasks(lm: VariantLM, names: Sequence[str], *, data_dir: str | Path, include_path: str | Path | None = None,
              limit: int | None = None, num_fewshot: int | None = None, max_gen_toks: int = 32,
              chat: bool = False) -> dict[str, Any]:
    """Every task of `names` on `lm` (see the module docstring for what comes back). `limit`:
    documents per task (None: all); `num_fewshot`: None leaves each task's own; `max_gen_toks`:
    lifecycle_qa's answer budget; `chat`: questions through the chat template."""
    if not names:
        return {}
    if len(set(names)) != len(names):
        raise InputError(f"evaluate.lm_eval_tasks names a task twice: {list(names)}")
    t_start = time.perf_counter()
    manager = _task_manager(names, None if include_path is None else Path(include_path))
    with tempfile.TemporaryDirectory(prefix="lm_eval_") as work, offline(), no_environment_report():
        local = {QA_TASK: lambda: qa_task(Path(data_dir), Path(work), max_gen_toks),
                 PAIRS_TASK: lambda: pairs_task(Path(data_dir), Path(work))}
        tasks = [local[n]() if n in local else n for n in names]
        try:
            results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, bootstrap_iters=0, log_samples=False,
                                      apply_chat_template=chat, random_seed=SEED, numpy_random_seed=SEED,
                                      torch_random_seed=SEED, fewshot_random_seed=SEED)
        except OSError as e:  # datasets' ConnectionError and FileNotFoundError among them
            raise InputError(f"an lm-eval task of {list(names)} could not load its data ({type(e).__name__}: {e}); "
                             "jobs run offline, so a task must read local files: copy its YAML into "
                             "evaluate.lm_eval_include_path with dataset_path: json and dataset_kwargs.data_files "
                             "naming the files") from e
    out = {"version": lm_eval.__version__, "limit": limit, "num_fewshot": num_fewshot, "chat_template": chat,
           "wall_seconds": time.perf_counter() - t_start, "tasks": {n: _metrics(results, n) for n in names}}
    for name, task in out["tasks"].items():
        log.info("lm-eval %s (%s documents): %s", name, task["samples"],
                 ", ".join(f"{m} {v:.4f}" for m, v in task["metrics"].items() if v is not None))
    return out
