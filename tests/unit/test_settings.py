"""The schema is the one source of defaults: a stage's run() called from Python, its command line
and the workflow (stages.config.check_config) all get the same settings, read from
workflow/schemas/config.schema.yaml itself here."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import pytest
import yaml

from pretrain_fixtures import make_data_dir
from sft_fixtures import write_toy_data
from stages import align, evaluate, export, finetune, prepare, pretrain, quantize, settings
from stages.config import SCHEMA_PATH, check_config
from stages.errors import ConfigError


def schema_file_defaults(name: str) -> dict:
    """Section `name`'s top-level defaults read from the schema file, without stages.config's code:
    YAML merge keys (`<<`) resolved by the YAML loader, `$ref` followed by hand."""
    root = yaml.safe_load(SCHEMA_PATH.read_text())
    node = root["$defs"]["experiment"]
    for part in settings.SECTIONS[name]:
        node = node["properties"][part]
        if "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return {key: prop["default"] for key, prop in node["properties"].items() if "default" in prop}


@pytest.mark.parametrize("name", list(settings.SECTIONS))
def test_defaults_are_the_schema_files_and_the_workflows(name):
    filled = settings.defaults(name)
    for key, default in schema_file_defaults(name).items():
        if isinstance(default, dict):  # a nested section: its own keys' defaults are filled in
            assert default.items() <= filled[key].items(), key
        else:
            assert filled[key] == default, key
    workflow = check_config({"experiments": {"t": {}}})["experiments"]["t"]
    for part in settings.SECTIONS[name]:
        workflow = workflow[part]
    assert filled == workflow


def test_an_unknown_setting_is_named_with_the_closest_one():
    with pytest.raises(ConfigError, match=r"'finetune.lora.lerning_rate' is unknown; did you mean 'learning_rate'"):
        settings.complete({"lerning_rate": 1e-3}, "lora")


def test_a_wrong_value_names_its_key():
    with pytest.raises(ConfigError, match=r"'pretrain.max_steps': 'ten' is not of type 'integer'"):
        settings.complete({"max_steps": "ten"}, "pretrain")
    with pytest.raises(ConfigError, match=r"'quantize.gptq.bits'"):
        settings.complete({"gptq": {"bits": 5}}, "quantize")


def help_text(main, *argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(out.getvalue().split())


@pytest.mark.parametrize("main, sections", [
    (pretrain.main, ("pretrain", "model")), (finetune.main, ("sft", "lora", "prefix")),
    (quantize.main, ("quantize",)), (evaluate.main, ("evaluate",)), (export.main, ("export",)),
    (prepare.main, ("data",)), (align.main, ("align",)),
])
def test_help_lists_every_setting_with_its_default(main, sections):
    text = help_text(main)
    for name in sections:
        for key, value in settings.defaults(name).items():
            flag = "--" + key.replace("_", "-")
            if main is quantize.main and key == "source":  # --source is the command's model directory
                continue
            # the flag's own entry: from its first listing after the usage line to the next option
            entry = re.search(rf"(?<=\s){re.escape(flag)}[ ,].*?(?=\s--(?!no-)[a-z]|$)", text.split("options:", 1)[1])
            assert entry, flag
            assert "default:" in entry.group() and json.dumps(value) in entry.group(), (flag, value, entry.group())


def test_command_line_settings_override_config():
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, "sft", "lora", "prefix")
    args = parser.parse_args(["--max-steps", "7", "--no-packing", "--target-modules", '["q_proj"]'])
    lora = settings.from_arguments(args, "lora", json.dumps({"max_steps": 3, "lora_rank": 2}))
    assert (lora["max_steps"], lora["lora_rank"], lora["packing"], lora["target_modules"]) == (7, 2, False, ["q_proj"])
    assert lora["learning_rate"] == settings.defaults("lora")["learning_rate"]


def test_finetune_run_from_python_gets_the_schema_defaults(tmp_path, debug_model_dir):
    data = write_toy_data(tmp_path / "data")
    finetune.run("lora", debug_model_dir, data, tmp_path / "lora", {"max_steps": 2, "warmup_steps": 1})
    recorded = json.loads((tmp_path / "lora" / "meta.json").read_text())["config"]
    assert recorded == {**settings.defaults("lora"), "max_steps": 2, "warmup_steps": 1}
    assert recorded["save_total_limit"] == schema_file_defaults("lora")["save_total_limit"] == 2


def test_pretrain_run_from_python_gets_the_schema_defaults(tmp_path):
    data = make_data_dir(tmp_path / "data")
    pretrain.run(data, tmp_path / "pretrain", {"flavour": "debug"},
                 {"world_size": 1, "max_steps": 2, "warmup_steps": 1, "max_length": 32})
    recorded = json.loads((tmp_path / "pretrain" / "meta.json").read_text())["config"]
    assert recorded["pretrain"] == {**settings.defaults("pretrain"), "world_size": 1, "max_steps": 2,
                                    "warmup_steps": 1, "max_length": 32}
    assert recorded["pretrain"]["async_save"] is schema_file_defaults("pretrain")["async_save"] is True


def test_quantize_and_export_run_from_python_get_the_schema_defaults(tmp_path, debug_model_dir):
    quantize.run(debug_model_dir, tmp_path / "wint8", "wint8")
    recorded = json.loads((tmp_path / "wint8" / "meta.json").read_text())["config"]
    assert recorded["group_size"] == schema_file_defaults("quantize")["group_size"]


def test_prepare_run_from_python_gets_the_schema_defaults(tmp_path):
    small = {"corpus": ["builtin:sft_targets"], "vocab_size": 300, "num_sft_train": 50, "num_sft_dev": 4}
    prepare.run(tmp_path / "data", small)
    recorded = json.loads((tmp_path / "data" / "meta.json").read_text())["config"]
    assert recorded == {**settings.defaults("data"), **small, "tokenizer": None}
    assert recorded["chat_template"] is schema_file_defaults("data")["chat_template"]
