"""grpo/registry.py: one helper behind every registry (policy losses, advantage estimators, tasks, rewards, rollout
backends): a name registered again with the same object keeps it, with another object is refused in one line."""
import functools

import pytest

from grpo.registry import Registry


def one(x):
    return x


def other(x):
    return -x


def test_the_same_object_again_is_kept_and_another_is_refused_in_one_line():
    r = Registry("widget")
    assert r.register("a")(one) is one and r.add("a", one) is one  # a module imported twice registers again
    wrapped = functools.wraps(one)(lambda x: one(x))
    assert r.add("a", wrapped) is one  # a wrapper of the same function is the same registration
    with pytest.raises(ValueError) as e:
        r.add("a", other)
    assert str(e.value) == ("widget 'a' is registered twice: tests.test_registry.one and tests.test_registry.other; "
                            "give one of them another name")
    assert r["a"] is one and r.get("b") is None and "a" in r and "b" not in r
    r.add("b", other)
    assert r.names() == ["a", "b"] and list(r) == ["a", "b"]


def test_every_registry_of_grpo_refuses_a_conflicting_duplicate():
    from grpo.algorithm.advantages import ADVANTAGE_SCALES
    from grpo.algorithm.policy_loss import POLICY_LOSSES, register_policy_loss
    from grpo.rewards.registry import REWARDS, register
    from grpo.rollout.registry import BACKENDS
    from grpo.tasks import TASKS, register_task

    for reg, add in ((POLICY_LOSSES, register_policy_loss), (TASKS, register_task), (REWARDS, register)):
        name = next(iter(reg))
        with pytest.raises(ValueError, match=f"'{name}' is registered twice"):
            add(name)(other)
    for reg in (ADVANTAGE_SCALES, BACKENDS):
        name = next(iter(reg))
        with pytest.raises(ValueError, match=f"'{name}' is registered twice"):
            reg.add(name, other)


def test_a_registered_name_is_got_back_and_a_conflict_of_plain_values_names_them_by_repr():
    """Objects without a module and a qualified name (values, partials) are named by their repr in the error."""
    r = Registry("widget")
    r.add("a", one)
    assert r.get("a") is one
    r.add("n", 3)
    with pytest.raises(ValueError) as e:
        r.add("n", 4)
    assert str(e.value) == "widget 'n' is registered twice: 3 and 4; give one of them another name"
    p, q = functools.partial(one, 1), functools.partial(other, 1)
    r.add("p", p)
    with pytest.raises(ValueError) as e:
        r.add("p", q)
    assert str(e.value) == f"widget 'p' is registered twice: {p!r} and {q!r}; give one of them another name"
