"""stages/config_sources.py: the --configfile words of a command line, what Snakemake cannot read
among them, and the file and line that set the key path an error message names."""

from __future__ import annotations

import pytest

from stages.config_sources import config_keys, configfile_arguments, configfile_problem


@pytest.mark.parametrize("argv, paths", [
    (["-n", "results/x/quant_eval.json", "--configfile", "a.yaml", "b.yaml"], ["a.yaml", "b.yaml"]),
    (["--configfile", "a.yaml", "results/x/quant_eval.json", "-n"], ["a.yaml", "results/x/quant_eval.json"]),
    (["--configfiles", "a.yaml", "--", "results/x/quant_eval.json"], ["a.yaml"]),
    (["--configfile=a.yaml", "results/x/quant_eval.json", "--config", "k=v", "--configfile", "b.yaml"],
     ["a.yaml", "b.yaml"]),
    (["--cores", "1", "results/x/quant_eval.json"], []),
])
def test_configfile_arguments_are_read_as_snakemake_reads_them(argv, paths):
    assert configfile_arguments(argv) == paths


def test_what_snakemake_cannot_read_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.yaml").write_text("experiments: {x: {}}\n")
    (tmp_path / "good.json").write_text('{"experiments": {"x": {}}}')
    (tmp_path / "tabs.json").write_text('{\n\t"experiments": {}\n}')  # JSON, not YAML: Snakemake reads it
    (tmp_path / "bad.yaml").write_text("experiments:\n  x: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- a\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "results" / "x").mkdir(parents=True)
    (tmp_path / "results" / "x" / "quant_eval.json").write_text('{"wint8": {}}')
    for path in ("good.yaml", "good.json", "tabs.json"):
        assert configfile_problem(path) is None, path
    assert configfile_problem("bad.yaml").startswith("bad.yaml:3:1: expected ',' or ']', but got '<stream end>'")
    assert configfile_problem("list.yaml") == ("list.yaml: a config file is a mapping of keys (experiments: ...), "
                                               "not seq")
    assert configfile_problem("empty.yaml").endswith("not empty")
    assert configfile_problem("absent.yaml") == "absent.yaml: no such config file (given to --configfile)"
    (tmp_path / "broken.json").write_text('{"experiments": {"x": }')
    assert configfile_problem("broken.json").startswith("broken.json:1:")  # a config file's syntax, not a target
    for target in ("results/x/quant_eval.json", "results/x/lora", "results/y/quant_eval.json", "report.html",
                   "llm/results/x/eval/wint8.json", "results"):
        assert configfile_problem(target) == (
            f"{target} was read as a config file (--configfile takes every word after it): put targets before "
            "--configfile, or end its list with --")


def test_the_last_source_that_sets_a_key_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(
        "experiments:\n  llama:\n    pretrain:\n      max_steps: 100\n      warmup_steps: 10\n")
    (tmp_path / "my.yaml").write_text(
        "# mine\nexperiments:\n  llama:\n    pretrain: {max_steps: 5}\n"
        "    data:\n      corpus:\n        - a.txt\n        - b/*.txt\n"
        "sweeps:\n  rank:\n    base: llama\n    grid:\n      finetune.lora.lora_rnak: [4, 8]\n")
    keys = config_keys(["config/config.yaml"], [tmp_path / "my.yaml"], {"experiments": {"llama": {"seed": 1}}})
    assert keys.locate("config key 'experiments.llama.pretrain.max_steps': -1 is less than 1") == "my.yaml:4"
    assert keys.locate("experiments.llama.pretrain.warmup_steps=10 is odd") == "config/config.yaml:5"
    # a section's relation: the first key below it the message names that a source sets
    assert keys.locate("experiments.llama.pretrain: warmup_steps=10 exceeds max_steps=5") == "my.yaml:4"
    assert keys.locate("experiments.llama.data.corpus[1]: 'b/*.txt' matches no file") == "my.yaml:8"
    assert keys.locate("config key 'experiments.llama.seed' is unknown") == "--config"
    # a sweep member's key is written in the sweep's grid
    assert keys.locate("config key 'experiments.rank.lora_rnak-4.finetune.lora.lora_rnak' is unknown") == "my.yaml:13"
    assert keys.locate("results/x/quant/wint3: unknown quantize variant 'wint3'") is None
