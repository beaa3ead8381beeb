"""A parallel layout is chosen by config alone: an extra --configfile adds experiments that
differ only in their pretrain layout, and Snakemake's pretrain rule (torchrun) produces the same
loss curve for them. With unified_checkpoint: false the tp2 ranks write their slices and the
merge_tp rule, now in the DAG, turns them into the same model the unified run wrote."""

import numpy as np
import pandas as pd
import torch
import yaml

from stages.checkpoint.hf import load_state_dict
from workflow_helpers import planned_jobs, snakemake

PRETRAIN = {"seed": 1234, "max_steps": 8, "warmup_steps": 2, "max_length": 32,
            "per_device_train_batch_size": 2}


def test_tensor_parallel_experiment_matches_the_single_process_one(tmp_path):
    experiments = {
        "single": {"model": {"flavour": "debug"}, "data": {"vocab_size": 512, "num_sft_train": 50},
                   "pretrain": {**PRETRAIN, "world_size": 1, "sharding": "none", "gradient_accumulation_steps": 2}},
        "tp2": {"model": {"flavour": "debug"}, "data": {"vocab_size": 512, "num_sft_train": 50},
                "pretrain": {**PRETRAIN, "world_size": 2, "tensor_parallel_degree": 2, "sharding": "none",
                             "gradient_accumulation_steps": 2}},
    }
    experiments["tp2_sharded"] = {**experiments["tp2"], "pretrain": {**experiments["tp2"]["pretrain"],
                                                                      "unified_checkpoint": False}}
    extra = tmp_path / "layouts.yaml"
    extra.write_text(yaml.safe_dump({"experiments": experiments}))
    targets = ["results/single/pretrain", "results/tp2/pretrain", "results/tp2_sharded/pretrain"]
    plan = planned_jobs(snakemake(tmp_path, "--configfile", str(extra), "-n", *targets).stdout)
    assert plan == {"prepare": 3, "plan_job": 3, "pretrain": 2, "pretrain_sharded": 1, "merge_tp": 1}, plan
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", *targets)
    single = pd.read_csv(tmp_path / "results" / "single" / "pretrain" / "train_log.csv")
    tp2 = pd.read_csv(tmp_path / "results" / "tp2" / "pretrain" / "train_log.csv")
    assert len(single) == len(tp2) == 8
    np.testing.assert_allclose(tp2["loss"], single["loss"], rtol=1e-5)

    assert (tmp_path / "results" / "tp2_sharded" / "pretrain_shards" / "model-tp01-pp00-dp00.safetensors").exists()
    merged = load_state_dict(tmp_path / "results" / "tp2_sharded" / "pretrain")
    unified = load_state_dict(tmp_path / "results" / "tp2" / "pretrain")
    assert sorted(merged) == sorted(unified)
    for key in unified:
        assert torch.equal(merged[key], unified[key]), key
