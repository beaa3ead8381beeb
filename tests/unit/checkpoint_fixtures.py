"""Small "published" checkpoints for the tests: random-init models saved by the installed
transformers (not by our code), with a tokenizer that may carry a ChatML chat template, as a user's
downloaded Llama/Qwen2/SmolLM directory would."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Words the unit tests' toy data is made of, so that they become single tokens.
_CORPUS = [
    "the colour of the apple is red", "the colour of the sky is blue", "the colour of grass is green",
    "a banana is yellow and a plum is purple", "snow is white, coal is black, an orange is orange",
    "what colour is it? question answer: one two three four five six seven eight nine ten",
    "def main(argv): return 0  # Python code, numbers 0123456789",
]


def save_tiny_tokenizer(out: Path) -> Path:
    """A byte-level BPE PreTrainedTokenizerFast (~300 tokens) saved in `out`: `<pad>`=0, `<s>`=1
    (bos), `</s>`=2 (eos), as docs/artifacts.md specifies for data/tokenizer/."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (0, 1, 2)
    fast.save_pretrained(out)
    return out


def save_prepared_tokenizer(out: Path) -> Path:
    """`save_tiny_tokenizer` as the prepare stage writes its own tokenizer: encoding with special
    tokens puts `<s>` in front (`stages.data.tokenizer.bos_post_processor`, `add_bos_token: true`)."""
    import json

    from stages.data.tokenizer import bos_post_processor

    save_tiny_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = bos_post_processor()
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "add_eos_token": False}))
    return out


# ChatML, as SmolLM2 / Qwen2 ship it (without their default system prompt).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_tokenizer(tokenizer_dir: Path, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """The test BPE with ChatML's two special tokens added; eos is `<|im_end|>` (the end of an
    assistant turn, where generation stops), pad `<pad>`, no bos, as in SmolLM2-Instruct."""
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.bos_token = None
    if chat_template:
        tok.chat_template = CHATML
    return tok


def save_checkpoint(out: Path, tokenizer, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random-init `model_type` causal LM (tiny: hidden 64, 2 layers, Mixtral, Qwen2-MoE and OLMoE 4 experts
    of which 2 run; Qwen3, GLM and GLM-4 4 layers of 4 heads of 16 dimensions, 2 KV heads) saved with
    `tokenizer` by transformers' own save_pretrained; returns `out`. The special token ids are the
    tokenizer's (GLM's config class defaults to ids outside a small vocabulary)."""
    torch.manual_seed(seed)
    vocab = len(tokenizer) + 3  # a few padding rows, as real checkpoints often have
    common = dict(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if model_type in ("llama", "qwen2", "mistral", "mixtral"):
        common.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rope_theta=100000.0)
    if model_type == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2)
    elif model_type in ("qwen2_moe", "olmoe"):  # 4 experts, top 2; OLMoE's k norm spans every head (no GQA)
        common.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2 if model_type == "qwen2_moe" else 4, max_position_embeddings=256,
                      rope_theta=100000.0, num_experts=4, num_experts_per_tok=2)
        if model_type == "qwen2_moe":
            common.update(moe_intermediate_size=64, shared_expert_intermediate_size=128)
    elif model_type == "qwen3_moe":  # experts of transformers' default width, which its GGUF loader assumes
        common.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)
    elif model_type in ("qwen3", "glm", "glm4"):  # head_dim is their own argument (GLM's default is 128)
        common.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    elif model_type == "gpt2":
        common.update(n_embd=64, n_layer=2, n_head=4, n_positions=256)
    config = transformers.AutoConfig.for_model(model_type, **{**common, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sharpen_and_perturb(out: Path, router_suffix: str | None = None) -> Path:
    """Routers scaled up so that each token's choice of experts is clear-cut (random init leaves router
    logits within ~1e-2 of each other); biases, norms and the shared expert's gate made non-trivial
    (zero biases and unit norms would hide a bias or norm written wrong)."""
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in list(state):
        if router_suffix is not None and name.endswith(router_suffix):
            state[name] = state[name] * 50
        elif name.endswith("bias") or name.endswith("shared_expert_gate.weight"):
            state[name] = torch.randn(state[name].shape, generator=gen) * 0.5
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            state[name] = 1.0 + 0.2 * torch.randn(state[name].shape, generator=gen)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def randomize_biases_and_norms(model: torch.nn.Module, seed: int = 7) -> None:
    """Seeded non-zero biases and non-unit norm weights (RMSNorm / LayerNorm, GPT-2's ln_*): zero
    biases and unit norms, as a fresh model has them, would hide a bias or norm bug."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def save_adapter(base_dir: Path, out: Path, peft_config) -> Path:
    """A peft adapter of `base_dir` (seed 0) saved as finetune saves one: adapter files, the
    tokenizer, meta.json naming its base."""
    import peft

    from stages.checkpoint.atomic import atomic_dir
    from stages.checkpoint.hf import copy_tokenizer
    from stages.checkpoint.meta import write_meta

    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                peft_config)
    with atomic_dir(out) as d:
        model.save_pretrained(d)
        copy_tokenizer(base_dir, d)
        write_meta(d, stage="finetune", config={}, parent=base_dir, seed=0, metrics={})
    return out


def variant_dirs(root: Path, tokenizer, **config):
    """`get(family, kind)`: the directory of a tiny `family` checkpoint (save_checkpoint with
    `config`, plus the family's entry of a `per_family` dict if given) as `kind`, one of full, lora
    (B != 0: the adapter changes the outputs), prefix, wint8, wint4 (group 32); built on first use
    under `root`, the full model shared by its variants."""
    import peft

    from stages import quantize

    per_family = config.pop("per_family", {})
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, kind: str) -> Path:
        if (family, kind) in built:
            return built[family, kind]
        base = built.get((family, "full")) or save_checkpoint(root / family / "full", tokenizer, family,
                                                              **{**config, **per_family.get(family, {})})
        built[family, "full"] = base
        out = root / family / kind
        if kind == "lora":
            save_adapter(base, out, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                    init_lora_weights=False, task_type="CAUSAL_LM"))
        elif kind == "prefix":
            save_adapter(base, out, peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
        elif kind in ("wint8", "wint4"):
            quantize.run(base, out, kind, 32)
        built[family, kind] = base if kind == "full" else out
        return built[family, kind]

    return get
