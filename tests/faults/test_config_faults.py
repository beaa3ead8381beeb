"""Config faults, as a user meets them: each case is a bad config (or a target path) given to a real
`snakemake -n` on this repository's workflow in a temporary working directory. Snakemake must stop
while it parses the workflow or builds the DAG, with a message naming the key path (or the file and
line), and leave the working directory's results/ untouched."""

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
    # A --configfile is read by Snakemake before the workflow's code: its own message, without the line
    # (`python -m stages.config FILE` names it: tests/unit/test_config.py).
    "yaml-syntax-configfile": ("experiments:\n  x:\n    model: {flavour: debug\n    data: {}\n",
                               "results/x/quant_eval.json", None, r"Config file is not valid JSON or YAML"),
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
    cmd = [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path)]
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
