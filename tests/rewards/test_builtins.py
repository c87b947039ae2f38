"""Built-in rewards on hand-written correct, wrong, malformed and empty completions; adapters;
the reward-model reward with a tiny random classifier."""
import math
import sys
import textwrap
import threading
import uuid

import pytest

from grpo.rewards import available, resolve
from grpo.rewards.exact_match import exact_match, final_answer
from grpo.rewards.format import format_reward, tag_count
from grpo.rewards.length import cosine_length, overlong_penalty
from grpo.rewards.math_answer import extract_answer, math_accuracy
from grpo.rewards.repetition import repetition_penalty

GARBAGE = ["", " ", "\\boxed{", "}}}{{{", "<answer>", "</answer><answer>", "\x00\xff\ud800",
           "9" * 5000, "\\frac{", "$$$$", "answer is", "\\boxed{9^{9^{9}}}", "\\boxed{10^{10^{10}}}",
           "\\boxed{99999999!}", "(" * 500, "<think></think><answer></answer>"]


def test_all_builtins_registered():
    assert {"math_accuracy", "format", "tag_count", "overlong_penalty", "cosine_length",
            "repetition_penalty", "code_tests", "reward_model", "countdown", "exact_match"} <= set(available())
    for name in available():
        assert callable(resolve(name))


# ---------------------------------------------------------------- math_accuracy
@pytest.mark.parametrize("completion,answer", [
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("The answer is 0.5", "\\frac{1}{2}"),
    ("<answer>1,000</answer>", "1000"),
    ("Answer: 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72"),
    ("therefore \\boxed{\\sqrt{2}}", "2^{1/2}"),
    ("the answer is $\\dfrac{3}{4}$", "0.75"),
    ("we get x = 3, so the final answer is x=3", "3"),
    ("First 7, then 8", "8"),
    ("<think>maybe 5?</think>The answer is 6 apples.", 6),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{-4}", "-4"),
])
def test_math_accuracy_correct(completion, answer):
    assert math_accuracy(["q"], [completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize("completion,answer", [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("The answer is 71", "72"),
    ("<think>the answer is 6</think>The answer is 5", "6"),   # only the conclusion counts
    ("\\boxed{x+1}", "x+2"),
    ("no number here", "3"),
    ("", "3"),
])
def test_math_accuracy_wrong_or_empty(completion, answer):
    assert math_accuracy(["q"], [completion], answer=[answer]) == [0.0]


def test_math_accuracy_garbage_never_raises_and_is_fast():
    import time

    start = time.monotonic()
    out = math_accuracy(["q"] * len(GARBAGE), GARBAGE, answer=["2"] * len(GARBAGE))
    assert out == [0.0] * len(GARBAGE)
    assert time.monotonic() - start < 20
    assert math_accuracy(["q"], [None], answer=["1"]) == [0.0]


def test_math_accuracy_missing_reference_and_threads():
    assert math_accuracy(["q", "q"], ["1", "2"], answer=[None, 2]) == [None, 1.0]
    assert math_accuracy(["q"], ["1"]) == [None]
    out = []
    t = threading.Thread(target=lambda: out.append(
        math_accuracy(["q"] * 2, ["\\boxed{\\frac{2}{4}}", "\\boxed{\\sqrt{4}}"], answer=["1/2", "2"])))
    t.start()
    t.join(60)
    assert out == [[1.0, 1.0]]  # math_verify's signal-based timeout must not break off the main thread


def test_extract_answer_priority():
    assert extract_answer("Answer: 4 but \\boxed{5}") == "5"
    assert extract_answer("<answer> 12 </answer> and then 13") == "12"
    assert extract_answer("1 2 3") == "3"
    assert extract_answer("nothing") is None


# ---------------------------------------------------------------- format / tag_count
STRICT_OK = "<think>\nLet me add.\n2+2=4\n</think>\n<answer>\n4\n</answer>"


@pytest.mark.parametrize("completion,strict,lenient", [
    (STRICT_OK, 1.0, 1.0),
    (STRICT_OK + "\n", 1.0, 1.0),
    ("<think>add</think><answer>4</answer>", 0.0, 1.0),              # no newlines
    ("Sure! " + STRICT_OK, 0.0, 1.0),                                 # text before
    ("<answer>\n4\n</answer>\n<think>\nx\n</think>", 0.0, 0.0),       # wrong order
    ("<think>\nx\n</think>\n", 0.0, 0.0),                             # no answer
    ("<think>\n<think>\n</think>\n<answer>\n4\n</answer>", 0.0, 1.0),  # nested tag
    ("", 0.0, 0.0),
    ("</answer><answer>", 0.0, 0.0),
])
def test_format(completion, strict, lenient):
    assert format_reward(["q"], [completion], strict=True) == [strict]
    assert format_reward(["q"], [completion], strict=False) == [lenient]


def test_format_think_in_prompt():
    body = "Let me add.\n</think>\n<answer>\n4\n</answer>"
    assert format_reward(["q"], [body], strict=True) == [0.0]
    assert format_reward(["q"], [body], strict=True, think_in_prompt=True) == [1.0]
    assert tag_count(["q"], [body], think_in_prompt=True) == [1.0]


@pytest.mark.parametrize("completion,expected", [
    (STRICT_OK, 1.0),
    ("<think>x</think> no answer", 0.5),
    ("<think>x</think><answer>4", 0.75),
    ("<think><think>x</think><answer>4</answer>", 0.75),
    ("<answer>4</answer><think>x</think>", 0.5),
    ("plain text", 0.0),
    ("", 0.0),
])
def test_tag_count(completion, expected):
    assert tag_count(["q"], [completion]) == [expected]


# ---------------------------------------------------------------- length
def test_overlong_penalty_soft_buffer():
    ids = [[0] * n for n in (0, 60, 70, 85, 100, 130)]
    out = overlong_penalty(["q"] * 6, ["x"] * 6, max_len=100, buffer_len=30, penalty_factor=1.0,
                           completion_ids=ids)
    assert out[:3] == [0.0, 0.0, 0.0]
    assert out[3] == pytest.approx(-0.5)
    assert out[4] == pytest.approx(-1.0)
    assert out[5] == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(["q"], ["x"], completion_ids=[[1]])
    assert overlong_penalty(["q"], [""], max_len=10, completion_ids=[[]]) == [0.0]


def test_cosine_length_orders_by_correctness_then_length():
    short, long = [[0] * 10], [[0] * 900]
    kw = dict(answer=["4"], max_len=1000)
    c_short = cosine_length(["q"], ["\\boxed{4}"], completion_ids=short, **kw)[0]
    c_long = cosine_length(["q"], ["\\boxed{4}"], completion_ids=long, **kw)[0]
    w_short = cosine_length(["q"], ["\\boxed{5}"], completion_ids=short, **kw)[0]
    w_long = cosine_length(["q"], ["\\boxed{5}"], completion_ids=long, **kw)[0]
    assert c_short > c_long > w_long > w_short
    assert cosine_length(["q"], ["\\boxed{4}"], completion_ids=[[]], **kw)[0] == pytest.approx(1.0)
    assert cosine_length(["q"], ["\\boxed{5}"], completion_ids=[[0] * 5000], **kw)[0] == pytest.approx(0.0)
    assert cosine_length(["q"], [""], completion_ids=[[]], **kw)[0] == pytest.approx(-0.5)
    assert cosine_length(["q"], ["\\boxed{4}"], completion_ids=long, truncated=[True],
                         exceed_penalty=-1.0, **kw) == [-1.0]
    assert cosine_length(["q"], ["4"], answer=[None]) == [None]


# ---------------------------------------------------------------- repetition
def test_repetition_penalty():
    fresh = "the quick brown fox jumps over the lazy dog"
    loop = "I think so. " * 50
    out = repetition_penalty(["q"] * 4, [fresh, loop, "too short", ""], ngram_size=3, max_penalty=-1.0,
                             unit="words")
    assert out[0] == 0.0 and out[2] == 0.0 and out[3] == 0.0
    assert -1.0 <= out[1] < -0.9
    # a collapse into one character is caught at the token and character level, not by words
    ids = [[7] * 200]
    assert repetition_penalty(["q"], ["!" * 200], completion_ids=ids)[0] < -0.9
    assert repetition_penalty(["q"], ["!" * 200], unit="chars")[0] < -0.9
    assert repetition_penalty(["q"], ["!" * 200], unit="words") == [0.0]
    with pytest.raises(ValueError):
        repetition_penalty(["q"], ["x"], max_penalty=0.5)


# ---------------------------------------------------------------- exact_match
@pytest.mark.parametrize("completion,answer,exact,contains", [
    ("<answer>48213</answer>", "48213", 1.0, 1.0),
    ("The code is given above.\n<answer> 48,213. </answer>", "48213", 1.0, 1.0),
    ("<answer>The code is 48213</answer>", "48213", 0.0, 1.0),
    ("<answer>482130</answer>", "48213", 0.0, 0.0),
    ("I read it.\nThe answer is: Paris", ["paris", "Paris, France"], 1.0, 1.0),
    ("Line one\nthe Eiffel Tower", "Eiffel tower", 1.0, 1.0),
    ("", "48213", 0.0, 0.0),
])
def test_exact_match(completion, answer, exact, contains):
    assert exact_match(["q"], [completion], answer=[answer]) == [exact]
    assert exact_match(["q"], [completion], answer=[answer], mode="contains") == [contains]


def test_exact_match_edges():
    assert exact_match(["q"], ["x"], answer=[None]) == [None]
    assert final_answer("<think>\n<answer>1</answer></think>\n<answer>2</answer>") == "2"
    with pytest.raises(ValueError):
        exact_match(["q"], ["x"], answer=["x"], mode="fuzzy")


# ---------------------------------------------------------------- adapters and dotted paths
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def trl_len(prompts, completions, max_len=10, **kwargs):
            return [min(len(c), max_len) / max_len for c in completions]

        def trl_kw(completions, answer, **kwargs):  # TRL calls by keyword; prompts is in kwargs
            return [float(c == str(a)) + 0.5 * ("prompts" in kwargs) for c, a in zip(completions, answer)]

        def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
            bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
            return {"score": float(solution_str.strip() == str(ground_truth)) + bonus, "acc": True}

        def verl_float(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
            if solution_str == "boom":
                raise RuntimeError("boom")
            return scale * float(data_source == "math")

        def verl_positional(src, solution_str, gt, info):
            return float(gt is not None and solution_str == str(gt))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_trl_style_by_dotted_path(user_module):
    fn = resolve(f"{user_module}:trl_len")
    assert fn(["p", "p"], ["abcde", "x" * 50], max_len=10, answer=[1, 2]) == [0.5, 1.0]
    assert resolve(f"{user_module}.trl_len")(["p"], ["abcde"]) == [0.5]
    kw = resolve(f"{user_module}:trl_kw")
    assert kw(["p", "p"], ["3", "4"], answer=[3, 3], completion_ids=[[1], [2]], truncated=[False] * 2) == [1.5, 0.5]


def test_verl_style_by_dotted_path(user_module):
    fn = resolve(f"{user_module}:verl_dict")
    # ground truth from `answer`, `ground_truth` or `reward_model.ground_truth`; extra_info per row
    assert fn(["p", "p"], [" 4", "5"], answer=[4, 4], completion_ids=[[1], [2]], truncated=[False] * 2) == [1.0, 0.0]
    assert fn(["p"], ["7"], ground_truth=["7"], extra_info=[{"bonus": 0.5}]) == [1.5]
    assert fn(["p"], ["7"], reward_model=[{"style": "rule", "ground_truth": "7"}]) == [1.0]
    assert fn(["p"], ["7"]) == [0.0]  # no ground truth anywhere: the user's function decides


def test_verl_style_kwargs_data_source_and_errors(user_module):
    fn = resolve(f"{user_module}:verl_float")
    out = fn(["p"] * 3, ["a", "boom", "c"], data_source=["math", "math", "code"], scale=2.0,
             completion_ids=[[1]] * 3, truncated=[False] * 3)
    assert out == [2.0, None, 0.0]   # the raising sample scores None, the batch survives
    assert fn(["p"], ["a"]) == [0.0]  # data_source defaults to "unknown"
    assert fn(["p", "p"], ["a", "b"], data_source="math") == [1.0, 1.0]  # a constant from the config


def test_verl_style_positional_names(user_module):
    fn = resolve(f"{user_module}:verl_positional")
    assert fn(["p", "p"], ["3", "4"], answer=["3", "3"]) == [1.0, 0.0]


def test_verl_non_numeric_result_scores_none():
    from grpo.rewards.adapters import from_verl

    fn = from_verl(lambda data_source, solution_str, ground_truth, extra_info: {"acc": 1})
    assert fn(["p"], ["x"]) == [None]
    fn = from_verl(lambda data_source, solution_str, ground_truth, extra_info: float("nan"))
    assert fn(["p"], ["x"]) == [None]


# ---------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_rm")
    words = ["[PAD]", "[UNK]", "[EOS]"] + "what is two plus two four five the answer".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="[EOS]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=2, pad_token_id=0,
                      max_position_embeddings=64)
    LlamaForSequenceClassification(cfg).eval().save_pretrained(path)
    yield str(path)
    from grpo.rewards.reward_model import clear_cache

    clear_cache()


def test_reward_model_scores_match_a_direct_forward(tiny_rm):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo.rewards import reward_model as rm

    prompts = ["what is two plus two ", "what is two plus two ", "the ", ""]
    completions = ["four", "the answer is five five five", "", ""]
    fn = resolve("reward_model")
    out = fn(prompts, completions, path=tiny_rm, batch_size=3, max_length=32)
    assert len(out) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in out)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    tok = AutoTokenizer.from_pretrained(tiny_rm)
    for i in range(2):  # unpadded, one at a time: batching and padding must not change the score
        ids = tok(prompts[i] + completions[i], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = model(input_ids=ids).logits[0, 0].item()
        assert out[i] == pytest.approx(ref, abs=1e-5)
    # cached per path: the same objects on the next call, and the same scores
    before = dict(rm._cache)
    assert fn(prompts, completions, path=tiny_rm, batch_size=3, max_length=32) == pytest.approx(out)
    assert rm._cache == before and len(before) == 1
    other = fn(prompts[:1], completions[:1], path=tiny_rm, label_index=1)
    assert other[0] != pytest.approx(out[0])


def test_reward_model_scores_each_group_with_the_prompt_encoded_once(tiny_rm):
    """share_prompt (the default) equals per-row scoring, with each prompt's tokens run through the model once:
    groups of 1, 2 and 4 rows, interleaved, ragged, an empty completion and a completion of padding-free text."""
    from grpo.rewards import reward_model as rm

    prompts = ["what is two plus two the answer is "] * 4 + ["five "] + ["the "] * 2
    completions = ["four", "five five", "", "two plus two is four", "four", "answer", "the the the"]
    order = [0, 4, 1, 5, 2, 3, 6]  # rows of a prompt need not be adjacent
    prompts, completions = [prompts[i] for i in order], [completions[i] for i in order]
    model, tok, _ = rm.load(tiny_rm)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        shared = rm.reward_model(prompts, completions, path=tiny_rm, batch_size=8)
        shared_tokens, seen[:] = sum(seen), []
        per_row = rm.reward_model(prompts, completions, path=tiny_rm, batch_size=8, share_prompt=False)
    finally:
        hook.remove()
    assert shared == pytest.approx(per_row, abs=1e-5)
    rows = [tok(p + c)["input_ids"] for p, c in zip(prompts, completions)]
    prompt_tokens = {p: len(tok(p)["input_ids"]) for p in prompts}
    # each distinct prompt once, then every row's own tokens
    assert shared_tokens == sum(prompt_tokens.values()) + sum(len(r) - prompt_tokens[p] for r, p in zip(rows, prompts))
    assert len(set(shared)) > 3
    # groups packed into forwards of about batch_size rows: the same scores
    assert rm.reward_model(prompts, completions, path=tiny_rm, batch_size=2) == pytest.approx(per_row, abs=1e-5)


def test_reward_model_needs_path():
    with pytest.raises(ValueError):
        resolve("reward_model")(["p"], ["c"])
