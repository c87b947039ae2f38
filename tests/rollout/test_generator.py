"""grpo/rollout/generator.py: the generator process's protocol with a trivial worker built in the child: weights
arrive (through shared memory) before the requests that follow them, results come back in order with their
timings, a failure comes back as one line, a dead process is reported, close stops it."""
import os
import signal

import pytest
import torch

from grpo.rollout.generator import Generated, GeneratorError, GeneratorProcess


class Echo:
    """Samples nothing: answers each request with the sum of the weights it holds."""

    def __init__(self, spec):
        self.spec, self.version, self.weights = spec, None, {}

    def load(self, version, weights):
        self.version, self.weights = version, {k: v.clone() for k, v in weights.items()}

    def sample(self, step, version):
        if step == self.spec.get("fail_at"):
            raise ValueError("a reward function broke\nsecond line")
        if step == self.spec.get("die_at"):
            os.kill(os.getpid(), signal.SIGKILL)
        total = float(sum(v.sum() for v in self.weights.values()))
        return Generated(step, version, batch=(self.version, total), sampler={"step": step})


def build(spec):
    return Echo(spec)


def test_weights_then_requests_in_order():
    gen = GeneratorProcess(build, {})
    try:
        w = torch.ones(3)
        gen.publish(0, {"w": w})
        w.add_(1.0)  # the trainer goes on changing its weights: the generator has its own copy of version 0
        gen.submit(1, 0)
        gen.submit(2, 0)
        gen.publish(1, {"w": w})
        gen.submit(3, 1)
        got = [gen.receive(timeout=60) for _ in range(3)]
        assert [(g.step, g.version, g.batch) for g in got] == [(1, 0, (0, 3.0)), (2, 0, (0, 3.0)), (3, 1, (1, 6.0))]
        assert all(g.wait_s >= 0 and g.busy_s >= 0 for g in got) and got[2].sampler == {"step": 3}
    finally:
        gen.close()
    assert not gen.proc.is_alive()


def test_a_failure_comes_back_as_one_line():
    gen = GeneratorProcess(build, {"fail_at": 1})
    try:
        gen.publish(0, {"w": torch.zeros(1)})
        gen.submit(1, 0)
        with pytest.raises(GeneratorError, match="^the generator process failed: ValueError: a reward function "
                                                 "broke$"):
            gen.receive(timeout=60)
    finally:
        gen.close()


def test_a_dead_generator_is_reported_not_waited_for():
    gen = GeneratorProcess(build, {"die_at": 1})
    try:
        gen.publish(0, {"w": torch.zeros(1)})
        gen.submit(1, 0)
        with pytest.raises(GeneratorError, match="died"):
            gen.receive(timeout=60)
    finally:
        gen.close()


def test_a_loaded_slot_is_reused_with_the_new_weights():
    """Once a batch of version v came back, the shared-memory slot of v (loaded before it) takes a later version:
    no fresh shared memory per step, and the generator sees the new values, not the old."""
    gen = GeneratorProcess(build, {})
    try:
        gen.publish(0, {"w": torch.ones(3)})
        first = gen._loading[0][1]["w"]
        gen.submit(1, 0)
        assert gen.receive(timeout=60).batch == (0, 3.0)
        gen.publish(1, {"w": torch.full((3,), 2.0)})
        assert gen._loading[1][1]["w"] is first  # the same slot
        gen.submit(2, 1)
        assert gen.receive(timeout=60).batch == (1, 6.0)
    finally:
        gen.close()
