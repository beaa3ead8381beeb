"""A starting checkpoint (`model.model_name_or_path`) is checked when the config is parsed: every
unusable directory is refused before any job starts, with the path, the reason and the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from stages.config import ConfigError, check_config, finetune_source, pretrain_enabled


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", chat_tokenizer(tiny_tokenizer_dir))


def experiment(path, **sections):
    return {"experiments": {"x": {"model": {"model_name_or_path": str(path)}, **sections}}}


def test_a_checkpoint_skips_pretraining_unless_asked(checkpoint):
    exp = check_config(experiment(checkpoint))["experiments"]["x"]
    assert not pretrain_enabled(exp) and finetune_source(exp) == "base"
    exp = check_config(experiment(checkpoint, pretrain={"enabled": True}))["experiments"]["x"]
    assert pretrain_enabled(exp) and finetune_source(exp) == "pretrain"
    default = check_config({"experiments": {"y": {}}})["experiments"]["y"]
    assert pretrain_enabled(default) and finetune_source(default) == "pretrain"


def copy_without(src, dst, *names):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


@pytest.mark.parametrize("case, match", [
    ("missing", r"model_name_or_path='.*nowhere': no such directory; give a local Hugging Face checkpoint"),
    ("no_config", r"config.json is missing; a Hugging Face checkpoint directory has a config.json"),
    ("bad_json", r"config.json is not valid JSON"),
    ("unsupported", r"architecture 'T5ForConditionalGeneration' is not supported; supported: LlamaForCausalLM "
                    r"\(llama\), Qwen2ForCausalLM"),
    ("chatglm", r"ChatGLM-6B / ChatGLM2-6B / ChatGLM3-6B \(ChatGLMModel\) exists only as remote code .* never runs "
                r"\(trust_remote_code stays off\); use GLM-4 \(GlmForCausalLM, Glm4ForCausalLM\)"),
    ("pickle", r"the weights are pickle files \(pytorch_model.bin\), which this pipeline never loads.*"
               r"save_pretrained\(dir, safe_serialization=True\)"),
    ("no_tokenizer", r"no tokenizer in .* tokenizer.save_pretrained\(dir\)"),
])
def test_unusable_checkpoints_are_refused_at_parse_time(checkpoint, tmp_path, case, match):
    path = tmp_path / case
    if case == "no_config":
        copy_without(checkpoint, path, "config.json")
    elif case == "bad_json":
        copy_without(checkpoint, path)
        (path / "config.json").write_text("{ not json")
    elif case == "unsupported":
        copy_without(checkpoint, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "architectures": ["T5ForConditionalGeneration"],
                                                      "model_type": "t5"}))
    elif case == "chatglm":  # THUDM/chatglm2-6b's config.json, in short
        copy_without(checkpoint, path)
        (path / "config.json").write_text(json.dumps({
            "architectures": ["ChatGLMModel"], "model_type": "chatglm",
            "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                         "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"}}))
    elif case == "pickle":
        copy_without(checkpoint, path, "*.safetensors")
        (path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    elif case == "no_tokenizer":
        copy_without(checkpoint, path, "tokenizer*", "chat_template.jinja")
    elif case == "missing":
        path = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=match):
        check_config(experiment(path))


@pytest.mark.parametrize("sections, match", [
    ({"quantize": {"source": "pretrain"}}, r"quantize.source=pretrain, but pretraining is skipped"),
    ({"finetune": {"sft": {"world_size": 2, "tensor_parallel_degree": 2}}},  # the engine would refuse it in the job
     r"tensor_parallel_degree=2 does not divide vocab_size=\d*[13579] of the starting checkpoint"),
    ({"finetune": {"sft": {"world_size": 4, "tensor_parallel_degree": 4}}},
     r"tensor_parallel_degree=4 does not divide num_key_value_heads=2 of the starting checkpoint"),
])
def test_keys_that_contradict_the_checkpoint(checkpoint, sections, match):
    if match is None:
        check_config(experiment(checkpoint, **sections))
        return
    with pytest.raises(ConfigError, match=match):
        check_config(experiment(checkpoint, **sections))


def test_model_parallelism_needs_our_model(tmp_path, tiny_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    gpt2 = save_checkpoint(tmp_path / "gpt2", tokenizer, "gpt2")
    check_config(experiment(gpt2, finetune={"sft": {"world_size": 2, "sharding": "stage1"}}))
    # GPT-2 pretrains and fully fine-tunes on our model, in every layout; its adapters train on transformers' model
    check_config(experiment(gpt2, pretrain={"enabled": True, "world_size": 2, "sharding": "stage1"}))
    with pytest.raises(ConfigError, match=r"pretrain: tensor_parallel_degree=2 does not divide vocab_size=323"):
        check_config(experiment(gpt2, pretrain={"enabled": True, "world_size": 2, "tensor_parallel_degree": 2}))
    with pytest.raises(ConfigError, match=r"lora: tensor_parallel_degree=2 / pipeline_parallel_degree=1 / "
                                          r"context_parallel_degree=1 with a GPT-2 "
                                          r"checkpoint: model parallelism runs on the project's own model \(Llama, "
                                          r"Qwen2, Mistral, Qwen3, GLM, GLM-4, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; "
                                          r"for pretraining and full SFT also GPT-2\); "
                                          r"GPT-2 trains adapters through transformers"):
        check_config(experiment(gpt2, finetune={"lora": {"world_size": 2, "tensor_parallel_degree": 2}}))
    check_config(experiment(gpt2, finetune={"sft": {"world_size": 2, "sharding": "stage1", "packing": True}}))
    with pytest.raises(ConfigError, match=r"pretrain: the starting checkpoint ties lm_head to the embedding"):
        check_config(experiment(gpt2, pretrain={"enabled": True, "world_size": 2, "pipeline_parallel_degree": 2,
                                                "gradient_accumulation_steps": 2}))
    opt = save_checkpoint(tmp_path / "opt", tokenizer, "opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                          num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=256)
    with pytest.raises(ConfigError, match=r"pretrain.enabled=true with a OPT checkpoint: continued pretraining"):
        check_config(experiment(opt, pretrain={"enabled": True}))


def test_no_checkpoint_no_skipping():
    with pytest.raises(ConfigError, match=r"pretrain.enabled=false needs experiments.x.model.model_name_or_path"):
        check_config({"experiments": {"x": {"pretrain": {"enabled": False}}}})
    with pytest.raises(ConfigError, match=r"quantize.source=base needs"):
        check_config({"experiments": {"x": {"quantize": {"source": "base"}}}})


def test_a_field_our_model_cannot_honour_is_refused_at_parse_time(checkpoint, tmp_path):
    path = copy_without(checkpoint, tmp_path / "partial", "nothing")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"model_name_or_path: .*config.json.*hidden_act.*gelu"):
        check_config(experiment(path))


def test_gguf_deploy_of_a_model_the_writer_refuses_stops_at_parse_time(tmp_path, tiny_tokenizer_dir):
    """deploy.gguf with a Qwen3 / GLM checkpoint, a GPT-2 flavour or a mixture with a capacity factor fails when
    Snakemake parses the config, not in the deploy job after the whole chain."""
    from transformers import PreTrainedTokenizerFast

    glm = save_checkpoint(tmp_path / "glm", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), "glm4")
    with pytest.raises(ConfigError, match=r"deploy.gguf=\['q8_0'\]: the starting checkpoint is model_type 'glm4', "
                                          r"which the GGUF writer does not write "
                                          r"\(it writes llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, "
                                          r"qwen3_moe\)"):
        check_config(experiment(glm, deploy={"gguf": ["q8_0"]}))
    # Qwen3 is written, but checked through transformers' GGUF loader, which reads 128-wide heads only
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    qwen3 = save_checkpoint(tmp_path / "qwen3", tokenizer, "qwen3")  # head_dim 16
    with pytest.raises(ConfigError, match=r"deploy.gguf=\['q8_0'\]: the starting checkpoint is a Qwen3 with "
                                          r"head_dim=16, whose GGUF file the deploy stage cannot check"):
        check_config(experiment(qwen3, deploy={"gguf": ["q8_0"]}))
    check_config(experiment(save_checkpoint(tmp_path / "qwen3_128", tokenizer, "qwen3", head_dim=128),
                            deploy={"gguf": ["q8_0"]}))
    # mixtures of experts: checked through our reading of the file (stages.checkpoint.gguf_mixture), dropless only
    check_config(experiment(save_checkpoint(tmp_path / "olmoe", tokenizer, "olmoe"), deploy={"gguf": ["q8_0"]}))
    check_config({"experiments": {"x": {"model": {"flavour": "moe-debug"}, "deploy": {"gguf": ["f32"]}}}})
    with pytest.raises(ConfigError, match=r"model.moe_capacity_factor=1.25 drops tokens .* set it to null"):
        check_config({"experiments": {"x": {"model": {"flavour": "moe-debug", "moe_capacity_factor": 1.25},
                                            "deploy": {"gguf": ["f32"]}}}})
    with pytest.raises(ConfigError, match=r"flavour 'gpt-tiny' is model_type 'gpt2'"):
        check_config({"experiments": {"x": {"model": {"flavour": "gpt-tiny"}, "deploy": {"gguf": ["f32"]}}}})
    check_config({"experiments": {"x": {"model": {"flavour": "tiny"}, "deploy": {"gguf": ["f32"]}}}})
