"""stages/metrics/preference.py: the summed answer log-probs of each side equal a by-hand computation
(one unpadded forward per sequence, only the answer's tokens and its end marker), in the plain and
the chat format and across batches that split pairs; and a model trained towards the chosen answers
ranks every pair right, the same pairs swapped every pair wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from stages.data.preference import PreferenceRecord
from stages.metrics.preference import encode_pair, pair_logps, preference_metrics, row_logps

PAIRS = [
    PreferenceRecord(["the colour of the apple is"], [], "red", "blue"),
    PreferenceRecord(["what colour is the sky?"], [], "the sky is blue", "green"),
    PreferenceRecord(["a banana is"], [], "yellow", "purple and black"),
    PreferenceRecord(["question: one two"], [], "three", "ten"),
    PreferenceRecord(["snow is"], [], "white", "black, coal is white"),
]


def _hand_logp(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """log p(answer | prompt) from one unpadded forward: the sum over the answer's positions only."""
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # (T, V)
    start = len(prompt_ids)
    return sum(float(logp[t - 1, ids[0, t]]) for t in range(start, ids.shape[1]))


@pytest.fixture(scope="module")
def plain(debug_model_dir):
    model = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(debug_model_dir)


def test_plain_format_logps_are_the_answers_alone(plain):
    model, tok = plain
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chosen, rejected = pair_logps(model, tok, PAIRS, src_length=32, max_length=64, chat=False, pad_token_id=0,
                                  batch_size=3)  # 10 rows in batches of 3: pairs split across batches
    for i, r in enumerate(PAIRS):
        prompt = [tok.bos_token_id] + ids(r.src[0])
        assert float(chosen[i]) == pytest.approx(_hand_logp(model, prompt, ids(r.chosen) + [tok.eos_token_id]),
                                                 abs=1e-4)
        assert float(rejected[i]) == pytest.approx(_hand_logp(model, prompt, ids(r.rejected) + [tok.eos_token_id]),
                                                   abs=1e-4)
    metrics = preference_metrics(model, tok, PAIRS, 32, 64, False, 0, batch_size=4)
    margin = (chosen - rejected).tolist()
    assert metrics["preference_pairs"] == 5
    assert metrics["preference_margin"] == pytest.approx(sum(margin) / 5, abs=1e-9)
    assert metrics["preference_accuracy"] == pytest.approx(sum(m > 0 for m in margin) / 5)


def test_chat_format_and_earlier_rounds(tmp_path, tiny_tokenizer_dir):
    """ChatML: each side scores its answer with the end-of-turn marker; with two rounds the first
    answer is scored on both sides alike, so the margin is the last answers' alone."""
    from checkpoint_fixtures import chat_tokenizer, save_checkpoint

    tok = chat_tokenizer(tiny_tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(save_checkpoint(tmp_path / "m", tok), dtype=torch.float32).eval()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    one = PreferenceRecord(["the colour of the apple is"], [], "red", "blue", system="be brief")
    two = PreferenceRecord(["a banana is", "and a plum?"], ["yellow"], "purple", "white")
    chosen, rejected = pair_logps(model, tok, [one, two], 48, 96, True, tok.pad_token_id, batch_size=2)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": one.src[0]}]
    prompt = ids(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert float(chosen[0]) == pytest.approx(_hand_logp(model, prompt, ids("red<|im_end|>")), abs=1e-4)
    assert float(rejected[0]) == pytest.approx(_hand_logp(model, prompt, ids("blue<|im_end|>")), abs=1e-4)
    messages = [{"role": "user", "content": "a banana is"}, {"role": "assistant", "content": "yellow"},
                {"role": "user", "content": "and a plum?"}]
    prompt = ids(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    hand = [_hand_logp(model, prompt, ids(f"{a}<|im_end|>")) for a in ("purple", "white")]
    assert float(chosen[1] - rejected[1]) == pytest.approx(hand[0] - hand[1], abs=1e-4)


def test_a_model_taught_the_chosen_answers_ranks_every_pair_right(debug_model_dir, plain):
    _, tok = plain
    model = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)
    before = preference_metrics(model, tok, PAIRS, 32, 64, False, 0)
    chosen_rows = [encode_pair(tok, r, 32, 64, False)[0] for r in PAIRS]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):  # maximise log p(chosen): the model learns to prefer them
        model.train()
        loss = 0.0
        for input_ids, labels in chosen_rows:
            logits = model(input_ids=torch.tensor([input_ids])).logits
            loss = loss - torch.log_softmax(logits[0, :-1].float(), -1).gather(
                -1, torch.tensor(labels[1:]).clamp(min=0)[:, None])[:, 0][torch.tensor(labels[1:]) >= 0].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = preference_metrics(model, tok, PAIRS, 32, 64, False, 0)
    assert before["preference_accuracy"] < 1.0  # the random model did not already prefer them all
    assert after["preference_accuracy"] == 1.0 and after["preference_margin"] > 5.0
    assert after["preference_margin"] > before["preference_margin"]
    swapped = [PreferenceRecord(r.src, r.history, r.rejected, r.chosen) for r in PAIRS]
    flipped = preference_metrics(model, tok, swapped, 32, 64, False, 0)
    assert flipped["preference_accuracy"] == 0.0
    assert flipped["preference_margin"] == pytest.approx(-after["preference_margin"], rel=1e-6)


def test_pairs_that_agree_within_max_length_are_left_out(plain):
    """A cut that keeps only what both answers share leaves nothing to prefer: such a pair is not
    counted (it would count as wrong, its margin 0); no pair left gives nulls."""
    model, tok = plain
    shared = PreferenceRecord(["a banana is"], [], "yellow and ripe", "yellow and green")
    (chosen, _), (rejected, _) = encode_pair(tok, shared, 32, 1000, False)
    prompt_and_shared = next(i for i, (c, r) in enumerate(zip(chosen, rejected, strict=False)) if c != r)
    assert prompt_and_shared > len(tok("a banana is")["input_ids"]) + 1  # "yellow" is kept on both sides
    metrics = preference_metrics(model, tok, [shared, PAIRS[0]], 32, prompt_and_shared, False, 0)
    assert metrics["preference_pairs"] == 1
    assert preference_metrics(model, tok, [shared], 32, prompt_and_shared, False, 0) == {
        "preference_accuracy": None, "preference_margin": None, "preference_pairs": 0}
    assert row_logps(model, [], 0).shape == (0,)
