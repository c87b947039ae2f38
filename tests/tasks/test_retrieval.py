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


def test_the_passage_holds_every_fact_in_paragraphs_of_six_sentences():
    (row,) = retrieval(1, seed=5, template="{passage}|{name}")
    passage, name = row["prompt"].split("|")
    paragraphs = passage.split("\n")
    sentences = [re.findall(r"[A-Z].*?\.(?= |$)", p) for p in paragraphs]
    assert [len(s) for s in sentences[:-1]] == [6] * (len(paragraphs) - 1) and 1 <= len(sentences[-1]) <= 6
    assert all(" ".join(s) == p for s, p in zip(sentences, paragraphs))  # one space between sentences
    facts = [s for p in sentences for s in p if s.startswith("The code of ")]
    assert len(facts) == 28 and len(sum(sentences, [])) == 28 + 42  # the defaults: 28 people, 1.5 others each
    assert f"The code of {name} is {row['answer']}." in facts
    assert all(re.fullmatch(r"The code of .+ is [1-9]\d{4}\.", f) for f in facts)  # five-digit codes
    one = retrieval(3, seed=0, num_facts=1, distractors_per_fact=0)
    for r in one:  # one person: the fact, and the question about them
        name = re.search(r"The code of (.+) is (\d+)\.", r["prompt"]).group(1)
        assert r["prompt"].count("The code of ") == 1 and f"What is the code of {name}?" in r["prompt"]


def test_the_prompts_a_seed_gives_stay_the_same():
    """docs/tasks.md: the same data.seed gives the same prompts on every machine (and in every version: a run's
    held-out prompts and its evaluation sets are named by their seed)."""
    assert [r["answer"] for r in retrieval(3, seed=0, num_facts=3)] == ["82420", "15064", "91343"]
    many = retrieval(1, seed=2, num_facts=3000, distractors_per_fact=0)[0]["prompt"]  # whose draws reach 100000
    assert len(set(re.findall(r"is (\d+)\.", many))) == 3000 and not re.search(r"\d{6}", many)
