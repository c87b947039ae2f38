"""Retrieval: find one fact in a long synthetic passage (a long-prompt task).

The passage lists ``num_facts`` people, each with a unique code ("The code of Dorin Valek is
48213.") plus distractor sentences about the same people that also contain numbers (birth years,
room numbers, counts), in shuffled order. The question asks for one person's code; the
``answer`` column holds it as a string. Score it with the ``exact_match`` reward. With the
default 28 facts a prompt is about 2,800 characters: ~1,200 tokens for tokenizers that split
digits (SmolLM2, Qwen), fewer for ones that group them; prompts grow linearly with ``num_facts``
(about 40 tokens per fact).
"""
from __future__ import annotations

import random

from grpo.tasks import register_task

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl",
           "st", "tr", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io"]
_CODAS = ["", "", "n", "r", "l", "k", "s", "th", "m"]
_CITIES = ["Arlen", "Brisk", "Calder", "Dunmore", "Estow", "Farrow", "Glenby", "Harth", "Ivel",
           "Jorvik", "Kesterly", "Lunmouth", "Marrow", "Norhaven", "Oakhurst", "Pellin"]
_THINGS = ["lamps", "books", "bicycles", "cats", "clocks", "kites", "maps", "violins"]
_DISTRACTORS = [
    lambda r, name: f"{name} was born in {r.randint(1940, 2005)}.",
    lambda r, name: f"{name} lives in room {r.randint(100, 999)} of the {r.choice(_CITIES)} hostel.",
    lambda r, name: f"{name} owns {r.randint(2, 60)} {r.choice(_THINGS)}.",
    lambda r, name: f"{name} moved to {r.choice(_CITIES)} in {r.randint(1970, 2023)}.",
    lambda r, name: f"The locker of {name} holds {r.randint(3, 90)} coins.",
]
TEMPLATE = ("Read the passage and answer the question.\n\n{passage}\n\nQuestion: What is the code "
            "of {name}? Give only the number, inside <answer> </answer> tags.")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables)).capitalize()


def _names(rng: random.Random, k: int) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < k:
        name = f"{_word(rng, rng.randint(1, 2))} {_word(rng, 2)}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def retrieval(n: int, seed: int, num_facts: int = 28, distractors_per_fact: float = 1.5,
              template: str = TEMPLATE) -> list[dict]:
    """``n`` passages with a question each, deterministic in ``seed``. ``num_facts`` (>= 1) people
    with codes; about ``distractors_per_fact`` other sentences per person. Column ``answer``."""
    if num_facts < 1:
        raise ValueError("retrieval needs num_facts >= 1")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        names = _names(rng, num_facts)
        codes = rng.sample(range(10000, 100000), num_facts)
        sentences = [f"The code of {name} is {code}." for name, code in zip(names, codes)]
        for _ in range(round(num_facts * distractors_per_fact)):
            sentences.append(rng.choice(_DISTRACTORS)(rng, rng.choice(names)))
        rng.shuffle(sentences)
        k = rng.randrange(num_facts)
        paragraphs = [" ".join(sentences[i:i + 6]) for i in range(0, len(sentences), 6)]
        rows.append({"prompt": template.format(passage="\n".join(paragraphs), name=names[k]),
                     "answer": str(codes[k])})
    return rows


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_task("retrieval")(retrieval)
