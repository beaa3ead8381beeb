"""The pretrain stage itself on this machine's device, and its resume: `torchrun -m stages.pretrain`
(one rank; NCCL and the GPU where there is one, gloo and the CPU elsewhere), bf16, ZeRO-1, a
checkpoint every 15 of 30 steps; then the same command again into a fresh output directory with
the same checkpoint directory, which resumes from checkpoint-15 and trains steps 16-30 again. Prints
and writes JSON: each run's exit code, final loss and tokens/s, the step the second resumed from,
the largest difference of its losses and written weights from the first run's (on a GPU, kernels
that sum in another order can make them differ in the last bits), and the end of a failed run's log.

On 2026-12-01 on an H200 the resumed run failed here in fused AdamW ('state_steps is on cpu'): the
recreated Adam state put its step on the CPU (fixed in stages.training.checkpointing).

    python3 bench/gpu_stage_resume.py --out bench/out/gpu_stage_resume.json      # ~15 s on a GPU, CPU too
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.data.corpus import write_token_files  # noqa: E402
from stages.config import check_config  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "gpu_stage_resume.json"
SECTION = dict(world_size=1, sharding="stage1", bf16=True, max_steps=30, warmup_steps=2, max_length=64, seed=7,
               learning_rate=3e-3, save_steps=15, save_total_limit=0, per_device_train_batch_size=4,
               gradient_accumulation_steps=2)
MODEL = {"flavour": "debug", "num_hidden_layers": 4}


def make_data(out: Path) -> Path:
    """A data directory of a repeated random phrase (quickly learnable), 320 token ids."""
    phrase = np.random.default_rng(0).integers(3, 300, size=37).tolist()
    docs = [phrase * 20 for _ in range(8)]
    write_token_files(out, {"train": docs, "validation": docs[:1]}, vocab_size=320, bos_id=1, eos_id=2, pad_id=0)
    return out


def pretrain(data: Path, out: Path, checkpoints: Path) -> tuple[int, str]:
    """(exit code, the log's end) of one `torchrun -m stages.pretrain` of SECTION."""
    experiment = check_config({"experiments": {"gpu": {"model": MODEL, "pretrain": SECTION}}})["experiments"]["gpu"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "stages.pretrain", "--data", str(data), "--out", str(out), "--checkpoints", str(checkpoints),
           "--model-config", json.dumps(experiment["model"]), "--config", json.dumps(experiment["pretrain"])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def _metrics(out: Path) -> dict:
    try:
        return json.loads((out / "meta.json").read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return {}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON to write (default: %(default)s)")
    args = parser.parse_args()
    import pandas as pd
    import torch

    from stages.checkpoint.hf import load_state_dict

    work = Path(tempfile.mkdtemp(prefix="gpu_stage_resume."))
    data, checkpoints = make_data(work / "data"), work / "checkpoints"
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("first", "resumed"):
        rc, tail = pretrain(data, work / name, checkpoints)
        metrics = _metrics(work / name)
        result[name] = {"rc": rc, "final_loss": metrics.get("final_loss"), "tokens_per_s": metrics.get("tokens_per_s"),
                        "resumed_from_step": metrics.get("resumed_from_step")}
        if rc:
            result[name]["log_end"] = tail
    if result["first"]["rc"] == 0 and result["resumed"]["rc"] == 0:
        a, b = (pd.read_csv(work / n / "train_log.csv") for n in ("first", "resumed"))
        result["max_loss_diff"] = float(np.abs(a["loss"].to_numpy() - b["loss"].to_numpy()).max())
        wa, wb = load_state_dict(work / "first"), load_state_dict(work / "resumed")
        result["max_weight_diff"] = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
