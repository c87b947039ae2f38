"""grpo/train.py: the entry point checks the command line before torch or a model is touched."""
from tests.helpers import train_cli_error
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401


def test_a_mistyped_key_is_one_line_and_no_run_directory(tmp_path, monkeypatch, capsys):
    code, err = train_cli_error(tmp_path, monkeypatch, capsys, "trainer.max_stepz=1")
    assert code != 0 and "trainer.max_stepz" in err and "trainer.max_steps" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


# Unit tests of grpo/train.py over stand-ins (no Hydra run, no model): `make mutate` runs these.
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import grpo.trainer.loop  # noqa: E402, F401 - what the Hydra job imports: at collection, not in each mutant
from grpo import train  # noqa: E402
from grpo.errors import ConfigError, SetupError  # noqa: E402


def _no_exit(code):
    raise AssertionError(f"os._exit({code}) in one process")


def test_fail_prints_one_line_drops_the_empty_run_dir_and_exits_2(monkeypatch, capsys):
    dropped = []
    monkeypatch.setattr(os, "_exit", _no_exit)
    monkeypatch.setattr(train, "_drop_empty_run_dir", dropped.append)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        train._fail(SetupError("bad thing"), "runs/a")
    assert e.value.code == 2 and capsys.readouterr().err == "error: bad thing\n" and dropped == ["runs/a"]
    with pytest.raises(SystemExit):
        train._fail(SetupError("x"))
    assert dropped == ["runs/a", None]
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as e:
        train._fail(SetupError("x"))
    assert e.value.code == 2


def test_fail_with_hydra_full_error_raises_the_error_itself(monkeypatch, capsys):
    dropped = []
    monkeypatch.setattr(os, "_exit", _no_exit)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train, "_drop_empty_run_dir", dropped.append)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    err = SetupError("bad")
    with pytest.raises(SetupError) as e:
        train._fail(err, "d")
    assert e.value is err and capsys.readouterr().err == "" and dropped == []
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with pytest.raises(SystemExit):
        train._fail(err, "d")


def test_fail_in_one_of_many_processes_exits_at_once(monkeypatch, capsys):
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(train, "_drop_empty_run_dir", lambda d: None)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(SystemExit, match=r"os\._exit\(2\)"):
        train._fail(ConfigError("bad"), None)
    assert exits == [2] and capsys.readouterr().err == "error: bad\n"


def test_interrupted_is_one_line_drops_the_run_dir_and_exits_130(monkeypatch, capsys):
    dropped = []
    monkeypatch.setattr(train, "_drop_empty_run_dir", dropped.append)
    with pytest.raises(SystemExit) as e:
        train._interrupted("d")
    assert e.value.code == 130 and dropped == ["d"]
    assert capsys.readouterr().err == "\n[grpo] interrupted (Ctrl-C) while starting; nothing was trained\n"
    with pytest.raises(SystemExit):
        train._interrupted()
    assert dropped == ["d", None]


def test_load_or_exit_returns_the_config_or_fails_in_its_run_dir(monkeypatch):
    failed = []
    monkeypatch.setattr(train, "load", lambda raw: ("cfg", raw))
    assert train._load_or_exit({"a": 1}, "d") == ("cfg", {"a": 1})

    def bad(raw):
        raise ConfigError("nope")

    monkeypatch.setattr(train, "load", bad)
    monkeypatch.setattr(train, "_fail", lambda e, d: failed.append((str(e), d)))
    assert train._load_or_exit({}, "d") is None and failed == [("nope", "d")]


def _hydra_dir(root, *names):
    d = root.joinpath(*names)
    (d / ".hydra").mkdir(parents=True)
    return d


def test_drop_empty_run_dir_removes_only_what_hydra_alone_wrote_and_the_emptied_parents(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    d = _hydra_dir(tmp_path, "outputs", "day", "time")
    (tmp_path / "outputs" / "other").mkdir()
    train._drop_empty_run_dir(str(d))
    assert sorted(os.listdir(tmp_path / "outputs")) == ["other"]  # a parent that holds something else stays
    d = _hydra_dir(tmp_path, "a")
    (d / "train.log").write_text("")
    train._drop_empty_run_dir("a")  # relative to the working directory
    assert sorted(os.listdir(tmp_path)) == ["outputs"]
    d = _hydra_dir(tmp_path, "b")
    (d / "train.log").write_text("")
    (d / "x").write_text("")
    train._drop_empty_run_dir(str(d))
    assert sorted(os.listdir(d)) == [".hydra", "train.log", "x"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "train.log").write_text("")
    train._drop_empty_run_dir(str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()  # train.log alone


def test_drop_empty_run_dir_never_the_working_directory_nor_on_another_rank_nor_outside(monkeypatch, tmp_path):
    d = _hydra_dir(tmp_path, "w")
    monkeypatch.chdir(d)
    monkeypatch.delenv("RANK", raising=False)
    train._drop_empty_run_dir(str(d))
    train._drop_empty_run_dir(None)
    train._drop_empty_run_dir("")
    train._drop_empty_run_dir(str(tmp_path / "missing"))
    assert d.is_dir()
    inner = _hydra_dir(d, "r")
    monkeypatch.setenv("RANK", "1")
    train._drop_empty_run_dir(str(inner))
    assert inner.is_dir()
    monkeypatch.setenv("RANK", "0")
    train._drop_empty_run_dir(str(inner))
    assert not inner.exists() and d.is_dir()
    monkeypatch.setenv("RANK", "")
    outside = _hydra_dir(tmp_path, "x", "y")
    train._drop_empty_run_dir(str(outside))
    assert not outside.exists() and (tmp_path / "x").is_dir()  # parents outside the working directory stay


def test_a_run_dir_that_cannot_be_removed_is_left_without_an_error(monkeypatch, tmp_path):
    def unremovable(*a, **k):
        raise PermissionError("read-only")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    d = _hydra_dir(tmp_path, "outputs", "day")
    (d / ".hydra" / "config.yaml").write_text("")
    monkeypatch.setattr(os, "unlink", unremovable)
    train._drop_empty_run_dir(str(d))
    assert (d / ".hydra" / "config.yaml").exists() and (tmp_path / "outputs").is_dir()


def test_main_fails_or_is_interrupted_in_one_line(monkeypatch):
    from grpo import cli

    seen = []
    monkeypatch.setattr(train, "show_warnings_as_lines", lambda: seen.append("warnings"))
    monkeypatch.setattr(cli, "prepare_argv", lambda argv: [*argv, "prepared"])
    monkeypatch.setattr(train, "_hydra_main", lambda: lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["grpo-train", "a=1"])
    monkeypatch.setattr(train, "_fail", lambda e: seen.append(("fail", str(e))))
    monkeypatch.setattr(train, "_interrupted", lambda: seen.append("interrupted"))
    train.main()
    assert seen == ["warnings", ["grpo-train", "a=1", "prepared"]]
    for raised, said in ((ConfigError("bad"), ("fail", "bad")), (KeyboardInterrupt(), "interrupted")):
        def hydra_main(raised=raised):
            def run():
                raise raised
            return run

        seen.clear()
        monkeypatch.setattr(train, "_hydra_main", hydra_main)
        train.main()
        assert seen == ["warnings", said]


class _Hydra:
    def __init__(self, run_dir, subdir=".hydra", task=("a=1",)):
        self.runtime = SimpleNamespace(output_dir=str(run_dir), choices=OmegaConf.create({"model": "tiny"}))
        self.overrides = SimpleNamespace(task=list(task))
        self.output_subdir = subdir


def _hydra_run(monkeypatch, tmp_path, fit, subdir=".hydra", output_dir=None, precedence=None, seen=None, raw=None):
    """The Hydra job's body on ``{"trainer": {"output_dir": output_dir, "max_steps": 3}}`` with stand-ins for
    Hydra's config, the precedence rules, fit and the run log; `_fail` and `_interrupted` record and exit."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from grpo.config import compose
    from grpo.trainer import logger, loop

    seen = {} if seen is None else seen
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: _Hydra(tmp_path / "run", subdir)))
    monkeypatch.setattr(hydra, "compose", lambda **kw: seen.setdefault("compose", kw))

    def apply(raw, task, choices, compose_fn):
        seen["precedence"] = (task, choices)
        compose_fn(["~recipe"])  # the recipe-less pass composes the config again
        if precedence:
            raise precedence
        return raw

    @contextlib.contextmanager
    def run_log(out, enabled):
        seen["log"] = (out, enabled)
        yield

    def fail(e, d):
        seen["fail"] = (type(e).__name__, str(e), d)
        raise SystemExit(2)

    def interrupted(d):
        seen["interrupted"] = d
        raise SystemExit(130)

    monkeypatch.setattr(compose, "apply_precedence", apply)
    monkeypatch.setattr(loop, "fit", lambda cfg: seen.setdefault("fit", cfg) and fit(cfg))
    monkeypatch.setattr(logger, "run_log", run_log)
    monkeypatch.setattr(train, "_fail", fail)
    monkeypatch.setattr(train, "_interrupted", interrupted)
    raw = OmegaConf.create(raw or {"trainer": {"output_dir": output_dir, "max_steps": 3}})
    return seen, train._hydra_main()(raw)


def test_the_hydra_job_trains_in_its_run_dir_saves_the_config_and_returns_the_reward(monkeypatch, tmp_path):
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    monkeypatch.delenv("RANK", raising=False)
    seen, result = _hydra_run(monkeypatch, tmp_path, lambda cfg: {"eval_after": {"reward_mean": 0.25}})
    assert result == 0.25 and seen["precedence"] == (["a=1"], {"model": "tiny"})
    assert seen["compose"] == {"config_name": "config", "overrides": ["~recipe"]}
    cfg = seen["fit"]
    assert cfg.trainer.output_dir == str(tmp_path / "run") and cfg.trainer.max_steps == 3
    assert seen["log"] == (str(tmp_path / "run"), True) and "fail" not in seen
    saved = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert saved.trainer.max_steps == 3 and saved.trainer.output_dir == str(tmp_path / "run")
    assert set(saved) == set(OmegaConf.create(dataclasses.asdict(cfg)))


def test_the_hydra_job_of_a_sweep_keeps_its_output_dir_and_rank_1_logs_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    seen, result = _hydra_run(monkeypatch, tmp_path, lambda cfg: {}, output_dir=str(tmp_path / "job"))
    assert result is None and seen["fit"].trainer.output_dir == str(tmp_path / "job")
    assert seen["log"] == (str(tmp_path / "job"), False) and not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "run").mkdir()
    seen, _ = _hydra_run(monkeypatch, tmp_path, lambda cfg: {}, subdir=None)
    assert seen["log"][1] is True and os.listdir(tmp_path / "run") == []
    seen, _ = _hydra_run(monkeypatch, tmp_path, lambda cfg: {"eval_after": {}})  # .hydra/ not there: not saved
    assert os.listdir(tmp_path / "run") == []


@pytest.mark.parametrize("raised, key, said, code", [
    (SetupError("bad"), "fail", ("SetupError", "bad", "RUN"), 2),
    (FileNotFoundError("gone"), "fail", ("FileNotFoundError", "gone", "RUN"), 2),
    (KeyboardInterrupt(), "interrupted", "RUN", 130),
])
def test_the_hydra_job_turns_a_failed_fit_into_one_line(monkeypatch, tmp_path, raised, key, said, code):
    def fit(cfg):
        raise raised

    seen = {}
    with pytest.raises(SystemExit) as e:
        _hydra_run(monkeypatch, tmp_path, fit, subdir=None, seen=seen)
    run = str(tmp_path / "run")
    expected = tuple(run if x == "RUN" else x for x in said) if isinstance(said, tuple) else run
    assert e.value.code == code and seen[key] == expected


def test_the_hydra_job_resolves_the_config_before_the_schema_drops_the_recipe_key(monkeypatch, tmp_path):
    raw = {"recipe": {"steps": 5}, "trainer": {"output_dir": None, "max_steps": "${recipe.steps}"}}
    seen, _ = _hydra_run(monkeypatch, tmp_path, lambda cfg: {}, subdir=None, raw=raw)
    assert seen["fit"].trainer.max_steps == 5


def test_the_hydra_job_fails_in_its_run_dir_on_a_config_the_schema_refuses(monkeypatch, tmp_path):
    seen = {}
    with pytest.raises(SystemExit):
        _hydra_run(monkeypatch, tmp_path, lambda cfg: {}, subdir=None, seen=seen, raw={"trainer": {"max_stepz": 1}})
    assert seen["fail"][0] == "ConfigError" and "trainer.max_stepz" in seen["fail"][1]
    assert seen["fail"][2] == str(tmp_path / "run") and "fit" not in seen


def test_the_hydra_job_exits_with_the_stop_signals_code(monkeypatch, tmp_path):
    from grpo.trainer.signals import StopNow

    def fit(cfg):
        raise StopNow(15)

    seen = {}
    with pytest.raises(SystemExit) as e:
        _hydra_run(monkeypatch, tmp_path, fit, subdir=None, seen=seen)
    assert e.value.code == 143 and "fail" not in seen and "interrupted" not in seen


def test_the_hydra_job_fails_in_one_line_when_the_precedence_does_not_compose(monkeypatch, tmp_path):
    seen = {}
    with pytest.raises(SystemExit):
        _hydra_run(monkeypatch, tmp_path, lambda cfg: {}, subdir=None, precedence=ConfigError("no"), seen=seen)
    assert seen["fail"] == ("ConfigError", "no", str(tmp_path / "run")) and "fit" not in seen
