"""The summary of one bench/gpu_checks.sh run: the steps' exit codes and times, the device probe,
the pretrain stage and its resume, the memory planner's estimate against the GPU's measured peak per
case, training throughput and MFU
against transformers.Trainer, and decode speed against transformers' generate, from the JSON the
steps wrote into the run's work folder. Prints the tables; writes them as JSON too.

    python3 bench/gpu_summary.py WORK_DIR SUMMARY_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's bench package
from bench.decode_steps import report as decode_table  # noqa: E402  (torch-free at import)

GiB, MiB = 2**30, 2**20


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(work: Path) -> list[dict[str, str]]:
    lines = (work / "steps.tsv").read_text().splitlines()[1:] if (work / "steps.tsv").exists() else []
    return [dict(zip(("step", "rc", "seconds", "limit"), line.split("\t"))) for line in lines]


def memory(work: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(work.glob("mem_*.json")):
        report = _load(path)
        for r in (report or {}).get("records", []):
            setup = max(rank["measured"].get("setup_peak", 0) for rank in r["ranks"])
            rows.append({"flavour": r["flavour"], "case": r["case"], "estimate_bytes": r["estimate_bytes"],
                         "measured_bytes": r["measured_bytes"], "ratio": r["ratio"],
                         "phase": r["estimate"]["phase"], "setup_peak_bytes": setup})
    order = {"none": 0, "none_bf16": 1, "stage1": 2, "stage1_bf16": 3, "stage2_bf16": 4, "stage3_bf16": 5,
             "stage1_bf16_recompute": 6, "stage2_bf16_offload": 7}
    return sorted(rows, key=lambda r: (r["flavour"] != "1b", order.get(r["case"], 9), r["case"]))


def summarize(work: Path) -> dict[str, Any]:
    return {"steps": steps(work), "probe": _load(work / "probe.json"), "memory": memory(work),
            "train": _load(work / "train_throughput.json"), "stage_resume": _load(work / "stage_resume.json"),
            "decode": [d for d in (_load(work / f"{name}.json") for name in ("decode_steps", "decode_compiled")) if d]}


def report(s: dict[str, Any]) -> str:
    lines = ["", "=" * 30 + " GPU checks summary " + "=" * 30,
             "steps: " + ", ".join(f"{x['step']} rc={x['rc']} {x['seconds']}s" for x in s["steps"])]
    p = s["probe"]
    if p:
        peak = max(p["peak_bf16_tflops"])
        lines.append(f"{p['gpu']} ({p['gpu_memory_gib']:.0f} GiB), torch {p['torch']} cuda {p['cuda']}, python "
                     f"{p['python']}; deepspeed {p['deepspeed']}, transformers {p['transformers']}, peft {p['peft']}; "
                     f"bf16 8192^3 matmul {peak:.0f} TFLOP/s")
    if s["memory"]:
        lines += ["", "memory planner: estimate vs torch.cuda.max_memory_allocated (world of one, 2 steps)",
                  f"{'flavour':<9}{'case':<23}{'est':>12}{'meas':>12}{'ratio':>7}  {'phase':<9}{'setup':>12}"]
        for r in s["memory"]:
            unit, scale = ("GiB", GiB) if r["flavour"] == "1b" else ("MiB", MiB)
            lines.append(f"{r['flavour']:<9}{r['case']:<23}{r['estimate_bytes'] / scale:>8.2f} {unit}"
                         f"{r['measured_bytes'] / scale:>8.2f} {unit}{r['ratio']:>7.3f}  {r['phase']:<9}"
                         f"{r['setup_peak_bytes'] / scale:>8.2f} {unit}")
    r = s["stage_resume"]
    if r:
        first, resumed = r["first"], r["resumed"]
        lines += ["", f"pretrain stage on {r['device']} (torchrun, bf16, ZeRO-1, 30 steps): rc {first['rc']}, final "
                      f"loss {first['final_loss']}; rerun resuming from step {resumed['resumed_from_step']}: rc "
                      f"{resumed['rc']}, largest loss / weight difference {r.get('max_loss_diff')} / "
                      f"{r.get('max_weight_diff')}"]
    t = s["train"]
    if t:
        st = t["settings"]
        lines += ["", f"training throughput: {st['flavour']} ({st['num_parameters'] / 1e9:.2f}B), batch "
                      f"{st['batch_size']} x {st['seq_len']}, {st['steps']} measured steps; MFU against "
                      f"{t['peak_flops'] / 1e12:.0f} TFLOP/s measured in the same run",
                  f"{'run':<24}{'ms/step':>9}{'min ms':>9}{'tokens/s':>10}{'MFU %':>7}{'x hf':>7}"]
        hf = t["runs"]["hf trainer (eager)"]["tokens_per_s"]
        for name, r in t["runs"].items():
            lines.append(f"{name:<24}{r['median_step_s'] * 1e3:>9.1f}{r['min_step_s'] * 1e3:>9.1f}"
                         f"{r['tokens_per_s']:>10.0f}{r['mfu'] * 100:>7.1f}{r['tokens_per_s'] / hf:>7.2f}")
    for d in s["decode"]:
        st = d["settings"]
        lines += ["", f"decode: flavour {st['flavour']} {st['dtype']} on {st['device']}, prompt {st['prompt_tokens']}, "
                      f"{st['new_tokens']} new tokens, median of {st['repeats']}",
                  *decode_table(d).splitlines()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    work, out = Path(argv[0]), Path(argv[1])
    summary = summarize(work)
    out.write_text(json.dumps(summary, indent=1))
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
