"""Fine-tuning quality over seeds: dev exact match of full SFT, LoRA and prefix tuning on the default
task, and what each forgot of the language (corpus perplexity against the starting model's).

A sweep (stages/sweeps.py): experiment `--base` (default `llama`) of `--config` (default
config/config.yaml), with the recipe overrides of `--overrides` applied (a YAML/JSON file: `{sft:
{...}, lora: {...}, prefix: {...}}`, or `{finetune: {...}, <other experiment sections>: {...}}`),
becomes experiment `q<prefix>-base`, and sweep `q<prefix>` runs it over the seeds (`--seeds`, default
1 2 3 7 42; `seed` sets every seed of the chain: the generated task and its split, pretraining,
fine-tuning, prediction and calibration) as experiments `q<prefix>.seed-<seed>`. Each seed's data and
pretrained model are made once by the sweep's hidden `shared-<hash>` experiment and reused by any later
call whose overrides change only fine-tuning. The config is written under bench/out/ and built by
one Snakemake run whose target is the sweep's comparison (the whole chain up to the evaluations of
the starting model, sft, lora, prefix and lora-merged; not quantization):

    snakemake --cores 2 results/sweeps/q<p>/compare.md \
        --configfile config/config.yaml bench/out/finetune_quality_q<p>.yaml

The starting model is `pretrain`, or `base` for an experiment that fine-tunes a checkpoint
(config/smollm2.yaml). Then, per method and seed, it reads exact_match, bleu4, rouge_l, dev_ppl and
the corpus perplexity `ppl` from results/<exp>/eval/<variant>.json, the wall time of each fine-tuning
rule from Snakemake's benchmark results/<exp>/benchmarks/finetune_<method>.tsv (and the training
loop's own time, the last `elapsed_s` of train_log.csv), and each variant's corpus perplexity over the
starting model's (`ppl x`), prints a table (mean, min, max and spread of each method; LoRA/SFT and
prefix/SFT ratios of the mean exact match and per seed), PASS/FAIL against the targets, on every seed
separately (SFT >= 0.85; LoRA >= 90% of the same seed's SFT; prefix >= 70%; corpus perplexity of
`--ppl-variants`, default sft and lora-merged, <= `--ppl-limit`, default 1.5, times the starting
model's), and writes JSON (default bench/out/finetune_quality.json).

Snakemake reruns only what changed: a second call with other fine-tuning overrides and the same
`--prefix` reruns fine-tuning and evaluation only. A benchmark TSV older than the run (a rule Snakemake did not rerun) is reported with
`fresh: false`.

    .venv/bin/python bench/finetune_quality.py                       # seeds 1 2 3 7 42, config.yaml's recipes
    .venv/bin/python bench/finetune_quality.py --seeds 1 --overrides my_recipes.yaml
    .venv/bin/python bench/finetune_quality.py --config config/smollm2.yaml --base smollm2 --seeds 42 \
        --prefix sm --ppl-limit 1.2 --ppl-variants sft lora prefix lora-merged --out bench/out/fq_smollm2.json
    .venv/bin/python bench/finetune_quality.py --no-run              # only report existing results
    .venv/bin/python bench/finetune_quality.py --help
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import git_commit, machine_info  # noqa: E402
from stages.checkpoint.atomic import write_json  # noqa: E402
from stages.config import check_config, finetune_source, merge  # noqa: E402
from stages.config import experiment as named_experiment  # noqa: E402
from stages.sweeps import expand as expand_sweeps  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "finetune_quality.json"
METHODS = ("sft", "lora", "prefix")
VARIANTS = (*METHODS, "lora-merged")  # the fine-tuned variants whose eval files are read
METRICS = ("exact_match", "bleu4", "rouge_l", "dev_ppl", "ppl")
# Targets, printed as pass/fail (never asserted): exact match relative to full SFT's, of the mean
# over the seeds and of every seed; SFT's own floor; forgetting (corpus ppl over pretrain's).
TARGETS = {"lora": 0.9, "prefix": 0.7}
SFT_FLOOR = 0.85
PPL_RATIO_LIMIT = 1.5
PPL_RATIO_VARIANTS = ("sft", "lora-merged")


# -- config ----------------------------------------------------------------------------------------


def load_overrides(path: Path | None) -> dict[str, Any]:
    """The overrides file as experiment-level settings: `{sft: .., lora: .., prefix: ..}` is taken
    as the `finetune` section; any other top-level keys are experiment sections."""
    if path is None:
        return {}
    data = yaml.safe_load(path.read_text()) or {}  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise SystemExit(f"--overrides {path}: expected a mapping, got {type(data).__name__}")
    if data and set(data) <= set(METHODS):
        return {"finetune": data}
    return data


def start_variant(exp: dict[str, Any]) -> str:
    """The variant fine-tuning starts from, the forgetting reference: `pretrain`, or `base` for an
    experiment that fine-tunes a checkpoint without pretraining it."""
    checked = check_config({"experiments": {"x": copy.deepcopy(exp)}})
    return finetune_source(named_experiment(checked, "x"))


def sweep_name(prefix: str) -> str:
    return f"q{prefix}"


def experiment_name(prefix: str, seed: int) -> str:
    """The sweep member of one seed (stages/sweeps.py names members <sweep>.<key>-<value>)."""
    return f"{sweep_name(prefix)}.seed-{seed}"


def write_sweep(args: argparse.Namespace) -> tuple[Path, dict[str, Any], dict[str, str]]:
    """The generated config: experiment q<prefix>-base (the base with the overrides) and sweep
    q<prefix> over its seeds. Returns its path, the base with overrides, and {member: the hidden
    experiment that makes its data and pretrained model}."""
    config = yaml.safe_load(args.config.read_text())
    try:
        base = config["experiments"][args.base]
    except (KeyError, TypeError):
        raise SystemExit(f"{args.config}: no experiments.{args.base}")
    name = sweep_name(args.prefix)
    recipe = merge(base, load_overrides(args.overrides))
    generated = {"experiments": {f"{name}-base": recipe},
                 "sweeps": {name: {"base": f"{name}-base", "grid": {"seed": list(args.seeds)},
                                   "variants": list(VARIANTS), "metrics": ["exact_match", "ppl", "ppl_ratio"]}}}
    path = args.generated or ROOT / "bench" / "out" / f"finetune_quality_{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Written by bench/finetune_quality.py: experiments.{args.base} of {args.config.name} with the\n"
              f"# overrides of {args.overrides or 'none'}, swept over the seeds (every seed of the chain)\n")
    path.write_text(header + yaml.safe_dump(generated, sort_keys=False))
    _, comparisons = expand_sweeps(merge(config, generated))  # as the workflow expands it
    return path, recipe, comparisons[f"sweeps/{name}"]["shared"]


def snakemake_command(args: argparse.Namespace, generated: Path) -> list[str]:
    """The sweep's comparison (which needs every member's evaluations of the start and the
    fine-tuned variants) is the target."""
    snakemake = Path(sys.executable).with_name("snakemake")
    cmd = [str(snakemake) if snakemake.exists() else "snakemake", "--cores", str(args.cores),
           "--rerun-incomplete", *args.snakemake_arg, f"results/sweeps/{sweep_name(args.prefix)}/compare.md",
           "--configfile", _rel(args.config), _rel(generated)]
    return cmd


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# -- results ---------------------------------------------------------------------------------------

def read_benchmark(path: Path, since: float | None) -> dict[str, Any] | None:
    """Snakemake's benchmark TSV of one rule: wall seconds, CPU seconds, max RSS (MB), and whether
    it was written during this run."""
    if not path.exists():
        return None
    with path.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        return None
    row = rows[-1]

    def num(key: str) -> float | None:
        try:
            return float(row[key])
        except (KeyError, TypeError, ValueError):
            return None

    return {"wall_s": num("s"), "cpu_s": num("cpu_time"), "max_rss_mb": num("max_rss"),
            "mean_load": num("mean_load"), "mtime": path.stat().st_mtime,
            "fresh": None if since is None else path.stat().st_mtime >= since}


def read_train_log(path: Path) -> dict[str, Any] | None:
    """The training loop's time (last elapsed_s), steps and last loss of train_log.csv."""
    if not path.exists():
        return None
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    last = rows[-1]
    return {"loop_s": float(last["elapsed_s"]), "steps": int(last["step"]), "last_loss": float(last["loss"]),
            "tokens_per_step": float(last["tokens"]) if last.get("tokens") else None}


def collect(args: argparse.Namespace, since: float | None) -> dict[str, Any]:
    """Per method, per seed: the eval metrics, the fine-tuning rule's benchmark and train log."""
    per_method: dict[str, dict[str, Any]] = {m: {} for m in ("start", *VARIANTS)}
    shared: dict[str, Any] = {}
    for seed in args.seeds:
        exp = experiment_name(args.prefix, seed)
        res = ROOT / "results" / exp
        upstream = ROOT / "results" / args.shared[exp]  # the sweep's hidden experiment made these
        shared[str(seed)] = {rule: read_benchmark(upstream / "benchmarks" / f"{rule}.tsv", since)
                             for rule in ("prepare", "pretrain")}
        start_eval = res / "eval" / f"{args.start}.json"
        start_ppl = json.loads(start_eval.read_text()).get("ppl") if start_eval.exists() else None
        for method in ("start", *VARIANTS):
            rec: dict[str, Any] = {"experiment": exp}
            eval_path = res / "eval" / f"{args.start if method == 'start' else method}.json"
            if eval_path.exists():
                ev = json.loads(eval_path.read_text())
                rec.update({k: ev.get(k) for k in METRICS})
                rec["num_dev_examples"] = ev.get("num_dev_examples")
                rec["ppl_ratio"] = ev["ppl"] / start_ppl if start_ppl and ev.get("ppl") is not None else None
            else:
                rec.update({k: None for k in METRICS})
                rec["ppl_ratio"] = None
            rec["finetune"] = read_benchmark(res / "benchmarks" / f"finetune_{method}.tsv", since)
            rec["evaluate"] = read_benchmark(res / "benchmarks" / f"evaluate_{method}.tsv", since)
            rec["train_log"] = read_train_log(res / method / "train_log.csv")
            meta_path = res / method / "meta.json"
            if meta_path.exists():
                meta = json.loads(meta_path.read_text())
                rec["recipe"] = meta.get("config")
                rec["train_metrics"] = {k: meta.get("metrics", {}).get(k)
                                        for k in ("first_loss", "final_loss", "dev_loss", "train_tokens_per_s",
                                                  "trainable_params", "resumed_from_step")}
            per_method[method][str(seed)] = rec
    return {"per_method": per_method, "per_seed_shared": shared}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None, "spread": None, "stdev": None, "n": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def summarise(collected: dict[str, Any], seeds: list[int], ppl_limit: float = PPL_RATIO_LIMIT,
              ppl_variants: tuple[str, ...] = PPL_RATIO_VARIANTS) -> dict[str, Any]:
    per_method = collected["per_method"]
    summary: dict[str, Any] = {}
    for method in METHODS:
        recs = [per_method[method][str(s)] for s in seeds]
        summary[method] = {metric: _stats([r[metric] for r in recs if r.get(metric) is not None])
                           for metric in METRICS}
        walls = [r["finetune"]["wall_s"] for r in recs if r.get("finetune") and r["finetune"]["wall_s"] is not None]
        loops = [r["train_log"]["loop_s"] for r in recs if r.get("train_log")]
        summary[method]["finetune_wall_s"] = _stats(walls)
        summary[method]["train_loop_s"] = _stats(loops)
    sft_mean = summary["sft"]["exact_match"]["mean"]
    ratios: dict[str, Any] = {}
    for method, target in TARGETS.items():
        mean = summary[method]["exact_match"]["mean"]
        ratio = mean / sft_mean if mean is not None and sft_mean else None
        per_seed = {}
        for s in seeds:
            a = per_method[method][str(s)].get("exact_match")
            b = per_method["sft"][str(s)].get("exact_match")
            per_seed[str(s)] = a / b if a is not None and b else None
        complete = summary[method]["exact_match"]["n"] == len(seeds) == summary["sft"]["exact_match"]["n"]
        ratios[method] = {"ratio_of_means": ratio, "per_seed": per_seed, "target": target,
                          "pass": bool(complete and ratio is not None and ratio >= target),
                          "pass_every_seed": bool(complete and all(v is not None and v >= target
                                                                  for v in per_seed.values()))}
    sft_em = {str(s): per_method["sft"][str(s)].get("exact_match") for s in seeds}
    forgetting = {}
    for variant in ppl_variants:
        per_seed = {str(s): per_method[variant][str(s)].get("ppl_ratio") for s in seeds}
        forgetting[variant] = {"per_seed": per_seed, "limit": ppl_limit,
                               "pass_every_seed": all(v is not None and v <= ppl_limit for v in per_seed.values())}
    ppl_ratio = {m: _stats([per_method[m][str(s)]["ppl_ratio"] for s in seeds
                            if per_method[m][str(s)].get("ppl_ratio") is not None])
                 for m in VARIANTS}
    wall_sum = {}
    for s in seeds:
        walls = [per_method[m][str(s)]["finetune"]["wall_s"] for m in METHODS
                 if per_method[m][str(s)].get("finetune")]
        wall_sum[str(s)] = sum(walls) if len(walls) == len(METHODS) else None
    return {"methods": summary, "ratios": ratios, "finetune_wall_sum_s": wall_sum, "ppl_ratio": ppl_ratio,
            "sft_floor": {"per_seed": sft_em, "floor": SFT_FLOOR,
                          "pass_every_seed": all(v is not None and v >= SFT_FLOOR for v in sft_em.values())},
            "forgetting": forgetting}


# -- report ----------------------------------------------------------------------------------------

def _f(value: Any, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def format_report(result: dict[str, Any]) -> str:
    seeds = result["settings"]["seeds"]
    per_method = result["per_method"]
    summary = result["summary"]
    out = []
    header = ["method", *[f"EM s{s}" for s in seeds], "EM mean", "min", "max", "spread",
              "BLEU-4", "ROUGE-L", "dev ppl", "ppl x max", *[f"ft s s{s}" for s in seeds], "loop s mean"]
    rows = []
    for m in METHODS:
        st = summary["methods"][m]
        row = [m, *[_f(per_method[m][str(s)].get("exact_match")) for s in seeds],
               _f(st["exact_match"]["mean"]), _f(st["exact_match"]["min"]), _f(st["exact_match"]["max"]),
               _f(st["exact_match"]["spread"]), _f(st["bleu4"]["mean"]), _f(st["rouge_l"]["mean"]),
               _f(st["dev_ppl"]["mean"], "{:.3g}"), _f(summary["ppl_ratio"][m]["max"], "{:.2f}")]
        for s in seeds:
            ft = per_method[m][str(s)].get("finetune")
            cell = _f(ft and ft["wall_s"], "{:.0f}")
            if ft and ft["fresh"] is False:
                cell += "*"
            row.append(cell)
        row.append(_f(st["train_loop_s"]["mean"], "{:.0f}"))
        rows.append(row)
    out.append(_table(header, rows))
    out.append("")
    for m, r in summary["ratios"].items():
        per_seed = ", ".join(f"s{s} {_f(r['per_seed'][str(s)], '{:.2f}')}" for s in seeds)
        out.append(f"{m}/sft mean EM: {_f(r['ratio_of_means'], '{:.3f}')} (target >= {r['target']:.2f}): "
                   f"{'PASS' if r['pass'] else 'FAIL'}   per seed: {per_seed}")
        out.append(f"{m}/sft per seed >= {r['target']:.2f} on every seed: {'PASS' if r['pass_every_seed'] else 'FAIL'}")
    floor = summary["sft_floor"]
    out.append(f"sft exact match >= {floor['floor']} on every seed: {'PASS' if floor['pass_every_seed'] else 'FAIL'}")
    out.append("")
    start = result["settings"]["start"]
    out.append(f"corpus perplexity over the starting model's ({start}; 1 = nothing forgotten):")
    ppl_rows = [[f"{start} (its ppl)", *[_f(per_method["start"][str(s)].get("ppl"), "{:.1f}") for s in seeds]]]
    ppl_rows += [[v, *[_f(per_method[v][str(s)].get("ppl_ratio"), "{:.2f}") for s in seeds]] for v in VARIANTS]
    out.append(_table(["variant", *[f"s{s}" for s in seeds]], ppl_rows))
    for variant, f in summary["forgetting"].items():
        out.append(f"{variant} ppl <= {f['limit']}x {start}'s on every seed: {'PASS' if f['pass_every_seed'] else 'FAIL'}")
    sums = ", ".join(f"s{s} {_f(v, '{:.0f}')} s" for s, v in summary["finetune_wall_sum_s"].items())
    out.append(f"fine-tuning rules, wall time summed over sft+lora+prefix: {sums}")
    stale = [f"{m} s{s}" for m in METHODS for s in seeds
             if (per_method[m][str(s)].get("finetune") or {}).get("fresh") is False]
    if stale:
        out.append(f"* benchmark not rewritten by this run (rule not rerun): {', '.join(stale)}")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/finetune_quality.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 7, 42],
                   help="seeds of the whole chain (default 1 2 3 7 42)")
    p.add_argument("--prefix", default="", help="the sweep is q<prefix>, its experiments q<prefix>.seed-<seed> "
                   "(default: q.seed-1, q.seed-2, ...)")
    p.add_argument("--overrides", type=Path, help="YAML/JSON recipe overrides: {sft: {..}, lora: {..}, prefix: {..}}")
    p.add_argument("--config", type=Path, default=ROOT / "config" / "config.yaml",
                   help="the config file holding the base experiment (default config/config.yaml)")
    p.add_argument("--base", default="llama", help="the experiment copied per seed (default llama)")
    p.add_argument("--ppl-limit", type=float, default=PPL_RATIO_LIMIT,
                   help=f"the forgetting target: corpus perplexity over the starting model's (default {PPL_RATIO_LIMIT})")
    p.add_argument("--ppl-variants", nargs="+", default=list(PPL_RATIO_VARIANTS), choices=VARIANTS,
                   help=f"the variants held to --ppl-limit (default {' '.join(PPL_RATIO_VARIANTS)})")
    p.add_argument("--cores", default="2", help="snakemake --cores (default 2)")
    p.add_argument("--generated", type=Path, help="where to write the experiments' config file "
                   "(default bench/out/finetune_quality_q<prefix>.yaml)")
    p.add_argument("--snakemake-arg", action="append", default=[],
                   help="an extra argument for snakemake (repeatable), e.g. --snakemake-arg=--keep-going")
    p.add_argument("--no-run", action="store_true", help="do not run snakemake; report the existing results")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {_rel(DEFAULT_OUT)})")
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds must be distinct")
    if args.overrides is not None and not args.overrides.exists():
        p.error(f"--overrides {args.overrides}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_wall = time.time()
    start = time.perf_counter()
    generated, recipe, args.shared = write_sweep(args)
    args.start = start_variant(recipe)
    cmd = snakemake_command(args, generated)
    print("$ " + " ".join(cmd), flush=True)
    machine = machine_info("transformers", "deepspeed", "snakemake")
    snakemake_rc = None
    snakemake_s = None
    if not args.no_run:
        t0 = time.perf_counter()
        snakemake_rc = subprocess.run(cmd, cwd=ROOT).returncode
        snakemake_s = time.perf_counter() - t0
        if snakemake_rc != 0:
            print(f"snakemake exited with {snakemake_rc}; reporting what exists", file=sys.stderr)
    collected = collect(args, None if args.no_run else start_wall)
    result = {
        "machine": machine,
        "settings": {"seeds": args.seeds, "prefix": args.prefix, "base": args.base, "config": _rel(args.config),
                     "overrides": str(args.overrides) if args.overrides else None,
                     "overrides_content": load_overrides(args.overrides), "generated_config": _rel(generated),
                     "cores": args.cores, "targets": TARGETS, "start": args.start,
                     "ppl_limit": args.ppl_limit, "ppl_variants": args.ppl_variants, "git_commit": git_commit(),
                     "recipes": {m: recipe.get("finetune", {}).get(m) for m in METHODS}},
        "command": " ".join(cmd),
        "argv": sys.argv,
        "snakemake_rc": snakemake_rc,
        "snakemake_seconds": snakemake_s,
        **collected,
    }
    result["summary"] = summarise(collected, args.seeds, args.ppl_limit, tuple(args.ppl_variants))
    result["total_seconds"] = time.perf_counter() - start
    print()
    print(format_report(result))
    write_json(args.out, result)  # atomic: a killed run leaves the previous JSON
    print(f"\nsnakemake {_f(snakemake_s, '{:.0f}')} s; wrote {_rel(args.out)}")
    return 0 if snakemake_rc in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
