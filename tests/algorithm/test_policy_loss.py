"""grpo/algorithm/policy_loss.py: the registry of policy losses (a new loss is one function) and ppo_clip."""
import sys

import pytest
import torch

from grpo.algorithm.loss import objective
from grpo.algorithm.policy_loss import get_policy_loss, ppo_clip, register_policy_loss
from grpo.config.schema import AlgorithmConfig
from grpo.errors import ConfigError

LOGP = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
OLD = torch.tensor([[-1.2, -1.5, -0.5]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])
ADV = torch.tensor([2.0])
W = MASK / 2  # token_mean over the two real tokens


def test_a_registered_loss_is_used_by_name_and_its_stats_are_kept():
    @register_policy_loss("test_reinforce")
    def reinforce(logp, old_logp, advantages, mask, algorithm):
        return -logp * advantages[:, None], {"ratio": mask.sum()}

    loss, stats = objective(LOGP, OLD, None, ADV, MASK, W, AlgorithmConfig(policy_loss="test_reinforce", beta=0.0))
    assert loss.item() == pytest.approx(-(-1.0 - 2.0) * 2.0 / 2)  # the masked token is not counted
    assert stats["ratio"].item() == 2 and "clip_low" not in stats


def test_a_loss_outside_grpo_is_named_module_function(tmp_path, monkeypatch):
    (tmp_path / "myloss.py").write_text("def zero(logp, old_logp, advantages, mask, algorithm):\n"
                                        "    return 0 * logp, {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "myloss", raising=False)
    loss, _ = objective(LOGP, OLD, None, ADV, MASK, W, AlgorithmConfig(policy_loss="myloss:zero"))
    assert loss.item() == 0.0


def test_an_unknown_loss_is_one_line_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss='nope' is not a registered.*ppo_clip"):
        get_policy_loss("nope")
    with pytest.raises(ConfigError, match="algorithm.policy_loss='nomodule_xyz:f': cannot import"):
        get_policy_loss("nomodule_xyz:f")


def test_ppo_clip_is_the_default_and_clips_the_ratio():
    assert get_policy_loss(AlgorithmConfig().policy_loss) is ppo_clip
    per_token, stats = ppo_clip(LOGP, OLD, ADV, MASK, AlgorithmConfig(epsilon=0.2))
    r = torch.exp(LOGP - OLD)[0]          # 1.22 (clipped at 1.2 for A > 0), 0.61
    assert per_token[0, 0].item() == pytest.approx(-1.2 * 2.0)
    assert per_token[0, 1].item() == pytest.approx(-r[1].item() * 2.0)
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 0


def test_a_ratio_at_a_clip_bound_is_not_counted_as_clipped():
    from types import SimpleNamespace

    alg = SimpleNamespace(epsilon=0.0, epsilon_high=None, delta=None, importance_sampling="token")
    logp = torch.zeros(2, 2)  # ratio exactly 1 = 1 - eps = 1 + eps
    _, stats = ppo_clip(logp, logp.clone(), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), alg)
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0 and stats["ratio"].item() == 4
    _, stats = ppo_clip(logp - 0.1, logp, torch.tensor([-1.0, 1.0]), torch.ones(2, 2), alg)
    assert stats["clip_low"].item() == 2 and stats["clip_high"].item() == 0  # below it: the negative advantage's


def test_only_a_negative_advantage_counts_as_clipped_low_and_only_a_positive_one_high():
    from types import SimpleNamespace

    alg = SimpleNamespace(epsilon=0.2, epsilon_high=None, delta=None, importance_sampling="token")
    old, mask = torch.zeros(2, 2), torch.ones(2, 2)
    _, low = ppo_clip(old - 0.5, old, torch.tensor([0.0, 0.5]), mask, alg)   # ratio 0.61 < 0.8
    _, high = ppo_clip(old + 0.5, old, torch.tensor([0.0, -0.5]), mask, alg)  # ratio 1.65 > 1.2
    assert (low["clip_low"].item(), low["clip_high"].item(), high["clip_low"].item(), high["clip_high"].item()) == \
        (0, 0, 0, 0)
    _, both = ppo_clip(torch.tensor([[-0.5], [0.5]]), torch.zeros(2, 1), torch.tensor([-0.5, 0.5]), torch.ones(2, 1),
                       alg)
    assert (both["clip_low"].item(), both["clip_high"].item()) == (1, 1)
