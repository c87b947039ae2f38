"""The run's alarms (`grpo.evaluation.alarms`) wired to the console, metrics.jsonl, wandb and the stop:
`Watch.step` prints one line when an alarm fires or clears, sends a wandb alert when one fires (wandb online), and
returns the ``alarm/<name>`` metrics of the step; ``stop`` holds the reason to stop when ``trainer.stop_on_alarm``."""
from __future__ import annotations

import sys

from grpo.config.schema import Config
from grpo.evaluation.alarms import RULES, Alarms, Context


class Watch:
    def __init__(self, cfg: Config, log, is_main: bool):
        self.alarms = Alarms({n: getattr(cfg.alarms, n) for n in RULES},
                             Context(cfg.rollout.max_new_tokens, cfg.algorithm.group_size, cfg.rollout.temperature))
        self.log, self.is_main, self.stop_on_alarm = log, is_main, cfg.trainer.stop_on_alarm
        self.stop: str | None = None

    def step(self, step: int, metrics: dict) -> dict:
        """This step's events printed (and alerted); its ``alarm/<name>`` metrics returned. The same on every rank
        (the metrics are all-reduced), so every rank agrees on a stop."""
        for e in self.alarms.update(step, metrics):
            if self.is_main:
                print(f"[grpo] step {step}: {e.line}", file=sys.stderr, flush=True)
            if e.fired:
                self.log.alert(f"grpo alarm: {e.name}", f"step {step}: {e.line}")
                if self.stop_on_alarm and self.stop is None:
                    self.stop = f"alarm {e.name} fired at step {step} and trainer.stop_on_alarm=true: stopped"
        return self.alarms.metrics()
