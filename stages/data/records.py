"""`builtin:records`: pretraining text that pairs a record with a sentence made of its values.

One pair is two lines, a shuffled "key: value" record and an English sentence that says it:

    city: Nice; name: Leo; job: miner
    Leo is a miner from Nice.
    sport: golf; job: baker; drink: tea; name: Ada; city: Oslo
    Ada is a baker from Oslo who drinks tea and plays golf.

Why the default corpus has it: the default SFT task (`builtin:attributes`) maps a record to a
phrase. A model pretrained on prose alone has never seen a value in a prompt copied into its
answer, and learns the lookup late in fine-tuning, after a plateau whose end moves with the
rounding of the run (on seed 1 of the default experiment SFT stayed at 0.31 exact match after 600
steps, while the same seed before a change of attention's float rounding reached 0.97). A corpus
that shows the copying (other keys, other words: no sizes, colours, shapes, number words or
plurals, so the task itself is not in it) made seed 1's SFT reach 0.97 at step 300 and its LoRA
0.97 at step 800 (bench/finetune_quality.py, docs/finetuning.md).
Pretraining corpora of real models hold such text (tables and infoboxes next to their prose).

The text is fixed (drawn once from a constant seed), as `builtin:pydoc` is. Its documents are
training text only: prepare keeps them out of the validation split, whose perplexity measures the
model on general text.
"""

from __future__ import annotations

import random

NAMES = ("Leo", "Ada", "Max", "Eva", "Tom", "Ida", "Sam", "Zoe", "Ben", "Mia", "Ian", "Amy", "Dan", "Liv",
         "Ray", "Uma", "Jon", "Kim", "Ned", "Ora", "Gus", "Fay", "Hal", "Ivy")
CITIES = ("Nice", "Oslo", "Rome", "Lima", "Kyiv", "Bonn", "Graz", "Pisa", "Lyon", "Baku", "Riga", "Cork",
          "Bern", "Turin", "Delft", "Porto")
JOBS = ("miner", "baker", "pilot", "nurse", "judge", "actor", "farmer", "tailor", "editor", "driver",
        "artist", "officer", "engineer", "usher", "cook", "singer")
DRINKS = ("tea", "milk", "coffee", "water", "juice", "cocoa", "soda", "cider")
SPORTS = ("golf", "chess", "tennis", "rugby", "hockey", "polo", "squash", "judo")

DOCUMENTS = 60  # 22% of the default corpus's training tokens (with the pydoc topics and the SFT targets)
PAIRS_PER_DOCUMENT = 20


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def pair(rng: random.Random) -> tuple[str, str]:
    """One (record, sentence): name, job and city always, a drink and a sport each half the time."""
    values = {"name": rng.choice(NAMES), "job": rng.choice(JOBS), "city": rng.choice(CITIES)}
    for key, words in (("drink", DRINKS), ("sport", SPORTS)):
        if rng.random() < 0.5:
            values[key] = rng.choice(words)
    keys = list(values)
    rng.shuffle(keys)
    record = "; ".join(f"{k}: {values[k]}" for k in keys)
    sentence = f"{values['name']} is {_article(values['job'])} {values['job']} from {values['city']}"
    habits = [f"drinks {values['drink']}"] if "drink" in values else []
    habits += [f"plays {values['sport']}"] if "sport" in values else []
    if habits:
        sentence += " who " + " and ".join(habits)
    return record, sentence + "."


def documents(count: int = DOCUMENTS, pairs: int = PAIRS_PER_DOCUMENT) -> list[str]:
    """`count` documents of `pairs` record/sentence pairs each, the same on every call."""
    rng = random.Random("builtin:records")
    return ["".join(f"{r}\n{s}\n" for r, s in (pair(rng) for _ in range(pairs))) for _ in range(count)]
