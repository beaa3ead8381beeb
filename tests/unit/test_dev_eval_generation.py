"""Evaluation while training: greedy generation stops once every row has produced eos, with the same
tokens as running the whole `max_new_tokens` budget and cutting after eos."""

import torch

from stages.model import LlamaForCausalLM
from stages.model.config import config_for_flavour
from stages.training.dev_eval import DevEvaluator


class CountedForwards(torch.nn.Module):
    """Our model behind a `.module` attribute, as a DeepSpeed engine holds it, counting forwards."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.module, self.calls = model, 0

    def forward(self, **inputs):
        self.calls += 1
        return self.module(**inputs)


def cut_after(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_generation_stops_when_every_row_has_its_eos_and_keeps_the_tokens():
    torch.manual_seed(0)
    model = CountedForwards(LlamaForCausalLM(config_for_flavour("debug", vocab_size=64)).eval())
    evaluator = DevEvaluator([], batch_size=2, pad_token_id=0)
    budget = 12
    with torch.no_grad():
        first = evaluator.greedy(model, [[5, 6, 7, 8]], budget, eos=-1)[0]
        # the second row is the first one two tokens on (left-padded): the rows share tokens
        prompts = [[5, 6, 7, 8], [5, 6, 7, 8, *first[:2]]]
        model.calls = 0
        whole = evaluator.greedy(model, prompts, budget, eos=-1)  # no row ever finishes
    assert model.calls == budget and [len(row) for row in whole] == [budget, budget]
    shared = set(whole[0]) & set(whole[1])
    assert shared

    for eos in sorted(shared):
        last = max(row.index(eos) for row in whole)  # the forward that makes the last row's eos
        model.calls = 0
        with torch.no_grad():
            got = evaluator.greedy(model, prompts, budget, eos=eos)
        assert got == [cut_after(row, eos) for row in whole]
        assert model.calls == last + 1 < budget
