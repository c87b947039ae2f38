"""docs/evaluation.md's commands, scaled down (the tiny model, 2 steps, 2 prompts a set) and run in process, in their
order, each checked for what the page promises: the eval-sets recipe logs pass@1, pass@8, maj@8 and mean@8 of every
set before, during and after training; grpo-report plots and tabulates them; grpo-eval compares two models on the
same prompts and seeds (a trained final/ scores exactly what the run logged after its last step, and so does its last
checkpoint); a one-token cap fires the truncation alarm and stops the run."""
import json
import re
import shlex

import pytest
from omegaconf import OmegaConf

from grpo.config.compose import compose
from grpo.config.schema import load
from grpo.errors import SetupError
from tests.helpers import ROOT

SETS = ("evaluation.sets=[{name: small-sums, source: builtin:arithmetic, task_kwargs: {level: 0}, num: 2, seed: 99},"
        "{name: two-digit, source: builtin:arithmetic, task_kwargs: {level: 1}, num: 2}]")
SCALE = ["model=tiny", "data.num_train=32", "data.num_eval=2", "rollout.prompts_per_step=2", "rollout.batch_size=2",
         "algorithm.group_size=2", "engine.max_tokens_per_micro_batch=1024"]
TRAIN = ["trainer.max_steps=2", "trainer.eval_every=1", "logging.sample_every=0"]
PROMISED = ("pass@1", "pass@8", "maj@1", "maj@8", "mean@8", "accuracy", "reward_mean")


def commands() -> list[list[str]]:
    text = (ROOT / "docs" / "evaluation.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        out += [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def train_in_process(words: list[str], extra: list[str], out: str):
    from grpo.trainer.loop import train

    raw = OmegaConf.to_container(compose([*words[1:], *SCALE, *extra]), resolve=False)
    raw.pop("hydra", None)
    raw["trainer"]["output_dir"] = raw["trainer"]["output_dir"] or out
    return train(load(OmegaConf.to_container(OmegaConf.create(raw), resolve=True)))


def evals(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k[5:]: v for k, v in r.items() if k.startswith("eval/")} for r in rows
            if any(k.startswith("eval/") for k in r)}


def test_documented_commands(tmp_path, monkeypatch, capsys):
    from grpo.eval import run_eval
    from grpo.trainer.report import main as report_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cmds = commands()
    assert [c[0] for c in cmds] == ["grpo-train", "grpo-report", "grpo-eval", "grpo-eval", "grpo-train"], cmds
    train_cmd, report_cmd, compare_cmd, ckpt_cmd, alarm_cmd = cmds

    # 1. training with two named sets and n=8: every set's promised metrics at steps 0, 1 and 2
    train_in_process(train_cmd, [*TRAIN, SETS], "unused")
    run = tmp_path / "outputs" / "eval-sets"
    logged = evals(run)
    assert sorted(logged) == [0, 1, 2]
    for step, m in logged.items():
        for prefix in ("", "small-sums/", "two-digit/"):
            for key in PROMISED:
                assert 0.0 <= m[prefix + key] <= 1.0, (step, prefix + key)
            assert m[prefix + "pass@8"] >= m[prefix + "pass@1"] - 1e-12
    err = capsys.readouterr().err
    assert "small-sums accuracy (before, 2 prompts, n=8 at temperature 0.6)" in err and "alarm" not in err

    # 2. grpo-report: the sets' plot and table
    report_main(report_cmd[1:])
    md = (run / "report.md").read_text()
    assert "## Evaluation sets" in md and (run / "eval_sets.png").stat().st_size > 0
    assert all(f"| {s} |" in md for s in ("held-out", "small-sums", "two-digit"))
    assert "pass@8" in md and "maj@8" in md

    # 3. two models in one command: the embedded model and final/, on the same prompts and seeds (each in its own
    # chat format: the embedded model's template, the tiny model's plain text)
    path = run_eval([*compare_cmd[1:], *SCALE, SETS])
    doc = json.loads(path.read_text())
    assert [m["model"] for m in doc["models"]] == ["embedded:smollm2-135m-instruct", "outputs/eval-sets/final"]
    final = {k[5:]: v for k, v in doc["models"][1]["metrics"].items()}
    assert final == pytest.approx(logged[2], abs=1e-6)  # what the run logged after its last step
    assert set(doc["models"][0]["metrics"]) == set(doc["models"][1]["metrics"])
    table = (tmp_path / "eval-results" / "eval.md").read_text()
    assert "| metric | `embedded:smollm2-135m-instruct` | `outputs/eval-sets/final` | difference |" in table
    assert "| `eval/two-digit/maj@8` |" in table
    assert doc["evaluation"]["n"] == 8 and doc["evaluation"]["temperature"] == 0.6

    # 4. a checkpoint directory with the quickstart recipe (no named sets): its held-out numbers are final/'s
    argv = [w.replace("step_15", "step_2") for w in ckpt_cmd[1:]]
    doc = json.loads(run_eval([*argv, *SCALE, "--out", "ckpt"]).read_text())
    got = {k[5:]: v for k, v in doc["models"][0]["metrics"].items()}
    assert got == pytest.approx({k: v for k, v in logged[2].items() if "/" not in k}, abs=1e-6)


def test_documented_alarm_stops_a_run_whose_answers_are_cut(tmp_path, monkeypatch, capsys):
    """The planted failure: a one-token cap. The alarm fires once, after its patience, says what to raise, is logged
    as alarm/truncation, and (trainer.stop_on_alarm) stops the run after checkpointing that step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    alarm_cmd = commands()[-1]
    with pytest.raises(SetupError) as e:
        train_in_process(alarm_cmd, ["trainer.max_steps=4", "data.num_eval=0", "logging.sample_every=0"],
                         str(tmp_path / "run"))
    assert str(e.value).startswith("alarm truncation fired at step 2 and trainer.stop_on_alarm=true: stopped")
    lines = [line for line in capsys.readouterr().err.splitlines() if ": alarm " in line]
    assert lines == ["[grpo] step 2: alarm truncation: 100% of completions hit rollout.max_new_tokens=1 for 2 steps: "
                     "rewards are computed on cut answers; raise rollout.max_new_tokens"]
    assert lines[0][len("[grpo] "):] in (ROOT / "docs" / "evaluation.md").read_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["alarm/truncation"]) for r in rows if "loss" in r] == [(1, 0), (2, 1)]
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").exists()


def test_grpo_eval_refusals(tmp_path, monkeypatch):
    from grpo.eval import run_eval

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SetupError, match="grpo-eval: unknown option --modle"):
        run_eval(["recipe=smoke", "--modle", "x"])
    with pytest.raises(SetupError, match="rollout.backend=vllm needs vLLM") if _no_vllm() else _nothing():
        run_eval(["recipe=smoke", "rollout.backend=vllm", "trainer.device=cpu", "--out", "o"])
    with pytest.raises(SetupError, match=r"grpo-eval does not run multi-turn episodes .* trainer.max_steps=0"):
        run_eval(["recipe=smoke", "rollout.tools=[grpo.rollout.episodes.calculator:calculate]"])
    with pytest.raises(SetupError, match="use rollout.backend=hf or vllm"):
        run_eval(["recipe=smoke", "rollout.backend=server", "rollout.server.urls=[http://127.0.0.1:9]"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SetupError, match="neither a run"):
        run_eval(["recipe=smoke", "--model", "empty"])


def _no_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_sampled_evaluation_leaves_training_as_it_was(tmp_path, monkeypatch):
    """The evaluation samples under its own seeds: a run evaluated with n=4 at temperature 1 every step trains
    exactly as the same run evaluated greedily (same losses, rewards, gradient norms)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    got = []
    for i, ev in enumerate((["evaluation.n=1"], ["evaluation.n=4", "evaluation.temperature=1.0"])):
        out = tmp_path / str(i)
        train_in_process(["grpo-train", "recipe=smoke", f"trainer.output_dir={out}", *TRAIN, *ev], [], "unused")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        got.append([(r["loss"], r["reward_mean"], r["grad_norm"]) for r in rows if "loss" in r])
    assert got[0] == got[1] and len(got[0]) == 2


def test_lora_adapter_and_checkpoint_score_what_the_run_logged(tmp_path, monkeypatch):
    """model.lora.merge_on_save=false leaves final/ an adapter alone: grpo-eval puts it on the config's model, and a
    LoRA checkpoint's trainable weights likewise; both score the run's last evaluation exactly, the base does not."""
    from grpo.eval import run_eval

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "run"
    lora = ["model.lora.enabled=true", "model.lora.merge_on_save=false", "trainer.lr=1e-2", "evaluation.n=2",
            "evaluation.temperature=1.0"]
    train_in_process(["grpo-train", "recipe=smoke", f"trainer.output_dir={out}", *TRAIN, *lora], [], "unused")
    assert (out / "final" / "adapter_config.json").is_file()
    doc = json.loads(run_eval(["recipe=smoke", *lora, *SCALE, "--model", str(out), "--model",
                               str(out / "checkpoints" / "step_2"), "--model", "tiny:llama",
                               "--out", str(tmp_path / "e")]).read_text())
    final, ckpt, base = ({k[5:]: v for k, v in m["metrics"].items()} for m in doc["models"])
    assert final == pytest.approx(evals(out)[2], abs=1e-6) and ckpt == final
    assert base != final
