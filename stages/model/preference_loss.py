"""Preference objectives, written once: DPO (sigmoid, with label smoothing), IPO, SimPO and ORPO on
the log-probabilities of a chosen and a rejected completion of the same prompt.

    chosen, rejected = sequence_logps(logits_c, labels_c), sequence_logps(logits_r, labels_r)
    objective = PreferenceObjective("dpo", beta=0.1)
    terms = objective.pair_terms(chosen, rejected, ref_chosen, ref_rejected)   # per pair (B,)
    loss = terms.loss.mean()          # + ORPO's NLL of the chosen answers: `orpo_nll`

A completion's log-probability is the sum over its learned tokens (labels != IGNORE_INDEX, the
prompt and padding are not) of log p(token | what precedes it), in fp32 (`sequence_logps`: position
t of the logits scores label t + 1, as `stages.model.loss` does). With z = (policy - reference)
log-ratio of the chosen answer minus that of the rejected one:

  dpo     -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)         (Rafailov et al.; eps: cDPO's
          label smoothing, the share of pairs assumed flipped)
  ipo     (z_c / n_c - z_r / n_r - 1 / (2 beta))^2, each log-ratio over its completion's tokens, as
          TRL normalises it (Azar et al., eq. 17)
  simpo   the dpo form with z = mean log-prob of chosen - that of rejected - gamma / beta, no reference
          (Meng et al.)
  orpo    -beta log sigmoid(log odds(chosen) - log odds(rejected)), odds of the mean log-prob, no
          reference, plus the NLL of the chosen sequences (Hong et al.)

The formulas are TRL's (DPOTrainer 1.16 for dpo at eps = 0 and ipo; CPOTrainer's `cpo_loss` for
simpo and the smoothed sigmoid; ORPOTrainer's `odds_ratio_loss`): tests/unit/test_preference_loss.py
runs those trainers on the same batches and compares losses and gradients. Rewards, for the logs
and the reward accuracy: beta x the log-ratio for dpo and ipo, beta x the mean log-prob for the
reference-free methods (as TRL logs them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stages.model.labels import IGNORE_INDEX

METHODS = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class SequenceLogps:
    """Per-sequence log-probabilities of the learned tokens: `total` (B,) their sum, `tokens` (B,) their count."""

    total: torch.Tensor
    tokens: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """(B,) the mean log-prob per learned token (0 tokens: 0)."""
        return self.total / self.tokens.clamp(min=1)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> SequenceLogps:
    """(logits (B, T, V), labels (B, T) with IGNORE_INDEX where nothing is learned) -> the summed
    fp32 log-probability of each row's learned tokens, position t scoring label t + 1."""
    targets = labels[:, 1:]  # (B, T-1)
    learned = targets != IGNORE_INDEX  # (B, T-1)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    token_logp = logp.gather(-1, targets.masked_fill(~learned, 0).unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return SequenceLogps(total=(token_logp * learned).sum(-1), tokens=learned.sum(-1))


@dataclass(frozen=True)
class PairTerms:
    """Per pair (B,): the loss, and the implicit rewards of the chosen and the rejected answer."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        return self.chosen_reward - self.rejected_reward

    @property
    def accuracy(self) -> torch.Tensor:
        """(B,) 1.0 where the chosen answer's reward is the higher one."""
        return (self.chosen_reward > self.rejected_reward).float()


def _smoothed_sigmoid(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's split at -log 2)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass(frozen=True)
class PreferenceObjective:
    """One preference method and its settings (the align section's `method`, `beta`,
    `label_smoothing`, `simpo_gamma`)."""

    method: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0  # dpo and simpo: the share of pairs assumed mislabelled
    simpo_gamma: float = 0.5  # simpo: the target reward margin (gamma / beta in log-prob units)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"align.method {self.method!r}: choose one of {', '.join(METHODS)}")
        if not self.beta > 0:
            raise ValueError(f"align.beta {self.beta}: must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"align.label_smoothing {self.label_smoothing}: must be in [0, 0.5)")
        if self.label_smoothing and self.method not in ("dpo", "simpo"):
            raise ValueError(f"align.label_smoothing applies to dpo and simpo, not {self.method}; set it to 0")

    @property
    def needs_reference(self) -> bool:
        return self.method not in REFERENCE_FREE

    def pair_terms(self, chosen: SequenceLogps, rejected: SequenceLogps, ref_chosen: SequenceLogps | None = None,
                   ref_rejected: SequenceLogps | None = None) -> PairTerms:
        """Losses and rewards of B pairs from the policy's (and, for dpo and ipo, the reference
        model's) sequence log-probabilities."""
        beta = self.beta
        if self.needs_reference:
            if ref_chosen is None or ref_rejected is None:
                raise ValueError(f"{self.method} needs the reference model's log-probabilities")
            chosen_ratio = chosen.total - ref_chosen.total  # (B,)
            rejected_ratio = rejected.total - ref_rejected.total  # (B,)
            if self.method == "dpo":
                loss = _smoothed_sigmoid(chosen_ratio - rejected_ratio, beta, self.label_smoothing)
            else:  # ipo, per completion token
                z = chosen_ratio / chosen.tokens.clamp(min=1) - rejected_ratio / rejected.tokens.clamp(min=1)
                loss = (z - 1 / (2 * beta)) ** 2
            return PairTerms(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
        chosen_mean, rejected_mean = chosen.mean, rejected.mean  # (B,) each
        if self.method == "simpo":
            z = chosen_mean - rejected_mean - self.simpo_gamma / beta
            loss = _smoothed_sigmoid(z, beta, self.label_smoothing)
        else:  # orpo
            log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
            loss = -beta * F.logsigmoid(log_odds)
        return PairTerms(loss, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def orpo_nll(chosen_logps: SequenceLogps) -> torch.Tensor:
    """ORPO's supervised term: the mean NLL over every learned token of the chosen sequences (a
    token mean over the batch, not a mean of per-sequence means)."""
    return -chosen_logps.total.sum() / chosen_logps.tokens.sum().clamp(min=1)
