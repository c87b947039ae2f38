"""grpo/trainer/budget.py: the micro-batch budget at start; a prompt + completion that cannot fit is refused."""
from types import SimpleNamespace

import pytest
import torch

from grpo.errors import SetupError
from grpo.models import tiny_model
from grpo.runtime.local import LocalRuntime
from grpo.trainer.budget import plan


def _runtime():
    rt = LocalRuntime("cpu")
    model = tiny_model("llama", 40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.setup(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    return rt


def test_an_explicit_budget_is_kept_and_one_too_small_refused_naming_the_key(cfg_factory, capsys):
    splits = SimpleNamespace(train=[{"prompt_ids": [1] * 20}, {"prompt_ids": [1] * 30}])
    rt = _runtime()
    assert plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 256}}), splits, rt) == 256
    with pytest.raises(SetupError, match="max_tokens_per_micro_batch"):
        plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 40}}), splits, rt)  # 30 + 16 > 40
    assert plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": "auto"}}), splits, rt) >= 46


def _spy(monkeypatch, name):
    """Record each call of grpo.trainer.budget's ``name`` (the real function still runs)."""
    import grpo.trainer.budget as budget

    calls, real = [], getattr(budget, name)

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(budget, name, spy)
    return calls


def test_the_estimate_holds_the_group_scores_of_the_longest_prompt_and_completion(cfg_factory, monkeypatch):
    from grpo.engine.memory import estimate, group_score_bytes

    rt = _runtime()
    scores, chosen = _spy(monkeypatch, "group_score_bytes"), _spy(monkeypatch, "choose_budget")
    cfg = cfg_factory({"engine": {"max_tokens_per_micro_batch": 256}, "algorithm": {"group_size": 3}})
    splits = SimpleNamespace(train=[{"prompt_ids": [1] * 20}, {"prompt_ids": [1] * 30}])
    plan(cfg, splits, rt)
    new = cfg.rollout.max_new_tokens
    assert scores == [(rt.model.config, 3, 30, new)]
    (value, est, free, longest, on_gpu), = chosen
    assert (value, longest, on_gpu) == (256, 30 + new, False) and free > 0
    assert est.transient == estimate(rt.model).transient + group_score_bytes(rt.model.config, 3, 30, new)
    plan(cfg, SimpleNamespace(train=[]), rt)  # no training prompt: the completion alone
    assert scores[-1][2] == 0 and chosen[-1][3] == new


def test_on_a_gpu_the_budget_is_chosen_for_the_gpu(cfg_factory, monkeypatch):
    import grpo.trainer.budget as budget

    chosen = _spy(monkeypatch, "choose_budget")
    monkeypatch.setattr(budget, "free_for", lambda device, ecfg: 2**34)
    cpu = _runtime()
    rt = SimpleNamespace(device=torch.device("cuda"), model=cpu.model, is_main=True)
    plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 256}}), SimpleNamespace(train=[]), rt)
    assert chosen[-1][2:] == (2**34, cfg_factory().rollout.max_new_tokens, True)


def test_the_choice_is_printed_once_on_stderr_by_the_main_process(cfg_factory, capsys):
    rt = _runtime()
    cfg = cfg_factory({"engine": {"max_tokens_per_micro_batch": 256}})
    plan(cfg, SimpleNamespace(train=[{"prompt_ids": [1] * 20}]), rt)
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("[grpo] engine.max_tokens_per_micro_batch=256") and \
        out.err.count("\n") == 1
    other = SimpleNamespace(device=rt.device, model=rt.model, is_main=False)  # another rank
    assert plan(cfg, SimpleNamespace(train=[{"prompt_ids": [1] * 20}]), other) == 256
    assert capsys.readouterr().err == ""


def test_a_refused_multi_turn_budget_says_how_long_a_completion_gets(cfg_factory):
    rt = _runtime()
    splits = SimpleNamespace(train=[{"prompt_ids": [1] * 30}])
    with pytest.raises(SetupError) as single:
        plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 40}}), splits, rt)
    assert "multi-turn" not in str(single.value)
    cfg = cfg_factory({"engine": {"max_tokens_per_micro_batch": 40},
                       "rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator", "max_turns": 3}})
    with pytest.raises(SetupError) as multi:
        plan(cfg, splits, rt)
    r = cfg.rollout
    completion = 3 * r.max_new_tokens + 2 * (r.max_tool_tokens + 32)
    assert str(multi.value).endswith(
        f" (multi-turn: a completion is up to {completion} tokens, rollout.max_turns turns of max_new_tokens with "
        "tool text of up to rollout.max_tool_tokens between them)")


@pytest.mark.parametrize("limit", [0, -1.5])
def test_a_memory_limit_that_is_not_positive_is_refused_naming_the_key(cfg_factory, limit):
    splits = SimpleNamespace(train=[{"prompt_ids": [1] * 20}])
    with pytest.raises(SetupError, match=rf"^engine.memory_limit_gib={float(limit)} must be > 0"):
        plan(cfg_factory({"engine": {"memory_limit_gib": limit}}), splits, _runtime())


def test_the_memory_limit_bounds_the_auto_budget(cfg_factory):
    splits, rt = SimpleNamespace(train=[{"prompt_ids": [1] * 20}]), _runtime()
    auto = {"max_tokens_per_micro_batch": "auto"}
    assert plan(cfg_factory({"engine": {**auto, "memory_limit_gib": 4}}), splits, rt) >= 20 + 16
    assert plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 64, "memory_limit_gib": 0.5}}), splits, rt) == 64
    with pytest.raises(SetupError, match="of the 0.0 GiB free"):  # a millionth of a GiB holds no sequence
        plan(cfg_factory({"engine": {**auto, "memory_limit_gib": 1e-6}}), splits, rt)


def test_a_refused_single_turn_budget_says_what_the_budget_check_said_and_nothing_more(cfg_factory, monkeypatch):
    import grpo.trainer.budget as budget

    said, real = [], budget.choose_budget

    def choose(*args):
        try:
            return real(*args)
        except ValueError as e:
            said.append(str(e))
            raise

    monkeypatch.setattr(budget, "choose_budget", choose)
    with pytest.raises(SetupError) as e:
        plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 40}}),
             SimpleNamespace(train=[{"prompt_ids": [1] * 30}]), _runtime())
    assert said and str(e.value) == said[-1]
