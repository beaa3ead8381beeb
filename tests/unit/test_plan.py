"""The memory plan of an experiment (stages/plan.py): which training jobs it plans, and their resources."""

from __future__ import annotations

import json

from stages.config import check_config
from stages.plan import check_plan, main, training_sections


def _experiment(**sections):
    config = check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "data": {"vocab_size": 512},
                                                 **sections}}})
    return config["experiments"]["x"]


def test_align_is_planned_only_when_enabled():
    assert "align" not in [job for job, *_ in training_sections("x", _experiment())]
    exp = _experiment(align={"enabled": True, "world_size": 2, "tuning": "lora", "lora_rank": 4})
    jobs = {job: (key, trained) for job, key, _, trained in training_sections("x", exp)}
    assert jobs["align"] == ("experiments.x.align", "lora")
    plan = check_plan("x", exp)["jobs"]["align"]
    assert plan["layout"]["world_size"] == 2 and plan["trained"] == "lora"
    # two ranks on one node; without a limit of its own, align takes fine-tuning's time limit
    assert (plan["resources"]["nodes"], plan["resources"]["tasks"], plan["resources"]["runtime"]) == (1, 2, 240)
    limited = _experiment(align={"enabled": True}, cluster={"runtime_minutes": {"align": 30}})
    assert check_plan("x", limited)["jobs"]["align"]["resources"]["runtime"] == 30


def test_the_align_job_file_is_written_from_the_rules_json(tmp_path, capsys):
    exp = _experiment(align={"enabled": True, "per_device_train_batch_size": 4})
    out = tmp_path / "align.json"
    assert main(["--experiment", "x", "--experiment-json", json.dumps(exp), "--job", "align", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["job"], plan["trained"], plan["layout"]["per_device_train_batch_size"]) == ("align", "full", 4)
    disabled = _experiment()
    assert main(["--experiment", "x", "--experiment-json", json.dumps(disabled), "--job", "align"]) == 1
    assert "has no training job 'align'" in capsys.readouterr().err
