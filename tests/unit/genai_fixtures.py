"""onnxruntime-genai's greedy generation, as the tests drive it."""

from __future__ import annotations


def genai_greedy(og, model, prompt: list[int], new_tokens: int, exact: bool = False) -> list[int]:
    """The tokens onnxruntime-genai's `model` generates greedily after `prompt`: at most
    `new_tokens` (exactly that many with `exact`: min_length holds eos back)."""
    params = og.GeneratorParams(model)
    length = len(prompt) + new_tokens
    params.set_search_options(max_length=length, do_sample=False, **({"min_length": length} if exact else {}))
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]
