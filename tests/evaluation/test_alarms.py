"""Each alarm fires on a metric stream built to trigger it (once, after its patience), clears once, and stays quiet
on a healthy stream: the real quickstart's metrics.jsonl (tests/fixtures/quickstart_metrics.jsonl)."""
import json

import pytest

from grpo.config.evaluation import AlarmsConfig
from grpo.evaluation.alarms import RULES, Alarms, Context
from tests.helpers import ROOT

CTX = Context(max_new_tokens=16, group_size=8, temperature=0.7)
HEALTHY = {"truncated_frac": 0.1, "zero_std_frac": 0.4, "entropy": 0.6, "loss": 0.01, "grad_norm": 0.5,
           "reward/accuracy": 0.4, "reward/accuracy_std": 0.49, "rollout_is/logp_diff_abs_mean": 0.01,
           "empty_batch": False}
BAD = {"truncation": {"truncated_frac": 1.0}, "zero_std": {"zero_std_frac": 1.0}, "entropy": {"entropy": 0.001},
       "logprob_gap": {"rollout_is/logp_diff_abs_mean": 0.9},
       "constant_reward": {"reward/accuracy": 0.0, "reward/accuracy_std": 0.0},
       "non_finite": {"loss": float("nan"), "grad_norm": float("inf")}}


def alarms(**changes) -> Alarms:
    cfg = AlarmsConfig()
    for name, kw in changes.items():
        for k, v in kw.items():
            setattr(getattr(cfg, name), k, v)
    return Alarms({n: getattr(cfg, n) for n in RULES}, CTX)


def run(a: Alarms, stream: list[dict]) -> list[tuple[int, object]]:
    return [(step, e) for step, m in enumerate(stream, 1) for e in a.update(step, m)]


@pytest.mark.parametrize("name", list(RULES))
def test_each_alarm_fires_after_its_patience_and_clears_once(name):
    a = alarms()
    patience = getattr(AlarmsConfig(), name).patience
    stream = [HEALTHY] * 2 + [{**HEALTHY, **BAD[name]}] * (patience + 3) + [HEALTHY] * 2
    events = run(a, stream)
    assert [(s, e.name, e.fired) for s, e in events] == [(2 + patience, name, True), (2 + patience + 4, name, False)]
    subject = {"logprob_gap": " (rollout_is/logp_diff_abs_mean)", "constant_reward": " (accuracy)"}.get(name, "")
    assert events[1][1].line == f"alarm {name}{subject} cleared at step {2 + patience + 4}"


def test_messages_say_what_and_what_to_change():
    a = alarms(truncation={"patience": 2})
    (_, e), = run(a, [{**HEALTHY, "truncated_frac": 0.92}] * 2)
    assert e.line == ("alarm truncation: 92% of completions hit rollout.max_new_tokens=16 for 2 steps: rewards are "
                      "computed on cut answers; raise rollout.max_new_tokens")
    a = alarms(constant_reward={"patience": 1})
    (_, e), = run(a, [{**HEALTHY, **BAD["constant_reward"]}])
    assert "reward.functions.accuracy gave every sample the same score (0)" in e.line


def test_patience_counts_steps_in_a_row():
    a = alarms(zero_std={"patience": 3})
    bad = {**HEALTHY, "zero_std_frac": 1.0}
    assert run(a, [bad, bad, HEALTHY, bad, bad, HEALTHY]) == []   # never 3 in a row
    assert a.metrics()["alarm/zero_std"] == 0
    assert len(run(a, [bad] * 3)) == 1 and a.metrics()["alarm/zero_std"] == 1


def test_disabled_and_threshold_configurable():
    a = alarms(truncation={"enabled": False})
    assert run(a, [{**HEALTHY, "truncated_frac": 1.0}] * 10) == []
    assert "alarm/truncation" not in a.metrics()
    a = alarms(truncation={"threshold": 0.05, "patience": 1})
    assert len(run(a, [HEALTHY])) == 1                          # 10% truncated is over a 5% threshold


def test_constant_reward_is_per_function():
    a = alarms(constant_reward={"patience": 2})
    m = {**HEALTHY, "reward/format": 1.0, "reward/format_std": 0.0}
    events = run(a, [m, m, HEALTHY])
    assert [(e.subject, e.fired) for _, e in events] == [("format", True), ("format", False)]


def test_empty_batch_is_not_non_finite():
    from grpo.update import EMPTY

    a = alarms(non_finite={"patience": 1})
    assert run(a, [dict(EMPTY)]) == []


def test_quiet_on_the_quickstart():
    """The quickstart (`make train`) raises no alarm, even at patience 1 (no single step looks broken): its
    metrics.jsonl, the held-out evaluations before and after and all 15 steps (the run itself printed no alarm)."""
    rows = [json.loads(line) for line in (ROOT / "tests/fixtures/quickstart_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 16))
    a = alarms(**{n: {"patience": 1} for n in RULES})
    events = run(a, steps)
    assert events == [], [e.line for _, e in events]


@pytest.mark.parametrize("name,key,at,below", [
    ("truncation", "truncated_frac", 0.9, 0.89), ("zero_std", "zero_std_frac", 0.95, 0.94),
    ("entropy", "entropy", 0.01, 0.011), ("logprob_gap", "rollout_is/logp_diff_abs_mean", 0.5, 0.49)])
def test_thresholds_are_inclusive(name, key, at, below):
    """The documented conditions: >= the threshold (<= for entropy) holds, just short of it does not."""
    a = alarms(**{name: {"patience": 1}})
    assert [e.name for _, e in run(a, [{**HEALTHY, key: at}])] == [name]
    a = alarms(**{name: {"patience": 1}})
    assert run(a, [{**HEALTHY, key: below}]) == []


def test_the_cleared_line_names_the_function_of_a_per_function_alarm_only():
    a = alarms(truncation={"patience": 1}, constant_reward={"patience": 1})
    bad = {**HEALTHY, "truncated_frac": 1.0, "reward/format": 1.0, "reward/format_std": 0.0}
    run(a, [bad])
    assert [e.line for e in a.update(2, HEALTHY)] == ["alarm truncation cleared at step 2",
                                                      "alarm constant_reward (format) cleared at step 2"]
    assert a.metrics()["alarm/truncation"] == 0 and a.metrics()["alarm/constant_reward"] == 0


def test_one_step_is_one_step_and_every_constant_function_fires():
    a = alarms(constant_reward={"patience": 1})
    m = {**HEALTHY, "reward/format": 1.0, "reward/format_std": 0.0, "reward/len": 0.5, "reward/len_std": 0.0}
    lines = [e.line for _, e in run(a, [m])]
    assert lines == [f"alarm constant_reward: reward.functions.{f} gave every sample the same score ({v}) for 1 step: "
                     f"{RULES['constant_reward'].advice}" for f, v in [("format", 1), ("len", 0.5)]]


def test_a_disabled_alarm_leaves_the_others_on():
    a = alarms(truncation={"enabled": False}, zero_std={"patience": 1})
    assert [e.name for _, e in run(a, [{**HEALTHY, "truncated_frac": 1.0, "zero_std_frac": 1.0}])] == ["zero_std"]


def test_the_sync_gap_of_the_generation_server_is_a_logprob_gap():
    a = alarms(logprob_gap={"patience": 1})
    (_, e), = run(a, [{**HEALTHY, "server/sync_logprob_gap": 0.75}])
    assert e.subject == "server/sync_logprob_gap" and e.line.startswith(
        "alarm logprob_gap: server/sync_logprob_gap=0.75: the sampler's log-probs are that far from the trainer's "
        "for 1 step: ")


@pytest.mark.parametrize("bad,what", [
    ({"loss": float("nan")}, "the loss was"), ({"grad_norm": float("inf")}, "the grad_norm was"),
    ({"loss": float("nan"), "grad_norm": float("nan")}, "the loss and the grad_norm were")])
def test_non_finite_names_what_was_not_finite(bad, what):
    a = alarms(non_finite={"patience": 1})
    (_, e), = run(a, [{**HEALTHY, **bad}])
    assert e.line.startswith(f"alarm non_finite: {what} not finite (the update was skipped) for 1 step: lower ")

