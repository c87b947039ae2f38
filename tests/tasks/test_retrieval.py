"""grpo/tasks/retrieval.py: long prompts of facts, one of them asked about."""
import random
import re

from grpo.tasks import retrieval as task
from grpo.tasks.retrieval import _CODAS, _ONSETS, _VOWELS, _names, _word, retrieval


def test_the_answer_is_stated_in_the_prompt_and_rows_are_deterministic():
    rows = retrieval(10, seed=2)
    assert rows == retrieval(10, seed=2) and rows != retrieval(10, seed=3)
    for r in rows:
        answers = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
        assert any(str(a) in r["prompt"] for a in answers)


class Last:
    """An rng that always picks the last choice."""

    def choice(self, seq):
        return seq[-1]


def test_a_word_is_its_syllables_run_together_and_capitalised():
    assert _word(Last(), 1) == "Shiom" and _word(Last(), 3) == "Shiomshiomshiom"
    syllable = f"(?:{'|'.join(_ONSETS)})(?:{'|'.join(_VOWELS)})(?:{'|'.join(c for c in _CODAS if c)})?"
    rng = random.Random(0)
    for n in (1, 2):
        for _ in range(50):
            word = _word(rng, n)
            assert word[0].isupper() and re.fullmatch(f"(?:{syllable}){{{n}}}", word.lower())


def test_names_are_distinct_a_first_name_of_one_or_two_syllables_and_a_surname_of_two(monkeypatch):
    words = iter(["Ana", "Bo", "Ana", "Bo", "Cy", "Do", "Ana", "Do"])
    monkeypatch.setattr(task, "_word", lambda rng, syllables: next(words))
    assert _names(random.Random(0), 3) == ["Ana Bo", "Cy Do", "Ana Do"]  # "Ana Bo" again is skipped
    asked = []

    def spy(rng, syllables):
        asked.append(syllables)
        return _word(rng, syllables)

    monkeypatch.setattr(task, "_word", spy)
    names = _names(random.Random(3), 40)
    assert len(names) == 40 == len(set(names)) == len(asked) // 2
    assert set(asked[0::2]) == {1, 2} and set(asked[1::2]) == {2}
