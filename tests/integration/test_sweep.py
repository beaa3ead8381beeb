"""A sweep through real Snakemake runs (stages/sweeps.py, stages/compare.py, workflow/rules/compare.smk):
LoRA rank x seed on the debug flavour pretrains once per seed (the ranks share it), compares the four
experiments, and a rank added to the grid plans only its new experiments. Slow (about 3 minutes on 2
cores): CI's second step runs it."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from workflow_helpers import DEBUG_CONFIG, planned_jobs, snakemake, weights_sha256

pytestmark = pytest.mark.slow

TARGET = "results/sweeps/rank/compare.md"


def _sweep_config(tmp_path, ranks):
    path = tmp_path / f"sweep_{len(ranks)}.yaml"
    path.write_text(yaml.safe_dump({"sweeps": {"rank": {
        "base": "ci", "grid": {"finetune.lora.lora_rank": ranks, "seed": [1, 2]},
        "variants": ["lora"], "metrics": ["exact_match", "ppl_ratio"]}}}))
    return ["--configfile", str(DEBUG_CONFIG), str(path)]


def test_a_sweep_pretrains_once_per_seed_compares_and_plans_only_what_a_new_value_adds(tmp_path):
    config = _sweep_config(tmp_path, [4, 16])
    planned = planned_jobs(snakemake(tmp_path, *config, "-n", TARGET).stdout)
    assert planned["prepare"] == planned["pretrain"] == 2, planned  # one per seed, not per experiment
    assert planned["finetune"] == 4 and planned["compare"] == 1, planned
    snakemake(tmp_path, *config, "--cores", "2", TARGET)

    results = tmp_path / "results"
    members = [f"rank.lora_rank-{r}.seed-{s}" for r in (4, 16) for s in (1, 2)]
    table = pd.read_csv(results / "sweeps" / "rank" / "compare.csv")
    assert sorted(table["experiment"]) == sorted(members)
    assert table["ppl_ratio"].between(0.2, 5).all() and table["exact_match"].between(0, 1).all()
    md = (results / "sweeps" / "rank" / "compare.md").read_text()
    assert md.count("| rank.lora_rank-") == 4 and "## Over seeds" in md
    # the ranks of one seed fine-tuned the same pretrained model (a copy of the shared one, hard-linked
    # on one file system: no symlink a storage provider could not hold); the seeds their own
    pretrained = {m: weights_sha256(results / m / "pretrain") for m in members}
    assert pretrained["rank.lora_rank-4.seed-1"] == pretrained["rank.lora_rank-16.seed-1"]
    assert pretrained["rank.lora_rank-4.seed-1"] != pretrained["rank.lora_rank-4.seed-2"]
    assert not (results / "rank.lora_rank-4.seed-1" / "pretrain").is_symlink()
    weights = sorted((results / "rank.lora_rank-4.seed-1" / "pretrain").glob("*.safetensors"))
    assert weights and all(w.stat().st_nlink == 3 for w in weights)  # the shared upstream's and two members'
    adapters = {m: yaml.safe_load((results / m / "lora" / "adapter_config.json").read_text())["r"] for m in members}
    assert adapters == {m: int(m.split("-")[1].split(".")[0]) for m in members}

    # A rank added to the grid: its two experiments fine-tune the existing pretrained models; nothing
    # of the first four runs again (the plan is the claim: running it would only add CI minutes).
    grown = _sweep_config(tmp_path, [4, 16, 8])
    planned = planned_jobs(snakemake(tmp_path, *grown, "-n", TARGET).stdout)
    assert "prepare" not in planned and "pretrain" not in planned, planned
    assert planned["finetune"] == 2 and planned["compare"] == 1, planned

    # A plain comparison of listed experiments (here two of the sweep's) needs nothing but its table.
    listed = tmp_path / "listed.yaml"
    pair = ["rank.lora_rank-4.seed-1", "rank.lora_rank-16.seed-2"]
    listed.write_text(yaml.safe_dump({"comparisons": {"two": {"experiments": pair, "variants": ["lora"]}}}))
    target = "results/comparisons/two/compare.md"
    assert planned_jobs(snakemake(tmp_path, *config, str(listed), "-n", target).stdout) == {"compare": 1}
    snakemake(tmp_path, *config, str(listed), "--cores", "2", target)
    two = pd.read_csv(results / "comparisons" / "two" / "compare.csv").set_index("experiment")
    for member in pair:  # the default metrics, as evaluated
        evaluated = json.loads((results / member / "eval" / "lora.json").read_text())
        assert two.loc[member, "exact_match"] == evaluated["exact_match"]
        assert two.loc[member, "ppl"] == pytest.approx(evaluated["ppl"], rel=1e-12)
