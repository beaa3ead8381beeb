"""Lazy models (stages/training/materialize.py): built on the meta device, sliced, then filled with
only this rank's tensors, they hold exactly what the whole model built and then sliced holds.

Bit-exact comparisons (rtol=0, atol=0): the seeded initialisation draws the same numbers in the
same order, and a checkpoint's tensors are copied, never computed.
"""

from __future__ import annotations

import pytest
import torch

from parallel_fixtures import run_gloo
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.model import build_model, config_for_flavour
from stages.training.materialize import (
    SeededInit,
    is_lazy,
    lazy_model,
    lazy_pretrained,
    materialize,
)
from stages.planning.memory import host_build_bytes, parameter_count

VARIANTS = {  # llama: separate lm_head; qwen2: q/k/v biases and tied embeddings
    "llama": dict(),
    "qwen2": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
}


def _config(variant: str):
    return config_for_flavour("debug", vocab_size=256, **VARIANTS[variant])


def _saved(model, directory):
    directory.mkdir()
    save_pretrained(model, directory)
    return directory


def _assert_same(model, reference) -> None:
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        torch.testing.assert_close(param, theirs[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_seeded_init_equals_the_whole_model_built_from_the_seed(variant):
    config = _config(variant)
    model = lazy_model(config, seed=11)
    assert is_lazy(model) and all(p.is_meta for p in model.parameters())
    materialize(model, model.weight_source)
    assert not is_lazy(model)
    _assert_same(model, build_model(config, seed=11))
    if config.tie_word_embeddings:  # the tie survives allocation
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_weights_equal_load_pretrained(variant, tmp_path):
    _saved(build_model(_config(variant), seed=3), tmp_path / "m")
    model = lazy_pretrained(tmp_path / "m")
    materialize(model, model.weight_source)
    _assert_same(model, load_pretrained(tmp_path / "m"))


def test_a_checkpoint_written_by_transformers_loads_lazily(tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = lazy_pretrained(tmp_path / "hf")
    materialize(model, model.weight_source)
    _assert_same(model, load_pretrained(tmp_path / "hf"))


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_an_adapter_on_a_lazy_base_starts_as_on_the_whole_base(method, tmp_path):
    """The adapter is created real, from the same global RNG draws; only the frozen base is filled."""
    from sft_fixtures import finetune_section
    from stages.adapters import attach_adapter

    path = _saved(build_model(_config("llama"), seed=3), tmp_path / "m")
    section = finetune_section(method, target_modules="all-linear") if method == "lora" else finetune_section(method)
    torch.manual_seed(0)
    whole = attach_adapter(load_pretrained(path), method, section)
    torch.manual_seed(0)
    lazy = attach_adapter(lazy_pretrained(path), method, section)
    trained = [name for name, p in lazy.named_parameters() if p.requires_grad]
    assert trained and not any(p.is_meta for _, p in lazy.named_parameters() if p.requires_grad)
    materialize(lazy, lazy.weight_source)
    _assert_same(lazy, whole)
    assert [n for n, p in whole.named_parameters() if p.requires_grad] == trained


def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_slicing(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved(build_model(_config("llama"), seed=3), tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "m" / "meta.json").unlink(missing_ok=True)  # no sha256 record to trip first
    with pytest.raises(ValueError,
                       match=r"m: checkpoint does not match the config: missing=\['model.layers.1.mlp.up_proj"):
        lazy_pretrained(tmp_path / "m")


def test_a_source_without_a_parameter_names_it():
    model = lazy_model(_config("llama"), seed=1)
    source = SeededInit(lazy_model(_config("llama"), seed=1), seed=1)
    source.order = [entry for entry in source.order if entry[0] != "model.norm.weight"]
    with pytest.raises(ValueError, match=r"SeededInit gives no tensor for \['model.norm.weight'\]"):
        materialize(model, source)


def _sliced(rank: int, world: int, variant: str, layout: dict, from_checkpoint: str | None) -> dict:
    """This rank's parameters after `parallelize`, from a whole model and from a lazy one,
    plus the elements the lazy rank allocated."""
    torch.manual_seed(0)
    from stages.parallel.topology import Topology
    from stages.training.parallelize import parallel_degrees, parallelize

    section = {"world_size": world, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
               "virtual_pp_degree": 1, "sharding": "none", "tensor_parallel_output": False, "recompute": False,
               "torch_compile": False, "gradient_accumulation_steps": 2, **layout}
    topology = Topology(parallel_degrees(section))
    config = _config(variant)
    if from_checkpoint:
        whole, lazy = load_pretrained(from_checkpoint), lazy_pretrained(from_checkpoint)
    else:
        whole, lazy = build_model(config, seed=5), lazy_model(config, seed=5)
    eager, runner = parallelize(whole, section, topology)
    source = lazy.weight_source
    module, lazy_runner = parallelize(lazy, section, topology)
    names = module.full_names() if lazy_runner is not None else {}
    materialize(module, source, names, topology.coordinates["tensor"], section["tensor_parallel_degree"])
    return {"eager": {k: v.detach().clone() for k, v in eager.state_dict().items()},
            "lazy": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "elements": sum(p.numel() for p in module.parameters())}


@pytest.mark.parametrize("variant,layout,checkpoint", [
    ("llama", {"tensor_parallel_degree": 2}, False),
    ("qwen2", {"tensor_parallel_degree": 2}, True),
    ("llama", {"pipeline_parallel_degree": 2}, False),
    ("llama", {"pipeline_parallel_degree": 2}, True),
])
def test_each_rank_gets_exactly_its_slice_of_the_whole_model(variant, layout, checkpoint, tmp_path):
    path = None
    if checkpoint:
        path = str(_saved(build_model(_config(variant), seed=9), tmp_path / "m"))
    ranks = run_gloo(_sliced, 2, variant, layout, path)
    whole = sum(p.numel() for p in build_model(_config(variant)).parameters())
    for rank in ranks:
        assert rank["lazy"].keys() == rank["eager"].keys()
        for name, tensor in rank["lazy"].items():
            torch.testing.assert_close(tensor, rank["eager"][name], rtol=0, atol=0, msg=name)
        assert rank["elements"] < 0.75 * whole  # a slice, not the whole model
    if "pipeline_parallel_degree" in layout:  # the two stages hold disjoint layers
        assert not set(ranks[0]["lazy"]) & set(ranks[1]["lazy"])


def test_the_planner_counts_a_slice_and_the_whole_base_only_for_a_prefix_from_tokens():
    arch = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8}
    whole = 4 * parameter_count(arch, 32000)
    layout = {"world_size": 128, "tensor_parallel_degree": 8, "pipeline_parallel_degree": 4, "virtual_pp_degree": 2,
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 32, "max_length": 4096}
    sliced = host_build_bytes(arch, layout, vocab_size=32000)
    # 70B over tp 8 x pp 4: a 32nd of the model plus its largest tensor (the 32000 x 8192 embedding)
    assert whole / 32 < sliced < whole / 32 + 4 * 32000 * 8192 + 1e9
    assert host_build_bytes(arch, {**layout, "prefix_init": "tokens"}, vocab_size=32000) == whole
