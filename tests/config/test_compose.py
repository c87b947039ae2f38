"""What you compose is what runs: the precedence rules of grpo/config/compose.py and the checks that run before
a run directory exists. Each case here was wrong before (issue: "what you compose is what runs")."""
import sys

import pytest
from omegaconf import OmegaConf

from grpo.config.compose import RECIPE_DIR, RECIPE_PATH_ENV
from grpo.config.schema import load
from tests.helpers import ROOT, compose_recipe


def composed(recipe, *overrides):
    raw = OmegaConf.to_container(compose_recipe(recipe, ["trainer.output_dir=/tmp/x", *overrides]), resolve=True)
    return load(raw)


def fns(cfg):
    return {name: spec["fn"] for name, spec in cfg.reward.functions.items()}


# ------------------------------------------------------------------------------ removing and replacing
def test_a_removed_reward_stays_removed():
    assert fns(composed("smoke", "~reward.functions.accuracy")) == {"format": "number_only"}
    assert fns(composed("quickstart", "~reward.functions.format")) == {"accuracy": "arithmetic"}


def test_load_replaces_dict_defaults_instead_of_merging_into_them():
    cfg = load({"reward": {"functions": {"mine": {"fn": "number_only"}}}, "logging": {"wandb": {"mode": "disabled"}}})
    assert list(cfg.reward.functions) == ["mine"]  # the schema's default 'accuracy' does not come back
    assert cfg.logging.wandb == {"mode": "disabled"}


def test_the_command_line_can_replace_the_whole_reward_set():
    cfg = composed("quickstart", "reward.functions={mine: {fn: number_only, weight: 2.0}}")
    assert cfg.reward.functions == {"mine": {"fn": "number_only", "weight": 2.0}}


# ----------------------------------------------------------------------------------- precedence
def test_a_group_named_on_the_command_line_beats_the_recipe():
    assert fns(composed("quickstart", "reward=math")) == {"accuracy": "math_accuracy", "format": "format"}
    cfg = composed("smoke", "data=countdown", "reward=countdown")
    assert fns(cfg) == {"accuracy": "countdown", "format": "format", "tags": "tag_count"}
    assert cfg.data.task_kwargs == {"min_numbers": 3, "max_numbers": 4}


def test_key_overrides_apply_on_top_of_a_named_group():
    cfg = composed("quickstart", "reward=math", "reward.functions.format.weight=1.0")
    assert cfg.reward.functions["format"] == {"fn": "format", "weight": 1.0, "strict": False}


def test_a_task_never_inherits_another_tasks_arguments():
    assert composed("quickstart", "data=countdown").data.task_kwargs == {"min_numbers": 3, "max_numbers": 4}
    assert composed("smoke", "data.source=builtin:countdown").data.task_kwargs == {}
    assert composed("smoke", "data.source=builtin:countdown", "+data.task_kwargs.max_numbers=3") \
        .data.task_kwargs == {"max_numbers": 3}
    # the same task keeps its arguments
    assert composed("quickstart", "data.source=builtin:arithmetic").data.task_kwargs == {"level": 0}


def test_a_recipe_written_from_the_docs_snippets_takes_its_own_rewards_and_task_arguments(tmp_path, monkeypatch):
    """docs/tasks.md's countdown block pasted into a recipe of the user's own folder, found by name through
    $GRPO_RECIPE_PATH (docs/getting-started.md): no leftover arithmetic level or reward. (Written where compose reads,
    not into the checkout's recipes/, which is not the folder the code reads when the package runs from a copy.)"""
    snippet = (ROOT / "docs" / "tasks.md").read_text().split("```yaml\n")[1].split("```")[0]
    (tmp_path / "zz-pasted-snippet.yaml").write_text("# @package _global_\n" + snippet)
    monkeypatch.setenv(RECIPE_PATH_ENV, str(tmp_path))
    cfg = composed("zz-pasted-snippet")
    assert cfg.data.source == "builtin:countdown"
    assert cfg.data.task_kwargs == {"min_numbers": 3, "max_numbers": 4}
    assert fns(cfg) == {"countdown": "countdown"}


def test_recipes_keep_their_own_values():
    assert composed("math-lora").data.task_kwargs["level"] == 3
    assert composed("math-lora", "data.task_kwargs.level=4").data.task_kwargs["level"] == 4
    assert composed("qwen-gsm8k").data.task_kwargs == {}  # a hub source: the arithmetic level does not leak


# ------------------------------------------------------------------------ checks before anything runs
def run_main(monkeypatch, capsys, tmp_path, *args):
    """`grpo-train recipe=smoke <args>` in this process; returns (exit code, stderr)."""
    from grpo import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=smoke", *args])
    with pytest.raises(SystemExit) as e:
        train.main()
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, fragment", [
    (["+reward.functions.format.wieght=2"], "reward.functions.format.wieght: 'number_only' has no argument 'wieght' "
                                            "(did you mean 'weight'?)"),
    (["+reward.functions.em.fn=exact_match", "+reward.functions.em.mdoe=contains"], "did you mean 'mode'?"),
    (["+data.task_kwargs.levle=2"], "data.task_kwargs.levle: builtin:arithmetic has no argument 'levle' "
                                    "(did you mean 'level'?)"),
    (["data.task_kwargs.level=9"], "arithmetic level must be 0-4, got 9"),
    (["+reward.functions.o.fn=overlong_penalty"], "overlong_penalty needs max_len > 0"),
    (["+reward.functions.rm.fn=reward_model"], "reward_model needs path="),
    (["+reward.functions.rm.fn=reward_model", "+reward.functions.rm.path=/no/such/rm"], "'/no/such/rm' does not exist"),
    (["logging.log_every=0"], "logging.log_every=0 is out of range"),
    (["trainer.adam_betas=0.9"], "trainer.adam_betas must be a list, e.g. trainer.adam_betas=[0.9,0.99]"),
    (["trainer.adam_betas=[0.9]"], "trainer.adam_betas=[0.9] must be two numbers in [0, 1)"),
    (["model.name_or_path=/no/such/dir"], "model.name_or_path='/no/such/dir' does not exist"),
    (["data.source=."], "data.source='.' is a folder"),
    (["reward.functions.accuracy.fn=nosuchmod:f"], "cannot import module 'nosuchmod'"),
    (["+reward.functions.x=1"], "reward.functions.x needs an 'fn'"),
    (["~reward.functions.acuracy"], "reward.functions has no 'acuracy' (did you mean 'accuracy'?)"),
    (["reward.functions.acuracy.weight=1"], "reward.functions has no 'acuracy' (did you mean 'accuracy'?)"),
    (["trainer.resume=/no/such/step_3"], "trainer.resume='/no/such/step_3': no such checkpoint directory"),
    (["trainer.resume=disable"], "trainer.resume=disable is verl's; ours: null (a fresh run), auto or a path"),
])
def test_mistakes_fail_in_one_line_and_leave_no_run_directory(monkeypatch, capsys, tmp_path, args, fragment):
    out = tmp_path / "run"
    code, err = run_main(monkeypatch, capsys, tmp_path, f"trainer.output_dir={out}", *args)
    assert code == 2
    assert fragment in err, err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()], err  # one line
    assert not out.exists() and not (tmp_path / "outputs").exists()


def test_an_existing_file_as_output_dir(monkeypatch, capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, err = run_main(monkeypatch, capsys, tmp_path, "trainer.output_dir=afile")
    assert code == 2 and "trainer.output_dir='afile' is an existing file" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_on_a_machine_without_it(monkeypatch, capsys, tmp_path):
    code, err = run_main(monkeypatch, capsys, tmp_path, "trainer.device=cuda", f"trainer.output_dir={tmp_path}/r")
    assert code == 2 and "trainer.device=cuda but this machine has no usable CUDA device" in err


def test_cfg_job_prints_the_config_that_runs(monkeypatch, capsys, tmp_path):
    from grpo import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=quickstart", "reward=math", "--cfg", "job"])
    with pytest.raises(SystemExit) as e:
        train.main()
    assert e.value.code == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert {k: v.fn for k, v in printed.reward.functions.items()} == {"accuracy": "math_accuracy", "format": "format"}
    assert not (tmp_path / "outputs").exists()


# ------------------------------------------------------------------------------ recipes from anywhere
def _recipe(path, steps, header=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{header}defaults:\n  - override /model: tiny\ntrainer: {{max_steps: {steps}}}\n")
    return path


def test_a_recipe_by_path_absolute_or_relative(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _recipe(tmp_path / "sub" / "mine.yaml", 7)
    for value in (str(tmp_path / "sub" / "mine.yaml"), "./sub/mine.yaml", "sub/mine.yaml"):
        cfg = composed(value)
        assert cfg.trainer.max_steps == 7 and cfg.model.name_or_path == "tiny:llama", value
    assert composed(str(RECIPE_DIR / "smoke.yaml")).algorithm.group_size == 4  # a built-in, by its path


def test_a_recipe_without_the_package_line_or_with_a_comment_above_it_applies_its_keys(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for header in ("", "# my recipe\n# @package _global_\n", "# just a comment\n"):
        _recipe(tmp_path / "r.yaml", 9, header)
        raw = compose_recipe("./r.yaml", ["trainer.output_dir=/tmp/x"])
        assert "recipe" not in raw and raw.trainer.max_steps == 9, header  # never a stray `recipe:` section


def test_recipe_names_are_looked_up_in_the_search_path_then_the_built_ins(monkeypatch, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _recipe(a / "mine.yaml", 3)
    _recipe(b / "mine.yaml", 4)
    _recipe(b / "smoke.yaml", 5)
    monkeypatch.setenv("GRPO_RECIPE_PATH", f"{a}:{b}")
    assert composed("mine").trainer.max_steps == 3  # the first folder that has it wins
    assert composed("smoke").trainer.max_steps == 5  # yours before the built-ins
    assert composed("quickstart").model.name_or_path.startswith("embedded:")  # a built-in still found
    monkeypatch.setenv("GRPO_RECIPE_PATH", str(b))
    assert composed("mine").trainer.max_steps == 4
    # a sweep over recipes of both kinds
    from grpo.config.compose import find_recipe, normalize
    swept = normalize(["recipe=mine,quickstart"])
    assert swept[0].endswith(",quickstart") and find_recipe(swept[0][7:].split(",")[0]) == (b / "mine.yaml").resolve()


def test_a_recipe_of_yours_goes_by_its_own_name_unless_a_built_in_has_it(monkeypatch, tmp_path):
    """Job names, overrides.yaml and grpo-report's labels say recipe=NAME, not the option Hydra loads it as; one that
    shadows a built-in is recipe=user/NAME (the built-in keeps its name)."""
    from grpo.config.compose import normalize

    _recipe(tmp_path / "mine" / "only-mine-x7.yaml", 3)
    _recipe(tmp_path / "mine" / "smoke.yaml", 5)
    monkeypatch.setenv("GRPO_RECIPE_PATH", str(tmp_path / "mine"))
    got = [o for o in normalize(["recipe=only-mine-x7,smoke"]) if o.startswith("recipe=")]
    assert got[0].startswith("recipe=only-mine-x7,user") and got[0].endswith("/smoke")
    assert composed("only-mine-x7").trainer.max_steps == 3 and composed("smoke").trainer.max_steps == 5


def test_a_recipe_not_found_names_every_folder_searched(monkeypatch, tmp_path):
    from grpo.cli import check_argv
    from grpo.errors import ConfigError

    monkeypatch.setenv("GRPO_RECIPE_PATH", str(tmp_path / "mine"))
    with pytest.raises(ConfigError) as e:
        check_argv(["recipe=nope"])
    msg = str(e.value)
    assert f"in {tmp_path / 'mine'}, {RECIPE_DIR.resolve()}; available: " in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="recipe='./nope.yaml': no such file"):
        check_argv(["recipe=./nope.yaml"])


def test_a_built_in_folder_recipe_with_a_comment_above_its_package_line_applies_its_keys():
    # the built-in folder compose reads (the checkout's recipes/ through configs/recipe; a copy of it inside mutants/)
    recipe = _recipe(RECIPE_DIR / "zz-comment-first.yaml", 11, "# what it shows\n# @package _global_\n")
    try:
        raw = compose_recipe("zz-comment-first", ["trainer.output_dir=/tmp/x"])
    finally:
        recipe.unlink()
    assert "recipe" not in raw and raw.trainer.max_steps == 11


# ------------------------------------------------------------- compose.py's pieces, without a Hydra composition: fast
from grpo.config import compose as C  # noqa: E402
from grpo.errors import ConfigError  # noqa: E402


def parsed(*overrides):
    return C._parse(list(overrides))


@pytest.fixture
def unserved(monkeypatch):
    """No recipe served yet in this process (the tests above served some: the overlay joins every command line)."""
    monkeypatch.setattr(C, "_served", {})
    monkeypatch.setattr(C, "_overlay", [])


def test_groups_are_the_config_folders_and_the_built_in_recipes():
    g = C.groups()
    assert set(g) == {"recipe", "model", "data", "reward", "rollout", "algorithm", "engine", "trainer", "logging",
                      "distributed", "evaluation", "alarms"}
    assert g["distributed"] == ["none", "zero2", "zero3"] and g["model"] == ["smollm2", "tiny"]
    assert {"smoke", "quickstart", "countdown"} <= set(g["recipe"]) and g["recipe"] == sorted(g["recipe"])
    assert C._is_group("distributed") and C._is_group("recipe")
    assert not C._is_group("distributed.backend") and not C._is_group("nosuch")


def test_a_command_line_that_does_not_parse_is_one_line():
    with pytest.raises(ConfigError, match=r"^cannot parse the command line: no viable alternative at input '\[1'$"):
        C._parse(["a=[1"])


def test_normalize_turns_a_dict_given_whole_into_delete_and_add_and_keeps_the_rest(unserved):
    assert C.normalize(["reward.functions={a: {fn: x}}", "model.tiny={hidden_size: 8}"]) == [
        "~reward.functions", "+reward.functions={a: {fn: x}}", "~model.tiny", "+model.tiny={hidden_size: 8}"]
    kept = ["+reward.functions={b: {fn: y}}", "++data.task_kwargs={level: 2}", "~reward.functions", "trainer.lr=1",
            "reward.functions=null", "reward.functions.a.weight=2", "reward.functions={a: {fn: x}},{b: {fn: y}}",
            "trainer.adam_betas=[0.9,0.9]"]
    assert C.normalize(kept) == kept


def test_yaml_of_a_missing_file_is_empty(tmp_path):
    assert C._yaml(tmp_path / "none.yaml") == {}
    (tmp_path / "a.yaml").write_text("x: {y: 1}\n")
    assert C._yaml(tmp_path / "a.yaml") == {"x": {"y": 1}}


def test_overrides_of_a_dict_apply_in_order_to_its_base():
    key = "data.task_kwargs"
    got = C._apply_overrides({"level": 1, "n": {"a": 1, "b": 2}}, key, parsed(
        "data.task_kwargs.level=3", "data.task_kwargs.level=5,6", "~data.task_kwargs.n.a", "+data.task_kwargs.new=4",
        "data.task_kwargsX.z=1", "trainer.lr=1", "~data.task_kwargs.absent", "~data.task_kwargs.nope.deeper"))
    assert got == {"level": 3, "n": {"b": 2}, "new": 4}  # the sweep and other keys are not applied
    assert C._apply_overrides({"level": 1}, key, parsed("data.task_kwargs={a: 1}", "data.task_kwargs.b=2")) == \
        {"a": 1, "b": 2}
    assert C._apply_overrides({"level": 1}, key, parsed("data.task_kwargs=null")) == {}
    assert C._apply_overrides({"level": 1}, key, parsed("~data.task_kwargs={level: 1}")) == {}  # a delete, valued
    assert C._apply_overrides({"level": 1}, key, parsed("~data.task_kwargs", "+data.task_kwargs.c=3")) == {"c": 3}
    merged = C._apply_overrides({"n": {"a": 1}}, key, parsed("+data.task_kwargs.n={b: 2}"))
    assert merged == {"n": {"a": 1, "b": 2}}  # + merges into a sub-dict, a plain override replaces it
    assert C._apply_overrides({"n": {"a": 1}}, key, parsed("data.task_kwargs.n={b: 2}")) == {"n": {"b": 2}}
    deep = C._apply_overrides({"n": {"d": {"x": 1, "y": 2}}}, key, parsed("~data.task_kwargs.n.d.x"))
    assert deep == {"n": {"d": {"y": 2}}}  # a delete two levels down: the last key comes off its own parent


def test_a_dicts_base_is_the_recipes_own_value_or_hydras_merge():
    from omegaconf import OmegaConf

    rec = OmegaConf.create({"reward": {"functions": {"a": {"fn": "x"}}}, "data": {"task_kwargs": {"level": 3}}})
    assert C._dict_base("reward.functions", [], {}, rec) == {"a": {"fn": "x"}}
    assert C._dict_base("reward.functions", [], {}, None) is None  # the section is dropped: Hydra's value
    assert C._dict_base("model.tiny", [], {}, rec) is None
    choices = {"data": "countdown"}  # its source: builtin:countdown
    assert C._dict_base("data.task_kwargs", [], choices, rec) == {"level": 3}
    # the command line switches the task: only its own arguments; the same task keeps them
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:arithmetic"), choices, rec) == {}
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:countdown"), choices, rec) == {"level": 3}
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:arithmetic", "data.source=builtin:countdown"),
                        choices, rec) == {"level": 3}  # the last one counts
    assert C._dict_base("data.task_kwargs", parsed("~data.source"), choices, rec) == {"level": 3}
    # a recipe that switches the task without arguments: the task's defaults; one that keeps it: Hydra's merge
    switched = OmegaConf.create({"data": {"source": "builtin:arithmetic"}})
    assert C._dict_base("data.task_kwargs", [], choices, switched) == {}
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:arithmetic"), choices, switched) == {}
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:countdown"), choices, switched) == {}
    own = OmegaConf.create({"data": {"source": "builtin:arithmetic", "task_kwargs": {"level": 3}}})
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:arithmetic"), choices, own) == {"level": 3}
    same = OmegaConf.create({"data": {"source": "builtin:countdown"}})
    assert C._dict_base("data.task_kwargs", [], choices, same) is None
    assert C._dict_base("data.task_kwargs", [], {}, switched) == {}  # no data group chosen
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:countdown"), {}, None) == {}
    assert C._dict_base("data.task_kwargs", parsed("data.source=builtin:countdown"), choices, None) is None


class _Composed:
    def __init__(self, rewards):
        self.reward = type("R", (), {"functions": dict.fromkeys(rewards)})()


def test_a_reward_the_run_does_not_have_gets_a_did_you_mean():
    seen = []

    def compose_fn(overrides):
        seen.append(overrides)
        return _Composed(["accuracy", "format"])

    line = C._reward_typo(["trainer.lr=1", "reward.functions.acuracy.weight=2"], compose_fn)
    assert line == ("reward.functions has no 'acuracy' (did you mean 'accuracy'?); this run's rewards: accuracy, "
                    "format; add a new one with '+reward.functions.acuracy={fn: ..., weight: ...}'")
    assert seen == [["trainer.lr=1"]]  # composed without the lines that name a reward
    assert C._reward_typo(["~reward.functions.zzz"], compose_fn).startswith("reward.functions has no 'zzz'; this")
    assert C._reward_typo(["reward.functions.format.weight=2", "~reward.functions.accuracy"], compose_fn) is None
    assert C._reward_typo(["+reward.functions.new.fn=x", "++reward.functions.n2.fn=y", "trainer.lr=1"],
                          compose_fn) is None
    assert len(seen) == 3  # nothing composed where no reward is named


def test_a_reward_typo_is_not_guessed_when_the_rest_does_not_compose_either():
    def broken(overrides):
        raise ValueError("another mistake")

    assert C._reward_typo(["reward.functions.acuracy.weight=2"], broken) is None


@pytest.mark.parametrize("text, line", [
    ("", "ValueError"),
    ("  \n  ", "ValueError"),
    ("Could not override 'x'.\nfull_key: x\nobject_type=dict\nKey 'x' is not in struct\n"
     "To append to your config use +x=1", "Could not override 'x'. Key 'x' is not in struct To append to your config "
                                          "use +x=1"),
    ("one line only", "one line only"),
    ("first\n  second  \nthird", "first second"),
    ("first\nTo append: +a\nobject_type=x", "first To append: +a"),
    ("first\nTo append: +a\nTo append: +b\ndetail", "first detail To append: +a"),  # one detail, one hint, in order
])
def test_hydras_error_is_its_first_line_the_detail_and_the_hint(text, line):
    assert C.hydra_error_line(ValueError(text)) == line


def test_recipe_folders_are_the_search_path_then_the_built_ins(monkeypatch, tmp_path):
    monkeypatch.delenv(C.RECIPE_PATH_ENV, raising=False)
    assert C.recipe_folders() == [C.RECIPE_DIR]
    monkeypatch.setenv(C.RECIPE_PATH_ENV, f"{tmp_path / 'a'}::{tmp_path / 'b'}:")
    assert C.recipe_folders() == [tmp_path / "a", tmp_path / "b", C.RECIPE_DIR]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(C.RECIPE_PATH_ENV, "~/r")
    assert C.recipe_folders()[0] == (tmp_path / "r").resolve()


@pytest.mark.parametrize("value, is_path", [
    ("smoke", False), ("my-first", False), ("a/b", True), ("x.yaml", True), ("x.yml", True), ("~x", True),
    ("x.yamlx", False),
])
def test_a_recipe_value_is_a_path_when_it_has_a_slash_a_yaml_suffix_or_a_tilde(value, is_path):
    assert C._is_path(value) is is_path


def test_a_backslash_is_a_separator_on_windows_only(monkeypatch):
    assert C._is_path("a\\b") is False  # POSIX: a name with a backslash in it
    monkeypatch.setattr(C.os, "sep", "\\")
    monkeypatch.setattr(C.os, "altsep", "/")
    assert C._is_path("a\\b") is True and C._is_path("a/b") is True and C._is_path("smoke") is False


def test_find_recipe_by_path_or_by_name_in_the_folders_in_order(monkeypatch, tmp_path, unserved):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, names in ((a, ["x"]), (b, ["x", "y"])):
        d.mkdir()
        for n in names:
            (d / f"{n}.yaml").write_text("trainer: {max_steps: 1}\n")
    monkeypatch.setenv(C.RECIPE_PATH_ENV, f"{a}:{b}")
    assert C.find_recipe("x") == a / "x.yaml" and C.find_recipe("y") == b / "y.yaml"
    assert C.find_recipe("smoke") == C.RECIPE_DIR / "smoke.yaml"
    monkeypatch.chdir(tmp_path)
    assert C.find_recipe("b/y.yaml") == (b / "y.yaml").resolve() == C.find_recipe(str(b / "y.yaml"))
    with pytest.raises(ConfigError) as e:
        C.find_recipe("nope")
    assert str(e.value).startswith(f"recipe='nope' does not exist in {a.resolve()}, {b.resolve()}, "
                                   f"{C.RECIPE_DIR.resolve()}; available: calculator-tools, ")
    assert ", smoke, " in str(e.value) and ", x, y, " in str(e.value)  # every folder's names, once, sorted
    assert str(e.value).endswith("; or give a path: recipe=./nope.yaml")
    monkeypatch.delenv(C.RECIPE_PATH_ENV)
    with pytest.raises(ConfigError, match=rf"does not exist in {C.RECIPE_DIR.resolve()} \(\$GRPO_RECIPE_PATH is not "
                                          "set\\); available: calculator-tools, "):
        C.find_recipe("nope")
    with pytest.raises(ConfigError, match=r"^recipe='a/none.yaml': no such file .*/a/none.yaml$"):
        C.find_recipe("a/none.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        C.find_recipe("./a")  # a folder is not a recipe file


@pytest.mark.parametrize("text, is_global", [
    ("# @package _global_\nx: 1\n", True),
    ("\n\n#@package _global_\n", True),
    ("# @package _global_   \n", True),
    ("# @package   _global_\n", True),
    ("# what it shows\n# @package _global_\n", False),  # a plain comment ends the header
    ("# @package _global_\n# a comment\n# @package foo\n", True),  # the header ended at the comment
    ("# @package foo\n# @package _global_\n", True),  # the last @package of the header
    ("# @package _global_\n# @package foo\n", False),
    ("x: 1\n# @package _global_\n", False),
    ("# @other _global_\n", False),
    ("# @package\n", False),
    ("", False),
])
def test_is_global_reads_the_header_as_hydra_does(text, is_global):
    assert C._is_global(text) is is_global


def test_recipes_outside_the_built_in_folder_are_served_by_their_own_name_or_user_name(monkeypatch, tmp_path,
                                                                                      unserved):
    import shutil

    at_exit = []
    monkeypatch.setattr(C.atexit, "register", lambda *call: at_exit.append(call))
    assert C._option(C.RECIPE_DIR / "smoke.yaml") == "smoke"  # a built-in, global: itself
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine, shadow = tmp_path / "a" / "mine-z9.yaml", tmp_path / "a" / "smoke.yaml"
    shadow2 = tmp_path / "b" / "smoke.yaml"
    for p in (mine, shadow, shadow2):
        p.write_text(f"trainer: {{max_steps: {len(str(p))}}}\n")
    assert C._option(mine) == "mine-z9" and C._option(mine) == "mine-z9"  # served once
    assert C._option(shadow) == "user/smoke" and C._option(shadow2) == "user2/smoke"
    overlay = C._overlay[0]
    assert len(C._overlay) == 1 and overlay.name.startswith("grpo-recipes-")
    assert at_exit == [(shutil.rmtree, overlay, True)]  # removed at exit, once, whatever is left in it
    assert (overlay / "recipe" / "mine-z9.yaml").read_text() == "# @package _global_\n" + mine.read_text()
    assert (overlay / "recipe" / "user2" / "smoke.yaml").read_text().endswith(shadow2.read_text())
    assert C.recipe_file("user/smoke") == shadow and C.recipe_file("smoke") == C.RECIPE_DIR / "smoke.yaml"
    assert C._served_file("user2/smoke") == shadow2 and C._served_file("nope") is None
    assert C.find_recipe("user/smoke") == shadow  # an option this process serves
    monkeypatch.delenv(C.RECIPE_PATH_ENV, raising=False)
    with pytest.raises(ConfigError, match="no such file"):
        C.find_recipe("user3/smoke")  # not served: a path, which does not exist
    shutil.rmtree(overlay)


def test_a_first_recipe_served_as_user_name_and_a_global_one_outside_the_built_ins_are_served(monkeypatch, tmp_path,
                                                                                             unserved):
    import shutil

    monkeypatch.setattr(C.atexit, "register", lambda *call: None)
    shadow, glob = tmp_path / "smoke.yaml", tmp_path / "glob-k3.yaml"
    shadow.write_text("trainer: {max_steps: 3}\n")
    glob.write_text("# @package _global_\ntrainer: {max_steps: 4}\n")
    assert C._option(shadow) == "user/smoke"  # the overlay's recipe/user/ made with its parents
    assert C._option(glob) == "glob-k3" and C._served[glob] == "glob-k3"  # Hydra reads only its search path
    assert (C._overlay[0] / "recipe" / "glob-k3.yaml").read_text() == "# @package _global_\n" + glob.read_text()
    yml = tmp_path / "quickstart.yml"  # a .yml file of a built-in's name
    yml.write_text("trainer: {max_steps: 5}\n")
    assert C._option(yml) == "user/quickstart"
    shutil.rmtree(C._overlay[0])


def test_serve_recipes_rewrites_recipe_values_and_puts_the_overlay_on_the_search_path(monkeypatch, tmp_path, unserved):
    assert C.serve_recipes(["recipe=smoke", "trainer.lr=1", "~recipe"]) == ["recipe=smoke", "trainer.lr=1", "~recipe"]
    mine = tmp_path / "mine-q4.yaml"
    mine.write_text("trainer: {max_steps: 2}\n")
    monkeypatch.setenv(C.RECIPE_PATH_ENV, str(tmp_path))
    out = C.serve_recipes(["trainer.lr=1", "recipe=mine-q4,smoke"])
    entry = f"file://{C._overlay[0]}"
    assert out == ["trainer.lr=1", "recipe=mine-q4,smoke", f"hydra.searchpath=[{entry}]"]
    assert C.serve_recipes(["+recipe=mine-q4", "hydra.searchpath=[]"]) == ["+recipe=mine-q4",
                                                                           f"hydra.searchpath=[{entry}]"]
    assert C.serve_recipes(["recipe=mine-q4", "hydra.searchpath=[file:///x]", "hydra.searchpath=[file:///y]"]) == [
        "recipe=mine-q4", "hydra.searchpath=[file:///x]", f"hydra.searchpath=[file:///y,{entry}]"]
    assert C.serve_recipes(["recipe=mine-q4", "hydra.searchpath=[file:///opt/X]"])[1] == \
        f"hydra.searchpath=[file:///opt/X,{entry}]"  # only the closing bracket comes off
    given = ["recipe=mine-q4", f"hydra.searchpath=[{entry}]"]
    assert C.serve_recipes(given) == given
    assert C.serve_recipes(["trainer.lr=1"]) == ["trainer.lr=1", f"hydra.searchpath=[{entry}]"]  # served before
    odd = tmp_path / "recipe=1"  # a quoted path with "recipe=" in it: only the key's own is rewritten
    odd.mkdir()
    (odd / "odd-k2.yaml").write_text("trainer: {max_steps: 2}\n")
    assert C.serve_recipes([f"recipe='{odd / 'odd-k2.yaml'}'"])[0] == "recipe=odd-k2"


def test_precedence_composes_the_named_groups_without_the_recipe_and_takes_their_sections():
    from omegaconf import OmegaConf

    calls = []

    def compose_fn(overrides):
        calls.append(overrides)
        return OmegaConf.create({"reward": {"functions": {"g": {"fn": "from_group"}}}, "trainer": {"lr": 9}})

    raw = OmegaConf.create({"reward": {"functions": {"r": {"fn": "from_recipe"}}, "timeout_s": 0},
                            "trainer": {"lr": 1}, "data": {"task_kwargs": {"level": 1}}})
    choices = {"recipe": "smoke", "reward": "math", "data": "arithmetic", "model": "tiny", "hydra/job": None,
               "distributed": None}
    overrides = ["reward=math", "reward.functions.g.weight=2", "trainer.lr=3", "~model", "data.source=builtin:x"]
    out = C.apply_precedence(raw, overrides, choices, compose_fn)
    assert calls == [["~recipe", "reward=math", "data=arithmetic", "model=tiny", "reward.functions.g.weight=2"]]
    assert out.reward.functions == {"g": {"fn": "from_group"}}  # the group's whole section (its CLI keys composed in)
    assert out.trainer.lr == 1  # a section no group named stays Hydra's
    assert out.data.task_kwargs == {}  # the command line switched the task
    assert raw.reward.functions == {"r": {"fn": "from_recipe"}}  # the input is not changed
    assert C.apply_precedence(raw, ["trainer.lr=3", "~reward"], choices, compose_fn) is not raw and len(calls) == 1


def test_precedence_without_a_recipe_or_a_named_group_composes_nothing_more():
    from omegaconf import OmegaConf

    def compose_fn(overrides):
        raise AssertionError("not composed")

    raw = OmegaConf.create({"reward": {"functions": {"a": {"fn": "x"}}}})
    assert C.apply_precedence(raw, ["reward=math"], {"reward": "math"}, compose_fn) == raw
    assert C.apply_precedence(raw, ["recipe=smoke", "trainer.lr=1"], {"recipe": "smoke"}, compose_fn).reward.functions \
        == {"accuracy": {"fn": "arithmetic", "weight": 1.0}, "format": {"fn": "number_only", "weight": 0.5}}
    assert C.apply_precedence(raw, ["trainer.lr=1"], {"recipe": "smoke"}, compose_fn).reward.functions == \
        {"accuracy": {"fn": "arithmetic", "weight": 1.0}, "format": {"fn": "number_only", "weight": 0.5}}


def test_precedence_leaves_a_section_that_is_not_a_mapping_alone_and_reads_the_recipe_and_group_files():
    from omegaconf import OmegaConf

    raw = OmegaConf.create({"reward": None, "data": {"task_kwargs": {"level": 1}}})
    out = C.apply_precedence(raw, [], {"recipe": "quickstart"}, None)
    assert out.reward is None and out.data.task_kwargs == {"level": 0}  # the recipe's own task arguments
    assert C._recipe_values(None) is None and C._recipe_values("") is None
    assert C._recipe_values("smoke").trainer.max_steps == 2
    assert C._group_source("countdown") == "builtin:countdown" and C._group_source(None) is None
    assert C._group_source("") is None


def test_precedence_says_in_one_line_when_the_named_groups_do_not_compose_without_the_recipe():
    def compose_fn(overrides):
        raise ValueError("Could not override 'reward.functions.g.weight'\nfull_key: x")

    from omegaconf import OmegaConf

    raw = OmegaConf.create({"reward": {"functions": {}}})
    with pytest.raises(ConfigError) as e:
        C.apply_precedence(raw, ["reward=math", "reward.functions.g.weight=2"], {"recipe": "smoke", "reward": "math"},
                           compose_fn)
    assert str(e.value) == ("cannot compose reward.functions.g.weight=2 without the recipe's values: Could not "
                            "override 'reward.functions.g.weight'")


def test_composing_warns_nothing():
    """Hydra warns on every composition that does not give its version_base: a stray line before each run."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C.compose(["recipe=smoke"]).trainer.max_steps == 2


def test_a_group_named_beside_a_recipe_is_composed_without_the_recipe():
    cfg = C.compose(["recipe=quickstart", "reward=math"])
    assert {k: v.fn for k, v in cfg.reward.functions.items()} == {"accuracy": "math_accuracy", "format": "format"}
    assert cfg.trainer.max_steps == 15  # the recipe's other sections stay


def test_a_reward_typo_lists_the_rewards_of_this_run_not_the_defaults():
    with pytest.raises(ConfigError) as e:
        C.compose(["recipe=smoke", "reward=countdown", "reward.functions.acuracy.weight=2"])
    assert str(e.value).startswith("reward.functions has no 'acuracy' (did you mean 'accuracy'?); this run's rewards: "
                                   "accuracy, format, tags; ")


def test_precedence_replaces_a_free_form_dict_below_a_section_whole(monkeypatch):
    """A free-form dict two levels below its section (none is today: the rule must not depend on that): replaced at
    its parent node by the recipe's whole dict, then the command line's keys; a group the command line names drops
    the recipe's dict there as for a dict one level down."""
    from omegaconf import OmegaConf

    monkeypatch.setattr(C, "open_dict_keys", lambda: {"reward.deep.opts"})
    monkeypatch.setattr(C, "_recipe_values", lambda recipe: OmegaConf.create({"reward": {"deep": {"opts": {"a": 1}}}}))
    raw = OmegaConf.create({"reward": {"deep": {"opts": {"a": 1, "b": 2}}}})  # Hydra's key-by-key merge
    out = C.apply_precedence(raw, ["reward.deep.opts.c=3"], {"recipe": "r"}, None)
    assert OmegaConf.to_container(out.reward) == {"deep": {"opts": {"a": 1, "c": 3}}}

    def compose_fn(overrides):  # the named group's section, its command-line keys composed in
        return OmegaConf.create({"reward": {"deep": {"opts": {"b": 2, "c": 3}}}})

    out = C.apply_precedence(raw, ["reward=math", "reward.deep.opts.c=3"], {"recipe": "r", "reward": "math"},
                             compose_fn)
    assert OmegaConf.to_container(out.reward) == {"deep": {"opts": {"b": 2, "c": 3}}}
