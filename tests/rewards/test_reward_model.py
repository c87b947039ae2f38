"""The reward-model reward (grpo/rewards/reward_model.py) function by function, on a tiny Llama classifier built in
memory and handed to ``load`` through its own ``from_pretrained`` calls (no files): the scores against the model's own
per-row forward, the loading rules, the texts, the shared-prefix grouping. tests/rewards/test_builtins.py runs it from
a saved directory."""
from __future__ import annotations

import types

import pytest
import torch

# imported here, not in the tests: `make mutate` runs every mutant in a fresh process, which would pay these again
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

import grpo.engine.hidden_states  # noqa: F401  (the shared-prefix engine, imported by the reward on its first call)
import grpo.engine.patch  # noqa: F401
from grpo.rewards import reward_model as rm
from grpo.rewards.registry import resolve

WORDS = ["[PAD]", "[UNK]", "[EOS]"] + "what is two plus two four five the answer".split()


def _tok(pad=True, eos=True):
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    kw = {"pad_token": "[PAD]"} if pad else {}
    kw.update({"eos_token": "[EOS]"} if eos else {})
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", **kw)


@pytest.fixture(scope="module")
def classifier():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=2, pad_token_id=None,
                      max_position_embeddings=64)
    return LlamaForSequenceClassification(cfg).eval()


@pytest.fixture
def served(monkeypatch, classifier):
    """``load`` reads the in-memory tokenizer and classifier; what it was asked for is recorded."""
    ns = types.SimpleNamespace(asked=[], model=classifier, tok=_tok(pad=False))
    asked = ns.asked
    classifier.config.pad_token_id = None
    classifier.requires_grad_(True).train()

    def tok_from(path):
        asked.append(("tok", path))
        return ns.tok

    def model_from(path, dtype=None):
        asked.append(("model", path, dtype))
        return classifier

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tok_from)
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", model_from)
    rm.clear_cache()
    yield ns
    rm.clear_cache()


def _reference(model, tok, text, label=0, max_length=None):
    ids = tok(text)["input_ids"] or [tok.eos_token_id]
    ids = ids[-max_length:] if max_length else ids
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, label].item()


def test_the_device_is_the_given_one_else_this_ranks_gpu_else_the_cpu(monkeypatch):
    assert rm._device("meta") == torch.device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rm._device(None) == torch.device("cpu") and rm._device("") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert rm._device(None) == torch.device("cuda", 3)
    assert rm._device("cpu") == torch.device("cpu")


def test_load_sets_padding_and_truncation_freezes_the_model_and_keeps_it_per_path_device_and_dtype(served):
    model, tok, dev = rm.load("org/rm", device="cpu")
    assert served.asked == [("tok", "org/rm"), ("model", "org/rm", torch.float32)]
    assert model is served.model and dev == torch.device("cpu")
    assert tok.pad_token == "[EOS]" and tok.truncation_side == "left"
    assert model.config.pad_token_id == WORDS.index("[EOS]")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert rm.load("org/rm", device="cpu") == (model, tok, dev) and len(served.asked) == 2  # kept
    rm.load("org/rm", device="cpu", dtype="float64")  # another dtype: loaded again, in that dtype
    assert served.asked[2:] == [("tok", "org/rm"), ("model", "org/rm", torch.float64)]
    assert len(rm._cache) == 2
    rm.clear_cache()
    assert rm._cache == {}
    served.model.to(torch.float32)


def test_load_pads_with_unk_without_eos_and_keeps_a_tokenizers_and_models_own_padding(served):
    served.tok = _tok(pad=False, eos=False)
    _, tok, _ = rm.load("org/rm", device="cpu")
    assert tok.pad_token == "[UNK]" and served.model.config.pad_token_id == WORDS.index("[UNK]")
    rm.clear_cache()
    served.tok, served.model.config.pad_token_id = _tok(), 5
    _, tok, _ = rm.load("org/rm", device="cpu")
    assert tok.pad_token == "[PAD]" and served.model.config.pad_token_id == 5


def test_load_picks_bfloat16_only_on_a_gpu_that_supports_it(served, monkeypatch):
    moved = []
    monkeypatch.setattr(served.model, "to", lambda d: moved.append(d) or served.model)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    rm.load("org/rm", device="cuda:1")
    rm.load("org/rm", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    rm.load("org/rm", device="cuda:0")
    assert [a[2] for a in served.asked if a[0] == "model"] == [torch.bfloat16, torch.float32, torch.float32]
    assert moved == [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0)]
    assert set(rm._cache) == {("org/rm", "cuda:1", "torch.bfloat16"), ("org/rm", "cpu", "torch.float32"),
                              ("org/rm", "cuda:0", "torch.float32")}


def test_texts_are_prompt_plus_completion_or_the_eos_token_or_the_chat_template():
    tok = types.SimpleNamespace(eos_token="<e>", pad_token="<p>")
    assert rm._texts(tok, ["a ", "", " "], ["b", "", " "], False) == ["a b", "<e>", "<e>"]
    tok.eos_token = None
    assert rm._texts(tok, [""], [""], False) == ["<p>"]
    seen = []
    tok.apply_chat_template = lambda msgs, tokenize: seen.append((msgs, tokenize)) or f"T{len(seen)}"
    assert rm._texts(tok, ["q1", "q2"], ["c1", "c2"], True) == ["T1", "T2"]
    assert seen[1] == ([{"role": "user", "content": "q2"}, {"role": "assistant", "content": "c2"}], False)


def test_pooled_position_is_the_last_token_that_is_not_padding():
    assert rm._pooled_position([4, 5, 6], None) == 2
    assert rm._pooled_position([4, 0, 5, 0, 0], 0) == 2
    assert rm._pooled_position([0, 0], 0) == 0
    assert rm._pooled_position([7, 8], 0) == 1


def test_common_prefix_is_the_length_of_the_tokens_every_row_starts_with():
    assert rm._common_prefix([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3]]) == 2
    assert rm._common_prefix([[1, 2], [1, 2, 3]]) == 2
    assert rm._common_prefix([[1, 2], [1, 2]]) == 2
    assert rm._common_prefix([[3, 2], [1, 2]]) == 0
    assert rm._common_prefix([[1, 2, 3], [1, 9, 3]]) == 1


PROMPTS = ["what is two plus two ", "five ", "what is two plus two ", "the ", "what is two plus two ", "", "", ""]
COMPLETIONS = ["four", "two", "the answer is five five five", "", "four four", "", "four", "five"]


def _scored(model, **kw):
    forwards = []
    hook = model.model.register_forward_hook(lambda m, i, o: forwards.append(1))
    try:
        return rm.reward_model(PROMPTS, COMPLETIONS, path="org/rm", device="cpu:0", **kw), len(forwards)
    finally:
        hook.remove()


@pytest.mark.parametrize("share", [True, False, None])
def test_the_scores_are_the_models_own_per_row_forward(served, share):
    """Each prompt's rows as one group (share_prompt, the default): the three rows of one prompt in one forward, the
    rows of the prompt "" alone (they share no first token), against one forward a row without it."""
    served.tok = _tok()
    served.tok.padding_side = "left"  # a batch's padding comes first: the attention mask must hide it
    kw = {} if share is None else {"share_prompt": share}
    out, forwards = _scored(served.model, batch_size=1, dtype="bfloat16", **kw)
    assert served.asked == [("tok", "org/rm"), ("model", "org/rm", torch.bfloat16)]
    assert set(rm._cache) == {("org/rm", "cpu:0", "torch.bfloat16")}
    model, tok, _ = rm.load("org/rm", device="cpu:0", dtype="bfloat16")
    assert tok.truncation_side == "left"
    ref = [_reference(model, tok, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert all(isinstance(v, float) for v in out)
    assert torch.allclose(torch.tensor(out), torch.tensor(ref), atol=1e-5)
    assert forwards == (8 if share is False else 6)
    # forwards of about batch_size rows (the shared path packs groups: the three-row group alone, then 1 + 1, ...)
    out, forwards = _scored(served.model, batch_size=2, dtype="bfloat16", **kw)
    assert torch.allclose(torch.tensor(out), torch.tensor(ref), atol=1e-5) and forwards == 4
    assert _scored(served.model, batch_size=0, dtype="bfloat16", **kw)[1] == (8 if share is False else 6)  # 1 a forward
    again = rm.reward_model(PROMPTS[:2], COMPLETIONS[:2], path="org/rm", label_index=1, device="cpu:0",
                            dtype="bfloat16", batch_size=3, **kw)
    ref1 = [_reference(model, tok, p + c, label=1) for p, c in zip(PROMPTS[:2], COMPLETIONS[:2])]
    assert torch.allclose(torch.tensor(again), torch.tensor(ref1), atol=1e-5)


def test_by_default_rows_go_eight_a_forward_and_keep_their_last_2048_tokens(served):
    served.tok = _tok()
    forwards = []
    hook = served.model.model.register_forward_hook(lambda m, a, k, o: forwards.append(k["attention_mask"].shape),
                                                    with_kwargs=True)
    try:
        rm.reward_model(["five "] * 9, ["two"] * 9, path="org/rm", share_prompt=False)
        assert forwards == [torch.Size([8, 2]), torch.Size([1, 2])]
        forwards.clear()
        rm.reward_model(["five "], ["two " * 2049], path="org/rm", share_prompt=False)
    finally:
        hook.remove()
    assert forwards == [torch.Size([1, 2048])]


class _Recorder(torch.nn.Module):
    """A classifier without a score head (scored row by row) that records the device of what it is given."""

    def __init__(self):
        super().__init__()
        self.config, self.seen = types.SimpleNamespace(pad_token_id=0), []

    def forward(self, input_ids, attention_mask):
        self.seen.append((input_ids.device, attention_mask.device))
        return types.SimpleNamespace(logits=torch.zeros(len(input_ids), 2))


def test_the_rows_go_to_the_models_device(served, monkeypatch):
    model = _Recorder()
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", lambda path, dtype=None: model)
    monkeypatch.setattr(model, "to", lambda d: model)
    out = rm.reward_model(["five "], ["two"], path="org/rm", device="meta")
    assert out == [0.0] and model.seen == [(torch.device("meta"), torch.device("meta"))]


@pytest.mark.parametrize("share", [True, False])
def test_long_rows_keep_their_last_tokens_and_non_texts_count_as_empty(served, share):
    served.tok = _tok()
    out = rm.reward_model(["what is two plus two the answer is ", None], ["five four two", 3], path="org/rm",
                          max_length=4, device="cpu", share_prompt=share)
    model, tok, _ = rm.load("org/rm", device="cpu")
    ref = [_reference(model, tok, "what is two plus two the answer is five four two", max_length=4),
           _reference(model, tok, "")]
    assert torch.allclose(torch.tensor(out), torch.tensor(ref), atol=1e-5)


def test_a_chat_template_formats_the_pair_and_adds_no_special_tokens(served, monkeypatch):
    """The template ends the text with [EOS], the tokenizer's padding too: HF pools at the last token that is not
    padding, and so must the shared path."""
    served.tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}[EOS]"
    calls = []
    real = PreTrainedTokenizerFast.__call__
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__",
                        lambda self, *a, **k: calls.append(k.get("add_special_tokens", True)) or real(self, *a, **k))
    out = rm.reward_model(["what is"], ["four"], path="org/rm", chat_template=True, device="cpu")
    assert calls and not any(calls)
    model, tok, _ = rm.load("org/rm", device="cpu")
    assert torch.allclose(torch.tensor(out), torch.tensor([_reference(model, tok, "what is four [EOS]")]), atol=1e-5)
    calls.clear()
    assert rm.reward_model(["what is"], ["four"], path="org/rm", chat_template=True, device="cpu",
                           share_prompt=False) == pytest.approx(out, abs=1e-5)
    assert calls == [False]
    calls.clear()
    rm.reward_model(["what is"], ["four"], path="org/rm", device="cpu", share_prompt=False)
    assert calls == [True]


def test_the_engine_serves_a_model_with_a_score_head_that_it_supports(classifier):
    assert rm._engine_serves(classifier)
    assert not rm._engine_serves(types.SimpleNamespace(score=None))
    assert not rm._engine_serves(classifier.model)  # no score head


def test_a_path_is_needed_and_a_missing_local_one_is_named(served):
    with pytest.raises(ValueError, match="path="):
        resolve("reward_model")(["p"], ["c"])
    with pytest.raises(ValueError, match="/no/such/dir"):
        rm.reward_model(["p"], ["c"], path="/no/such/dir")
    assert served.asked == []
