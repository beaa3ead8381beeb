"""What serving an experiment's variants behind one server saves in memory: `python -m stages.serve
--experiment DIR` (one process, adapters on one copy of their base's weights) against one
`--model` server per variant (as many processes), every server its own process, measured one
after the other.

Each server is started, waited for until it prints its address, sent one greedy chat request per
model (max_tokens 8: the decode engine and its caches are made), then its resident memory is read
from /proc/<pid>/status (VmRSS now, VmHWM its peak) and it is stopped. The one-server run also logs
its weights held against loaded one by one (`N models hold X MB of weights (Y MB loaded one by
one)`, stages/serve.py), which separates the weights saved from the per-process cost (Python,
torch, transformers: paid once instead of once per variant).

    .venv/bin/python bench/serve_memory.py --experiment results/llama    # after make demo; about 6 minutes
Prints a table and writes JSON (default bench/out/serve_memory.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import finish, machine_info  # noqa: E402
from stages.serving.variants import experiment_variants  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "serve_memory.json"
WEIGHTS_LINE = re.compile(r"models hold ([\d.]+) MB of weights \(([\d.]+) MB loaded one by one\)")


def _status_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def _ask(url: str, model: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"model": model, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": "count: 2"}]}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"{model}: HTTP {response.status}")
    conn.close()


def measure(args: list[str], model_ids: list[str]) -> dict:
    """One server of `args`: its memory (MB) after one request per model, and its weights log line."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stages.serve", *args], stdout=subprocess.PIPE, stderr=log,
                                text=True, cwd=ROOT)
        try:
            # anything a library prints on stdout comes before the address line
            line = next((line for line in proc.stdout if line.startswith("serving ")), "")
            if not line:
                log.seek(0)
                raise RuntimeError(f"the server did not start: {log.read()[-2000:]}")
            url = line.split(" at ")[1].split()[0]
            for model in model_ids:
                _ask(url, model)
            memory = _status_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        weights = WEIGHTS_LINE.search(log.read())
    if weights:
        memory["weights_held_mb"], memory["weights_one_by_one_mb"] = float(weights[1]), float(weights[2])
    return memory


def run(experiment: Path) -> dict:
    specs = experiment_variants(experiment)
    ids = [s.model_id for s in specs]
    together = measure(["--experiment", str(experiment)], ids)
    separate = {s.model_id: measure(["--model", str(s.model_dir), "--served-model-name", s.model_id], [s.model_id])
                for s in specs}
    total = {key: sum(m[key] for m in separate.values()) for key in ("VmRSS", "VmHWM")}
    return {"machine": machine_info("transformers", "peft"), "experiment": str(experiment), "variants": ids,
            "one_server": together, "one_server_per_variant": separate, "sum_of_servers": total,
            "ratio_rss": together["VmRSS"] / total["VmRSS"]}


def report(result: dict) -> str:
    lines = ["| server | VmRSS MB | VmHWM MB |", "|---|---|---|"]
    for model, m in result["one_server_per_variant"].items():
        lines.append(f"| --model {model} | {m['VmRSS']:.0f} | {m['VmHWM']:.0f} |")
    total, together = result["sum_of_servers"], result["one_server"]
    lines.append(f"| sum of the {len(result['variants'])} | {total['VmRSS']:.0f} | {total['VmHWM']:.0f} |")
    lines.append(f"| --experiment (all {len(result['variants'])}) | {together['VmRSS']:.0f} | "
                 f"{together['VmHWM']:.0f} |")
    lines.append(f"\none server holds {result['ratio_rss']:.2f}x the RSS of one server per variant")
    if "weights_held_mb" in together:
        lines.append(f"weights: {together['weights_held_mb']:.1f} MB held, {together['weights_one_by_one_mb']:.1f} MB "
                     "loaded one by one")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", type=Path, default=ROOT / "results" / "llama")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    started = time.perf_counter()
    return finish(args.out, run(args.experiment), report, started)


if __name__ == "__main__":
    sys.exit(main())
