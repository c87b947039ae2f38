"""grpo/trainer/settings.py: every stage's settings derived once; the checked config is left as it was.

The smoke recipe is composed once, when the module is imported (`make mutate` forks every mutant's run from a process
that has collected the tests, so no mutant composes it again); each test merges its overrides into it."""
from omegaconf import OmegaConf

from grpo.algorithm.policy_loss import POLICY_LOSSES
from grpo.config.schema import load
from grpo.rollout.base import Sampling
from grpo.trainer.settings import EvalSettings, derive, eval_settings
from tests.helpers import smoke_raw

SMOKE = smoke_raw()


def config(overrides: dict):
    raw = OmegaConf.merge(SMOKE, {"trainer": {"output_dir": "unused"}}, overrides)
    return load(OmegaConf.to_container(raw, resolve=True))


def test_settings_carry_the_config_and_the_sized_budget_without_writing_into_it():
    cfg = config({"engine": {"max_tokens_per_micro_batch": "auto"}, "trainer": {"eval_max_new_tokens": 7}})
    s = derive(cfg, max_tokens=321)
    assert s.update.engine.max_tokens_per_micro_batch == 321 and s.collect.engine.max_tokens_per_micro_batch == 321
    assert cfg.engine.max_tokens_per_micro_batch == "auto"
    assert s.collect.sampling.max_new_tokens == cfg.rollout.max_new_tokens and s.collect.group_size == 4
    assert s.evaluation.max_new_tokens == 7 and s.evaluation.batch_size == cfg.rollout.batch_size * 4
    assert s.episodes is None and s.seed == cfg.trainer.seed
    assert derive(cfg).update.engine.max_tokens_per_micro_batch == "auto"


def test_multi_turn_runs_get_episode_settings():
    cfg = config({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator", "max_turns": 3}})
    s = derive(cfg, max_tokens=500, chat=True)
    assert s.episodes.max_turns == 3 and s.episodes.chat and s.episodes.max_tokens == 500
    assert s.update.max_len == cfg.rollout.max_new_tokens * 3  # dr_grpo's constant: every turn's tokens


def test_every_stage_gets_each_key_from_its_own_place():
    """Distinct values for every key a stage takes, so a swapped or dropped one shows."""
    cfg = config({"rollout": {"max_new_tokens": 11, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
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


def test_episode_settings_take_the_tool_budget_and_the_configured_micro_batch():
    cfg = config({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator", "max_turns": 2,
                                   "max_tool_tokens": 9, "max_new_tokens": 13},
                       "engine": {"max_tokens_per_micro_batch": 700}})
    e = derive(cfg).episodes  # no sized budget: the configured one
    assert (e.max_turns, e.max_tool_tokens, e.chat, e.max_new_tokens, e.max_tokens) == (2, 9, False, 13, 700)
    auto = config({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator"},
                        "engine": {"max_tokens_per_micro_batch": "auto"}})
    assert derive(auto).episodes.max_tokens == 0  # auto, not yet sized: no bound


def test_a_sampled_evaluation_takes_its_own_sampling_ks_seed_and_correct_reward():
    cfg = config({"evaluation": {"n": 4, "temperature": 0.6, "top_p": 0.8, "top_k": 7, "k": [4, 2, 2], "seed": 5,
                                 "correct_reward": "format", "threshold": 0.5},
                  "rollout": {"max_new_tokens": 9}})
    assert eval_settings(cfg) == EvalSettings(9, cfg.rollout.batch_size * 4, 4, Sampling(9, 0.6, 0.8, 7), (2, 4), 5,
                                              "format", 0.5)  # k sorted, each once
    assert eval_settings(config({"evaluation": {"n": 3, "temperature": 0.6}})).ks == (1, 3)  # no k: 1 and n
    # any temperature above 0 samples (below 1 as well); 0 is greedy
    warm = config({"evaluation": {"temperature": 0.5}})
    assert eval_settings(warm).sampling == Sampling(warm.rollout.max_new_tokens, 0.5)
    assert eval_settings(config({})).sampling is None


def test_the_sampler_and_the_update_get_the_run_resolved_and_their_sections():
    cfg = config({"data": {"max_prompt_tokens": 77}, "trainer": {"seed": 23}})
    s = derive(cfg)
    sampler = s.sampler
    assert (sampler.backend, sampler.rollout, sampler.reward, sampler.data) == ("hf", cfg.rollout, cfg.reward, cfg.data)
    assert (sampler.model_name, sampler.seed, sampler.longest_prompt) == (cfg.model.name_or_path, 23, 77)
    assert sampler.episodes is None and s.update.policy_loss is POLICY_LOSSES.get("ppo_clip")  # resolved once
    given = derive(cfg, backend="vllm", longest_prompt=31).sampler  # the data's longest prompt, where known
    assert (given.backend, given.longest_prompt) == ("vllm", 31)
    multi = derive(config({"rollout": {"environment": "grpo.rollout.episodes.calculator:Calculator"}}))
    assert multi.sampler.episodes is multi.episodes and multi.episodes is not None
