"""The workflow used the way Snakemake workflows are used: imported by another workflow as a module
with a prefix and its own config, and with its results on a storage provider (the fs plugin with
node-local scratch as `--local-storage-prefix`, and S3 on a moto server on 127.0.0.1). The module
run builds the whole debug DAG (an undeclared path in any rule fails under a prefix); the S3 run a job
of every rule kind but the report in a bucket (S3_TARGETS: 17 of the DAG's 33 jobs, every quantizer
among them); the fs run builds data, pretraining and SFT, and resumes pretraining from its scratch.
The weights in storage equal the module run's, a run on the local file system, and the S3 run, a
second run from scratch, writes every artifact it makes as the module run did, byte for byte apart
from the measurements of the machine's speed and memory and the paths (tests/integration/rerun_identity.py)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rerun_identity import differing_artifacts
from workflow_helpers import DEBUG_CONFIG, ROOT

pytestmark = pytest.mark.slow

# weight files whose bytes every run must reproduce: trained, merged, and quantized by each method
WEIGHT_DIRS = ("pretrain", "sft", "lora", "prefix", "lora-merged", "quant/wint4", "quant/gptq-w4",
               "quant/awq-w4", "quant/a8w8-smooth")
ARTIFACTS = (*WEIGHT_DIRS, "data", "export", "deploy/gguf-f32", "deploy/compressed-tensors-a8w8-smooth")
# The S3 run: every rule kind but the report (the whole DAG runs under the module's prefix here and in
# make test's DAG test), every quantization method; what SFT and prefix tuning add
# (their jobs are finetune's, as LoRA's) is in neither this list nor the bucket.
S3_TARGETS = ("results/ci/deploy/manifest.json", "results/ci/eval/lora.json", "results/ci/plan.json",
              *(f"results/ci/quant/{v}" for v in ("wint4", "gptq-w4", "awq-w4")))
NOT_IN_S3 = ("sft", "prefix")
S3_ARTIFACTS = tuple(a for a in ARTIFACTS if a not in NOT_IN_S3)


def run_snakemake(workdir: Path, *args: str, snakefile: Path = ROOT / "workflow" / "Snakefile",
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir), "--cores", "2",
           "--show-failed-logs", *args]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def sha256s(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def local_weights(experiment: Path) -> dict[str, str]:
    """{<artifact>/<weight file>: sha256} of a results/<name> directory on the local file system."""
    return sha256s({f"{d}/{p.name}": p.read_bytes() for d in WEIGHT_DIRS
                    for p in sorted((experiment / d).glob("*.safetensors"))})


@pytest.fixture(scope="module")
def module_run(tmp_path_factory) -> Path:
    """The debug DAG through a second workflow that imports this one as module `llm`, prefix llm/."""
    work = tmp_path_factory.mktemp("importer")
    shutil.copy(DEBUG_CONFIG, work / "config.yaml")
    (work / "Snakefile").write_text(
        'configfile: "config.yaml"\n\n\n'
        "module llm:\n"
        f'    snakefile: "{ROOT / "workflow" / "Snakefile"}"\n'
        "    config: config\n"
        '    prefix: "llm"\n\n\n'
        "use rule * from llm as llm_*\n")
    run_snakemake(work, "llm/results/ci/quant_eval.json", snakefile=work / "Snakefile")
    return work


def test_an_importing_workflow_runs_the_debug_dag_under_its_prefix(module_run):
    exp = module_run / "llm" / "results" / "ci"
    for artifact in ARTIFACTS:
        assert (exp / artifact / "meta.json").is_file(), artifact
    assert (exp / "report.md").is_file() and (exp / "deploy" / "manifest.json").is_file()
    assert not (module_run / "results").exists()  # nothing escaped the prefix
    # training checkpoints beside their outputs, under the prefix too
    assert {"pretrain", "sft"} <= {p.name for p in (exp / "checkpoints").iterdir()}  # debug.yaml's save_steps
    assert len(local_weights(exp)) >= len(WEIGHT_DIRS)


def test_results_on_a_shared_file_system_with_local_scratch(module_run, tmp_path):
    """snakemake-storage-plugin-fs: results in `store`, jobs on copies under `scratch`; training
    checkpoints stay on the scratch, where a rerun of the job resumes from them."""
    work, store, scratch = tmp_path / "work", tmp_path / "store", tmp_path / "scratch"
    for d in (work, store):
        d.mkdir()
    storage = ["--configfile", str(ROOT / "config" / "config.yaml"), str(DEBUG_CONFIG),
               "--default-storage-provider", "fs", "--default-storage-prefix", str(store),
               "--local-storage-prefix", str(scratch)]
    run_snakemake(work, *storage, "results/ci/sft")  # S3 below runs the whole DAG: here what fs adds
    exp = store / "results" / "ci"
    for artifact in ("data", "pretrain", "sft"):
        assert (exp / artifact / "meta.json").is_file(), artifact
    assert not (work / "results").exists()
    assert not [p for p in store.rglob("*") if p.is_symlink()]
    reference = local_weights(module_run / "llm" / "results" / "ci")
    assert local_weights(exp) == {k: v for k, v in reference.items() if k.startswith(("pretrain/", "sft/"))}

    # the checkpoints beside the pretrain output's local copy, not in the store
    assert not (exp / "checkpoints").exists()
    saved = sorted(p.parent.name for p in scratch.rglob("results/ci/checkpoints/pretrain/*/*/checkpoint_complete.json"))
    assert saved == ["checkpoint-0000010", "checkpoint-0000020"], saved
    # pretraining run again (as after a kill) resumes from them and ends with the same weights
    before = local_weights(exp)
    run_snakemake(work, *storage, "--force", "results/ci/pretrain")  # this job only, not every experiment's
    assert "resumed at step 20 of 30" in (exp / "logs" / "pretrain.log").read_text()
    assert {k: v for k, v in local_weights(exp).items() if k.startswith("pretrain/")} == \
        {k: v for k, v in before.items() if k.startswith("pretrain/")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(tmp_path):
    """A moto S3 server on 127.0.0.1 with an empty bucket `llm`; yields (endpoint, client)."""
    import boto3

    port = _free_port()
    log = (tmp_path / "moto.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    try:
        for _ in range(100):
            try:
                client.create_bucket(Bucket="llm")
                break
            except Exception:  # not listening yet
                time.sleep(0.2)
        else:
            pytest.fail(f"moto server did not start: {(tmp_path / 'moto.log').read_text()[-2000:]}")
        yield endpoint, client
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_results_in_s3(module_run, s3_server, tmp_path):
    endpoint, client = s3_server
    # the target first: each --storage-s3-* option takes every word after it (tagged values)
    run_snakemake(tmp_path, *S3_TARGETS, "--configfile", str(ROOT / "config" / "config.yaml"),
                  str(DEBUG_CONFIG), "--default-storage-provider", "s3", "--default-storage-prefix", "s3://llm",
                  "--storage-s3-endpoint-url", endpoint, "--storage-s3-access-key", "test",
                  "--storage-s3-secret-key", "test")
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="llm")
            for o in page.get("Contents", [])]
    for artifact in S3_ARTIFACTS:
        assert f"results/ci/{artifact}/meta.json" in keys, artifact
    assert "results/ci/eval/lora.json" in keys and not (tmp_path / "results").exists()
    in_bucket = {key.removeprefix("results/ci/"): client.get_object(Bucket="llm", Key=key)["Body"].read()
                 for key in keys if key.endswith(".safetensors")
                 and Path(key).parent.as_posix().removeprefix("results/ci/") in WEIGHT_DIRS}
    module = local_weights(module_run / "llm" / "results" / "ci")
    assert sha256s(in_bucket) == {k: v for k, v in module.items() if k.split("/")[0] not in NOT_IN_S3}
    # every artifact it made: a second run from scratch writes the same bytes (rerun_identity.py)
    bucket = tmp_path / "bucket" / "results"
    for key in keys:
        (bucket.parent / key).parent.mkdir(parents=True, exist_ok=True)
        (bucket.parent / key).write_bytes(client.get_object(Bucket="llm", Key=key)["Body"].read())
    made = {_unit(Path(key).relative_to("results")) for key in keys}
    assert differing_artifacts(comparable_tree(module_run / "llm" / "results", tmp_path / "module", made),
                               comparable_tree(bucket, tmp_path / "s3")) == []


GROUPS = ("eval", "quant", "deploy", "plan")  # directories of one entry per variant or job


def _unit(relative: Path) -> tuple[str, ...]:
    """The artifact a file under results/ belongs to: (experiment, artifact directory or file), or
    (experiment, group, entry) in a directory of GROUPS."""
    return relative.parts[:3] if relative.parts[1] in GROUPS else relative.parts[:2]


_PATH = re.compile(r"[^\s\"',|()]*(?<![\w.-])results/")


def comparable_tree(results: Path, out: Path, only: set[tuple[str, ...]] | None = None) -> Path:
    """A copy of a results tree with the paths its text files record (the module's llm/ prefix, the
    storage plugin's local copies under .snakemake/storage/) cut to results/..., and without the
    training checkpoints (a storage run keeps them on its local scratch, not in the bucket); with
    `only`, the files of those artifacts (`_unit`) only."""
    for path in sorted(results.rglob("*")):
        relative = path.relative_to(results)
        if not path.is_file() or relative.parts[1:2] == ("checkpoints",):
            continue
        if only is not None and _unit(relative) not in only:
            continue
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in (".json", ".jsonl", ".csv", ".md", ".txt"):
            target.write_text(_PATH.sub("results/", path.read_text()))
        else:
            target.write_bytes(path.read_bytes())
    return out
