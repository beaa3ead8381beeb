"""Our Llama runs what a transformers config.json says, for the llama, qwen2, qwen3, mistral, glm and
glm4 families.

Each parity case builds a tiny random-init model with the installed transformers (5.23), saves it
(the transformers-5 layout: `rope_parameters`), optionally rewrites config.json to the
transformers-4 layout (top-level `rope_theta` + `rope_scaling`; Qwen2 without `layer_types`) and
checks that transformers still reads it the same, loads it with `stages.checkpoint.hf.load_pretrained`
and compares logits in fp32 on a short sequence (shorter than every window and max position) and a
long one (longer than both: sliding windows and dynamic NTK act). Biases and norm weights are
randomized first: zero biases and unit norms hide bugs. Every case then saves our model back and
checks that config.json comes back field for field, and that transformers builds the same class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from checkpoint_fixtures import randomize_biases_and_norms

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_config, load_pretrained, save_pretrained
from stages.model.config import CARRIED_KEYS, FAMILY_DEFAULTS, HONOURED_KEYS, REFUSED_KEYS, LlamaConfig
from stages.parallel.pipeline import build_stage_module

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
           "qwen3": transformers.Qwen3Config, "glm": transformers.GlmConfig, "glm4": transformers.Glm4Config}
LENGTHS = (6, 40)  # below every window / max position of the cases, and above them
TOL = 1e-5

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
CASES = {  # id -> (family, transformers config fields)
    "llama-theta": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen2-theta": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-theta": ("mistral", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                      sliding_window=None)),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})),
    "llama-dynamic": ("llama", dict(max_position_embeddings=16,
                                    rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0})),
    "qwen2-dynamic": ("qwen2", dict(max_position_embeddings=24,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})),
    # theta 1e4, hd 16, original 64: wavelengths 6, 20, 63, 199 cover the high, medium and low bands
    "llama-llama3": ("llama", dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "llama-yarn": ("llama", dict(max_position_embeddings=32, rope_parameters=YARN)),
    "llama-yarn-mscale": ("llama", dict(max_position_embeddings=32, rope_parameters={
        **YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "truncate": False})),
    "qwen2-yarn-attention-factor": ("qwen2", dict(max_position_embeddings=32, rope_parameters={
        **YARN, "attention_factor": 1.3})),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "mistral-head-dim": ("mistral", dict(head_dim=8, sliding_window=None)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict()),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral-window-yarn": ("mistral", dict(sliding_window=8, max_position_embeddings=32, rope_parameters=YARN)),
    "qwen3": ("qwen3", dict()),
    "qwen3-bias-tied": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True, head_dim=32)),
    "qwen3-window": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "glm": ("glm", dict(pad_token_id=0, eos_token_id=[1, 2])),
    "glm-no-bias-yarn": ("glm", dict(attention_bias=False, max_position_embeddings=32, pad_token_id=0,
                                     eos_token_id=2, rope_parameters={**YARN, "partial_rotary_factor": 0.5})),
    "glm4": ("glm4", dict(pad_token_id=0, eos_token_id=[1, 2])),
    "glm4-quarter-rotary": ("glm4", dict(head_dim=32, pad_token_id=0, eos_token_id=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.25})),
}
# transformers 5 saves layer_types; these cases also set them against what max_window_layers says
LAYER_TYPE_CASES = {
    "qwen2-layer-types": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=28,
                                        layer_types=["sliding_attention", "full_attention"])),
}


def _as_transformers4(config_path: Path) -> None:
    """Rewrite a transformers-5 config.json in the layout transformers 4 wrote."""
    d = json.loads(config_path.read_text())
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:  # GLM: transformers 4 read it at the top level
        d["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    d["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.46.3"
    if d["model_type"] in ("qwen2", "qwen3"):
        d.pop("layer_types")  # transformers 4 derived them from use_sliding_window / max_window_layers
    config_path.write_text(json.dumps(d, indent=2))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _probes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, t), generator=g) for t in LENGTHS]


def _hf_checkpoint(path: Path, family: str, fields: dict, layout: str) -> transformers.PreTrainedModel:
    """Save a random-init transformers model of `family` to `path` in `layout` ("v5"/"v4") and
    return it as transformers reads it back from there (checked equal to the saved model)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CLASSES[family](**SMALL, **fields)).float().eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    if layout == "v4":
        _as_transformers4(path / "config.json")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for ids in _probes():  # transformers reads the rewritten layout as the same model
        assert torch.equal(_logits(theirs, ids), _logits(model, ids))
    return theirs


def _check_parity_and_round_trip(tmp_path: Path, family: str, fields: dict, layout: str) -> float:
    theirs = _hf_checkpoint(tmp_path / "hf", family, fields, layout)
    ours = load_pretrained(tmp_path / "hf").eval()
    diff = max((_logits(ours, ids) - _logits(theirs, ids)).abs().max().item() for ids in _probes())
    assert diff <= TOL, diff

    with atomic_dir(tmp_path / "ours") as out:
        save_pretrained(ours, out)
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written == source  # same keys, values and RoPE layout
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again) is type(theirs)
    for ids in _probes():
        assert torch.equal(_logits(again, ids), _logits(theirs, ids))
    return diff


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("case", list(CASES))
def test_transformers_checkpoint_logits_and_round_trip(tmp_path, case, layout):
    family, fields = CASES[case]
    diff = _check_parity_and_round_trip(tmp_path, family, fields, layout)
    print(f"{case} [{layout}]: max |logit diff| = {diff:.2e}")


@pytest.mark.parametrize("case", list(LAYER_TYPE_CASES))
def test_qwen2_layer_types_are_honoured_per_layer(tmp_path, case):
    family, fields = LAYER_TYPE_CASES[case]
    diff = _check_parity_and_round_trip(tmp_path, family, fields, "v5")
    print(f"{case} [v5]: max |logit diff| = {diff:.2e}")
    assert load_config(tmp_path / "hf").layer_windows() == [8, None]


def test_sliding_window_masks_only_long_sequences(tmp_path):
    """A window shorter than the sequence changes the logits; SDPA's causal path serves short ones."""
    _hf_checkpoint(tmp_path / "hf", "mistral", dict(sliding_window=8), "v5")
    windowed = load_pretrained(tmp_path / "hf").eval()
    full = load_pretrained(tmp_path / "hf").eval()
    for layer in full.model.layers.values():
        layer.self_attn.sliding_window = None
    short, long = _probes()
    assert torch.equal(_logits(windowed, short), _logits(full, short))
    assert (_logits(windowed, long) - _logits(full, long)).abs().max() > 1e-3


def test_attention_dropout_acts_in_training_only(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "llama", dict(attention_dropout=0.5), "v5")
    ours = load_pretrained(tmp_path / "hf")
    ids = _probes()[1]
    ours.eval()
    assert torch.equal(_logits(ours, ids), _logits(ours, ids))
    ours.train()
    torch.manual_seed(3)
    assert not torch.equal(_logits(ours, ids), _logits(ours.eval(), ids))


@pytest.mark.parametrize("case", ["llama-dynamic", "mistral-window-yarn", "qwen2-window", "llama-bias"])
def test_pipeline_stages_compute_what_the_model_computes(tmp_path, case):
    """Two stage modules (layers 0 and 1) chained by hand equal the whole model: the stages call
    the model's own RoPE and layers, so dynamic NTK, YaRN's factor and windows hold there too."""
    family, fields = CASES[case]
    _hf_checkpoint(tmp_path / "hf", family, fields, "v5")
    model = load_pretrained(tmp_path / "hf").eval()
    first = build_stage_module(model, [0], is_first=True, is_last=False)
    last = build_stage_module(model, [1], is_first=False, is_last=True)
    for ids in _probes():
        with torch.no_grad():
            assert torch.equal(last(first(ids)), model(ids))


# -- what is honoured, carried, refused --------------------------------------------------------
@pytest.mark.parametrize("family", list(CLASSES))
def test_every_transformers_config_field_is_sorted(family):
    """A field a future transformers adds to these config classes fails here until it is sorted
    into honoured / carried / refused; the defaults of omitted keys are transformers' own."""
    fields = {f.name: f.default for f in dataclasses.fields(CLASSES[family])}
    known = set(HONOURED_KEYS[family]) | CARRIED_KEYS | set(REFUSED_KEYS)
    assert sorted(set(fields) - known) == []
    for key, default in FAMILY_DEFAULTS[family].items():
        if key in fields:
            assert default == fields[key], key


def _saved_config(tmp_path: Path, family: str, **fields) -> dict:
    _hf_checkpoint(tmp_path / "hf", family, fields, "v5")
    return json.loads((tmp_path / "hf" / "config.json").read_text())


def _refused(tmp_path: Path, d: dict, *fragments: str) -> None:
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as info:
        load_config(tmp_path / "hf")
    message = str(info.value)
    for fragment in (str(tmp_path / "hf" / "config.json"), *fragments):
        assert fragment in message, (fragment, message)


def test_refuses_unsupported_activation(tmp_path):
    d = _saved_config(tmp_path, "llama")
    _refused(tmp_path, {**d, "hidden_act": "gelu"}, "hidden_act='gelu'", "silu")


def test_refuses_unsupported_rope_types(tmp_path):
    d = _saved_config(tmp_path, "llama")
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64}
    _refused(tmp_path, {**d, "rope_parameters": longrope}, "rope_parameters.rope_type='longrope'",
             "default, linear, dynamic, llama3, yarn")
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    _refused(tmp_path, {**legacy, "rope_theta": 1e4, "rope_scaling": {"type": "su", "factor": 2.0}},
             "rope_scaling.rope_type='su'")
    _refused(tmp_path, {**d, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
             "rope_parameters with rope_type='linear' lacks ['factor']")


def test_refuses_unknown_model_type_listing_the_supported_ones(tmp_path):
    d = _saved_config(tmp_path, "llama")
    _refused(tmp_path, {**d, "model_type": "gemma2"}, "model_type='gemma2'", "llama, qwen2, mistral")


def test_refuses_what_changes_the_maths(tmp_path):
    d = _saved_config(tmp_path, "llama")
    _refused(tmp_path, {**d, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5")
    _refused(tmp_path, {**d, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.5}},
             "rope_parameters.partial_rotary_factor=0.5")
    _refused(tmp_path, {**d, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config=",
             "load_quantized")
    _refused(tmp_path, {**d, "is_causal": False}, "is_causal=False")
    _refused(tmp_path, {**d, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
             "both rope_parameters=", "rope_scaling=")
    _refused(tmp_path, {**d, "attention_dropout": 1.5}, "attention_dropout=1.5")


def test_refuses_windows_transformers_would_not_run(tmp_path):
    d = _saved_config(tmp_path, "qwen2")  # use_sliding_window false, so sliding_window null
    _refused(tmp_path, {**d, "layer_types": ["sliding_attention", "full_attention"]},
             "layer_types has sliding_attention layers but use_sliding_window=False")
    _refused(tmp_path, {**d, "layer_types": ["full_attention"]}, "num_hidden_layers=2")
    d = _saved_config(tmp_path, "mistral", sliding_window=8)
    _refused(tmp_path, {**d, "layer_types": ["full_attention", "sliding_attention"]},
             "layer_types=['full_attention', 'sliding_attention'] with model_type='mistral'", "qwen2")


def test_carries_bookkeeping_and_unknown_keys(tmp_path, caplog):
    d = _saved_config(tmp_path, "llama")
    d.update(use_cache=False, pretraining_tp=2, custom_note="kept", sliding_window=16)  # Llama ignores the last two
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING, logger="stages.model.config"):
        config = load_config(tmp_path / "hf")
    assert "custom_note" in caplog.text and "sliding_window" in caplog.text and "use_cache" not in caplog.text
    assert config.layer_windows() == [None, None]  # transformers' Llama has no sliding window either
    assert config.to_hf_dict() == d


def test_our_own_configs_name_their_class_and_layout():
    for model_type, arch in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                             ("mistral", "MistralForCausalLM")):
        d = LlamaConfig(**SMALL, model_type=model_type).to_hf_dict()
        assert d["architectures"] == [arch] and d["rope_theta"] == 10000.0 and "rope_parameters" not in d
        assert LlamaConfig.from_hf_dict(d).to_hf_dict() == d
    with pytest.raises(ValueError, match="sliding_window.*exist only for model_type 'qwen2' / 'qwen3' / 'mistral', "
                                         "not 'llama'"):
        LlamaConfig(**SMALL, sliding_window=8)
    with pytest.raises(ValueError, match="mlp_bias.*not 'qwen2'"):
        LlamaConfig(**SMALL, model_type="qwen2", mlp_bias=True)
