"""Multi-turn episodes through the real command line: a 2-step smoke run with a plain-text environment, and a bad
tool path refused at start with one line."""
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, in_one_process

ENV = '''
class Steps:
    """Answers each turn with an observation; the third turn ends the episode. reward(): 1 after three turns."""

    def reset(self, row):
        self.turns = 0
        return "Think in steps."

    def step(self, text):
        self.turns += 1
        return None if self.turns >= 3 else f"\\n[observation {self.turns}]\\n"

    def reward(self):
        return 1.0 if self.turns >= 3 else 0.0
'''


SMOLLM2 = Path.home() / ".cache" / "grpo" / "SmolLM2-135M-Instruct" / "config.json"
LORA = {"full": [], "lora": ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]}


def _commands(root: Path) -> dict:
    """name -> (working directory, ``grpo-train`` arguments, output directory) of every command line of this file."""
    env = ["rollout.environment=smoke_env:Steps", "rollout.max_turns=3", "rollout.max_new_tokens=8",
           "rollout.max_tool_tokens=16", "trainer.eval_every=2", "data.num_eval=2"]
    out = {f"env-{k}": (root, ["recipe=smoke", f"trainer.output_dir={root / k}", *env, *extra], root / k)
           for k, extra in LORA.items()}
    out["bad-tool"] = (root, ["recipe=smoke", f"trainer.output_dir={root / 'bad'}",
                              "rollout.tools=[no_such_pkg.tools:calc]"], root / "bad")
    out["tiny-tools"] = (ROOT, ["recipe=smoke", "rollout.tools=[tests.tool_fixtures:add]", "rollout.max_turns=2",
                                f"trainer.output_dir={root / 'tiny'}", "trainer.max_steps=1", "data.num_eval=2"],
                         root / "tiny")
    if SMOLLM2.exists():
        out["smollm2-tools"] = (ROOT, ["recipe=quickstart", "rollout.tools=[tests.tool_fixtures:add]",
                                       "rollout.max_turns=2", f"trainer.output_dir={root / 'smollm2'}",
                                       "trainer.max_steps=1", "data.num_eval=0", "rollout.prompts_per_step=2",
                                       "algorithm.group_size=2", "rollout.max_new_tokens=8", "logging.sample_every=1"],
                                root / "smollm2")
    return out


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """Every command line of this file, in one process (tests/helpers.py `in_one_process`; conftest.py's TOGETHER
    runs the tests that read them on one worker): name -> (its output directory, what it gave)."""
    root = tmp_path_factory.mktemp("cli")
    (root / "smoke_env.py").write_text(ENV)
    commands = _commands(root)
    ran = in_one_process([(cwd, ["grpo.train", *args]) for cwd, args, _ in commands.values()], timeout_each=600)
    return {name: (out, p) for (name, (_, _, out)), p in zip(commands.items(), ran)}


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["full", "lora"])
def test_a_smoke_run_with_an_environment(cli, lora):
    out, p = cli[f"env-{lora}"]
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["episode/turns_mean"] == 3.0 and r["episode/tool_calls_mean"] == 2.0  # two observations each
        assert r["episode/max_turns_frac"] == 0.0 and r["episode/tool_failures"] == 0
        assert r["reward/Steps"] == 1.0 and r["grad_norm"] > 0
        assert r["episode/tool_tokens_mean"] > 0
        # completions hold the observations too; the loss's token counts do not
        assert r["completion_len_mean"] >= 3 + r["episode/tool_tokens_mean"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    roles = [t["role"] for t in samples[0]["episode"]["turns"]]
    assert roles == ["assistant", "user", "assistant", "user", "assistant"]
    assert "[observation 1]" in samples[0]["completion"] and "[observation 2]" in samples[0]["completion"]
    assert "held-out" in p.stderr
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert evals and any(k.endswith("turns_mean") for k in evals[-1])


def test_a_bad_tool_fails_before_anything_loads(cli):
    out, p = cli["bad-tool"]
    assert p.returncode == 2 and not out.exists()
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.tools[0]='no_such_pkg.tools:calc': cannot import module"), p.stderr[-500:]


# ------------------------------------------------------------------------------- tools with the shipped models
def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tools_with_the_tiny_model_from_the_cli(cli):
    """The tiny model's tokenizer has no chat template: rollout.tool_format=auto describes the tools in the hermes
    format and the run completes with the episode metrics."""
    out, p = cli["tiny-tools"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("rollout.tool_format=hermes (the prompts use no chat template)") == 1
    (step,) = [r for r in _metrics(out) if "loss" in r]
    assert {"episode/turns_mean", "episode/tool_use_rate", "episode/tool_failures"} <= set(step)
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert "<tool_response></tool_response> tags.\n\nWhat is" in sample["prompt"]  # samples show the prompt's end


def test_tools_that_raise_or_hang_do_not_stop_training(tmp_path, monkeypatch):
    """Two training steps in which every first turn calls a tool that raises or one that hangs (the tiny model's
    first turns are replaced by those calls; its later turns are its own): the run finishes, the failures and the
    timeouts are counted, and the model read the errors."""
    from omegaconf import OmegaConf

    import grpo.trainer.loop
    from grpo.config.schema import load
    from grpo.rollout.backends import HFBackend
    from grpo.rollout.hf import generate as real
    from grpo.trainer.loop import train
    from tests.helpers import smoke_raw

    calls = ['<tool_call>{"name":"broken","arguments":{"x":7}}</tool_call>',
             '<tool_call>{"name":"slow","arguments":{"seconds":30}}</tool_call>']

    def first_turn_calls(model, tok, prompt_ids, *, group_size, suffixes=None, **kw):
        ids, cut = real(model, tok, prompt_ids, group_size=group_size, suffixes=suffixes, **kw)
        if suffixes is None and not kw.get("greedy"):
            ids = [[tok(calls[j % 2], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for j in
                    range(len(g))] for g in ids]
            cut = [[False] * len(g) for g in ids]
        return ids, cut

    build = grpo.trainer.loop.build_run

    def build_run(cfg):  # the run's rollout backend: our decode loop, its first turns replaced by those calls
        run = build(cfg)
        run.rollout.backend = HFBackend(lambda: run.runtime.model, run.tokenizer, batch_size=cfg.rollout.batch_size,
                                        context=run.runtime.generation_context, generate_fn=first_turn_calls)
        return run

    monkeypatch.setattr(grpo.trainer.loop, "build_run", build_run)
    out = tmp_path / "run"
    # two tools' schemas in characters: room for a longer prompt
    raw = OmegaConf.merge(smoke_raw(), {"trainer": {"output_dir": str(out)}, "data": {"num_eval": 0,
                                                                                      "max_prompt_tokens": 1536},
                                        "model": {"tiny": {"max_position_embeddings": 2048}},
                                        "engine": {"max_tokens_per_micro_batch": 2048},
                                        "rollout": {"tools": ["tests.tool_fixtures:broken", "tests.tool_fixtures:slow"],
                                                    "max_turns": 2, "max_new_tokens": 64, "tool_timeout_s": 1.0,
                                                    "max_tool_tokens": 64}})
    train(load(OmegaConf.to_container(raw, resolve=True)))
    steps = [r for r in _metrics(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 2 prompts x G=4: half call the raising tool, half the hanging one
        assert r["episode/tool_calls_mean"] == 1.0 and r["episode/tool_failures"] == 8
        assert r["episode/tool_timeouts"] == 4 and r["episode/turns_mean"] == 2.0
    errors = ("<tool_response>\nError: ValueError: cannot handle 7\n</tool_response>",
              "<tool_response>\nError: tool slow timed out after 1 s\n</tool_response>")
    for line in (out / "samples.jsonl").read_text().splitlines():  # the model's second turn read the error
        turns = json.loads(line)["episode"]["turns"]
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"] and turns[1]["text"].strip() in errors


@pytest.mark.slow
def test_tools_with_smollm2_from_the_cli(cli):
    """The quickstart recipe (SmolLM2-135M-Instruct, whose chat template shows no tools) with a tool: hermes, results
    as the template's generic tool turn."""
    if not SMOLLM2.exists():
        pytest.skip("embedded SmolLM2 not prepared (make model)")
    out, p = cli["smollm2-tools"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rollout.tool_format=hermes (the chat template of" in p.stderr and "results as tool turns" in p.stderr
    (step,) = [r for r in _metrics(out) if "loss" in r]
    assert "episode/tool_use_rate" in step and step["grad_norm"] >= 0
    prompt = json.loads((out / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert "<tool_response></tool_response> tags.<|im_end|>\n<|im_start|>user\n" in prompt


SEEN = '''
SEEN = []


class Briefed:
    """reset(row) adds a line to the prompt; the episode ends after its first turn."""

    def reset(self, row):
        return "Answer in one line."

    def step(self, text):
        return None


def record(prompts, completions, **columns):
    SEEN.extend(prompts)
    return [0.0] * len(completions)
'''


def test_rewards_and_samples_see_the_prompt_with_the_text_reset_added(tmp_path, monkeypatch, cfg_factory):
    """The text an environment's reset(row) adds is part of the prompt the model answered: the rewards' ``prompts``
    (training and held-out) and samples.jsonl show it."""
    from grpo.trainer.loop import train

    (tmp_path / "seen_env.py").write_text(SEEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    try:
        import seen_env

        cfg = cfg_factory({"rollout": {"environment": "seen_env:Briefed", "max_turns": 1},
                           "reward": {"functions": {"seen": {"fn": "seen_env:record"}}},
                           "trainer": {"max_steps": 1}, "data": {"num_eval": 2}})
        train(cfg)
        # held-out before (2 prompts), one training rollout (2 prompts x G=4), held-out after (2 prompts)
        assert len(seen_env.SEEN) == 2 + 8 + 2
        assert all(p.endswith("\n\nAnswer in one line.") for p in seen_env.SEEN)
        samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
        assert samples and all(s["prompt"].endswith("\n\nAnswer in one line.") for s in samples)
    finally:
        sys.modules.pop("seen_env", None)
