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
