"""Config faults, as a user meets them: each case is a bad config (or a target path) given to a real
`snakemake -n` on this repository's workflow in a temporary working directory. Snakemake must stop
while it parses the workflow or builds the DAG, with a message naming the key path (or the file and
line), and leave the working directory's results/ untouched. The second test runs the command as
the user types it and checks the one line it prints: `my.yaml:7: config key ...`, no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"


def _model_dir(workdir: Path, config: dict | None) -> None:
    """A checkpoint directory `model/` in the workdir: without config.json (config None) or with one."""
    (workdir / "model").mkdir()
    if config is not None:
        (workdir / "model" / "config.json").write_text(json.dumps(config))


# id -> (YAML of the extra --configfile, target, set-up of the workdir, expected text (regex))
CASES = {
    "unknown-key": ("experiments: {x: {finetune: {lora: {lora_rnak: 4}}}}", "results/x/quant_eval.json", None,
                    r"'experiments\.x\.finetune\.lora\.lora_rnak' is unknown; did you mean 'lora_rank'\?"),
    "wrong-type": ("experiments: {x: {pretrain: {max_steps: ten}}}", "results/x/quant_eval.json", None,
                   r"'experiments\.x\.pretrain\.max_steps': 'ten' is not of type 'integer'"),
    "kv-heads": ("experiments: {x: {model: {flavour: debug, num_key_value_heads: 3}}}", "results/x/quant_eval.json",
                 None, r"experiments\.x\.model\.num_key_value_heads=3 does not divide num_attention_heads=4 "
                       r"\(flavour 'debug'\)"),
    "heads-hidden": ("experiments: {x: {model: {flavour: debug, hidden_size: 66}}}", "results/x/quant_eval.json",
                     None, r"num_attention_heads=4 \(flavour 'debug'\) does not divide "
                           r"experiments\.x\.model\.hidden_size=66"),
    "odd-head-dim": ("experiments: {x: {model: {flavour: debug, hidden_size: 36}}}", "results/x/quant_eval.json",
                     None, r"experiments\.x\.model\.hidden_size=36 / num_attention_heads=4 \(flavour 'debug'\) = "
                           r"head_dim 9 is odd"),
    "tp-heads": ("experiments: {x: {model: {flavour: debug}, pretrain: {world_size: 8, tensor_parallel_degree: 8}}}",
                 "results/x/quant_eval.json", None,
                 r"experiments\.x\.pretrain: tensor_parallel_degree=8 does not divide num_attention_heads=4"),
    "tp-vocab": ("experiments: {x: {model: {flavour: debug}, data: {vocab_size: 515},\n"
                 "  finetune: {sft: {world_size: 2, tensor_parallel_degree: 2}}}}", "results/x/quant_eval.json", None,
                 r"experiments\.x\.finetune\.sft: tensor_parallel_degree=2 does not divide data\.vocab_size=515"),
    "world-size": ("experiments: {x: {pretrain: {world_size: 3, tensor_parallel_degree: 2}}}",
                   "results/x/quant_eval.json", None,
                   r"experiments\.x\.pretrain: world_size=3 is not divisible by tensor_parallel_degree=2"),
    "model-missing": ("experiments: {x: {model: {model_name_or_path: nowhere}}}", "results/x/quant_eval.json", None,
                      r"experiments\.x\.model\.model_name_or_path='nowhere': no such directory"),
    "model-no-config-json": ("experiments: {x: {model: {model_name_or_path: model}}}", "results/x/quant_eval.json",
                             lambda w: _model_dir(w, None),
                             r"experiments\.x\.model\.model_name_or_path='model': model/config\.json is missing"),
    "model-architecture": ("experiments: {x: {model: {model_name_or_path: model}}}", "results/x/quant_eval.json",
                           lambda w: _model_dir(w, {"architectures": ["T5ForConditionalGeneration"],
                                                    "model_type": "t5"}),
                           r"experiments\.x\.model\.model_name_or_path='model': model/config\.json: architecture "
                           r"'T5ForConditionalGeneration' is not supported; supported: LlamaForCausalLM"),
    "corpus-missing": ("experiments: {x: {data: {corpus: [nowhere/*.txt]}}}", "results/x/quant_eval.json", None,
                       r"experiments\.x\.data\.corpus\[0\]"),
    "target-quant-variant": ("experiments: {x: {}}", "results/x/quant/wint3", None,
                             r"results/x/quant/wint3: unknown quantize variant 'wint3'; experiments\.x\.quantize\."
                             r"variants lists wint8, wint4"),
    "quant-variant-unknown": ("experiments: {x: {quantize: {variants: [wint8, gptq-w5]}}}", "results/x/quant_eval.json",
                              None, r"experiments\.x\.quantize: quantize variant 'gptq-w5' is unknown; choose one of "
                                    r"\['a8w8', .*'gptq-w4g128'.*\] or define it under quantize\.custom_variants"),
    "quant-custom-bad-setting": ("experiments: {x: {quantize: {variants: [mine], custom_variants: {mine: "
                                 "{method: rtn, desc_act: true}}}}}", "results/x/quant_eval.json", None,
                                 r"quantize\.custom_variants\.mine: \['desc_act'\] are not settings of method rtn"),
    "target-variant-not-listed": ("experiments: {x: {quantize: {variants: [wint8]}}}", "results/x/quant/wint4", None,
                                  r"unknown quantize variant 'wint4'; experiments\.x\.quantize\.variants lists wint8 "
                                  r"\(built-in names: wint8, wint4, wint4-sym, gptq-w4"),
    "target-eval-variant": ("experiments: {x: {}}", "results/x/eval/wint3.json", None,
                            r"results/x/eval/wint3\.json: unknown variant 'wint3' for experiment 'x'; expected one of "
                            r"pretrain, sft, lora, prefix, lora-merged, wint8, wint4"),
    "target-experiment": ("experiments: {x: {}}", "results/xx/lora", None,
                          r"experiment 'xx' is not in config 'experiments'; did you mean 'x'\?"),
    "target-method": ("experiments: {x: {}}", "results/x/lora2", None, r"No rule to produce results/x/lora2"),
    # A syntax error in the config/config.yaml the Snakefile reads (no --configfile): file:line:column.
    "yaml-syntax-snakefile-config": (None, "results/llama/quant_eval.json",
                                     lambda w: (w / "config").mkdir() or (w / "config" / "config.yaml").write_text(
                                         "experiments:\n  llama:\n    model: {flavour: tiny\n    data: {}\n"),
                                     r"config/config\.yaml:4:9: expected ',' or '\}', but got ':' \(while parsing a "
                                     r"flow mapping at line 3, column 12\)"),
    # A --configfile is read by Snakemake before the workflow's code; the workflow profile checks it
    # first (stages/config_sources.py): file:line:column.
    "yaml-syntax-configfile": ("experiments:\n  x:\n    model: {flavour: debug\n    data: {}\n",
                               "results/x/quant_eval.json", None,
                               r"bad\.yaml:4:9: expected ',' or '\}', but got ':' \(while parsing a flow mapping at "
                               r"line 3, column 12\)"),
}


# Each case costs a Snakemake start (~6 s); the default run keeps one of each kind, the rest run with
# the slow suite (every check is also unit-tested through stages.config in tests/unit/test_config.py).
DEFAULT_RUN = {"kv-heads", "tp-vocab", "model-architecture", "target-quant-variant", "target-eval-variant",
               "yaml-syntax-snakefile-config"}


@pytest.mark.parametrize("case", [c if c in DEFAULT_RUN else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_a_config_fault_stops_snakemake_at_parse_time(case, tmp_path, snapshot):
    text, target, setup, expected = CASES[case]
    results = tmp_path / "results"
    (results / "earlier").mkdir(parents=True)
    (results / "earlier" / "kept.json").write_text("{}")  # an earlier run's output: must stay as it is
    if setup:
        setup(tmp_path)
    before = snapshot(results)
    cmd = [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "workflow" / "Snakefile"), "--directory", str(tmp_path)]
    if text is not None:
        (tmp_path / "bad.yaml").write_text(text)
        cmd += ["--configfile", str(DEFAULT_CONFIG), str(tmp_path / "bad.yaml")]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([*cmd, "--", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{case}: snakemake -n accepted it:\n{output[-3000:]}"
    assert "This was a dry-run" not in output and "Job stats" not in output, output[-3000:]
    assert re.search(expected, output), f"{case}: {expected!r} not in\n{output[-3000:]}"
    assert snapshot(results) == before


# The file and line. Run as the user runs it, from their own directory with relative paths
# (`snakemake -n <target> --configfile config/config.yaml my.yaml`): every mistake is one line that
# starts with `file:line:` (the last file that sets the key) and no traceback follows.
# id -> ({file name: text} in --configfile order after config/config.yaml, the words after them, expected (regex))
WHERE = {
    "unknown-key": ({"my.yaml": "# my experiment\nexperiments:\n  x:\n    model: {flavour: debug}\n    finetune:\n"
                                "      lora:\n        lora_rnak: 4\n"}, [],
                    r"my\.yaml:7: config key 'experiments\.x\.finetune\.lora\.lora_rnak' is unknown; did you mean "
                    r"'lora_rank'\?"),
    "unknown-top-level-key": ({"my.yaml": "experiments: {x: {}}\nsweps: {}\n"}, [],
                              r"my\.yaml:2: config key 'sweps' is unknown; did you mean 'sweeps'\?"),
    "wrong-type": ({"my.yaml": "experiments:\n  x:\n    pretrain:\n      max_steps: ten\n"}, [],
                   r"my\.yaml:4: config key 'experiments\.x\.pretrain\.max_steps': 'ten' is not of type 'integer'"),
    "out-of-range": ({"my.yaml": "experiments:\n  x:\n    finetune:\n      lora: {lora_rank: 0}\n"}, [],
                     r"my\.yaml:4: config key 'experiments\.x\.finetune\.lora\.lora_rank': 0 is less than the "
                     r"minimum of 1"),
    "not-in-enum": ({"my.yaml": "experiments:\n  x:\n    pretrain:\n      sharding: stage4\n"}, [],
                    r"my\.yaml:4: config key 'experiments\.x\.pretrain\.sharding': 'stage4' is not one of "
                    r"\['none', 'stage1', 'stage2', 'stage3'\]"),
    # set in two files: the last one is in force, and named (whichever of the two holds the bad value)
    "last-file-bad": ({"a.yaml": "experiments:\n  x:\n    pretrain: {max_steps: 5}\n",
                       "b.yaml": "\nexperiments:\n  x:\n    pretrain: {max_steps: -1}\n"}, [],
                      r"b\.yaml:4: config key 'experiments\.x\.pretrain\.max_steps': -1 is less than the minimum"),
    "last-file-conflict": ({"b.yaml": "experiments:\n  x:\n    pretrain: {max_steps: 100}\n",
                            "a.yaml": "experiments:\n  x:\n    pretrain:\n      max_steps: 5\n"}, [],
                           r"a\.yaml:4: experiments\.x\.pretrain: warmup_steps=\d+ exceeds max_steps=5"),
    "relation": ({"my.yaml": "experiments:\n  x:\n    model:\n      flavour: debug\n      num_key_value_heads: 3\n"},
                 [], r"my\.yaml:5: experiments\.x\.model\.num_key_value_heads=3 does not divide"),
    "data-path": ({"my.yaml": "experiments:\n  x:\n    data:\n      corpus:\n        - nowhere/*.txt\n"}, [],
                  r"my\.yaml:5: experiments\.x\.data\.corpus\[0\]: 'nowhere/\*\.txt' .*matches no file"),
    "sweep-grid-key": ({"my.yaml": "sweeps:\n  rank:\n    base: llama\n    grid:\n"
                                   "      finetune.lora.lora_rnak: [4, 8]\n"},
                       [], r"my\.yaml:5: config key 'experiments\.rank\..*\.lora_rnak' is unknown; did you mean "
                           r"'lora_rank'\?"),
    "command-line-config": ({"my.yaml": "experiments: {x: {}}\n"}, ["--config", "experiments={'x': {'seed': 1}}"],
                            r"--config: config key 'experiments\.x\.seed' is unknown"),
    "yaml-syntax": ({"my.yaml": "experiments:\n  x:\n    model: {flavour: debug\n    data: {}\n"}, [],
                    r"my\.yaml:4:9: expected ',' or '\}', but got ':'"),
    "not-a-mapping": ({"my.yaml": "- experiments\n"}, [],
                      r"my\.yaml: a config file is a mapping of keys \(experiments: \.\.\.\), not seq"),
    "missing-file": ({}, ["mine.yaml"], r"mine\.yaml: no such config file \(given to --configfile\)"),
    # `--configfile` takes every word after it: the target is read as a config file
    "swallowed-target": ({"my.yaml": "experiments: {x: {}}\n"}, ["results/x/quant_eval.json"],
                         r"results/x/quant_eval\.json was read as a config file \(--configfile takes every word "
                         r"after it\): put targets before --configfile, or end its list with --"),
}
SNAKEMAKE_INFO = ("Using workflow specific profile", "Config file config/config.yaml is extended")
WHERE_DEFAULT_RUN = {"unknown-key", "wrong-type", "not-in-enum", "last-file-bad", "yaml-syntax", "swallowed-target"}


@pytest.mark.parametrize("case", [c if c in WHERE_DEFAULT_RUN else pytest.param(c, marks=pytest.mark.slow)
                                  for c in WHERE])
def test_a_config_mistake_names_the_file_and_line_without_a_traceback(case, tmp_path, run_workflow):
    files, more, expected = WHERE[case]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(DEFAULT_CONFIG.read_text())
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    target = [] if case == "swallowed-target" else ["results/x/quant_eval.json"]
    ran = run_workflow(tmp_path, "-n", *target, "--configfile", "config/config.yaml", *files, *more)
    assert ran.returncode == 1, ran.describe()
    errors = [line for line in ran.output.splitlines() if re.match(expected, line)]
    assert errors, f"{case}: {expected!r} not at the start of a line in\n{ran.describe()}"
    assert not ran.traceback and "common.smk" not in ran.output, ran.describe()
    said = [line for line in ran.output.splitlines() if line.strip() and not line.startswith(SNAKEMAKE_INFO)]
    assert said == errors[:1], ran.describe()  # one line, and nothing else but Snakemake's own notes
