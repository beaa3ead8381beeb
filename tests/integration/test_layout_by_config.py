"""A parallel layout is chosen by config alone: an extra --configfile adds two experiments that
differ only in their pretrain layout, and Snakemake's pretrain rule (torchrun) produces the same
loss curve for both."""

import numpy as np
import pandas as pd
import yaml

from workflow_helpers import snakemake

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
    extra = tmp_path / "layouts.yaml"
    extra.write_text(yaml.safe_dump({"experiments": experiments}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2",
              "results/single/pretrain", "results/tp2/pretrain")
    single = pd.read_csv(tmp_path / "results" / "single" / "pretrain" / "train_log.csv")
    tp2 = pd.read_csv(tmp_path / "results" / "tp2" / "pretrain" / "train_log.csv")
    assert len(single) == len(tp2) == 8
    np.testing.assert_allclose(tp2["loss"], single["loss"], rtol=1e-5)
