"""grpo/trainer/settings.py: every stage's settings derived once; the checked config is left as it was."""
from grpo.trainer.settings import derive


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
