"""stages/model/preference_loss.py against TRL's trainers (trl in the test dependencies): each
trainer, built on a tiny random Llama saved by transformers, tokenizes and collates its own batch
of preference pairs and computes its loss; ours is computed from the same batch's tensors with the
same model, and the losses and every parameter's gradient must agree within 1e-6 in fp32.

  DPOTrainer (1.16): loss_type sigmoid (DPO) and ipo, with a reference model (a second copy of
    the checkpoint, its weights moved so that the reference log-ratios are not zero)
  CPOTrainer: loss_type simpo (cpo_alpha 0: SimPO as published), and sigmoid with label
    smoothing against our dpo form with a zero reference (CPO's loss is DPO's without one)
  ORPOTrainer: the odds-ratio loss plus its NLL of the chosen sequences"""

from __future__ import annotations

import datasets
import pytest
import torch
import trl
from checkpoint_fixtures import save_checkpoint
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from stages.model.labels import IGNORE_INDEX
from stages.model.preference_loss import (
    PreferenceObjective,
    SequenceLogps,
    orpo_nll,
    sequence_logps,
)

PAIRS = [
    {"prompt": "The cat is", "chosen": " black and small", "rejected": " blue"},
    {"prompt": "Two plus two", "chosen": " is four", "rejected": " is five or six"},
    {"prompt": "Rivers run", "chosen": " to the sea", "rejected": " uphill all day long"},
]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    return save_checkpoint(tmp_path_factory.mktemp("preference") / "llama", tokenizer, "llama"), tokenizer


def _model(path, seed: int | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if seed is not None:  # another point of weight space: the reference differs from the policy
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _args(config_class, tmp_path, **settings):
    return config_class(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PAIRS), report_to=[],
                        use_cpu=True, max_length=64, **settings)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _their_loss(trainer, loss_of) -> tuple[dict, torch.Tensor, dict[str, torch.Tensor]]:
    """(the trainer's first batch, its loss on it by `loss_of(model, batch)`, the gradients of that
    loss); the model's gradients are cleared again for ours."""
    batch = next(iter(trainer.get_train_dataloader()))
    loss = loss_of(trainer.model, batch)
    loss.backward()
    grads = _grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    return batch, loss, grads


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, our_grads, their_grads):
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=TOLERANCE)
    assert our_grads.keys() == their_grads.keys() and our_grads
    for name, grad in their_grads.items():
        assert torch.allclose(our_grads[name], grad, atol=TOLERANCE, rtol=0), name


def _logps(model, ids, attention_mask, labels) -> SequenceLogps:
    return sequence_logps(model(input_ids=ids, attention_mask=attention_mask).logits, labels)


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_dpo_and_ipo_equal_trls_dpo_trainer(checkpoint, tmp_path, method):
    path, tokenizer = checkpoint
    objective = PreferenceObjective(method, beta=0.3)
    trainer = trl.DPOTrainer(model=_model(path), ref_model=_model(path, seed=1),
                             args=_args(trl.DPOConfig, tmp_path, beta=objective.beta,
                                        loss_type=["sigmoid" if method == "dpo" else "ipo"]),
                             train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer)
    batch, theirs, their_grads = _their_loss(trainer, trainer.compute_loss)  # chosen rows, then rejected rows
    model = trainer.model

    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = ids.masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)  # the completion tokens are learned
    with torch.no_grad():
        ref = _logps(trainer.ref_model, ids, mask, labels)
    policy = _logps(model, ids, mask, labels)
    half = len(PAIRS)
    split = [SequenceLogps(s.total[rows], s.tokens[rows]) for s in (policy, ref)
             for rows in (slice(0, half), slice(half, None))]
    terms = objective.pair_terms(split[0], split[1], split[2], split[3])
    ours = terms.loss.mean()
    ours.backward()
    _assert_same(ours, theirs, _grads(model), their_grads)
    assert terms.loss.shape == (half,) and float(ours.detach()) != pytest.approx(0.6931, abs=1e-3)  # the reference moved it


def _cpo_style(trainer, model, batch):
    """(chosen, rejected, chosen sequences' labels for the NLL) from a CPO/ORPO batch, as their
    concatenated_forward builds it."""
    pad = trainer.pad_token_id if hasattr(trainer, "pad_token_id") else trainer.padding_value  # CPO's name, ORPO's
    concatenated = trainer.concatenated_inputs(batch, padding_value=pad)
    ids, mask = concatenated["concatenated_input_ids"], concatenated["concatenated_attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits
    half = batch["chosen_labels"].shape[0]
    both = sequence_logps(logits, concatenated["concatenated_labels"])
    whole = sequence_logps(logits[:half], ids[:half].masked_fill(mask[:half] == 0, IGNORE_INDEX))
    return (SequenceLogps(both.total[:half], both.tokens[:half]),
            SequenceLogps(both.total[half:], both.tokens[half:]), whole)


@pytest.mark.parametrize("method, settings", [
    ("simpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.7}),
    ("dpo", {"loss_type": "sigmoid", "cpo_alpha": 0.0, "label_smoothing": 0.2}),
])
def test_simpo_and_smoothed_sigmoid_equal_trls_cpo_trainer(checkpoint, tmp_path, method, settings):
    path, tokenizer = checkpoint
    trainer = CPOTrainer(model=_model(path), args=_args(CPOConfig, tmp_path, beta=2.0, **settings),
                         train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer)
    batch, theirs, their_grads = _their_loss(trainer, lambda model, batch: trainer.get_batch_loss_metrics(model, batch)[0])
    model = trainer.model

    objective = PreferenceObjective(method, beta=2.0, label_smoothing=settings.get("label_smoothing", 0.0),
                                    simpo_gamma=settings.get("simpo_gamma", 0.5))
    chosen, rejected, _ = _cpo_style(trainer, model, batch)
    if method == "dpo":  # CPO's sigmoid is DPO's against a reference whose log-probs are all zero
        zero = SequenceLogps(torch.zeros_like(chosen.total), chosen.tokens)
        terms = objective.pair_terms(chosen, rejected, zero, SequenceLogps(torch.zeros_like(rejected.total),
                                                                           rejected.tokens))
    else:
        terms = objective.pair_terms(chosen, rejected)
    ours = terms.loss.mean()
    ours.backward()
    _assert_same(ours, theirs, _grads(model), their_grads)


def test_orpo_equals_trls_orpo_trainer(checkpoint, tmp_path):
    path, tokenizer = checkpoint
    trainer = ORPOTrainer(model=_model(path), args=_args(ORPOConfig, tmp_path, beta=0.25),
                          train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer)
    batch, theirs, their_grads = _their_loss(trainer, lambda model, batch: trainer.get_batch_loss_metrics(model, batch)[0])
    model = trainer.model

    chosen, rejected, whole_chosen = _cpo_style(trainer, model, batch)
    terms = PreferenceObjective("orpo", beta=0.25).pair_terms(chosen, rejected)
    ours = orpo_nll(whole_chosen) + terms.loss.mean()  # TRL's NLL covers prompt and answer
    ours.backward()
    _assert_same(ours, theirs, _grads(model), their_grads)


def test_rewards_margins_and_settings():
    chosen = SequenceLogps(torch.tensor([-4.0, -9.0]), torch.tensor([2, 3]))
    rejected = SequenceLogps(torch.tensor([-6.0, -5.0]), torch.tensor([4, 1]))
    reference = SequenceLogps(torch.tensor([-5.0, -5.0]), torch.tensor([2, 3]))
    terms = PreferenceObjective("dpo", beta=0.5).pair_terms(chosen, rejected, reference, reference)
    assert terms.chosen_reward.tolist() == [0.5, -2.0] and terms.rejected_reward.tolist() == [-0.5, 0.0]
    assert terms.accuracy.tolist() == [1.0, 0.0] and terms.margin.tolist() == [1.0, -2.0]
    simpo = PreferenceObjective("simpo", beta=2.0).pair_terms(chosen, rejected)
    assert simpo.chosen_reward.tolist() == [-4.0, -6.0]  # beta x the mean log-prob
    with pytest.raises(ValueError, match="needs the reference"):
        PreferenceObjective("ipo").pair_terms(chosen, rejected)
    with pytest.raises(ValueError, match="align.method 'kto': choose one of dpo, ipo, simpo, orpo"):
        PreferenceObjective("kto")
    with pytest.raises(ValueError, match="align.label_smoothing applies to dpo and simpo"):
        PreferenceObjective("orpo", label_smoothing=0.1)
