"""stages/sweeps.py: a sweep's grid or list expanded into experiments, upstreams shared by content;
stages/compare.py: the members side by side, and mean and spread over seeds."""

import json

import pandas as pd
import pytest

from stages import compare
from stages.checkpoint.atomic import write_json
from stages.config import ConfigError, check_config
from stages.sweeps import expand, short_names

BASE = {"model": {"flavour": "debug"}, "finetune": {"lora": {"lora_rank": 8}}}


def _config(**sweep):
    return {"experiments": {"ci": BASE}, "sweeps": {"rank": {"base": "ci", **sweep}}}


def test_a_sweep_over_align_compares_the_aligned_variant():
    base = {**BASE, "align": {"enabled": True}}
    config, comparisons = expand({"experiments": {"ci": base}, "sweeps": {"beta": {
        "base": "ci", "grid": {"align.beta": [0.1, 0.5]}, "variants": ["sft", "align"]}}})
    spec = comparisons["sweeps/beta"]
    assert spec["members"] == ["beta.beta-0.1", "beta.beta-0.5"] and spec["variants"] == ["sft", "align"]
    checked = check_config(config)["experiments"]
    assert [checked[m]["align"]["beta"] for m in spec["members"]] == [0.1, 0.5]
    assert all(checked[m]["align"]["enabled"] for m in spec["members"])


def test_grid_expands_into_named_experiments_sharing_upstream_by_content():
    config, comparisons = expand(_config(grid={"finetune.lora.lora_rank": [4, 16], "seed": [1, 2]}))
    spec = comparisons["sweeps/rank"]
    assert spec["members"] == ["rank.lora_rank-4.seed-1", "rank.lora_rank-4.seed-2",
                               "rank.lora_rank-16.seed-1", "rank.lora_rank-16.seed-2"]
    exps = config["experiments"]
    assert exps["rank.lora_rank-16.seed-2"]["finetune"]["lora"]["lora_rank"] == 16
    seeded = exps["rank.lora_rank-16.seed-2"]
    assert seeded["data"]["seed"] == seeded["pretrain"]["seed"] == seeded["finetune"]["sft"]["seed"] == 2
    assert seeded["quantize"]["calibration"]["seed"] == 2
    assert seeded["align"]["seed"] == 2  # preference alignment too (its shuffling and dropout)
    assert exps["ci"] == BASE and "sweeps" not in config  # the base is untouched
    # rank is downstream of pretraining: one upstream per seed, shared by both ranks
    shared = spec["shared"]
    assert shared["rank.lora_rank-4.seed-1"] == shared["rank.lora_rank-16.seed-1"] != shared["rank.lora_rank-4.seed-2"]
    assert sorted(n for n in exps if n.startswith("shared-")) == sorted(set(shared.values()))
    assert spec["columns"]["rank.lora_rank-16.seed-1"] == {"lora_rank": 16, "seed": 1}
    assert spec["variants"] == ["lora-merged"] and spec["metrics"] == ["exact_match", "ppl"]  # defaults
    check_config(config)  # every expanded experiment, the hidden upstreams too, is a valid experiment


def test_adding_a_value_keeps_every_existing_experiment_and_upstream():
    before, _ = expand(_config(grid={"finetune.lora.lora_rank": [4, 16], "seed": [1, 2]}))
    after, spec = expand(_config(grid={"finetune.lora.lora_rank": [4, 16, 32], "seed": [1, 2]}))
    assert all(after["experiments"][name] == exp for name, exp in before["experiments"].items())
    assert set(after["experiments"]) - set(before["experiments"]) == {"rank.lora_rank-32.seed-1",
                                                                      "rank.lora_rank-32.seed-2"}


def test_upstream_changes_give_their_own_shared_experiment():
    _, comparisons = expand(_config(grid={"pretrain.sharding": ["stage1", "stage3"]}))
    shared = comparisons["sweeps/rank"]["shared"]
    assert len(set(shared.values())) == 2


def test_list_rows_and_short_names():
    _, comparisons = expand(_config(list=[{"finetune.lora.lora_rank": 4},
                                          {"finetune.lora.lora_rank": 16, "finetune.lora.lora_alpha": 32}]))
    assert comparisons["sweeps/rank"]["members"] == ["rank.lora_rank-4", "rank.lora_rank-16.lora_alpha-32"]
    assert short_names(["finetune.sft.learning_rate", "finetune.lora.learning_rate", "seed"]) == {
        "finetune.sft.learning_rate": "sft_learning_rate", "finetune.lora.learning_rate": "lora_learning_rate",
        "seed": "seed"}


@pytest.mark.parametrize("sweep, message", [
    ({"grid": {"seed": [1]}, "list": [{"seed": 1}]}, "exactly one of `grid`"),
    ({"grid": {"seed": []}}, r"sweeps\.rank\.grid\.seed: a non-empty list"),
    ({"grid": {"seed": [1]}, "metric": ["ppl"]}, r"unknown key\(s\) \['metric'\]"),
    ({"grid": {"data.corpus": [["a.txt", "b.txt"]]}}, "cannot be part of an experiment name"),
    ({"grid": {"seed": [1, 1]}}, "defined twice"),
    ({"grid": {"model.flavour.size": [1]}}, "'flavour' is a value"),
])
def test_bad_sweeps_name_the_key(sweep, message):
    with pytest.raises(ConfigError, match=message):
        expand(_config(**sweep))


def test_unknown_base_or_listed_experiment():
    with pytest.raises(ConfigError, match=r"sweeps\.rank\.base: 'nope' is not an experiment"):
        expand({"experiments": {"ci": BASE}, "sweeps": {"rank": {"base": "nope", "grid": {"seed": [1]}}}})
    with pytest.raises(ConfigError, match=r"comparisons\.two\.experiments: \['nope'\]"):
        expand({"experiments": {"ci": BASE}, "comparisons": {"two": {"experiments": ["ci", "nope"]}}})


# -- stages/compare.py -----------------------------------------------------------------------------

def _member_evals(results, member, em, ppl, start_ppl):
    write_json(results / member / "eval" / "lora.json", {"variant": "lora", "exact_match": em, "ppl": ppl})
    write_json(results / member / "eval" / "pretrain.json",
               {"variant": "pretrain", "exact_match": 0.0, "ppl": start_ppl})


def test_compare_rows_and_spread_over_seeds(tmp_path):
    _, comparisons = expand(_config(grid={"finetune.lora.lora_rank": [4, 16], "seed": [1, 2]}))
    spec = {**comparisons["sweeps/rank"], "variants": ["lora"], "metrics": ["exact_match", "ppl_ratio"]}
    spec["starts"] = {m: "pretrain" for m in spec["members"]}
    results = tmp_path / "results"
    numbers = {"rank.lora_rank-4.seed-1": (0.5, 12.0, 10.0), "rank.lora_rank-4.seed-2": (0.7, 11.0, 10.0),
               "rank.lora_rank-16.seed-1": (0.9, 15.0, 10.0), "rank.lora_rank-16.seed-2": (1.0, 10.0, 8.0)}
    for member, (em, ppl, start) in numbers.items():
        _member_evals(results, member, em, ppl, start)
    out = tmp_path / "out"
    compare.run(json.loads(json.dumps(spec)), out, results)
    table = pd.read_csv(out / "compare.csv")
    assert len(table) == 4 and list(table.columns) == ["experiment", "lora_rank", "seed", "variant", "exact_match",
                                                       "ppl_ratio"]
    assert table.set_index("experiment").loc["rank.lora_rank-16.seed-2", "ppl_ratio"] == pytest.approx(1.25)
    md = (out / "compare.md").read_text()
    assert md.count("| rank.lora_rank-") == 4  # one row per experiment
    assert "| 4 | 1 | lora | 0.5 | 1.2 |" in md
    # rank 4 over seeds 1 and 2: exact match mean 0.6, sample std 0.1414, min 0.5, max 0.7
    assert "| 4 | lora | 0.6000 ± 0.14 (0.5000–0.7000, n=2) |" in md
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_names_a_missing_evaluation(tmp_path):
    spec = {"kind": "comparisons", "name": "two", "members": ["a"], "columns": {"a": {}}, "variants": ["lora"],
            "metrics": ["exact_match"], "starts": {"a": "pretrain"}}
    with pytest.raises(ValueError, match=r"a/eval/lora\.json is missing"):
        compare.run(spec, tmp_path / "out", tmp_path / "results")
    assert not (tmp_path / "out" / "compare.md").exists()
