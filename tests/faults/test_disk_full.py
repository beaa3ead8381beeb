"""A full disk during a checkpoint save: the pretraining job's checkpoint directory is a 3 MB tmpfs
(one ~2 MB checkpoint of the debug model fits, the second does not). The job fails with an error
naming the checkpoint path, the space it needed and what was free; the first checkpoint stays
complete and no partial directory is left taking space; once the file system is grown the same
`snakemake` command resumes from that checkpoint and finishes. Needs root (mount); skipped else."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from stages.checkpoint.store import checkpoint_name

pytestmark = pytest.mark.slow  # three Snakemake runs

PRETRAIN = {"seed": 3, "max_steps": 30, "warmup_steps": 3, "max_length": 32, "per_device_train_batch_size": 2,
            "world_size": 2, "sharding": "stage1", "save_steps": 10, "async_save": True}
EXPERIMENT = {"model": {"flavour": "debug"}, "data": {"vocab_size": 512, "num_sft_train": 50}, "pretrain": PRETRAIN}


def _mount_tmpfs(path, size: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_save_into_a_full_disk_fails_clearly_and_resumes_once_space_is_freed(tmp_path, run_snakemake):
    extra = tmp_path / "full.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"full": EXPERIMENT}}))

    def snakemake(*args: str):
        return run_snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", *args)

    ran = snakemake("results/full/data")
    assert ran.returncode == 0, ran.describe()
    checkpoints = tmp_path / "results" / "full" / "checkpoints" / "pretrain"
    checkpoints.mkdir(parents=True)
    if not _mount_tmpfs(checkpoints, "3m"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        ran = snakemake("results/full/pretrain")
        assert ran.returncode != 0, ran.describe()
        log = (tmp_path / "results" / "full" / "logs" / "pretrain.log").read_text()
        message = [line for line in log.splitlines() if "error: no space left writing" in line]
        assert message, log[-4000:]
        assert checkpoint_name(20) in message[0] and "MB needed" in message[0] and "MB free there" in message[0]
        assert "previous checkpoint and results are intact" in message[0]
        assert sorted(p.name for p in checkpoints.glob("*/*")) == [checkpoint_name(10)]  # no .partial left
        assert next(checkpoints.glob(f"*/{checkpoint_name(10)}/checkpoint_complete.json"))

        subprocess.run(["mount", "-o", "remount,size=32m", str(checkpoints)], check=True)  # space freed
        ran = snakemake("results/full/pretrain")
        assert ran.returncode == 0, ran.describe()
        meta = json.loads((tmp_path / "results" / "full" / "pretrain" / "meta.json").read_text())["metrics"]
        assert meta["resumed_from_step"] == 10 and meta["steps"] == 30
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], capture_output=True)
