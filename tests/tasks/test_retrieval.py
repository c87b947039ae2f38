"""grpo/tasks/retrieval.py: long prompts of facts, one of them asked about."""
from grpo.tasks.retrieval import retrieval


def test_the_answer_is_stated_in_the_prompt_and_rows_are_deterministic():
    rows = retrieval(10, seed=2)
    assert rows == retrieval(10, seed=2) and rows != retrieval(10, seed=3)
    for r in rows:
        answers = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
        assert any(str(a) in r["prompt"] for a in answers)
