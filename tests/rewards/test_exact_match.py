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


def test_the_final_answer_comes_after_the_last_think_block():
    assert final_answer("<think>maybe the answer is Rome</think>The answer is New York") == "New York"
    assert final_answer("<think>a</think>answer: Rome</think>The answer is New York") == "New York"
    assert final_answer(None) == "" and final_answer("") == "" and final_answer("\n  \n") == ""


def test_an_empty_reference_in_a_list_is_skipped_not_the_end():
    assert matches("paris", ["", "Paris"]) and matches("paris", ["the", "paris"], mode="contains")
    assert not matches("", [""]) and not matches("paris", [])


def test_rows_without_a_reference_are_not_scored():
    assert exact_match(None, ["a", "b"]) == [None, None]
