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

from stages.data.preference import PreferenceRecord
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


# -- preference pairs: the right description and one a model can get wrong -----------------------

MISTAKES = ("value", "count", "plural", "order")  # what a rejected answer gets wrong


def parse_src(src: str) -> Combo:
    """The combination a prompt lists ("count: 3; shape: box; ..." in any order)."""
    values = dict(part.split(": ", 1) for part in src.split("; "))
    return values["size"], values["color"], values["shape"], int(values["count"])


def wrong_answer(combo: Combo, mistake: str, rng: random.Random) -> str:
    """A description of `combo` with one mistake of the kind `mistake` (MISTAKES): another size,
    colour or shape; another count; the plural rule broken ("boxs", "three big red box", "a big red
    boxes"); size and colour swapped. Never the right answer."""
    size, color, shape, count = combo
    if mistake == "value":
        slot = rng.randrange(3)
        options = (SIZES, COLORS, SHAPES)[slot]
        wrong = list(combo)
        wrong[slot] = rng.choice([v for v in options if v != combo[slot]])
        return describe(*wrong)
    if mistake == "count":
        return describe(size, color, shape, rng.choice([c for c in COUNTS if c != count]))
    right = describe(*combo)
    if mistake == "plural":
        if count == 1:
            return f"{right.rsplit(' ', 1)[0]} {plural(shape)}"
        words = right.split(" ")
        broken = shape + "s" if shape.endswith(("s", "x")) and rng.random() < 0.5 else shape
        return " ".join([*words[:-1], broken])
    if mistake == "order":
        words = right.split(" ")
        return " ".join([words[0], words[2], words[1], *words[3:]])
    raise ValueError(f"unknown mistake {mistake!r}: one of {MISTAKES}")


def rejected_answer(record: SftRecord, rng: random.Random) -> str:
    """One wrong answer for a task record, its kind of mistake drawn uniformly from MISTAKES."""
    return wrong_answer(parse_src(record.src[-1]), rng.choice(MISTAKES), rng)


def preference_pairs(records: list[SftRecord], seed: int, split: str) -> list[PreferenceRecord]:
    """`builtin:attributes` preference pairs: one per task record, chosen its target, rejected
    `rejected_answer`. The draws are seeded by (`seed`, `split`), so train and dev pairs do not
    depend on each other's sizes and a seed always makes the same pairs."""
    rng = random.Random(f"{seed}:preference:{split}")  # a str seed is hashed with sha512: stable across runs
    return [PreferenceRecord(src=list(r.src), history=list(r.tgt[:-1]), chosen=r.tgt[-1],
                             rejected=rejected_answer(r, rng), system=r.system) for r in records]
