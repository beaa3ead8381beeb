"""The workflow through the slurm profile against a real slurmctld (tests/slurm/local_slurm.sh).

Marked `slurm`: left out of `make test`, run by CI (.ci/run) after it starts the local cluster: two
SLURM nodes (llmnode1, llmnode2, one slurmd each) on this one machine. Every rule goes through sbatch
(the executor plugin), the training rules start their ranks with `srun --overlap` inside the job
(stages/launch.py), and the results are checked as a user would: the debug DAG's jobs of every rule
kind but the report (14 of its 33) complete with their pretraining as a 2-node job (one rank per
node, `cluster.tasks_per_node: 1`) whose ranks, per their own log lines, ran on different nodes and
met at the first node's rendezvous; a second experiment
pretrains at the same time as a 2-task step on one node, sharing a node with the first, without
colliding; a job failing on bad data and one reaching its time limit (which saves a checkpoint
before it, and is not requeued here) are reported while Snakemake stops cleanly with the results
made before them intact; a pretraining job whose time limit is too short saves a checkpoint before
it, requeues itself, and the workflow finishes on its own with the weights of an uninterrupted
run; so does a job requeued by `scontrol requeue`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.integration.workflow_helpers import (
    DEBUG_CONFIG, ROOT, logged_steps, planned_jobs, snakemake, weights_sha256,
)

pytestmark = pytest.mark.slurm

LOCAL_SLURM = ROOT / "tests" / "slurm" / "local_slurm.sh"
PROFILE = ROOT / "workflow" / "profiles" / "slurm"
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")  # the launcher's line, logging, DeepSpeed
# stages.launch's line inside an allocation, and each rank's line after init
# (stages.training.distributed.init_distributed)
LAUNCH = re.compile(r"stages\.launch: srun --overlap --kill-on-bad-exit=1 --ntasks=(\d+) --nodes=(\d+) "
                    r"--ntasks-per-node=(\d+) .*\(MASTER_ADDR=(\S+) MASTER_PORT=(\d+)\)")
RANK = re.compile(r"rank (\d+) of (\d+) on node (\S+) \(local rank (\d+), rendezvous (\S+):(\d+), (\w+)\)")


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local two-node cluster: started here unless it already runs (then left running)."""
    state = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/llm-lifecycle-slurm"))
    running = (state / "slurmctld.pid").exists()
    out = subprocess.run([str(LOCAL_SLURM), "start"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"local_slurm.sh start failed:\n{out.stdout}\n{out.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", out.stdout).group(1)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if not running:
        subprocess.run([str(LOCAL_SLURM), "stop"], capture_output=True, text=True, timeout=120)


def _config(tmp_path: Path, experiments: dict) -> Path:
    path = tmp_path / "slurm_test.yaml"
    path.write_text(yaml.safe_dump({"experiments": experiments}))
    return path


def _debug_experiment() -> dict:
    return yaml.safe_load(DEBUG_CONFIG.read_text())["experiments"]["ci"]


def _through_slurm(workdir: Path, config: Path, *targets: str, extra: tuple[str, ...] = (), check=True):
    return snakemake(workdir, "--configfile", str(config), "--workflow-profile", str(PROFILE),
                     "--slurm-keep-successful-logs", "--slurm-init-seconds-before-status-checks", "5",
                     *extra, *targets, check=check)


def _sbatch_rules(workdir: Path) -> set[str]:
    """Rules with a SLURM job log: each went through sbatch."""
    logs = workdir / ".snakemake" / "slurm_logs"
    return {p.name.removeprefix("rule_") for p in logs.glob("rule_*") if any(p.rglob("*.log"))}


def _interval(log: Path) -> tuple[datetime, datetime]:
    stamps = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S") for s in STAMP.findall(log.read_text())]
    return stamps[0], stamps[-1]


def _ranks(log: str) -> dict[int, dict]:
    """Rank -> where it ran and met the others, from the ranks' own log lines."""
    return {int(m[0]): {"world": int(m[1]), "node": m[2], "local_rank": int(m[3]), "rendezvous": (m[4], m[5]),
                        "backend": m[6]} for m in RANK.findall(log)}


def test_debug_dag_and_a_second_pretraining_run_through_slurm(tmp_path, slurm_cluster):
    first = _debug_experiment()
    first["cluster"] = {"tasks_per_node": 1}  # world_size 2: one rank on each of two nodes
    second = _debug_experiment()
    second["pretrain"]["seed"] = 7  # cluster defaults: both ranks on one node
    config = _config(tmp_path, {"ci": first, "ci2": second})
    # every rule kind but the report's (a JSON-and-plots job; the whole debug DAG runs in the default
    # suite and under a prefix in test_portable_workflow.py): 14 of the DAG's 33 jobs, local ones included
    targets = ("results/ci/deploy/manifest.json", "results/ci/eval/lora.json", "results/ci/plan.json",
               "results/ci2/pretrain")
    expected = planned_jobs(snakemake(tmp_path, "--configfile", str(config), "-n", *targets).stdout)

    start = time.monotonic()
    proc = _through_slurm(tmp_path, config, *targets)
    elapsed = time.monotonic() - start
    print(f"debug DAG + second pretraining through SLURM: {elapsed:.0f} s")

    results = tmp_path / "results"
    assert (results / "ci" / "deploy" / "manifest.json").is_file() and (results / "ci2" / "pretrain").is_dir()
    assert {"prepare", "pretrain", "finetune", "merge_lora", "quantize", "export", "deploy_gguf",
            "deploy_compressed_tensors", "evaluate"} <= set(expected), expected
    # every rule is a SLURM job but the local ones (`localrule: True`: a JSON file in a second)
    local = {"plan", "plan_job", "deploy_manifest"}
    assert local <= set(expected) and not local & _sbatch_rules(tmp_path), _sbatch_rules(tmp_path)
    assert set(expected) - local <= _sbatch_rules(tmp_path), (expected, _sbatch_rules(tmp_path), proc.stdout[-3000:])

    launches, ranks = {}, {}
    for name, layout in (("ci", ("2", "2", "1")), ("ci2", ("2", "1", "2"))):
        log = (results / name / "logs" / "pretrain.log").read_text()
        launch = LAUNCH.search(log)
        assert launch, f"{name}: pretraining did not start as a 2-task srun step:\n{log[:2000]}"
        assert launch.groups()[:3] == layout, f"{name}: tasks, nodes, tasks per node {launch.groups()[:3]}"
        launches[name] = launch.group(4), launch.group(5)
        planned = {int(r) for r in re.findall(r"rank (\d+): memory planned", log)}
        assert planned == {0, 1}, log[-2000:]  # each task logs the plan beside its measured peak
        ranks[name] = _ranks(log)
        assert set(ranks[name]) == {0, 1} and {r["world"] for r in ranks[name].values()} == {2}, log[-3000:]
        # every rank met at the address and port the launcher chose
        assert {r["rendezvous"] for r in ranks[name].values()} == {launches[name]}, (launches[name], ranks[name])
        short = re.sub(r" --export=ALL .* \(", " --export=ALL ... (", launch.group(0))  # the stage's arguments out
        print(f"{name}: " + "\n    ".join([short, *(m.group(0) for m in RANK.finditer(log))]))
    ci, ci2 = ranks["ci"], ranks["ci2"]
    # ci: one rank on each node, rank 0 on the allocation's first node, which is the rendezvous host
    assert (ci[0]["node"], ci[1]["node"]) == ("llmnode1", "llmnode2"), ci
    assert ci[0]["local_rank"] == ci[1]["local_rank"] == 0, ci
    assert launches["ci"][0] == ci[0]["node"], (launches["ci"], ci)
    # ci2: both ranks on one node, which ci also used, rendezvous on that node
    assert ci2[0]["node"] == ci2[1]["node"] == launches["ci2"][0], (launches["ci2"], ci2)
    assert {ci2[0]["local_rank"], ci2[1]["local_rank"]} == {0, 1}, ci2
    assert {ci2[0]["node"]} <= {ci[0]["node"], ci[1]["node"]}, (ci, ci2)
    assert launches["ci"][1] != launches["ci2"][1], "two jobs on one node must not share a rendezvous port"
    (a0, a1), (b0, b1) = (_interval(results / n / "logs" / "pretrain.log") for n in ("ci", "ci2"))
    assert a0 < b1 and b0 < a1, f"the two pretraining jobs did not overlap: ci {a0}-{a1}, ci2 {b0}-{b1}"
    plan = (results / "ci" / "plan.json").read_text()
    assert '"pretrain"' in plan and '"resources"' in plan
    resources = json.loads(plan)["jobs"]["pretrain"]["resources"]  # what sbatch was asked for
    assert (resources["nodes"], resources["tasks"], resources.get("slurm_extra")) == (2, 2, "--ntasks-per-node=1")


def test_a_failing_and_a_timed_out_job_are_reported_and_earlier_results_stay(tmp_path, slurm_cluster):
    bad_corpus = tmp_path / "corpus.jsonl"  # readable at parse time; line 2 fails in prepare
    bad_corpus.write_text('{"text": "fine"}\n{"txt": "a misspelt field"}\n')
    bad = _debug_experiment()
    bad["data"]["corpus"] = [str(bad_corpus)]
    slow = _debug_experiment()
    slow["pretrain"].update(max_steps=100000, save_steps=0)
    slow["cluster"] = {"runtime_minutes": {"pretrain": 1}}
    config = _config(tmp_path, {"bad": bad, "slow": slow})

    start = time.monotonic()
    os.environ["LLM_LIFECYCLE_MAX_REQUEUES"] = "0"  # stop before the time limit, but do not requeue
    try:
        with _LimitFromFirstStep(tmp_path, "slow") as watch:
            proc = _through_slurm(tmp_path, config, "results/bad/data", "results/slow/pretrain",
                                  extra=("--keep-going", "--retries", "0"), check=False)
    finally:
        del os.environ["LLM_LIFECYCLE_MAX_REQUEUES"]
    print(f"failure run through SLURM: {time.monotonic() - start:.0f} s (limit raised {watch.extended} times "
          "before the first step)")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"Error in rule prepare", out) and "no 'text' field" in \
        (tmp_path / "results" / "bad" / "logs" / "prepare.log").read_text()
    assert re.search(r"Error in rule pretrain", out)
    log = (tmp_path / "results" / "slow" / "logs" / "pretrain.log").read_text()
    # stopped by itself ahead of the limit (a 1-minute job keeps 6 s), with a checkpoint to resume from
    assert "stopped by the SLURM job's time limit (deadline) at step" in log and "not again" in log, log[-3000:]
    checkpoints = tmp_path / "results" / "slow" / "checkpoints" / "pretrain"
    assert list(checkpoints.glob("*/checkpoint-*/checkpoint_complete.json"))
    results = tmp_path / "results"
    assert not (results / "bad" / "data").exists()
    assert not (results / "slow" / "pretrain").exists()  # no half-written output
    assert (results / "slow" / "data" / "index.json").is_file()  # made before the time-out, kept
    assert (results / "slow" / "plan" / "pretrain.json").is_file()
    assert "Complete log" in out or "Exiting because a job execution failed" in out


def _job_id(workdir: Path, rule: str, experiment: str) -> str:
    """The SLURM job id of a rule's job, from the executor's log file name."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        logs = sorted((workdir / ".snakemake" / "slurm_logs" / f"rule_{rule}" / experiment).glob("*.log"))
        if logs:
            return logs[-1].stem
        time.sleep(1)
    raise AssertionError(f"no SLURM job for {rule} of {experiment}")


def _wait_for(condition, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"scontrol {' '.join(args)}: {out.stderr}"
    return out.stdout


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


class _LimitFromFirstStep:
    """A 1-minute time limit that starts counting, in effect, at the first training step: while
    `experiment`'s pretraining job runs but has logged no step, its limit is raised by a minute
    whenever less than SPARE_S is left. Start-up (the executor's Snakemake, the ranks' imports, the
    model) takes ~20 s on an idle 2-core machine but took the whole minute beside CI's other
    streams, when SLURM's SIGTERM at the limit came before the first step (2026-11-26): a time
    limit is then not what the test is testing. Once training, the job meets its limit as a user's
    does: 25-85 s later. With `release_after_requeue` minutes, the job is also let start again as
    soon as it is pending after its requeue, with that limit: otherwise it starts by itself two
    minutes later under its 1-minute limit again and, while the test waits on another job (CI's
    load, 2026-11-29), can finish in several 1-minute slices and leave the controller
    (MinJobAge). A thread, so a blocking Snakemake run can be watched too."""

    SPARE_S = 25

    def __init__(self, workdir: Path, experiment: str, release_after_requeue: int | None = None):
        self.workdir, self.experiment, self.extended = workdir, experiment, 0
        self.release_after_requeue, self.released = release_after_requeue, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=60)

    def _watch(self):
        job = _job_id(self.workdir, "pretrain", self.experiment)
        while not self._done.wait(0.5):
            training = logged_steps(self.workdir, self.experiment) > 0
            if training and (self.release_after_requeue is None or self.released):
                return
            out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60).stdout
            restarts = re.search(r"Restarts=(\d+)", out)
            if self.release_after_requeue is not None and "JobState=PENDING" in out and restarts and int(restarts[1]):
                _release(job, time_limit=self.release_after_requeue)
                self.released = True
                continue
            end = re.search(r"EndTime=(\S+)", out)
            if training or "JobState=RUNNING" not in out or not end:
                continue
            if datetime.fromisoformat(end.group(1)).timestamp() - time.time() < self.SPARE_S:
                subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=+1"], capture_output=True, timeout=60)
                self.extended += 1


def _release(job: str, time_limit: int | None = None) -> None:
    """A requeued job waits (BeginTime) about two minutes before it may start again; a user waits,
    the test lets it start now (with `time_limit` minutes, set first)."""
    _wait_for(lambda: "JobState=PENDING" in _scontrol("show", "job", job), f"job {job} pending again")
    if time_limit is not None:
        _scontrol("update", f"JobId={job}", f"TimeLimit={time_limit}")
    _scontrol("update", f"JobId={job}", "StartTime=now")


def test_a_time_limit_and_a_requeue_end_in_the_uninterrupted_weights(tmp_path, slurm_cluster):
    """Three pretraining jobs of one recipe: `limit` runs under a 1-minute time limit, too short
    for its 1600 steps (about 30 s are left for training on an idle machine, ~17 steps/s here; the
    limit is raised while it has not started training, `_LimitFromFirstStep`, so 25-85 s): it saves
    a checkpoint before the limit (a 1-minute job keeps 6 s), requeues itself and resumes there
    (released with a 30-minute limit); `requeue` is first sent SIGTERM by `scancel --signal=TERM` (the job's steps:
    the ranks, not the executor's Snakemake in the batch step), saves a checkpoint at the step the
    ranks agree on, requeues itself and resumes there, then is requeued by hand (`scontrol requeue`:
    SIGTERM to the whole job, then SIGKILL) and resumes from its newest checkpoint; `straight` runs
    through. One Snakemake run finishes all three without a manual rerun, with bit-identical
    weights."""
    recipe = _debug_experiment()
    recipe["pretrain"].update(max_steps=1600, save_steps=100)
    limit = {**recipe, "cluster": {"runtime_minutes": {"pretrain": 1}}}  # not in the checkpoint fingerprint
    config = _config(tmp_path, {"limit": limit, "requeue": recipe, "straight": recipe})
    targets = [f"results/{name}/pretrain" for name in ("limit", "requeue", "straight")]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "workflow" / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(ROOT / "config" / "config.yaml"), str(config), "--workflow-profile", str(PROFILE),
           "--slurm-keep-successful-logs", "--slurm-init-seconds-before-status-checks", "5", "--retries", "0",
           *targets]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the limit job is released, with room to finish, as soon as it is pending after its requeue
    with _LimitFromFirstStep(tmp_path, "limit", release_after_requeue=30) as watch:
        try:
            requeue_job = _job_id(tmp_path, "pretrain", "requeue")
            _wait_for(lambda: logged_steps(tmp_path, "requeue") >= 150, "requeue: 150 steps (one checkpoint)")
            cancel = subprocess.run(["scancel", "--signal=TERM", requeue_job], capture_output=True, text=True,
                                    timeout=60)
            assert cancel.returncode == 0, cancel.stderr
            _release(requeue_job)  # requeued by its rank 0 after the save
            resumed = tmp_path / "results" / "requeue" / "logs" / "pretrain.log"
            _wait_for(lambda: "resumed at step" in _text(resumed), "requeue: resumed after SIGTERM")
            assert "when stopped by SIGTERM" in _text(resumed), _text(resumed)[-3000:]
            _wait_for(lambda: logged_steps(tmp_path, "requeue") >= 500, "requeue: 500 steps")
            _scontrol("requeue", requeue_job)
            _release(requeue_job)
            out, _ = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(f"three pretraining jobs, one stopped at its time limit, one requeued: {time.monotonic() - start:.0f} s "
          f"(the limit raised {watch.extended} times before the first step)")
    assert proc.returncode == 0, out[-4000:]
    assert watch.released, "the limit job was never pending after a requeue"

    results = tmp_path / "results"
    straight = weights_sha256(results / "straight" / "pretrain")
    assert straight
    limit = json.loads((results / "limit" / "pretrain" / "meta.json").read_text())["metrics"]
    assert [s["reason"] for s in limit["stops"]] == ["the SLURM job's time limit (deadline)"], limit["stops"]
    assert limit["resumed_from_step"] == limit["stops"][0]["step"] < 1600
    assert weights_sha256(results / "limit" / "pretrain") == straight
    # scancel --signal=TERM: a save at the signal's step, the first stop; `scontrol requeue` also
    # signals the executor's Snakemake in the batch step, which may end the job before the ranks
    # save: then the rerun starts from the newest periodic checkpoint
    requeued = json.loads((results / "requeue" / "pretrain" / "meta.json").read_text())["metrics"]
    print(f"requeue: resumed from step {requeued['resumed_from_step']}, stops {requeued['stops']}")
    assert requeued["stops"][0]["reason"] == "SIGTERM" and 150 <= requeued["stops"][0]["step"] < 500, requeued
    assert requeued["resumed_from_step"] > requeued["stops"][0]["step"]  # from the second run's checkpoints
    assert weights_sha256(results / "requeue" / "pretrain") == straight
    assert "resumed at step" in (results / "limit" / "logs" / "pretrain.log").read_text()
