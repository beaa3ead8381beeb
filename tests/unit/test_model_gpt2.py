"""GPT-2 on our model (config switches: learned positions, LayerNorm with bias, GELU MLP, biases, a
fused qkv projection, tied embeddings; stages.model.gpt2_layout) against transformers'
GPT2LMHeadModel, in both directions: checkpoints transformers saved, read by us; ours, read by
transformers. fp32, biases and norms randomised first (zeros and ones hide bugs)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from checkpoint_fixtures import randomize_biases_and_norms
from safetensors.torch import load_file, save_file

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_config, load_pretrained, save_pretrained
from stages.model import build_model, gpt2_layout
from stages.model.config import CARRIED_KEYS, LlamaConfig
from stages.parallel.pipeline import build_stage_module

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)


def _hf_checkpoint(path, **fields) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL, **fields)).eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    return model


def _ids(T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fields", [{}, {"activation_function": "gelu", "n_inner": 96, "tie_word_embeddings": False},
                                    {"activation_function": "relu", "layer_norm_epsilon": 1e-3}],
                         ids=["gpt2", "gelu-n-inner-untied", "relu-eps"])
def test_transformers_checkpoint_logits_loss_and_round_trip(tmp_path, fields):
    theirs = _hf_checkpoint(tmp_path / "hf", **fields)
    ours = load_pretrained(tmp_path / "hf", families="all").eval()
    ids = _ids()
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        logits, loss = ours(ids, labels=labels)
        want = theirs(ids, labels=labels)
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=1e-6, atol=1e-6)
    assert ours.config.tie_word_embeddings == fields.get("tie_word_embeddings", True)

    with atomic_dir(tmp_path / "ours") as out:
        save_pretrained(ours, out)
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written == source  # GPT2Config's own keys, n_inner null where it was, carried keys kept
    assert set(load_file(tmp_path / "ours" / "model.safetensors")) == \
        set(load_file(tmp_path / "hf" / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is transformers.GPT2LMHeadModel
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want.logits)


def test_our_random_init_gpt2_runs_in_transformers(tmp_path):
    config = LlamaConfig(model_type="gpt2", vocab_size=VOCAB, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         hidden_act="gelu_new", rms_norm_eps=1e-5, tie_word_embeddings=True)
    ours = build_model(config, seed=0).eval()
    randomize_biases_and_norms(ours)
    assert sum(p.numel() for p in ours.parameters()) == config.num_parameters()
    with atomic_dir(tmp_path / "m") as out:
        save_pretrained(ours, out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(theirs) is transformers.GPT2LMHeadModel
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), theirs(_ids()).logits, rtol=0, atol=1e-5)


def test_old_checkpoint_names_and_mask_buffers_are_read(tmp_path):
    """GPT-2 checkpoints of the original release name tensors without `transformer.` and carry the
    causal-mask buffers `h.<i>.attn.bias`; both are read (the buffers dropped)."""
    theirs = _hf_checkpoint(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    old["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ours = load_pretrained(tmp_path / "hf", families="all").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), theirs(_ids()).logits, rtol=0, atol=1e-5)


def test_packed_rows_and_pipeline_stages(tmp_path):
    """Two examples packed in one row (position ids restarting at 0) give each example's own
    logits; two stage modules chained equal the whole model."""
    _hf_checkpoint(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf", families="all").eval()
    a, b = _ids(10, seed=2)[:1], _ids(14, seed=3)[:1]
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with torch.no_grad():
        got = model(packed, position_ids=positions)
        torch.testing.assert_close(got[:, :10], model(a), rtol=0, atol=1e-5)
        torch.testing.assert_close(got[:, 10:], model(b), rtol=0, atol=1e-5)
        first = build_stage_module(model, [0], is_first=True, is_last=False).eval()
        last = build_stage_module(model, [1], is_first=False, is_last=True).eval()
        assert torch.equal(last(first(_ids())), model(_ids()))
    assert "model.embed_positions.weight" in dict(first.named_parameters())


def test_dropouts_act_in_training_only(tmp_path):
    _hf_checkpoint(tmp_path / "hf")  # GPT2Config's defaults: resid, embd and attn dropout 0.1
    model = load_pretrained(tmp_path / "hf", families="all")
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attention_dropout) == (0.1, 0.1, 0.1)
    with torch.no_grad():
        assert torch.equal(model.eval()(_ids()), model(_ids()))
        torch.manual_seed(0)
        assert not torch.equal(model.train()(_ids()), model.eval()(_ids()))


def test_refusals_name_the_key_and_gpt2_stays_on_transformers_in_the_chain(tmp_path):
    _hf_checkpoint(tmp_path / "hf")
    with pytest.raises(ValueError, match="GPT-2 .GPT2LMHeadModel. runs on transformers' model"):
        load_config(tmp_path / "hf")  # the chain's stages keep transformers' model for GPT-2 for now
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value in (("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
                       ("activation_function", "gelu_fast")):
        with pytest.raises(ValueError, match=f"{key if key != 'activation_function' else 'hidden_act'}="):
            LlamaConfig.from_hf_dict({**d, key: value}, source="x/config.json")


def test_every_gpt2_config_field_is_sorted():
    """A field a future transformers adds to GPT2Config fails here until it is sorted into
    honoured / carried / refused; the defaults of omitted keys are transformers' own."""
    fields = {f.name: f.default for f in dataclasses.fields(transformers.GPT2Config)}
    known = set(gpt2_layout.HONOURED) | set(gpt2_layout.CARRIED) | set(gpt2_layout.REFUSED) | CARRIED_KEYS
    assert sorted(set(fields) - known) == []
    for key, default in {**gpt2_layout.DEFAULTS, **gpt2_layout.TOKEN_DEFAULTS}.items():
        assert fields[key] == default, key
