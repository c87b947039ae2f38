"""grpo/trainer/settings.py: every stage's settings derived once; the checked config is left as it was."""
from grpo.rollout.base import Sampling
from grpo.trainer.settings import EvalSettings, derive


def test_settings_carry_the_config_and_the_sized_budget_without_writing_into_it(cfg_factory):
    cfg = cfg_factory({"engine": {"max_tokens_per_micro_batch": "auto"}, "trainer": {"eval_max_new_tokens": 7}})
    s = derive(cfg, max_tokens=321)
    assert s.update.engine.max_tokens_per_micro_batch == 321 and s.collect.engine.max_tokens_per_micro_batch == 321
    assert cfg.engine.max_tokens_per_micro_batch == "auto"
    assert s.collect.sampling.max_new_tokens == cfg.rollout.max_new_tokens and s.collect.group_size == 4
    assert s.evaluation.max_new_tokens == 7 and s.evaluation.batch_size == cfg.rollout.batch_size * 4
    assert s.episodes is None and s.seed == cfg.trainer.seed
    assert derive(cfg).update.engine.max_tokens_per_micro_batch == "auto"


def test_multi_turn_runs_get_episode_settings(cfg_factory):
    cfg = cfg_factory({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator", "max_turns": 3}})
    s = derive(cfg, max_tokens=500, chat=True)
    assert s.episodes.max_turns == 3 and s.episodes.chat and s.episodes.max_tokens == 500
    assert s.update.max_len == cfg.rollout.max_new_tokens * 3  # dr_grpo's constant: every turn's tokens


def test_every_stage_gets_each_key_from_its_own_place(cfg_factory):
    """Distinct values for every key a stage takes, so a swapped or dropped one shows."""
    cfg = cfg_factory({"rollout": {"max_new_tokens": 11, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                   "prompts_per_step": 3, "batch_size": 1},
                       "algorithm": {"group_size": 2, "mask_truncated": True, "rollout_is": "sequence_mask",
                                     "rollout_is_cap": 3.5},
                       "trainer": {"seed": 17, "max_grad_norm": 0.25}})
    s = derive(cfg, max_tokens=400)
    assert s.collect.sampling == Sampling(11, 0.7, 0.9, 5, greedy=False)
    assert (s.collect.prompts_per_step, s.collect.group_size, s.collect.seed) == (3, 2, 17)
    assert s.collect.algorithm is cfg.algorithm and s.update.algorithm is cfg.algorithm
    u = s.update
    assert (u.temperature, u.max_len, u.mask_truncated, u.max_grad_norm) == (0.7, 11, True, 0.25)
    assert (u.rollout_is, u.rollout_is_cap) == ("sequence_mask", 3.5)
    assert s.evaluation == EvalSettings(max_new_tokens=11, batch_size=2)  # eval_max_new_tokens unset: rollout's


def test_episode_settings_take_the_tool_budget_and_the_configured_micro_batch(cfg_factory):
    cfg = cfg_factory({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator", "max_turns": 2,
                                   "max_tool_tokens": 9, "max_new_tokens": 13},
                       "engine": {"max_tokens_per_micro_batch": 700}})
    e = derive(cfg).episodes  # no sized budget: the configured one
    assert (e.max_turns, e.max_tool_tokens, e.chat, e.max_new_tokens, e.max_tokens) == (2, 9, False, 13, 700)
    auto = cfg_factory({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator"},
                        "engine": {"max_tokens_per_micro_batch": "auto"}})
    assert derive(auto).episodes.max_tokens == 0  # auto, not yet sized: no bound
