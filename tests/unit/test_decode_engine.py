"""stages/inference/engine.py (and its cache, stages/inference/kv_cache.py): greedy tokens equal
transformers' `generate` (the path evaluate and predict took before the engine) token for token,
for every family the chain fine-tunes on, OPT, Bloom and GPT-NeoX included (tiny random checkpoints saved by transformers,
checkpoint_fixtures.save_checkpoint) and every kind of torch variant load_variant gives (full,
LoRA and prefix adapters, wint8 / wint4 on stages.quant's kernels), at batch 1 and on a
left-padded batch of prompts of different lengths; then eos, stop strings, per-row budgets,
`on_token`, a sliding window shorter than the cache, and seeded sampling against `generate`'s;
prompt-lookup speculative decoding gives the greedy tokens with fewer forwards."""

from __future__ import annotations

import peft
import pytest
import torch
from checkpoint_fixtures import save_checkpoint, variant_dirs
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from stages.inference.engine import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeEngine,
    Sampling,
    unsupported,
)
from stages.inference.generation import cut_at_eos, left_padded
from stages.inference.kv_cache import PreallocatedCache
from stages.inference.loading import load_variant
from stages.inference.prompt_lookup import PromptLookup

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "glm", "glm4", "gpt2", "opt", "bloom", "gpt_neox")
# Families the chain fine-tunes on transformers' own model (tiny: width 64, 2 layers, 4 heads)
TRANSFORMERS_ONLY = {
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=256),
    # at the default initializer_range (0.02) the tiny Bloom repeats the prompt's last token with or
    # without an adapter, and the check that an adapter changes the tokens could not hold
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.3),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256),
}
KINDS = ("full", "lora", "prefix", "wint8", "wint4")
NEW_TOKENS = 10
EOS, PAD = 2, 0


def _prompts(vocab: int = 300) -> list[list[int]]:
    """Four prompts of different lengths (the batch is left-padded), ids that are neither pad nor eos."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 11, 2, 8)]


@torch.no_grad()
def _generate(model, prompts, max_new_tokens=NEW_TOKENS, eos=EOS, **decode) -> list[list[int]]:
    """The old path: one `generate` call on the left-padded batch, each row cut after its eos."""
    ids, mask = left_padded(prompts, PAD)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, num_beams=1,
                         eos_token_id=eos, pad_token_id=PAD, **({"do_sample": False} | decode))
    return [cut_at_eos(out[r, ids.shape[1]:].tolist(), eos) for r in range(len(prompts))]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer):
    """`get(family, kind)` -> directory, built on first use (checkpoint_fixtures.variant_dirs)."""
    return variant_dirs(tmp_path_factory.mktemp("engine"), tokenizer, per_family=TRANSFORMERS_ONLY)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate(family_dirs, family, kind):
    model, _, _ = load_variant(family_dirs(family, kind))
    engine = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = _prompts()
    for batch in ([prompts[1]], prompts):
        expected = _generate(model, batch)
        got = engine.generate(batch, NEW_TOKENS)
        assert [d.tokens for d in got] == expected, f"{family} {kind}, batch of {len(batch)}"
        assert all(d.finish_reason == (FINISH_EOS if d.tokens[-1] == EOS else FINISH_LENGTH) for d in got)
    assert sum(len(t) for t in expected) > len(prompts)  # not every row ends at once: the steps were compared
    if kind in ("lora", "prefix"):  # the adapter is in the path: the base alone answers otherwise
        base, _, _ = load_variant(family_dirs(family, "full"))
        assert _generate(base, prompts) != expected


def test_one_prefill_then_one_step_per_token(family_dirs):
    model, _, _ = load_variant(family_dirs("llama", "full"))
    engine = DecodeEngine(model, eos_token_id=None, pad_token_id=PAD)
    rows = engine.generate(_prompts(), NEW_TOKENS)
    assert [len(r.tokens) for r in rows] == [NEW_TOKENS] * 4
    assert engine.forward_calls == NEW_TOKENS  # the prefill gives the first token, each step one more
    cache = engine._cache
    engine.generate(_prompts()[::-1], NEW_TOKENS - 2)  # same batch size, shorter: the buffers are reused
    assert engine._cache is cache


def test_eos_ends_a_row_and_is_kept(family_dirs):
    model, _, _ = load_variant(family_dirs("qwen2", "full"))
    prompts = _prompts()
    free = DecodeEngine(model, eos_token_id=None, pad_token_id=PAD).generate(prompts, NEW_TOKENS)
    eos = free[0].tokens[3]  # a token row 0 generates: as eos, it must end row 0 there
    got = DecodeEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(prompts, NEW_TOKENS)
    assert got[0].tokens == free[0].tokens[:free[0].tokens.index(eos) + 1] and got[0].finish_reason == FINISH_EOS
    assert [d.tokens for d in got] == _generate(model, prompts, eos=eos)


def test_per_row_budgets_and_stop_strings(family_dirs, tokenizer):
    model, _, _ = load_variant(family_dirs("gpt2", "full"))
    engine = DecodeEngine(model, eos_token_id=None, pad_token_id=PAD)
    prompts = _prompts()
    free = [d.tokens for d in engine.generate(prompts, NEW_TOKENS)]
    budgets = [1, 5, 0, 3]
    rows = engine.generate(prompts, budgets)
    assert [d.tokens for d in rows] == [f[:b] for f, b in zip(free, budgets)]
    assert all(d.finish_reason == FINISH_LENGTH for d in rows)

    stop = tokenizer.decode(free[1][4:6])  # text row 1 produces at its 5th and 6th tokens
    rows = engine.generate(prompts, NEW_TOKENS, stop_strings=[stop], tokenizer=tokenizer)
    ends = [next((n for n in range(1, NEW_TOKENS + 1) if stop in tokenizer.decode(f[:n])), NEW_TOKENS) for f in free]
    assert ends[1] <= 6
    assert [d.tokens for d in rows] == [f[:n] for f, n in zip(free, ends)]
    assert rows[1].finish_reason == FINISH_STOP

    seen = []
    rows = engine.generate(prompts, NEW_TOKENS, on_token=lambda r, t: seen.append((r, t)) or r == 2)
    assert rows[2].tokens == free[2][:1] and rows[2].finish_reason == FINISH_STOP
    assert [d.tokens for d in rows][:2] == free[:2] and sorted(seen) == sorted(
        [(r, t) for r, f in enumerate(free) for t in (f[:1] if r == 2 else f)])


def test_a_sliding_window_shorter_than_the_cache_takes_the_dynamic_cache(tmp_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(
        save_checkpoint(tmp_path / "mistral", tokenizer, "mistral", sliding_window=6), dtype=torch.float32).eval()
    engine = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = _prompts()
    assert [d.tokens for d in engine.generate(prompts, NEW_TOKENS)] == _generate(model, prompts)
    assert engine._cache is None  # the window slides within prompt + new tokens: no preallocated cache


@pytest.mark.parametrize("kind", ["full", "prefix"])
def test_seeded_sampling_is_generates(family_dirs, kind):
    """With a generator seeded as torch.manual_seed seeds the global one, the engine's draws are
    generate's; the same seed repeats, another one differs."""
    model, _, _ = load_variant(family_dirs("llama", kind))
    engine = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = _prompts()
    for sampling in (Sampling(seed=3), Sampling(temperature=0.7, top_k=50, top_p=0.9, seed=4)):
        torch.manual_seed(sampling.seed)
        expected = _generate(model, prompts, do_sample=True, temperature=sampling.temperature,
                             top_k=sampling.top_k, top_p=sampling.top_p)
        got = [d.tokens for d in engine.generate(prompts, NEW_TOKENS, sampling=sampling)]
        assert got == expected
        assert [d.tokens for d in engine.generate(prompts, NEW_TOKENS, sampling=sampling)] == got
    other = engine.generate(prompts, NEW_TOKENS, sampling=Sampling(seed=5))
    assert [d.tokens for d in other] != got
    # top_k=1 keeps the most likely token only: sampling becomes greedy
    assert ([d.tokens for d in engine.generate(prompts, NEW_TOKENS, sampling=Sampling(top_k=1, seed=6))]
            == [d.tokens for d in engine.generate(prompts, NEW_TOKENS)])


def test_what_the_engine_does_not_run(family_dirs):
    class NotTorch:
        pass

    assert "not a torch model" in unsupported(NotTorch())
    model, _, _ = load_variant(family_dirs("llama", "full"))
    prompt_tuning = peft.get_peft_model(model, peft.PromptTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM"))
    assert "PROMPT_TUNING" in unsupported(prompt_tuning)
    with pytest.raises(ValueError, match="cannot run"):
        DecodeEngine(prompt_tuning, eos_token_id=EOS, pad_token_id=PAD)


@pytest.mark.slow  # torch.compile: about 20 s per batch shape on 2 cores
@pytest.mark.parametrize("kind", ["full", "prefix"])
def test_a_compiled_decode_step_gives_the_same_tokens(family_dirs, kind):
    """compile=True: the decode step through torch.compile on a StaticCache; its tokens equal
    generate's here too (inductor's fused sums differ in the last bits, which can flip a near tie
    on other weights: the compiled engine is an option, not what evaluate and predict run)."""
    model, _, _ = load_variant(family_dirs("llama", kind))
    engine = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD, compile=True)
    prompts = _prompts()
    for batch in ([prompts[1]], prompts):
        assert [d.tokens for d in engine.generate(batch, NEW_TOKENS)] == _generate(model, batch)


def test_a_generation_config_asking_for_a_processor_keeps_generate(family_dirs):
    """A checkpoint whose generation_config.json sets e.g. repetition_penalty: generate applies it,
    the engine would not; generate_greedy keeps generate's answers for it."""
    from stages.inference.generation import generate_greedy

    model, _, _ = load_variant(family_dirs("llama", "full"))
    plain = generate_greedy(model, _prompts(), max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                            batch_size=4)
    model.generation_config.repetition_penalty = 3.0
    assert "repetition_penalty=3.0" in unsupported(model)
    expected = [_generate(model, [p])[0] for p in _prompts()]
    assert expected != plain  # the penalty changes the answers: the test sees which path ran
    assert generate_greedy(model, _prompts(), max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                           batch_size=4) == expected


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_match():
    lookup = PromptLookup(max_ngram=2, num_draft_tokens=3)
    assert lookup.draft([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]) == [5, 6, 1]  # (2, 3) last seen before 5
    assert lookup.draft([7, 3, 8, 9, 3]) == [8, 9, 3]  # no (9, 3) earlier: the 1-gram 3
    assert lookup.draft([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], limit=1) == [5]
    assert lookup.draft([4, 5, 6]) == [] and lookup.draft([4]) == [] and lookup.draft([4, 4], limit=0) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        PromptLookup(num_draft_tokens=0)


def test_the_preallocated_cache_forgets_its_last_positions():
    cache = PreallocatedCache(num_layers=1, capacity=8)
    keys = torch.arange(5.0).view(1, 1, 5, 1)
    cache.update(keys, keys, 0)
    cache.crop(-2)
    assert cache.get_seq_length() == 3 and cache.layers[0].keys.flatten().tolist() == [0.0, 1.0, 2.0]
    cache.crop(0)
    keys, _ = cache.update(torch.full((1, 1, 2, 1), 7.0), torch.full((1, 1, 2, 1), 7.0), 0)
    assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 7.0, 7.0]
    with pytest.raises(ValueError, match="minus the number"):
        cache.crop(1)


@pytest.mark.parametrize("kind", ["full", "lora", "prefix", "wint4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_prompt_lookup_gives_the_greedy_tokens_in_fewer_forwards(family_dirs, family, kind):
    """Each prompt alone, 32 new tokens: the tokens equal generate's greedy ones and transformers' own prompt
    lookup's; the tiny random models repeat themselves, so drafts are taken and the forwards are fewer."""
    model, _, _ = load_variant(family_dirs(family, kind))
    plain = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    engine = DecodeEngine(model, eos_token_id=EOS, pad_token_id=PAD, prompt_lookup=PromptLookup())
    tokens = 0
    for prompt in _prompts():
        expected = _generate(model, [prompt], max_new_tokens=32)
        assert [d.tokens for d in engine.generate([prompt], 32)] == expected, (family, kind, prompt)
        assert [d.tokens for d in plain.generate([prompt], 32)] == expected
        if kind != "prefix":  # transformers' prompt lookup does not take a peft prefix
            assert _generate(model, [prompt], max_new_tokens=32, prompt_lookup_num_tokens=10) == expected
        tokens += len(expected[0])
    assert engine.accepted_tokens > 0 and engine.forward_calls < plain.forward_calls == tokens, (
        engine.accepted_tokens, engine.forward_calls, plain.forward_calls)


def test_prompt_lookup_keeps_eos_budgets_stop_strings_and_batches(family_dirs, tokenizer):
    model, _, _ = load_variant(family_dirs("llama", "full"))
    plain = DecodeEngine(model, eos_token_id=None, pad_token_id=PAD)
    engine = DecodeEngine(model, eos_token_id=None, pad_token_id=PAD, prompt_lookup=PromptLookup(num_draft_tokens=4))
    prompt = _prompts()[1]
    free = plain.generate([prompt], 40)[0].tokens
    for budget in (1, 2, 7, 40):
        assert engine.generate([prompt], budget)[0].tokens == free[:budget]
    eos = free[9]
    with_eos = DecodeEngine(model, eos_token_id=eos, pad_token_id=PAD, prompt_lookup=PromptLookup())
    row = with_eos.generate([prompt], 40)[0]
    assert row.tokens == free[:free.index(eos) + 1] and row.finish_reason == FINISH_EOS
    stop = tokenizer.decode(free[12:14])
    row = engine.generate([prompt], 40, stop_strings=[stop], tokenizer=tokenizer)[0]
    end = next(n for n in range(1, 41) if stop in tokenizer.decode(free[:n]))
    assert row.tokens == free[:end] and row.finish_reason == FINISH_STOP
    # a batch of several prompts decodes step by step (drafts are for a lone row)
    assert [d.tokens for d in engine.generate(_prompts(), 12)] == [d.tokens for d in plain.generate(_prompts(), 12)]
    with pytest.raises(ValueError, match="choose one of compile and prompt_lookup"):
        DecodeEngine(model, eos_token_id=None, pad_token_id=PAD, compile=True, prompt_lookup=PromptLookup())
