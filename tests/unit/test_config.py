"""Config validation: defaults from the schema, unknown keys with a suggestion, types, relations."""

import pytest
import yaml

from stages.config import SCHEMA_PATH, ConfigError, check_config, experiment, load_schema

ROOT = SCHEMA_PATH.parents[2]


def test_shipped_config_is_valid_and_defaults_fill_every_section():
    config = check_config(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    llama = config["experiments"]["llama"]
    assert llama["model"]["flavour"] == "tiny"
    assert llama["finetune"]["lora"]["lora_rank"] == 16
    assert llama["quantize"]["variants"] == ["wint8", "wint4", "gptq-w4", "a8w8-smooth"]
    assert llama["pretrain"]["lr_scheduler_type"] == "cosine"  # from the shared training defaults


def test_a_bare_experiment_gets_every_default_and_experiments_do_not_share_state():
    config = check_config({"experiments": {"a": {}, "b": {"model": {"flavour": "debug"}}}})
    a, b = config["experiments"]["a"], config["experiments"]["b"]
    assert a["model"]["flavour"] == "tiny" and b["model"]["flavour"] == "debug"
    a["data"]["corpus"].append("x")  # a mutable default: deep-copied into each experiment
    assert "x" not in b["data"]["corpus"]
    assert "x" not in load_schema()["$defs"]["experiment"]["properties"]["data"]["properties"]["corpus"]["default"]


def test_a_section_overrides_the_shared_training_default():
    config = check_config({"experiments": {"a": {}}})
    assert config["experiments"]["a"]["finetune"]["prefix"]["learning_rate"] == 0.01
    assert config["experiments"]["a"]["finetune"]["sft"]["learning_rate"] == 0.001


@pytest.mark.parametrize("bad, message", [
    ({"finetune": {"lora": {"lora_rnak": 4}}}, r"'experiments.x.finetune.lora.lora_rnak' is unknown; did you mean 'lora_rank'"),
    ({"pretrian": {}}, r"'experiments.x.pretrian' is unknown; did you mean 'pretrain'"),
    ({"pretrain": {"max_steps": "ten"}}, r"'experiments.x.pretrain.max_steps': 'ten' is not of type 'integer'"),
    ({"pretrain": {"sharding": "stage4"}}, r"experiments.x.pretrain.sharding"),
    ({"model": {"flavour": "huge"}}, r"experiments.x.model.flavour"),
    ({"finetune": {"sft": {"src_length": 128, "max_length": 128}}}, r"src_length=128 must be smaller than max_length=128"),
    ({"pretrain": {"warmup_steps": 50, "max_steps": 10}}, r"warmup_steps=50 exceeds max_steps=10"),
    ({"model": {"flavour": "debug"}, "data": {"vocab_size": 512},
      "finetune": {"prefix": {"prefix_projection": True, "world_size": 2, "tensor_parallel_degree": 2}}},
     r"experiments\.x\.finetune\.prefix: prefix_projection=true with tensor_parallel_degree=2: .* set "
     r"prefix_projection: false"),
    ({"finetune": {"prefix": {"prefix_projection": True, "prefix_init": "tokens"}}},
     r"experiments\.x\.finetune\.prefix: prefix_init=tokens with prefix_projection=true: .*use prefix_init: random"),
])
def test_bad_values_name_the_key(bad, message):
    with pytest.raises(ConfigError, match=message):
        check_config({"experiments": {"x": bad}})


def test_unknown_top_level_key_and_unknown_experiment():
    with pytest.raises(ConfigError, match="did you mean 'experiments'"):
        check_config({"experiments": {}, "experiment": {}})
    with pytest.raises(ConfigError, match="did you mean 'llama'"):
        experiment({"experiments": {"llama": {}}}, "lama")


def test_int4_group_size_must_tile_the_flavour_widths():
    with pytest.raises(ConfigError, match=r"variant wint4 has group_size=40, which does not divide the input "
                                          r"width\(s\) \[64, 192\]"):
        check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "quantize": {"group_size": 40}}}})
    check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "quantize": {"group_size": 32}}}})
    # GPTQ takes a narrower last group, but no group wider than a row
    check_config({"experiments": {"x": {"model": {"flavour": "debug"},
                                        "quantize": {"group_size": 40, "variants": ["gptq-w4"]}}}})
    with pytest.raises(ConfigError, match=r"variant gptq-w4g128 has group_size=128, which exceeds the input "
                                          r"width\(s\) \[64\]"):
        check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "quantize": {"variants": ["gptq-w4g128"]}}}})


def test_unknown_quantize_variant_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"experiments\.x\.quantize: quantize variant 'gptq-w5' is unknown; "
                                          r"choose one of \[.*'gptq-w4g128'.*\]"):
        check_config({"experiments": {"x": {"quantize": {"variants": ["wint8", "gptq-w5"]}}}})
    config = check_config({"experiments": {"x": {"quantize": {
        "variants": ["w3"], "custom_variants": {"w3": {"method": "gptq", "bits": 3, "group_size": 32}}}}}})
    assert config["experiments"]["x"]["quantize"]["custom_variants"]["w3"]["bits"] == 3


@pytest.mark.parametrize("pretrain, message", [
    ({"world_size": 3, "tensor_parallel_degree": 2},
     r"world_size=3 is not divisible by tensor_parallel_degree=2 x context_parallel_degree=1 x "
     r"pipeline_parallel_degree=1 = 2"),
    ({"world_size": 4, "context_parallel_degree": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2},
     None),
    ({"world_size": 4, "context_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True}, None),
    ({"world_size": 2, "context_parallel_degree": 2, "context_parallel_mode": "ulysses"}, None),
    ({"world_size": 4, "context_parallel_degree": 2, "context_parallel_mode": "ulysses", "tensor_parallel_degree": 2},
     r"context_parallel_mode=ulysses with context_parallel_degree=2: num_key_value_heads=2 / "
     r"tensor_parallel_degree=2 is not divisible by 2 .* use context_parallel_mode: all_gather of flavour 'debug'"),
    ({"world_size": 2, "pipeline_parallel_degree": 2, "sharding": "stage2", "gradient_accumulation_steps": 2},
     r"sharding=stage2 with pipeline_parallel_degree=2"),
    ({"world_size": 2, "tensor_parallel_degree": 2, "sharding": "none"} , None),
    ({"world_size": 8, "tensor_parallel_degree": 8},
     r"tensor_parallel_degree=8 does not divide num_attention_heads=4 of flavour 'debug'"),
    ({"world_size": 2, "pipeline_parallel_degree": 2, "virtual_pp_degree": 2, "gradient_accumulation_steps": 4},
     r"4 chunks exceed num_hidden_layers=2"),
    ({"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 1},
     r"gradient_accumulation_steps=1 \(the pipeline's micro-batches\) must be >= pipeline_parallel_degree=2"),
    ({"virtual_pp_degree": 2}, r"virtual_pp_degree=2 needs pipeline_parallel_degree > 1"),
    ({"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2, "fp16": True},
     r"fp16 with pipeline_parallel_degree=2: fp16's loss scaling lives in DeepSpeed's backward"),
])
def test_parallel_layouts_are_checked_before_any_process_starts(pretrain, message):
    config = {"experiments": {"x": {"model": {"flavour": "debug"}, "pretrain": pretrain}}}
    if message is None:
        check_config(config)
        return
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_tied_flavour_cannot_be_pipelined_and_overrides_apply():
    with pytest.raises(ConfigError, match="ties lm_head to the embedding"):
        check_config({"experiments": {"x": {"model": {"flavour": "debug", "tie_word_embeddings": True},
                                             "pretrain": {"pipeline_parallel_degree": 2,
                                                          "gradient_accumulation_steps": 2}}}})
    check_config({"experiments": {"x": {"model": {"flavour": "debug", "num_hidden_layers": 4},
                                         "pretrain": {"pipeline_parallel_degree": 2, "virtual_pp_degree": 2,
                                                      "gradient_accumulation_steps": 4}}}})


def test_fp16_is_checked_against_this_machine(monkeypatch):
    """fp16 where DeepSpeed cannot run it is a parse-time error naming the key and the fix; where it
    can (or with the check switched off for a SLURM login node) the config passes."""
    from stages.training import capabilities

    config = {"experiments": {"x": {"model": {"flavour": "debug"}, "pretrain": {"fp16": True}}}}
    monkeypatch.setattr(capabilities, "fp16_unsupported_reason", lambda: "no fp16 kernels here; use bf16: true")
    with pytest.raises(ConfigError, match=r"experiments\.x\.pretrain\.fp16=true: no fp16 kernels here; use bf16"):
        check_config(config)
    monkeypatch.setenv("LLM_LIFECYCLE_DEVICE_CHECK", "0")
    check_config(config)
    monkeypatch.delenv("LLM_LIFECYCLE_DEVICE_CHECK")
    monkeypatch.setattr(capabilities, "fp16_unsupported_reason", lambda: None)
    check_config(config)


def test_bf16_auto_is_valid_and_exclusive_with_fp16():
    """bf16: auto passes the parse-time check without asking the device (the job decides);
    with fp16: true it is refused like bf16: true."""
    check_config({"experiments": {"x": {"pretrain": {"bf16": "auto"}, "finetune": {"lora": {"bf16": "auto"}}}}})
    with pytest.raises(ConfigError, match=r"experiments\.x\.pretrain: bf16=auto and fp16=true; choose one"):
        check_config({"experiments": {"x": {"pretrain": {"bf16": "auto", "fp16": True}}}})
    with pytest.raises(ConfigError, match="bf16"):
        check_config({"experiments": {"x": {"pretrain": {"bf16": "yes"}}}})


def test_fp16_verdict_matches_deepspeed():
    """Our up-front verdict is DeepSpeed's own: the accelerator refuses fp16 exactly when we do."""
    from deepspeed.accelerator import get_accelerator

    from stages.training.capabilities import fp16_unsupported_reason

    assert (fp16_unsupported_reason() is None) == bool(get_accelerator().is_fp16_supported())


@pytest.mark.parametrize("model, message", [
    ({"num_key_value_heads": 3}, r"experiments\.x\.model\.num_key_value_heads=3 does not divide "
                                 r"num_attention_heads=4 \(flavour 'debug'\): grouped-query attention"),
    ({"num_attention_heads": 1}, r"num_key_value_heads=2 \(flavour 'debug'\) does not divide "
                                 r"experiments\.x\.model\.num_attention_heads=1"),
    ({"hidden_size": 66}, r"num_attention_heads=4 \(flavour 'debug'\) does not divide "
                          r"experiments\.x\.model\.hidden_size=66: every attention head"),
    ({"hidden_size": 36}, r"head_dim 9 is odd; rotary embeddings rotate pairs of channels"),
    ({"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128}, None),
])
def test_the_model_architecture_is_checked_at_parse_time(model, message):
    config = {"experiments": {"x": {"model": {"flavour": "debug", **model}}}}
    if message is None:
        check_config(config)
        return
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_tensor_parallelism_needs_a_divisible_vocabulary():
    with pytest.raises(ConfigError, match=r"experiments\.x\.pretrain: tensor_parallel_degree=2 does not divide "
                                          r"data\.vocab_size=515: the embedding and lm_head are split"):
        check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "data": {"vocab_size": 515},
                                             "pretrain": {"world_size": 2, "tensor_parallel_degree": 2}}}})


@pytest.mark.parametrize("case, message", [
    ("missing", r"experiments\.x\.model\.model_name_or_path='.*/nowhere': no such directory"),
    ("no_config", r"experiments\.x\.model\.model_name_or_path='.*/model': .*/model/config\.json is missing"),
    ("unsupported", r"experiments\.x\.model\.model_name_or_path='.*/model': .*/model/config\.json: architecture "
                    r"'BertModel' is not supported; supported: LlamaForCausalLM \(llama\)"),
])
def test_a_starting_checkpoint_error_names_the_key_and_the_file(tmp_path, case, message):
    path = tmp_path / ("nowhere" if case == "missing" else "model")
    if case != "missing":
        path.mkdir()
    if case == "unsupported":
        (path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    with pytest.raises(ConfigError, match=message):
        check_config({"experiments": {"x": {"model": {"model_name_or_path": str(path)}}}})


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    from stages.config import check_yaml_syntax, load_yaml, main

    bad = tmp_path / "my.yaml"
    bad.write_text("experiments:\n  x:\n    model: {flavour: debug\n    data: {}\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:4:9: expected ',' or '\}}', but got ':' \(while parsing a "
                                          r"flow mapping at line 3, column 12\)$"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match=rf"{bad}:4:9"):
        check_yaml_syntax(tmp_path / "absent.yaml", bad)  # an absent file is Snakemake's to report
    assert main([str(ROOT / "config" / "config.yaml"), str(bad)]) == 1
    assert capsys.readouterr().err.startswith(f"{bad}:4:9: expected")
    good = tmp_path / "good.yaml"
    good.write_text("experiments: {x: {model: {flavour: debug}}}\n")
    assert main([str(ROOT / "config" / "config.yaml"), str(good)]) == 0
    assert "valid (llama, x)" in capsys.readouterr().out


@pytest.mark.parametrize("finetune, message", [
    ({"lora": {"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2}},
     r"finetune.lora: pipeline_parallel_degree=2: lora trains under data parallel, ZeRO and tensor parallelism"),
    ({"sft": {"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2, "packing": True}},
     r"finetune.sft: packing=True with pipeline_parallel_degree=2"),
    ({"sft": {"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2, "eval_steps": 5}},
     r"finetune.sft: eval_steps=5 with pipeline_parallel_degree=2"),
    ({"prefix": {"load_best_model_at_end": True}}, r"finetune.prefix: load_best_model_at_end=true needs eval_steps > 0"),
    ({"lora": {"load_best_model_at_end": True, "eval_steps": 5, "metric_for_best_model": "eval_rouge_l"}},
     r"metric_for_best_model=eval_rouge_l is measured on generations"),
    ({"lora": {"world_size": 3, "tensor_parallel_degree": 2}}, r"finetune.lora: world_size=3 is not divisible"),
    ({"prefix": {"world_size": 2, "context_parallel_degree": 2, "context_parallel_mode": "ulysses"}},
     r"finetune.prefix: context_parallel_mode=ulysses with prefix tuning: a prefix is per head"),
    ({"prefix": {"world_size": 2, "context_parallel_degree": 2, "context_parallel_mode": "ring"}},
     r"finetune.prefix: context_parallel_mode=ring with prefix tuning: ring attention passes only the tokens'"),
])
def test_fine_tuning_layouts_that_cannot_run_are_refused(finetune, message):
    with pytest.raises(ConfigError, match=message):
        check_config({"experiments": {"t": {"model": {"flavour": "debug"}, "finetune": finetune}}})


def test_parsing_the_workflow_loads_no_torch():
    """What Snakemake runs at parse time (a no-op rerun pays it): the workflow's own imports and the
    config check of the shipped config load neither torch nor transformers (1.5 s against 4.2 s)."""
    from light_imports import loaded_by_code

    files = [ROOT / "workflow" / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]
    imports = [line.strip() for f in files for line in f.read_text().splitlines()
               if line.startswith(("from stages", "import stages"))]
    assert len(imports) >= 10, imports  # the scan found the workflow's imports
    check = "\n".join([*imports, "import yaml", "from stages.config import check_config",
                       "check_config(yaml.safe_load(open('config/config.yaml').read()))"])
    assert loaded_by_code(check, ("torch", "transformers", "pandas", "numpy")) == []


# -- align (preference alignment) --------------------------------------------------------------------

def _fake_checkpoint(path):
    """A directory read_source_config accepts (a debug-sized Llama config.json, a weights file and a
    tokenizer file); nothing loads its weights at parse time."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def test_align_is_off_by_default_and_then_checks_nothing():
    config = check_config({"experiments": {"x": {"align": {"source": "base", "label_smoothing": 0.1,
                                                            "method": "ipo"}}}})
    assert config["experiments"]["x"]["align"]["enabled"] is False


@pytest.mark.parametrize("align, message", [
    ({"source": "base"}, r"experiments\.x\.align\.source=base needs experiments\.x\.model\.model_name_or_path"),
    ({"method": "ipo", "label_smoothing": 0.1},
     r"experiments\.x\.align: label_smoothing=0\.1 with method=ipo: only dpo and simpo .* set label_smoothing: 0"),
    ({"method": "orpo", "label_smoothing": 0.2}, r"label_smoothing=0\.2 with method=orpo"),
    ({"src_length": 128, "max_length": 128}, r"experiments\.x\.align: src_length=128 must be smaller than max_length"),
    ({"warmup_steps": 20, "max_steps": 10}, r"experiments\.x\.align: warmup_steps=20 exceeds max_steps=10"),
    ({"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2, "tuning": "lora"},
     (r"experiments\.x\.align: pipeline_parallel_degree=2 with tuning: lora: .* set "
      r"pipeline_parallel_degree: 1 .* or tuning: full")),
    ({"world_size": 3, "tensor_parallel_degree": 2}, r"experiments\.x\.align: world_size=3 is not divisible"),
    ({"world_size": 2, "context_parallel_degree": 2},
     r"experiments\.x\.align: context_parallel_degree=2: preference alignment sums each sequence's log-probability"),
    ({"world_size": 2, "tensor_parallel_degree": 2},
     r"experiments\.x\.align: tensor_parallel_degree=2 does not divide data\.vocab_size=511"),
])
def test_an_enabled_align_section_is_checked_with_its_key(align, message):
    with pytest.raises(ConfigError, match=message):
        check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "data": {"vocab_size": 511},
                                             "align": {"enabled": True, **align}}}})


def test_align_needs_preference_pairs(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    exp = {"data": {"sft": str(sft)}, "align": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"experiments\.x\.align\.enabled=true needs preference pairs, and "
                                          r"experiment 'x' has none: data\.preference is null with data\.sft"):
        check_config({"experiments": {"x": exp}})
    check_config({"experiments": {"x": {**exp, "data": {"sft": str(sft), "preference": str(tmp_path)}}}})


def test_lm_evals_pairs_task_needs_preference_pairs(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    exp = {"data": {"sft": str(sft)}, "evaluate": {"lm_eval_tasks": ["lifecycle_qa", "lifecycle_pairs"]}}
    with pytest.raises(ConfigError, match=r"experiments\.x\.evaluate\.lm_eval_tasks names lifecycle_pairs, built from "
                                          r"the preference dev pairs, and experiment 'x' has none"):
        check_config({"experiments": {"x": exp}})
    check_config({"experiments": {"x": {**exp, "evaluate": {"lm_eval_tasks": ["lifecycle_qa"]}}}})
    check_config({"experiments": {"x": {"evaluate": {"lm_eval_tasks": ["lifecycle_pairs"]}}}})  # builtin pairs


def test_label_smoothing_is_valid_for_dpo_and_simpo():
    for method in ("dpo", "simpo"):
        check_config({"experiments": {"x": {"align": {"enabled": True, "method": method, "label_smoothing": 0.1}}}})


def test_align_source_pretrain_needs_pretraining_and_base_a_checkpoint(tmp_path):
    path = _fake_checkpoint(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"experiments\.x\.align\.source=pretrain, but experiment 'x' does not "
                                          r"pretrain .* use source: base"):
        check_config({"experiments": {"x": {"model": {"model_name_or_path": path},
                                             "align": {"enabled": True, "source": "pretrain"}}}})
    for source in ("base", "sft", "lora-merged"):  # what that experiment makes
        check_config({"experiments": {"x": {"model": {"model_name_or_path": path},
                                             "align": {"enabled": True, "source": source}}}})


@pytest.mark.parametrize("source, align, message", [
    ("align", {}, r"experiments\.x\.quantize\.source=align needs experiments\.x\.align\.enabled: true"),
    ("align", {"enabled": True, "tuning": "lora"},
     r"experiments\.x\.quantize\.source=align with experiments\.x\.align\.tuning=lora: .*set quantize\.source: "
     r"align-merged"),
    ("align-merged", {"enabled": True},
     r"experiments\.x\.quantize\.source=align-merged with experiments\.x\.align\.tuning=full: .*set "
     r"quantize\.source: align"),
])
def test_quantizing_the_aligned_model_needs_a_model_not_an_adapter(source, align, message):
    with pytest.raises(ConfigError, match=message):
        check_config({"experiments": {"x": {"quantize": {"source": source}, "align": align}}})
    check_config({"experiments": {"x": {"quantize": {"source": "align"}, "align": {"enabled": True}}}})
    check_config({"experiments": {"x": {"quantize": {"source": "align-merged"},
                                         "align": {"enabled": True, "tuning": "lora"}}}})


def test_the_reference_methods_are_the_loss_modules_other_methods():
    from stages.config import REFERENCE_METHODS
    from stages.model.preference_loss import METHODS, REFERENCE_FREE

    schema_methods = load_schema()["$defs"]["experiment"]["properties"]["align"]["properties"]["method"]["enum"]
    assert set(schema_methods) == set(METHODS) == set(REFERENCE_METHODS) | set(REFERENCE_FREE)
    assert not set(REFERENCE_METHODS) & set(REFERENCE_FREE)
