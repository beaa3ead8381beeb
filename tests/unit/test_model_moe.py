"""Our mixture-of-experts decoder runs what transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
run (stages/model/moe.py), both directions, and its routing options do what they say.

Each family case builds a small random-init model with the installed transformers (5.23; biases and
norms randomized), saves it (transformers writes the per-expert checkpoint names, e.g.
`block_sparse_moe.experts.0.w1.weight`), loads it with our loader and compares logits in fp32, and
the training loss with the load-balancing term (transformers' `output_router_logits=True`). Our
model saved back gives the same config.json, and transformers reads our files as the same model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from checkpoint_fixtures import randomize_biases_and_norms

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_config, load_pretrained, save_pretrained
from stages.model import LlamaConfig, build_model
from stages.model.config import CARRIED_KEYS, FAMILY_DEFAULTS, HONOURED_KEYS, MOE_CARRIED_KEYS, REFUSED_KEYS
from stages.model.moe import MoeRouting, RouterRecord, SparseMoeBlock, router_z_loss, run_experts, within_capacity

VOCAB = 120
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, eos_token_id=2, pad_token_id=0)
CLASSES = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig}
CASES = {  # id -> (family, transformers config fields)
    "mixtral": ("mixtral", dict(num_local_experts=4)),
    "mixtral-window-top1": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=1, sliding_window=6)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40)),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(num_experts=6, moe_intermediate_size=24, num_experts_per_tok=3,
                                                shared_expert_intermediate_size=40, decoder_sparse_step=2,
                                                norm_topk_prob=True)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=24, mlp_only_layers=[1])),
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(num_experts=5, moe_intermediate_size=24, norm_topk_prob=True,
                                              head_dim=16, attention_bias=True)),
    "olmoe": ("olmoe", dict(num_experts=4)),
    "olmoe-clip": ("olmoe", dict(num_experts=4, clip_qkv=0.3, attention_bias=True)),
}
TOL = 1e-5


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_checkpoint(path: Path, family: str, fields: dict) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CLASSES[family](**{**SMALL, **fields})).float().eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_checkpoint_logits_loss_and_round_trip(tmp_path, case):
    family, fields = CASES[case]
    theirs = _hf_checkpoint(tmp_path / "hf", family, fields)
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.moe and any(ours.config.sparse_layers())
    ids = _ids()
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= TOL
    # the training loss: cross-entropy plus router_aux_loss_coef x transformers' load-balancing loss
    theirs.config.output_router_logits = True
    _, loss = ours(ids, labels=ids)
    expected = theirs(ids, labels=ids)
    assert expected.aux_loss.item() > 0
    assert abs(loss.item() - expected.loss.item()) <= TOL

    with atomic_dir(tmp_path / "ours") as out:
        save_pretrained(ours, out)
    theirs.config.output_router_logits = False
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("family", list(CLASSES))
def test_our_random_init_opens_in_transformers(tmp_path, family):
    """The other direction: a model we build (our init, our config.json) is transformers' model."""
    fields = dict(SMALL, num_experts=4, model_type=family)
    if family in ("qwen2_moe", "qwen3_moe"):
        fields["moe_intermediate_size"] = 24
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = 40
    ours = build_model(LlamaConfig(**fields), seed=3).eval()
    randomize_biases_and_norms(ours)
    with atomic_dir(tmp_path / "ours") as out:
        save_pretrained(ours, out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(theirs).__name__ == CLASSES[family].__name__.replace("Config", "ForCausalLM")
    assert sum(p.numel() for p in ours.parameters()) == ours.config.num_parameters() == theirs.num_parameters()
    with torch.no_grad():
        assert (ours(_ids()) - theirs(_ids()).logits).abs().max().item() <= TOL


def test_qwen3_moe_config_of_transformers_4_keeps_its_spelling(tmp_path):
    """Released Qwen3-MoE config.json files (transformers 4) say num_experts; transformers 5 writes
    num_local_experts. Either is read, and written back as it came."""
    _hf_checkpoint(tmp_path / "hf", "qwen3_moe", dict(num_experts=4, moe_intermediate_size=24))
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    d["num_experts"] = d.pop("num_local_experts")
    config = LlamaConfig.from_hf_dict(d)
    assert config.num_experts == 4 and config.to_hf_dict() == d


def test_active_parameters_count_the_experts_a_token_runs():
    config = LlamaConfig(**{**SMALL, "num_experts": 8, "model_type": "mixtral"})
    per_expert = 3 * config.hidden_size * config.intermediate_size
    assert config.num_parameters() - config.num_parameters(active=True) == 3 * 6 * per_expert  # 3 layers, 8 - 2


# -- routing --------------------------------------------------------------------------------------------
def test_capacity_keeps_each_experts_first_tokens_in_token_order():
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # 8 pairs, 4 experts: capacity 1 x 8 x 2 / 4 ... factor 1
    keep = within_capacity(chosen, num_experts=4, capacity_factor=1.0)  # ceil(1 x 4 x 2 / 4) = 2 per expert
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert within_capacity(chosen, 4, capacity_factor=4.0).all()


def test_dropless_block_equals_a_per_token_loop_and_capacity_drops_only_overflow():
    torch.manual_seed(0)
    block = SparseMoeBlock(16, 24, 4, MoeRouting(top_k=2, renormalize=True), ("w1", "w3", "w2")).eval()
    x = torch.randn(1, 10, 16)
    with torch.no_grad():
        y = block(x)[0]
        probs = torch.softmax(block.gate(x[0]), -1)
        for t in range(10):
            w, e = probs[t].topk(2)
            w = w / w.sum()
            expected = sum(w[j] * block.experts[int(e[j])](x[0, t]) for j in range(2))
            assert torch.allclose(y[t], expected, atol=1e-6)
        chosen = block.record.chosen
        keep = within_capacity(chosen, 4, 0.5)
        assert not keep.all()
        weights = torch.ones_like(chosen, dtype=torch.float32)
        dropped = run_experts(block.experts, x[0], chosen, weights, keep)
        for t in range(10):
            expected = sum((block.experts[int(chosen[t, j])](x[0, t]) for j in range(2) if keep[t, j]),
                           torch.zeros(16))
            assert torch.allclose(dropped[t], expected, atol=1e-6)


def test_router_losses_train_the_router_and_every_expert_gets_a_gradient():
    config = LlamaConfig(**{**SMALL, "num_experts": 8, "model_type": "mixtral", "router_z_loss_coef": 0.01})
    model = build_model(config, seed=0).train()
    ids = torch.randint(0, VOCAB, (1, 3))  # 3 tokens x 2 choices cannot reach all 8 experts
    _, loss = model(ids, labels=ids)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name  # unrouted experts: a zero gradient, not none
    router = model.model.layers["0"].block_sparse_moe.gate.weight
    assert router.grad.abs().sum() > 0
    logits = torch.randn(5, 8)
    assert torch.allclose(router_z_loss([RouterRecord(logits, logits.topk(2).indices)]),
                          torch.logsumexp(logits, -1).pow(2).mean())


def test_recompute_gives_the_same_loss_and_gradients():
    config = LlamaConfig(**{**SMALL, "num_experts": 4, "model_type": "olmoe"})
    ids = torch.randint(0, VOCAB, (2, 8))
    grads = []
    for recompute in (False, True):
        model = build_model(config, seed=0).train()
        model.gradient_checkpointing = recompute
        _, loss = model(ids, labels=ids)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))


# -- what is honoured, carried, refused ----------------------------------------------------------------
@pytest.mark.parametrize("family", list(CLASSES))
def test_every_transformers_config_field_is_sorted(family):
    fields = {f.name: f.default for f in dataclasses.fields(CLASSES[family])}
    known = set(HONOURED_KEYS[family]) | CARRIED_KEYS | set(REFUSED_KEYS) | set(MOE_CARRIED_KEYS[family])
    assert sorted(set(fields) - known) == []
    for key, default in FAMILY_DEFAULTS[family].items():
        if key in fields:
            assert default == fields[key], key


def _refused(tmp_path: Path, d: dict, *fragments: str) -> None:
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as info:
        load_config(tmp_path / "hf")
    for fragment in (str(tmp_path / "hf" / "config.json"), *fragments):
        assert fragment in str(info.value), (fragment, str(info.value))


def test_refuses_what_it_does_not_run(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "qwen2_moe", dict(num_experts=4, moe_intermediate_size=24))
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    _refused(tmp_path, {**d, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true",
             "qwen2_moe")
    _refused(tmp_path, {**d, "mlp_only_layers": [5]}, "mlp_only_layers=[5]", "0 .. 2")
    _refused(tmp_path, {**d, "num_experts_per_tok": 9}, "num_experts_per_tok=9")
    _refused(tmp_path, {**d, "moe_capacity_factor": 0}, "moe_capacity_factor=0")
    with pytest.raises(ValueError, match="num_experts.*exist only for model_type 'mixtral'"):
        LlamaConfig(**{**SMALL, "num_experts": 4})  # a dense family
    with pytest.raises(ValueError, match="OLMoE's q_norm spans hidden_size"):
        LlamaConfig(**{**SMALL, "num_experts": 4, "model_type": "olmoe", "head_dim": 16})


def test_training_flops_count_the_active_experts():
    from stages.training.flops import flops_per_token, matmul_weights

    config = LlamaConfig(**{**SMALL, "num_experts": 6, "model_type": "qwen2_moe", "moe_intermediate_size": 24,
                            "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2})
    model = build_model(config, seed=0)
    trained, frozen = matmul_weights(model)
    assert frozen == 0 and trained == flops_per_token(config, 16)["trained_matmul_params"]
    everything = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert everything - trained == 3 * 32 * 24 * (6 - 2)  # one sparse layer (of 3, step 2): 4 experts idle


def test_the_exported_graph_computes_every_expert_densely_and_the_same_output():
    """ONNX export traces `run_experts_densely` (no sort, no data-dependent shapes)."""
    from stages.model.moe import run_experts_densely

    torch.manual_seed(0)
    block = SparseMoeBlock(16, 24, 4, MoeRouting(top_k=2, renormalize=False), ("w1", "w3", "w2")).eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        chosen = torch.softmax(block.gate(x), -1).topk(2).indices
        weights = torch.rand(7, 2)
        keep = within_capacity(chosen, 4, 0.75)
        for k in (None, keep):
            torch.testing.assert_close(run_experts_densely(block.experts, x, chosen, weights, k),
                                       run_experts(block.experts, x, chosen, weights, k), rtol=0, atol=1e-6)


@pytest.mark.parametrize("section, fragment", [
    ({"pretrain": {"world_size": 2, "pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2}},
     "pipeline_parallel_degree=2 with the mixture of experts model_type='mixtral': the load-balancing loss"),
    ({"model": {"flavour": "moe-debug", "moe_capacity_factor": 1.25},
      "pretrain": {"world_size": 2, "context_parallel_degree": 2}},
     "context_parallel_degree=2 with moe_capacity_factor=1.25: an expert's capacity counts the tokens of one"),
    ({"model": {"flavour": "moe-debug", "moe_capacity_factor": 1.25}, "deploy": {"gguf": ["q8_0"]}},
     "model.moe_capacity_factor=1.25 drops tokens past an expert's capacity, which llama.cpp does not"),
    ({"deploy": {"compressed_tensors": ["a8w8"]}, "quantize": {"variants": ["a8w8"]}},
     "transformers 5.23 cannot load"),
])
def test_the_config_check_refuses_what_a_mixture_does_not_get(section, fragment):
    from stages.config import check_config
    from stages.errors import ConfigError

    experiment = {"model": {"flavour": "moe-debug"}, **section}  # a section's own model replaces it
    with pytest.raises(ConfigError, match="experiments.m.") as info:
        check_config({"experiments": {"m": experiment}})
    assert fragment in str(info.value)
    tp2 = {"model": {"flavour": "moe-debug"}, "pretrain": {"world_size": 2, "tensor_parallel_degree": 2}}
    check_config({"experiments": {"m": tp2}})  # attention split, experts replicated: accepted
    ep2 = {"model": {"flavour": "moe-debug"}, "pretrain": {"world_size": 2, "expert_parallel_degree": 2}}
    check_config({"experiments": {"m": ep2}})  # experts split over the two data ranks: accepted
    cp2 = {"model": {"flavour": "moe-debug"}, "pretrain": {"world_size": 2, "context_parallel_degree": 2}}
    check_config({"experiments": {"m": cp2}})  # each sequence's tokens over two ranks, dropless: accepted
    sp = {"model": {"flavour": "moe-debug"}, "pretrain": {"world_size": 2, "tensor_parallel_degree": 2,
                                                          "sequence_parallel": True}}
    check_config({"experiments": {"m": sp}})  # the sparse blocks gather the sequence: accepted
