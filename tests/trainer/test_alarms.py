"""grpo/trainer/alarms.py and the logger's alert: an alarm's line once on the console, one wandb alert where wandb is
online (none offline), the alarm/<name> metrics, and the stop that trainer.stop_on_alarm asks for."""
from omegaconf import OmegaConf

from grpo.config.schema import load
from grpo.evaluation.alarms import Context
from grpo.trainer.alarms import Watch
from grpo.trainer.logger import MetricsLogger
from tests.helpers import smoke_raw

SMOKE = smoke_raw()  # composed once, at import (every `make mutate` mutant's run is forked after it)


class Alerts:
    def __init__(self):
        self.sent = []

    def alert(self, title, text):
        self.sent.append((title, text))


def cfg(rollout=None, **trainer):
    raw = OmegaConf.merge(SMOKE, {"trainer": {"output_dir": "unused", **trainer}, "rollout": rollout or {},
                                  "alarms": {"zero_std": {"patience": 2}}})
    return load(OmegaConf.to_container(raw, resolve=True))


def test_one_line_one_alert_and_the_metric(capsys):
    log = Alerts()
    watch = Watch(cfg(), log, is_main=True)
    bad, good = {"zero_std_frac": 1.0}, {"zero_std_frac": 0.0}
    got = [watch.step(s, m)["alarm/zero_std"] for s, m in enumerate([bad, bad, bad, bad, good], 1)]
    assert got == [0, 1, 1, 1, 0]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[grpo] step 2: alarm zero_std: 100% of groups of G=4 had all-equal rewards for 2 steps: their "
                     "advantages are 0 and nothing is learned from them; make the prompts match the model (easier or "
                     "harder), raise algorithm.group_size or rollout.temperature",
                     "[grpo] step 5: alarm zero_std cleared at step 5"]
    assert log.sent == [("grpo alarm: zero_std", lines[0][len("[grpo] "):])]
    assert watch.stop is None


def test_the_alarms_quote_the_runs_settings_and_take_its_rules(capsys):
    watch = Watch(cfg(rollout={"max_new_tokens": 13, "temperature": 0.7}), Alerts(), is_main=True)
    assert watch.alarms.context == Context(max_new_tokens=13, group_size=4, temperature=0.7)
    assert watch.alarms.specs["zero_std"].patience == 2  # the run's alarms.* sections
    assert {f"alarm/{n}" for n in watch.alarms.specs} == set(watch.step(1, {}))
    patience = watch.alarms.specs["truncation"].patience
    for s in range(2, 2 + patience):
        watch.step(s, {"truncated_frac": 1.0})
    assert "100% of completions hit rollout.max_new_tokens=13" in capsys.readouterr().err


def test_stop_on_alarm_and_quiet_ranks(capsys):
    watch = Watch(cfg(stop_on_alarm=True), Alerts(), is_main=False)
    for s in (1, 2):
        watch.step(s, {"zero_std_frac": 1.0})
    assert watch.stop == "alarm zero_std fired at step 2 and trainer.stop_on_alarm=true: stopped"
    assert capsys.readouterr().err == ""  # only rank 0 prints


def test_wandb_alert_only_online(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLogger(str(tmp_path), wandb_cfg={"mode": "disabled"})
    log._wandb = fake = Alerts()  # a wandb run that is offline: no alert leaves the machine
    log.alert("t", "x")
    assert fake.sent == []
    log._online = True
    log.alert("t", "x")
    assert fake.sent == [("t", "x")]
