"""grpo/rewards/exact_match.py: the final answer, SQuAD-normalised, against one or several references."""
from grpo.rewards.exact_match import exact_match, final_answer, matches, normalize


def test_normal_form_and_the_final_answer():
    assert normalize("The  Answer: 1,024.") == "answer 1024"
    assert final_answer("<think>x</think> so <answer>Paris</answer>") == "Paris"
    assert final_answer("work\n\\boxed{12}") == "12" and final_answer("first\nlast line") == "last line"


def test_exact_contains_and_lists_of_references():
    assert matches("the Eiffel Tower.", "Eiffel tower") and not matches("Eiffel", "Eiffel tower")
    assert matches("it is in Paris, France", "paris", mode="contains") and matches("NYC", ["New York", "nyc"])
    assert exact_match(None, ["<answer>Paris</answer>", "<answer>Rome</answer>"], answer=["paris", "paris"]) == \
        [1.0, 0.0]
