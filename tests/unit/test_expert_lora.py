"""LoRA on a mixture of experts' routed experts (`finetune.lora.target_parameters`,
stages/adapters/expert_lora.py), both directions with peft on transformers' model:

- ours -> peft: our model (loaded from a checkpoint the installed transformers saved) with LoRA on
  its attention, shared expert and routed experts, every factor non-zero, written as the training
  engine writes it; `PeftModel.from_pretrained` on transformers' model gives our logits (fp32, 1e-5),
  for Mixtral, Qwen2-MoE, Qwen3-MoE (a dense layer among the sparse ones) and OLMoE, both expert
  parameters or one; `stages.merge` folds it into a checkpoint our loader reads with the same logits;
- peft -> ours: an adapter peft itself makes on transformers' Mixtral (`target_parameters`, random
  factors) merges through `stages.merge` into the logits peft computes;
- training: the finetune stage trains the experts' factors, and ep2, ep2 x ZeRO-1, dp2 x ZeRO-3 and tp2
  follow the one-process run (real torchrun, gloo, fp32: loss 1e-5 relative, the adapter file's tensors
  1e-5), as does attention-only LoRA under ep2 x ZeRO-1 (the frozen experts split over the ranks);
- preference alignment with LoRA on the experts (SimPO) writes an adapter peft loads and our merge folds in;
- the config check refuses what cannot run, naming the key.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from align_fixtures import write_preference_data
from checkpoint_fixtures import randomize_biases_and_norms
from runs_in_one_world import start_world
from safetensors.torch import load_file
from sft_fixtures import train_losses, write_toy_data

from stages import align, finetune, merge
from stages.adapters import attach_adapter
from stages.adapters.peft_files import adapter_writer
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_config, load_pretrained, save_pretrained
from stages.config import check_config
from stages.errors import ConfigError
from stages.model.config import config_for_flavour
from stages.model.llama import build_model
from stages.sections import AlignSettings, LoraSettings
from stages.training.checkpointing import trained_parameters

VOCAB = 120
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, eos_token_id=2, pad_token_id=0)
CASES = {  # id -> (transformers config, LoRA target_parameters)
    "mixtral": (transformers.MixtralConfig(**SMALL, num_local_experts=4), ["gate_up_proj", "down_proj"]),
    "qwen2_moe": (transformers.Qwen2MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=40),
                  ["experts.gate_up_proj", "down_proj"]),
    "qwen3_moe-down-only": (transformers.Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=24,
                                                        mlp_only_layers=[1]), ["mlp.experts.down_proj"]),
    "olmoe-gate-up-only": (transformers.OlmoeConfig(**SMALL, num_experts=4), ["gate_up_proj"]),
}
TOL = 1e-5


def lora_section(**overrides) -> LoraSettings:
    """`finetune.lora` of an experiment on the moe-debug flavour (LoRA on experts needs a mixture),
    small-run settings and `overrides`, as the workflow checks it."""
    small = dict(max_steps=30, warmup_steps=2, per_device_train_batch_size=8, src_length=16, max_length=24, seed=0,
                 lora_rank=4, lora_alpha=8)
    config = check_config({"experiments": {"t": {"model": {"flavour": "moe-debug"},
                                                 "finetune": {"lora": small | overrides}}}})
    return LoraSettings.of(config["experiments"]["t"]["finetune"]["lora"])


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    out = model.eval()(input_ids=_ids())
    return getattr(out, "logits", out).float()  # transformers' output, or our model's logits


def _hf_checkpoint(path, config) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)


@pytest.mark.parametrize("case", list(CASES))
def test_our_expert_lora_is_peft_s_on_transformers_and_merges(tmp_path, case):
    config, parameters = CASES[case]
    _hf_checkpoint(tmp_path / "base", config)
    model = load_pretrained(tmp_path / "base")
    section = lora_section(target_modules="all-linear", target_parameters=parameters, lora_rank=3)
    torch.manual_seed(0)
    attach_adapter(model, "lora", section)
    trained = trained_parameters(model)
    assert any(".experts." in name for name, _ in trained)
    with torch.no_grad():
        for _, p in trained:  # B too: the update is not zero
            p.copy_(torch.randn_like(p) * 0.2)
    ours = _logits(model)
    adapter = tmp_path / "adapter"
    with atomic_dir(adapter) as tmp:
        adapter_writer("lora", section, model, tmp_path / "base")(tmp, {n: p.detach() for n, p in trained})

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, adapter)
    wrapped = [n for n, m in theirs.named_modules() if isinstance(m, peft.tuners.lora.ParamWrapper)]
    assert len(wrapped) == len(parameters) * sum(1 for m in base.modules() if type(m).__name__.endswith("Experts"))
    torch.testing.assert_close(_logits(theirs), ours, atol=TOL, rtol=TOL)
    assert not torch.allclose(ours, _logits(load_pretrained(tmp_path / "base")), atol=1e-3)  # the update counts

    merge.run(adapter, tmp_path / "merged", base_dir=tmp_path / "base")
    torch.testing.assert_close(_logits(load_pretrained(tmp_path / "merged")), ours, atol=TOL, rtol=TOL)


def test_peft_s_expert_lora_merges_through_our_merge(tmp_path):
    """An adapter peft makes on transformers' Mixtral (attention and both expert parameters, random
    factors) opens in our merge stage, which writes the model peft computes."""
    config, _ = CASES["mixtral"]
    _hf_checkpoint(tmp_path / "base", config)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    theirs = peft.get_peft_model(base, lora)
    expected = _logits(theirs)
    theirs.save_pretrained(tmp_path / "adapter")
    merge.run(tmp_path / "adapter", tmp_path / "merged", base_dir=tmp_path / "base")
    torch.testing.assert_close(_logits(load_pretrained(tmp_path / "merged")), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(flavour="debug", target_parameters=["down_proj"]), "debug' is Llama, a dense model"),
    (dict(flavour="moe-debug", target_parameters=["w2"]), "'w2', which is no expert parameter"),
    (dict(flavour="moe-debug", target_parameters=["down_proj"], lora_dropout=0.1), "set lora_dropout: 0"),
])
def test_the_config_check_names_the_key(overrides, fragment):
    flavour = overrides.pop("flavour")
    with pytest.raises(ConfigError, match="experiments.t.finetune.lora") as e:
        check_config({"experiments": {"t": {"model": {"flavour": flavour}, "finetune": {"lora": overrides}}}})
    assert fragment in str(e.value)


# -- training: one process, and expert parallelism --------------------------------------------------

RECIPE = dict(learning_rate=1e-2, lora_rank=4, target_modules=["q_proj", "v_proj"],
              target_parameters=["gate_up_proj", "down_proj"], max_steps=5, warmup_steps=1)
ATTENTION_ONLY = {**RECIPE, "target_parameters": None}
LAYOUTS = {  # name -> (recipe, layout); the one-process reference runs micro-batches of 4 x 2
    "ep2": (RECIPE, dict(world_size=2, expert_parallel_degree=2, per_device_train_batch_size=4)),
    "ep2_zero1": (RECIPE, dict(world_size=2, expert_parallel_degree=2, sharding="stage1",
                               per_device_train_batch_size=4)),
    # ZeRO-3 gathers each expert's factors with its weights; tp2 keeps the experts and their factors
    # whole on both ranks (attention split)
    "zero3_dp2": (RECIPE, dict(world_size=2, sharding="stage3", per_device_train_batch_size=4)),
    "tp2": (RECIPE, dict(world_size=2, tensor_parallel_degree=2, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2)),
    # the experts frozen and split: each rank must keep its own (DeepSpeed's start-up broadcast once gave
    # every rank data rank 0's experts here)
    "attention_only_ep2_zero1": (ATTENTION_ONLY, dict(world_size=2, expert_parallel_degree=2, sharding="stage1",
                                                      per_device_train_batch_size=4)),
}


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, debug_model_dir):
    """The moe-debug flavour (Mixtral blocks, top 2 of 4 experts) from seed 0, the debug tokenizer."""
    config = config_for_flavour("moe-debug", vocab_size=load_config(debug_model_dir).vocab_size, bos_token_id=1,
                                eos_token_id=2, pad_token_id=0)
    out = tmp_path_factory.mktemp("moe") / "model"
    with atomic_dir(out) as tmp:
        save_pretrained(build_model(config, seed=0), tmp, tokenizer_dir=debug_model_dir)
    return out


@pytest.mark.multiproc
def test_expert_lora_trains_and_expert_parallelism_follows_one_process(tmp_path, moe_model_dir):
    data = write_toy_data(tmp_path / "data")
    references = {}
    for name, recipe in (("experts", RECIPE), ("attention_only", ATTENTION_ONLY)):
        references[name] = tmp_path / name
        finetune.run("lora", moe_model_dir, data, references[name],
                     lora_section(**recipe, per_device_train_batch_size=4, gradient_accumulation_steps=2))
    losses = train_losses(references["experts"])
    assert len(losses) == 5 and losses[-1] < losses[0]
    tensors = load_file(references["experts"] / "adapter_model.safetensors")
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    assert len(experts) == 2 * 2 * 2  # 2 sparse layers x 2 parameters x (A, B)
    assert all(v.abs().max() > 0 for k, v in experts.items())  # B trained away from its zero start
    assert train_losses(references["attention_only"]) != pytest.approx(losses, rel=1e-4)  # the experts' LoRA counts

    world = start_world(2, {name: {"stage": "finetune", "method": "lora", "model": moe_model_dir, "data": data,
                                   "out": tmp_path / name, "section": dict(lora_section(**recipe, **layout))}
                            for name, (recipe, layout) in LAYOUTS.items()}, tmp_path / "world")
    for name, (recipe, _) in LAYOUTS.items():
        reference = references["experts" if recipe is RECIPE else "attention_only"]
        out = world.out(name)
        assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-5), name
        ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
        assert ours.keys() == theirs.keys()
        for key in ours:  # whole tensors, every expert's factors in peft's packing, whatever the layout
            torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")


def test_lora_alignment_adapts_the_experts_too(tmp_path, moe_model_dir):
    """align's `tuning: lora` with the experts: the same adapter writer, peft reads it, merge folds it in."""
    data = write_preference_data(tmp_path / "data")
    section = dict(enabled=True, method="simpo", tuning="lora", lora_rank=4, target_modules=["q_proj", "v_proj"],
                   target_parameters=["gate_up_proj", "down_proj"], max_steps=3, warmup_steps=1,
                   per_device_train_batch_size=8, src_length=16, max_length=24, seed=0, learning_rate=1e-2)
    config = check_config({"experiments": {"t": {"model": {"flavour": "moe-debug"}, "align": section}}})
    out = tmp_path / "align"
    align.run(moe_model_dir, data, out, AlignSettings.of(config["experiments"]["t"]["align"]))
    experts = {k: v for k, v in load_file(out / "adapter_model.safetensors").items() if ".experts." in k}
    assert len(experts) == 2 * 2 * 2 and all(v.abs().max() > 0 for v in experts.values())
    base = transformers.AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)
    adapted = _logits(peft.PeftModel.from_pretrained(base, out))
    merge.run(out, tmp_path / "merged", base_dir=moe_model_dir)
    torch.testing.assert_close(_logits(load_pretrained(tmp_path / "merged")), adapted, atol=TOL, rtol=TOL)
    assert not torch.allclose(adapted, _logits(load_pretrained(moe_model_dir)), atol=1e-4)
