"""`builtin:attributes`: the default SFT task, generated from a seed.

A record lists four attributes of some objects in a shuffled order; the target describes them in
English with fixed rules:

    src: "count: 3; shape: box; size: big; color: red"
    tgt: "three big red boxes"

Rules (the target is a function of the attribute values alone, never of their order):
1. words in the canonical order count, size, color, shape;
2. count 1 is the article: "an" before a vowel-initial next word ("an enormous ..."), else "a";
   counts 2..8 are number words;
3. the shape is plural when count > 1: "+es" after s/x ("boxes", "crosses"), else "+s".

Why this task: a small model pretrained briefly on prose can learn it within a couple of hundred
SFT steps (lookups by key, a small number-word table, two morphology rules), while exact match
stays near zero for a model that has not learned it, so evaluation measures real learning.
Dev records are attribute combinations that no train record has in any order, so a high dev
score means the rules were learned, not the strings memorised.
"""

from __future__ import annotations

import itertools
import random

from stages.data.sft import SftRecord
from stages.errors import InputError

SIZES = ("big", "small", "tiny", "huge", "large", "enormous")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
SHAPES = ("circle", "square", "triangle", "star", "box", "cube", "cross", "heart")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
COUNTS = (1, *NUMBER_WORDS)
ATTRIBUTE_NAMES = ("size", "color", "shape", "count")

Combo = tuple[str, str, str, int]  # (size, color, shape, count)


class AttributesTaskError(InputError):
    """An impossible request for the generated task (e.g. more records than distinct inputs)."""


def plural(noun: str) -> str:
    """English plural of the task's shape nouns: "+es" after s/x, "+s" otherwise."""
    return noun + "es" if noun.endswith(("s", "x")) else noun + "s"


def describe(size: str, color: str, shape: str, count: int) -> str:
    """The target text for one combination (rules 1-3 of the module docstring)."""
    if count == 1:
        article = "an" if size[0] in "aeiou" else "a"
        return f"{article} {size} {color} {shape}"
    return f"{NUMBER_WORDS[count]} {size} {color} {plural(shape)}"


def render_src(combo: Combo, order: tuple[int, ...]) -> str:
    """The prompt: "name: value" pairs joined by "; " in the given attribute order."""
    return "; ".join(f"{ATTRIBUTE_NAMES[i]}: {combo[i]}" for i in order)


def all_combos() -> list[Combo]:
    return list(itertools.product(SIZES, COLORS, SHAPES, COUNTS))


def _records(combos: list[Combo], n: int, rng: random.Random, what: str) -> list[SftRecord]:
    """`n` records over `combos`, each with a random attribute order, no src twice. Combinations
    are used round-robin so that every one appears before any repeats (in another order)."""
    orders = list(itertools.permutations(range(len(ATTRIBUTE_NAMES))))
    capacity = len(combos) * len(orders)
    if n > capacity:
        raise AttributesTaskError(f"builtin:attributes can make at most {capacity} distinct {what} records, "
                                  f"{n} were asked for; lower data.num_sft_{what}")
    used: set[str] = set()
    records: list[SftRecord] = []
    for combo in itertools.cycle(combos):
        if len(records) == n:
            break
        # Orders not yet used for this combination, so that the cycle always makes progress.
        free = [o for o in orders if render_src(combo, o) not in used]
        if not free:
            continue
        src = render_src(combo, rng.choice(free))
        used.add(src)
        records.append(SftRecord(src=[src], tgt=[describe(*combo)]))
    return records


def generate(num_train: int, num_dev: int, seed: int) -> tuple[list[SftRecord], list[SftRecord]]:
    """(train, dev) records of the task, a pure function of the arguments.

    Dev draws `num_dev` attribute combinations that train never uses; train cycles through the
    remaining combinations in a seeded order.
    """
    if num_train < 1 or num_dev < 1:
        raise AttributesTaskError(f"num_sft_train={num_train} and num_sft_dev={num_dev} must both be >= 1")
    combos = all_combos()
    if num_dev >= len(combos):
        raise AttributesTaskError(f"num_sft_dev={num_dev} leaves no combination for train "
                                  f"({len(combos)} exist); lower data.num_sft_dev")
    rng = random.Random(seed)
    rng.shuffle(combos)
    dev = _records(combos[:num_dev], num_dev, rng, "dev")
    train = _records(combos[num_dev:], num_train, rng, "train")
    return train, dev
