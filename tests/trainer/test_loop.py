"""grpo/trainer/loop.py over stand-ins: no model, no sampler, no files. Every stage the loop calls (the batches, the
update, the evaluation, the checkpoints, the metrics logger, the alarms, the step clock, the signals) is a fake that
records what it was asked, in one list of events, so the tests read what the loop does and in which order."""
from __future__ import annotations

import contextlib
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from grpo.config.schema import Config
from grpo.errors import SetupError
from grpo.trainer import loop
from grpo.trainer.run import LoopState


class Events(list):
    def __call__(self, *event):
        self.append(event)


class Runtime:
    def __init__(self, events, is_main=True, stop_at=None):
        self.events, self.is_main, self.stop_at, self.asked = events, is_main, stop_at, []

    def any_rank(self, flag):
        self.asked.append(flag)
        return flag

    @contextlib.contextmanager
    def peer_failures_as_errors(self):
        self.events("peers on")
        yield
        self.events("peers off")


class Batches:
    """pipeline.batches: the batch of each step, its stats as given (``stats[step]``, else the defaults)."""

    def __init__(self, events, stats, defaults):
        self.events, self.stats, self.defaults, self.asked = events, stats, defaults, []

    def batch(self, step):
        self.events("batch", step)
        self.asked.append(step)
        stats = {"reward_mean": float(step), **self.defaults, **self.stats.get(step, {})}
        return SimpleNamespace(step=step, stats=stats)

    def in_flight(self):
        return {"asked": list(self.asked)}

    def close(self):
        self.events("batches closed")


class Log:
    """logger.MetricsLogger."""

    def __init__(self, events, logged=None):
        self.events, self.logged, self.path, self.rows = events, logged, "metrics.jsonl", []

    def log(self, metrics, console=True, progress=None):
        self.rows.append(metrics)
        self.events("log", metrics["step"], console, progress)

    def samples(self, step, rows):
        self.events("samples", step, rows)

    def completions(self, step, rows):
        self.events("completions", step, rows)

    def logged_eval(self, step):
        self.events("logged_eval", step)
        return self.logged

    def truncate_after(self, step):
        self.events("truncate_after", step)

    def finish(self):
        self.events("finish")


class Watch:
    def __init__(self, events, fire=None, stop=None):
        self.events, self.fire, self.stop, self.stop_at = events, fire or {}, None, stop

    def step(self, step, metrics):
        self.events("watch", step, dict(metrics))
        if step == self.stop_at:
            self.stop = f"alarm x fired at step {step}"
        return self.fire.get(step, {})


class Signals:
    def __init__(self, requested_at=None):
        self.step, self.saved_step, self.requested_at = None, None, requested_at

    @property
    def requested(self):
        return self.step == self.requested_at


def _cfg(tmp_path, **sections):
    cfg = Config()
    cfg.trainer.output_dir, cfg.model.name_or_path = str(tmp_path), "tiny"
    cfg.trainer.max_steps, cfg.logging.sample_every, cfg.logging.plot = 3, 0, False
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


@pytest.fixture
def world(monkeypatch, tmp_path):
    """The loop's collaborators replaced; ``w.events`` is what they were asked, in order."""
    events = Events()
    w = SimpleNamespace(events=events, updates=[], clock=iter(range(100, 10_000, 2)), state=LoopState(), stats={},
                        defaults={"reward/acc": 1.0, "reward/acc_errors": 0},
                        update_stats={}, evals={}, log=None, eval_steps=[], signals=None, watch=Watch(events), lr=[0.5])
    w.run = SimpleNamespace(runtime=Runtime(events), settings=SimpleNamespace(update="update settings",
                                                                              sampler=SimpleNamespace(backend="hf")),
                            scheduler=SimpleNamespace(get_last_lr=lambda: list(w.lr)),
                            sampler=SimpleNamespace(rewards=[SimpleNamespace(name="acc", fn=len)],
                                                    backend=SimpleNamespace(ready=lambda: events("ready"))),
                            splits=SimpleNamespace(train=[1, 2, 3], eval=[4, 5]), close=lambda: events("run closed"))

    def update(runtime, batch, settings):
        assert runtime is w.run.runtime and settings == "update settings"
        events("update", batch.step)
        return {"loss": 0.25, "skipped": False, **w.update_stats.get(len([e for e in events if e[0] == "update"]), {})}

    def evaluate(run, label):
        assert run is w.run
        events("evaluate", label)
        w.eval_steps.append(w.signals and w.signals.step)
        return dict(w.evals.get(label, {"accuracy": 0.5}))

    def logger_(output_dir, cfg_dict, wandb, enabled=True, resumed=False):
        assert cfg_dict == asdict(w.cfg) and wandb is w.cfg.logging.wandb
        events("logger", output_dir, enabled, resumed)
        w.log = Log(events, {"accuracy": 0.125})
        return w.log

    def restore(run, cfg):
        assert run is w.run and isinstance(cfg, Config)
        w.cfg = cfg
        return w.state

    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: float(next(w.clock))))
    monkeypatch.setattr(loop, "policy_update", update)
    monkeypatch.setattr(loop, "evaluate", evaluate)
    monkeypatch.setattr(loop, "restore", restore)
    def abandon_after(run, cfg, log, start):
        assert run is w.run and cfg is w.cfg and log is w.log
        events("abandon_after", start)

    monkeypatch.setattr(loop, "abandon_after", abandon_after)
    def save_checkpoint(run, state, cfg):
        assert run is w.run and cfg is w.cfg and state is w.state
        events("save", state.step, state.in_flight)

    def save_final(run, cfg):
        assert run is w.run and cfg is w.cfg
        events("final")

    monkeypatch.setattr(loop, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(loop, "save_final", save_final)
    def batches(run, cfg, state):
        assert run is w.run and cfg is w.cfg and state is w.state
        return Batches(events, w.stats, w.defaults)

    def watch(cfg, log, is_main):
        assert cfg is w.cfg and log is w.log and is_main is w.run.runtime.is_main
        return w.watch

    monkeypatch.setattr(loop.pipeline, "batches", batches)
    monkeypatch.setattr(loop.logger, "MetricsLogger", logger_)
    monkeypatch.setattr(loop.logger, "read_metrics", lambda path: [{"reward_mean": 0.5}, {"x": 1}, {"reward_mean": 1}]
                        * (path == "metrics.jsonl"))
    monkeypatch.setattr(loop.logger, "ascii_curve", lambda values, label: f"curve {values} {label}")
    monkeypatch.setattr(loop.logger, "plot_curves", lambda rows, path: events("plot", rows, path))
    monkeypatch.setattr(loop, "Watch", watch)
    monkeypatch.setattr(loop, "StepClock", lambda start, n: SimpleNamespace(line=lambda k: f"{k}/{n} from {start}"))
    monkeypatch.setattr(loop.experience, "sample_rows", lambda sampler, batch, n: [("rows", batch.step, n)] * (
        sampler is w.run.sampler))
    monkeypatch.setattr(loop.experience, "completion_rows", lambda sampler, batch: [("table", batch.step)] * (
        sampler is w.run.sampler))
    monkeypatch.setattr(loop.registry, "capabilities", lambda name: SimpleNamespace(remote=name == "server"))
    return w


def _of(events, *kinds):
    return [e for e in events if e[0] in kinds]


def test_a_fresh_run_trains_each_step_then_evaluates_saves_and_reports(world, tmp_path, capsys):
    """Four steps, num_iterations 2 (a batch every other step), evaluation every 2 steps (not at the last: the after
    evaluation is), the console every 2 steps, samples every 3, a checkpoint every 3 and at the end."""
    cfg = _cfg(tmp_path, trainer={"max_steps": 4, "eval_every": 2, "save_every": 3},
               algorithm={"num_iterations": 2}, logging={"log_every": 2, "sample_every": 3, "num_samples": 5})
    signals = world.signals = Signals()
    world.evals = {"after": {"accuracy": 0.75}}
    out = loop._train(world.run, cfg, signals)
    assert out == {"steps": 4, "eval_before": {"accuracy": 0.5}, "eval_after": {"accuracy": 0.75}}
    ev = [e for e in world.events if e[0] != "watch"]
    assert ev == [
        ("logger", str(tmp_path), True, False), ("evaluate", "before"), ("truncate_after", -1),
        ("log", 0, False, None),
        ("batch", 1), ("update", 1), ("log", 1, False, "1/4 from 0"),
        ("update", 1), ("evaluate", "step 2"), ("log", 2, True, "2/4 from 0"),
        ("batch", 3), ("update", 3), ("log", 3, False, "3/4 from 0"),
        ("samples", 3, [("rows", 3, 5)]), ("completions", 3, [("table", 3)]), ("save", 3, {"asked": [1, 3]}),
        ("update", 3), ("log", 4, True, "4/4 from 0"),
        ("evaluate", "after"), ("log", 4, False, None), ("save", 4, {"asked": [1, 3]}), ("final",), ("finish",),
        ("batches closed",)]
    rows = world.log.rows
    assert rows[0] == {"step": 0, "eval/accuracy": 0.5} and rows[-1] == {"step": 4, "eval/accuracy": 0.75}
    assert rows[2]["eval/accuracy"] == 0.5 and "eval/accuracy" not in rows[1] and "eval/accuracy" not in rows[4]
    assert signals.step == 4 and signals.saved_step == 3 and world.state.step == 4 and world.state.buffer is None
    assert world.eval_steps == [1, 2, 4]  # a signal in the before evaluation stops after step 1: none is done yet
    assert world.run.runtime.asked == [False] * 4
    err = capsys.readouterr().err
    assert err.startswith("[grpo] tiny: 3 train / 2 held-out prompts, ")
    assert "\ncurve [0.5, 1] reward_mean\n" in err


def test_each_steps_metrics_are_the_batchs_the_updates_the_counters_and_the_times(world, tmp_path):
    """The clock ticks 2 s a call: t0, t1 (after the batch), step_time_s and update_s each read it once."""
    cfg = _cfg(tmp_path, trainer={"max_steps": 2})
    world.stats = {1: {"kl": 0.125, "reward_mean": 7.0}}
    world.update_stats = {2: {"skipped": True, "loss": 9.0}}
    world.watch = Watch(world.events, fire={2: {"alarm/kl": 1.0}})
    world.lr = [0.5, 0.25]
    loop._train(world.run, cfg, Signals())
    first, second = world.log.rows[1:3]
    assert first == {"step": 1, "reward_mean": 7.0, "reward/acc": 1.0, "reward/acc_errors": 0, "loss": 0.25,
                     "skipped": False, "skipped_steps": 0, "lr": 0.5, "step_time_s": 4.0, "time/experience_s": 2.0,
                     "time/update_s": 4.0, "kl": 0.125}
    assert second["kl"] is None and second["skipped"] is True and second["skipped_steps"] == 1
    assert second["alarm/kl"] == 1.0 and second["loss"] == 9.0 and second["reward_mean"] == 2.0
    watched = _of(world.events, "watch")
    assert [e[1] for e in watched] == [1, 2] and watched[0][2] == {k: v for k, v in first.items()}
    assert "alarm/kl" not in watched[1][2] and watched[1][2]["kl"] is None  # kl is set before the alarms read


def test_bad_steps_in_a_row_are_counted_an_empty_batch_leaves_the_count_and_a_good_one_resets_it(world, tmp_path):
    state = world.state
    world.run.runtime.is_main = "main?"  # the alarms are the main rank's: Watch is told which
    cfg = _cfg(tmp_path, trainer={"max_steps": 6, "max_bad_steps": 3})
    world.update_stats = {1: {"skipped": True}, 2: {"skipped": True, "empty_batch": True}, 3: {"skipped": True},
                          4: {}, 5: {"skipped": True}, 6: {"empty_batch": True}}
    counts = []

    class Counting(Watch):
        def step(self, step, metrics):
            counts.append((state.bad_steps, state.skipped_steps))
            return {}

    world.watch = Counting(world.events)
    loop._train(world.run, cfg, Signals())
    assert counts == [(1, 1), (1, 2), (2, 3), (0, 3), (1, 4), (1, 4)]


def test_too_many_bad_steps_save_the_last_good_state_and_stop(world, tmp_path):
    cfg = _cfg(tmp_path, trainer={"max_steps": 5, "max_bad_steps": 2})
    world.update_stats = {2: {"skipped": True}, 3: {"skipped": True}}
    with pytest.raises(SetupError, match=r"^2 steps in a row had a non-finite loss or gradient; stopped\. "):
        loop._train(world.run, cfg, Signals())
    assert _of(world.events, "save", "batches closed", "batch") == [
        ("batch", 1), ("batch", 2), ("batch", 3), ("save", 3, {"asked": [1, 2, 3]}), ("batches closed",)]
    world.events.clear()
    world.state = LoopState()
    world.update_stats = {1: {"skipped": True}}
    cfg.trainer.max_bad_steps, cfg.trainer.max_steps = 1, 1
    with pytest.raises(SetupError, match=r"^1 steps in a row"):  # at the bound itself
        loop._train(world.run, cfg, Signals())


def test_an_alarm_that_stops_saves_this_step_and_stops_with_its_line(world, tmp_path):
    cfg = _cfg(tmp_path, trainer={"max_steps": 5})
    world.watch = Watch(world.events, stop=2)
    with pytest.raises(SetupError, match=r"^alarm x fired at step 2; the state after this step is checkpointed "
                                         r"\(resume with trainer.resume=auto\)$"):
        loop._train(world.run, cfg, Signals())
    assert _of(world.events, "save", "batch") == [("batch", 1), ("batch", 2), ("save", 2, {"asked": [1, 2]})]
    assert world.state.step == 2


def test_a_signal_saves_the_step_it_came_in_and_stops_after_it(world, tmp_path, capsys):
    cfg = _cfg(tmp_path, trainer={"max_steps": 5})
    signals = Signals(requested_at=2)
    assert loop._train(world.run, cfg, signals) == {"steps": 2, "interrupted": True}
    assert world.state.stop_requested and world.run.runtime.asked == [False, True]
    assert signals.saved_step == 2
    assert [e for e in world.events if e[0] not in ("watch", "log")][-3:] == [
        ("save", 2, {"asked": [1, 2]}), ("finish",), ("batches closed",)]
    assert capsys.readouterr().err.endswith(
        "[grpo] stopped by signal at step 2; checkpoint written, resume with trainer.resume=auto\n")


def test_a_resumed_run_goes_on_from_its_step_with_its_buffer_and_the_before_it_logged(world, tmp_path):
    """Resumed after step 3 of num_iterations 2: step 4 trains again on the stored batch, step 5 samples."""
    cfg = _cfg(tmp_path, trainer={"max_steps": 5}, algorithm={"num_iterations": 2})
    stored = SimpleNamespace(step=3, stats={"reward/acc": 1.0, "reward/acc_errors": 0})
    world.state = LoopState(step=3, buffer=stored)
    signals = Signals()
    out = loop._train(world.run, cfg, signals)
    assert out["eval_before"] == {"accuracy": 0.125} and out["steps"] == 5
    assert _of(world.events, "logger", "abandon_after", "logged_eval", "batch", "update", "evaluate") == [
        ("logger", str(tmp_path), True, True), ("abandon_after", 3), ("logged_eval", 0), ("update", 3),
        ("batch", 5), ("update", 5), ("evaluate", "after")]
    assert [r["step"] for r in world.log.rows] == [4, 5, 5]


@pytest.mark.parametrize(("step", "stored", "sampled"), [(3, True, [4]), (1, False, [2, 4])])
def test_a_resume_samples_at_each_round_of_num_iterations_and_whenever_it_has_no_batch(world, tmp_path, step, stored,
                                                                                        sampled):
    """num_iterations 3 (rounds start at steps 1, 4, 7): a batch stored at step 3 (a checkpoint of a run with other
    num_iterations) is not trained on at step 4, a new round; a run resumed mid-round without a batch samples one."""
    cfg = _cfg(tmp_path, trainer={"max_steps": 6}, algorithm={"num_iterations": 3})
    world.state = LoopState(step=step, buffer=SimpleNamespace(step=0, stats={}) if stored else None)
    loop._train(world.run, cfg, Signals())
    assert [e[1] for e in _of(world.events, "batch")] == sampled
    trained_on = [max(s for s in sampled if s <= k) for k in range(step + 1, 7)]  # the newest batch sampled
    assert [e[1] for e in _of(world.events, "update")] == trained_on


def test_a_fresh_run_with_an_empty_buffer_samples_every_step_with_one_iteration(world, tmp_path):
    cfg = _cfg(tmp_path, trainer={"max_steps": 3})
    world.state = LoopState()
    loop._train(world.run, cfg, Signals())
    assert _of(world.events, "batch") == [("batch", 1), ("batch", 2), ("batch", 3)]
    assert not _of(world.events, "abandon_after", "logged_eval", "ready")


@pytest.mark.parametrize(("backend", "staleness", "ready"), [("server", 0, True), ("server", 2, False),
                                                              ("hf", 0, False)])
def test_a_remote_backend_is_connected_first_unless_it_samples_ahead(world, tmp_path, backend, staleness, ready):
    cfg = _cfg(tmp_path, trainer={"max_steps": 1}, rollout={"max_staleness": staleness})
    world.run.settings.sampler.backend = backend
    loop._train(world.run, cfg, Signals())
    assert (world.events[0] == ("ready",)) == ready and world.events.count(("ready",)) == int(ready)


def test_the_logger_and_the_lines_are_the_main_ranks_only(world, tmp_path, capsys):
    cfg = _cfg(tmp_path, trainer={"max_steps": 1}, logging={"plot": True})
    world.run.runtime.is_main = False
    loop._train(world.run, cfg, Signals())
    assert world.events[0] == ("logger", str(tmp_path), False, False)
    assert capsys.readouterr().err == "" and not _of(world.events, "plot")


def test_the_report_plots_the_reward_rows_and_tables_every_eval_metric(world, tmp_path, capsys):
    cfg = _cfg(tmp_path, logging={"plot": True})
    log = Log(world.events)
    loop._report(world.run, cfg, {"eval_before": {"accuracy": 0.5, "format": None}, "eval_after": {"accuracy": 1.0,
                                                                                                    "b": 0.25}}, log)
    assert world.events == [("plot", [{"reward_mean": 0.5}, {"reward_mean": 1}], str(tmp_path / "reward_curve.png"))]
    assert capsys.readouterr().err == (
        "\ncurve [0.5, 1] reward_mean\n"
        "held-out accuracy             before   0.500  after   1.000\n"
        "held-out b                    before     n/a  after   0.250\n"
        "held-out format               before     n/a  after     n/a\n"
        f"final model: {tmp_path / 'final'}\n")
    loop._report(world.run, cfg, {}, log)
    assert capsys.readouterr().err == f"\ncurve [0.5, 1] reward_mean\nfinal model: {tmp_path / 'final'}\n"


def test_the_report_plots_nothing_without_reward_rows_or_with_plot_off(world, tmp_path, monkeypatch):
    log = Log(world.events)
    loop._report(world.run, _cfg(tmp_path, logging={"plot": False}), {}, log)
    monkeypatch.setattr(loop.logger, "read_metrics", lambda path: [{"x": 1}])
    loop._report(world.run, _cfg(tmp_path, logging={"plot": True}), {}, log)
    assert world.events == []


def test_the_summary_line(world, tmp_path):
    cfg = _cfg(tmp_path, trainer={"max_steps": 1, "lr": 2e-5, "warmup_steps": 3, "lr_schedule": "cosine"},
               rollout={"prompts_per_step": 4}, algorithm={"group_size": 8, "beta": 0.04})
    world.run.sampler.rewards = [SimpleNamespace(name="acc"), SimpleNamespace(name="format")]
    assert loop._summary_line(world.run, cfg) == (
        f"tiny: 3 train / 2 held-out prompts, 4 prompts x G=8 per step, 1 step, lr 2e-05 (cosine, warmup 3), "
        f"beta 0.04, rewards acc, format; output {tmp_path}")
    cfg.trainer.max_steps, cfg.rollout.max_staleness = 2, 1
    assert loop._summary_line(world.run, cfg).endswith(f" 2 steps, lr 2e-05 (cosine, warmup 3), beta 0.04, rewards "
                                                       f"acc, format; output {tmp_path}; asynchronous, max_staleness 1")


def _failing(world, tmp_path, stats, max_failed=2, verl=False):
    fn = SimpleNamespace(verl_fn=len) if verl else len
    world.run.sampler.rewards = [SimpleNamespace(name="ok", fn=len), SimpleNamespace(name="bad", fn=fn)]
    world.defaults = {"reward/ok": 1.0, "reward/ok_errors": 0, "reward/bad": 0.5, "reward/bad_errors": 0}
    world.stats = {s: {"reward/bad": None, "reward/bad_errors": e} for s, e in stats.items()}
    return _cfg(tmp_path, trainer={"max_steps": 5}, reward={"max_failed_steps": max_failed})


def test_a_reward_that_scores_nothing_in_max_failed_steps_rollouts_in_a_row_stops_the_run(world, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(loop, "first_failure", lambda name: f"raised ValueError('{name}')")
    cfg = _failing(world, tmp_path, {2: 3, 3: 1})
    with pytest.raises(SetupError) as e:
        loop._train(world.run, cfg, Signals())
    assert str(e.value) == ("reward function 'bad' scored no sample in 2 training rollouts in a row (the last at step "
                            "3; reward.max_failed_steps=2): it raised ValueError('bad'); fix it or remove it with "
                            "~reward.functions.bad")
    assert world.state.failed_reward_steps == {"ok": 0, "bad": 2}
    assert _of(world.events, "log")[-1][1] == 3  # the step is logged first
    assert not _of(world.events, "save")


def test_a_failure_count_restarts_after_a_rollout_that_scores(world, tmp_path):
    cfg = _failing(world, tmp_path, {1: 0, 3: 0, 4: 0})
    with pytest.raises(SetupError, match=r"'bad' scored no sample in 2 training rollouts in a row \(the last at step "
                                         r"4; .*: it returned None for every sample; fix it"):
        loop._train(world.run, cfg, Signals())
    assert world.state.failed_reward_steps == {"ok": 0, "bad": 2}


def test_a_verl_function_that_returned_none_says_its_errors_are_logged_once(world, tmp_path):
    cfg = _failing(world, tmp_path, {1: 0}, max_failed=1, verl=True)
    with pytest.raises(SetupError, match=r"at step 1; reward.max_failed_steps=1\): it returned None for every sample "
                                         r"\(a verl-style function that raises scores None: its first error is logged "
                                         r"once\); fix it or remove it with ~reward.functions.bad$"):
        loop._train(world.run, cfg, Signals())


def test_without_a_first_failure_the_reason_is_failed(world, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "first_failure", lambda name: None)
    cfg = _failing(world, tmp_path, {1: 2}, max_failed=1)
    with pytest.raises(SetupError, match=r"\): it failed; fix it"):
        loop._train(world.run, cfg, Signals())


def test_a_resume_mid_round_without_failure_counts_has_no_failure(world, tmp_path):
    """A checkpoint holding a batch but no counts (one written before a function was added): none failed yet."""
    cfg = _failing(world, tmp_path, {}, max_failed=1)
    cfg.algorithm.num_iterations = 2
    world.state = LoopState(step=1, buffer=SimpleNamespace(step=1, stats={}))
    assert loop._train(world.run, cfg, Signals())["steps"] == 5


def test_failures_are_counted_on_the_rollout_rounds_only(world, tmp_path):
    """num_iterations 2: steps 1 and 3 sample; a batch reused at step 2 is not a second failed rollout."""
    cfg = _failing(world, tmp_path, {1: 0, 3: 0}, max_failed=3)
    cfg.algorithm.num_iterations, cfg.trainer.max_steps = 2, 4
    loop._train(world.run, cfg, Signals())
    assert world.state.failed_reward_steps == {"ok": 0, "bad": 2}


@pytest.fixture
def done(world, monkeypatch, tmp_path):
    """A run resumed at trainer.max_steps: what checkpoint says of its directory."""
    world.state = LoopState(step=3)
    world.later, world.damage = [], None
    monkeypatch.setattr(loop.checkpoint, "later_than", lambda d, start: world.events("later_than", d, start)
                        or world.later)
    monkeypatch.setattr(loop.checkpoint, "step_of", lambda path: int(path.rsplit("-", 1)[1]))
    monkeypatch.setattr(loop.checkpoint, "final_damage", lambda d: world.events("damage", d) or world.damage)
    monkeypatch.setattr(loop.checkpoint, "set_final_aside", lambda d: world.events("aside", d) or "final.damaged")
    return world


def test_resumed_at_max_steps_with_later_steps_keeps_them_and_trains_nothing(done, tmp_path, capsys):
    done.later = ["checkpoint-4", "checkpoint-5", "checkpoint-6"]
    cfg = _cfg(tmp_path)
    assert loop._train(done.run, cfg, Signals()) == {"steps": 3, "resumed": True}
    assert done.events[1:] == [("later_than", str(tmp_path), 3), ("finish",)]
    assert capsys.readouterr().err == (
        "[grpo] checkpoint step 3 is at trainer.max_steps=3: nothing to do. This directory's run went on to step 6; it "
        "is kept as it was. Raise trainer.max_steps to train on from step 3 (that removes the later steps), or resume "
        "with trainer.resume=auto\n")


def test_resumed_past_max_steps_with_an_intact_final_does_nothing(done, tmp_path, capsys):
    done.state.step = 4
    assert loop._train(done.run, _cfg(tmp_path), Signals()) == {"steps": 4, "resumed": True}
    assert done.events[1:] == [("later_than", str(tmp_path), 4), ("damage", str(tmp_path)), ("finish",)]
    assert capsys.readouterr().err == ("[grpo] run already reached trainer.max_steps=3 (checkpoint step 4); nothing to "
                                       "do\n")


def test_a_damaged_final_is_set_aside_and_saved_again(done, tmp_path, capsys):
    done.damage = "model.safetensors differs"
    (tmp_path / "final").mkdir()
    out = loop._train(done.run, _cfg(tmp_path), Signals())
    assert out == {"steps": 3, "resumed": True, "final_saved": True}
    assert done.events[2:] == [("damage", str(tmp_path)), ("aside", str(tmp_path)), ("final",), ("finish",)]
    assert capsys.readouterr().err == ("[grpo] final/ is damaged (model.safetensors differs): saving it again from "
                                       "checkpoint step 3; the damaged one is kept as final.damaged\n")


def test_only_the_main_rank_sets_a_damaged_final_aside(done, tmp_path):
    done.damage = "missing"
    done.run.runtime.is_main = False
    (tmp_path / "final").mkdir()
    loop._train(done.run, _cfg(tmp_path), Signals())
    assert not _of(done.events, "aside") and _of(done.events, "final")


def test_a_missing_final_is_saved_from_the_last_checkpoint(done, tmp_path, capsys):
    done.damage = "no final/"
    out = loop._train(done.run, _cfg(tmp_path), Signals())
    assert out == {"steps": 3, "resumed": True, "final_saved": True} and not _of(done.events, "aside")
    assert capsys.readouterr().err == ("[grpo] run reached trainer.max_steps=3 but stopped before its final model was "
                                       "saved; saving it from the last checkpoint\n")


def test_a_fresh_run_of_zero_steps_is_not_already_done(world, tmp_path):
    out = loop._train(world.run, _cfg(tmp_path, trainer={"max_steps": 0}), Signals())
    assert out == {"steps": 0, "eval_before": {"accuracy": 0.5}, "eval_after": {"accuracy": 0.5}}
    assert _of(world.events, "final", "batch", "evaluate") == [("evaluate", "before"), ("evaluate", "after"),
                                                                ("final",)]


def test_a_run_resumed_after_its_first_step_is_a_resume(world, tmp_path, monkeypatch):
    """Step 1 is a checkpoint like any other: the logger resumes, the later steps go, the before is the logged one;
    at trainer.max_steps=1 there is nothing to do."""
    world.state = LoopState(step=1)
    out = loop._train(world.run, _cfg(tmp_path, trainer={"max_steps": 2}), Signals())
    assert out["eval_before"] == {"accuracy": 0.125}
    assert _of(world.events, "logger", "abandon_after", "logged_eval", "batch") == [
        ("logger", str(tmp_path), True, True), ("abandon_after", 1), ("logged_eval", 0), ("batch", 2)]
    world.events.clear()
    world.state = LoopState(step=1)
    monkeypatch.setattr(loop.checkpoint, "later_than", lambda d, start: [])
    monkeypatch.setattr(loop.checkpoint, "final_damage", lambda d: None)
    assert loop._train(world.run, _cfg(tmp_path, trainer={"max_steps": 1}), Signals()) == {"steps": 1, "resumed": True}
    assert not _of(world.events, "batch", "evaluate", "abandon_after")


def test_saved_names_the_last_complete_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    asked = []
    monkeypatch.setattr(loop.checkpoint, "latest", lambda d: asked.append(d))
    assert loop._saved(cfg) == "no checkpoint has been written, nothing to resume"
    monkeypatch.setattr(loop.checkpoint, "latest", lambda d: f"{d}/checkpoint-2")
    assert loop._saved(cfg) == (f"the last complete checkpoint, {tmp_path}/checkpoint-2, is intact: resume with "
                                "trainer.resume=auto")
    assert asked == [str(tmp_path)]


@pytest.mark.parametrize(("rank", "enabled"), [(None, True), ("", True), ("0", True), ("1", False)])
def test_fit_builds_the_run_trains_inside_the_signals_and_closes_it(world, tmp_path, monkeypatch, rank, enabled):
    cfg = _cfg(tmp_path, trainer={"max_steps": 1})
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    made = []

    @contextlib.contextmanager
    def run_log(output_dir, enabled=True):
        world.events("run_log", output_dir, enabled)
        yield
        world.events("run_log closed")

    class StopSignals(Signals):
        def __init__(self, announce, saved):
            super().__init__()
            made.append((announce, saved))

        def __enter__(self):
            world.events("signals on")
            return self

        def __exit__(self, *exc):
            world.events("signals off")

    monkeypatch.setattr(loop.logger, "quiet_when_not_interactive", lambda: world.events("quiet"))
    monkeypatch.setattr(loop.logger, "run_log", run_log)
    monkeypatch.setattr(loop, "build_run", lambda c: world.events("build", c) or world.run)
    monkeypatch.setattr(loop, "StopSignals", StopSignals)
    monkeypatch.setattr(loop.checkpoint, "latest", lambda d: None)
    world.run.runtime.is_main = "main?"
    assert loop.fit(cfg)["steps"] == 1
    ev = world.events
    assert ev[:5] == [("quiet",), ("run_log", str(tmp_path), enabled), ("build", cfg), ("signals on",), ("peers on",)]
    assert ev[-4:] == [("peers off",), ("signals off",), ("run closed",), ("run_log closed",)]
    (announce, saved), = made
    assert announce == "main?" and saved() == "no checkpoint has been written, nothing to resume"


def test_fit_closes_the_run_when_training_fails(world, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "build_run", lambda c: world.run)
    monkeypatch.setattr(loop.logger, "quiet_when_not_interactive", lambda: None)
    monkeypatch.setattr(loop.logger, "run_log", lambda d, enabled: contextlib.nullcontext())
    monkeypatch.setattr(loop, "StopSignals", lambda announce, saved: contextlib.nullcontext(Signals()))
    world.update_stats = {1: {"skipped": True}}
    with pytest.raises(SetupError):
        loop.fit(_cfg(tmp_path, trainer={"max_steps": 2, "max_bad_steps": 1}))
    assert world.events[-1] == ("run closed",)


def test_a_line_is_flushed_at_once(world, monkeypatch):
    """The console is the run's log (`logger.run_log` tees it into train.log): each line is written through."""
    calls = []
    monkeypatch.setattr(loop.sys, "stderr", SimpleNamespace(write=lambda t: calls.append(t), flush=lambda: calls.append(
        "flush")))
    loop._say(world.run, "saved")
    assert calls[-1] == "flush" and "".join(calls[:-1]) == "[grpo] saved\n"
    world.run.runtime.is_main = False
    loop._say(world.run, "not said")
    assert len(calls) == 3
