"""Several training runs, one after another, in one world of torchrun ranks (a test helper).

`torchrun --standalone --nproc_per_node=N tests/unit/runs_in_one_world.py RUNS.json` initialises
the process group once and calls the stage's own `run` for each entry of RUNS.json, in order:
`{"stage": "pretrain", "data": DIR, "out": DIR, "model": {...}, "section": {...}}` or
`{"stage": "finetune", "method": M, "model": DIR, "data": DIR, "out": DIR, "section": {...}}` or
`{"stage": "align", "model": DIR, "data": DIR, "out": DIR, "section": {...}, "reference": DIR}`, each
with an optional `"checkpoints": DIR` (the stage's checkpoint directory), a pretraining entry with
an optional `"init": DIR` (continued pretraining from that checkpoint, the stage's `--init`).

Why: a torchrun spends most of its time before training (interpreter, imports, rendezvous, data,
model and engine set-up: ~8 s of an 8.7-s LoRA tp2 run of 5 debug steps on 2 cores, 0.6 s of
training), so a layout matrix with one torchrun per layout spent most of its time starting processes. Each
run builds its own model, engine and parallel groups (`stages.parallel.topology` creates them per
run), so a run that leaked state into the next would show in that run's parity check. The
stages' command lines are run by the tests that start them one torchrun each (e.g.
test_two_zero1_ranks_match_one_process, the workflow tests). A run that raises ends the world;
the runs before it have written their outputs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("runs_in_one_world")
ROOT = Path(__file__).resolve().parents[2]


class World:
    """The outputs of one world's runs (the caller's side): `out(name)` is that run's output
    directory, or an AssertionError with the ranks' stderr when the world ended before writing it."""

    def __init__(self, runs: dict[str, dict], returncode: int, stderr: str):
        self.runs, self.returncode, self.stderr = runs, returncode, stderr

    def out(self, name: str) -> Path:
        out = Path(self.runs[name]["out"])
        assert self.returncode == 0 or (out / "meta.json").exists(), \
            f"the world of {len(self.runs)} runs ended (rc {self.returncode}) before {name} ({out}):\n" \
            f"{self.stderr[-5000:]}"
        return out


def torchrun_env() -> dict[str, str]:
    """The environment of a torchrun a test starts: the project importable, one thread per rank,
    and no world of the test process's own."""
    from stages.training.distributed import without_world

    # an in-process engine run of the test session must not leak its world
    return without_world(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def start_world(nproc: int, runs: dict[str, dict], workdir: Path) -> World:
    """Run `runs` (name -> entry as this module's docstring says), in order, on `nproc` gloo ranks of
    one torchrun whose files go to `workdir`."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    runs_file = Path(workdir) / "runs.json"
    runs_file.write_text(json.dumps(list(runs.values()), default=str))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           __file__, str(runs_file)]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=900)
    return World(runs, proc.returncode, proc.stderr)


def run_one(entry: dict) -> None:
    if entry["stage"] == "pretrain":
        from stages import pretrain

        pretrain.run(entry["data"], entry["out"], entry["model"], entry["section"], entry.get("checkpoints"),
                     entry.get("init"))
    elif entry["stage"] == "finetune":
        from stages import finetune

        finetune.run(entry["method"], entry["model"], entry["data"], entry["out"], entry["section"],
                     entry.get("checkpoints"))
    elif entry["stage"] == "align":
        from stages import align

        align.run(entry["model"], entry["data"], entry["out"], entry["section"], entry.get("reference"),
                  entry.get("checkpoints"))
    else:
        raise ValueError(f"{entry['stage']!r}: expected 'pretrain', 'finetune' or 'align'")


def main(runs_file: str) -> None:
    from stages.stage_logs import configure_logging
    from stages.training.distributed import finish_distributed

    configure_logging()
    runs = json.loads(Path(runs_file).read_text())
    for i, entry in enumerate(runs, 1):
        log.info("run %d of %d: %s -> %s", i, len(runs), entry["stage"], entry["out"])
        run_one(entry)
    finish_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
