"""grpo/trainer/checkpoint.py's directory bookkeeping past one digit: steps are ordered by number, not by name
(``step_10`` sorts before ``step_9`` as text), for ``resume=auto``, pruning to ``keep_last`` and what a resume
abandons (``later_than``); the ranks' agreement on one step to resume; and a run saved and restored: weights,
optimizer, schedule, sampler, RNG and loop state, the configured schedule put in place, a changed run refused, what a
resume abandons, ``final/``."""
from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.trainer import checkpoint, manifest
from grpo.trainer.run import LoopState


def _save(out, step, keep_last=2):
    return checkpoint.save(out, step, lambda tmp: (tmp / "w").write_text(str(step)), keep_last=keep_last)


def _names(out):
    return [p.name for p in checkpoint.complete_checkpoints(out)]


def test_steps_past_nine_order_by_number_for_resume_and_pruning(tmp_path):
    for step in (8, 9, 10):
        _save(tmp_path, step, keep_last=3)
    (tmp_path / "checkpoints" / "step_11").mkdir()  # no COMPLETE marker: never a checkpoint
    assert _names(tmp_path) == ["step_8", "step_9", "step_10"]  # oldest first, by number
    assert checkpoint.latest(tmp_path).name == "step_10"
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_10"  # the newest, not step_9
    _save(tmp_path, 11, keep_last=2)  # pruning keeps the two newest: 10 and 11, not 8 and 9
    assert _names(tmp_path) == ["step_10", "step_11"]
    assert (tmp_path / "checkpoints" / "step_11" / "w").read_text() == "11"
    for step in range(12, 101, 11):  # 12, 23, ..., 100: one, two and three digits
        _save(tmp_path, step, keep_last=2)
    assert _names(tmp_path) == ["step_89", "step_100"]
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_100"


def test_later_than_picks_only_the_numerically_newer_ones(tmp_path):
    """What a resume from a step abandons: the checkpoints after it by number (step_100 and step_19 after step_10;
    step_9 and step_2 before it, though step_9 sorts after step_10 as text)."""
    for step in (2, 9, 10, 19, 100):
        _save(tmp_path, step, keep_last=10)
    assert [p.name for p in checkpoint.later_than(tmp_path, 10)] == ["step_19", "step_100"]
    assert [p.name for p in checkpoint.later_than(tmp_path, 9)] == ["step_10", "step_19", "step_100"]
    assert checkpoint.later_than(tmp_path, 100) == [] and checkpoint.step_of(tmp_path / "step_100") == 100


class _Gathered:
    """A rank whose gather returns what every rank said: its own view and the other ranks' (multi-node resume)."""

    def __init__(self, *others):
        self.others = [(*o, None) if len(o) == 2 else o for o in others]  # (step, steps held, no error)

    def gather(self, obj):
        return [obj, *self.others]


def _cfg(out):
    from types import SimpleNamespace

    return SimpleNamespace(trainer=SimpleNamespace(output_dir=str(out)))


def test_ranks_agree_on_the_newest_step_every_node_holds(tmp_path):
    """One output_dir per node: a node that died while finalising step_10 holds one fewer; every rank resumes
    step_9, the newest complete on all of them (by number: step_10 > step_9 > step_2)."""
    import pytest

    from grpo.errors import SetupError
    from grpo.trainer.checkpoint import _agree_on_checkpoint

    for step in (2, 9, 10):
        _save(tmp_path, step, keep_last=5)
    mine = checkpoint.complete_checkpoints(tmp_path)
    newest = checkpoint.latest(tmp_path)
    same = _Gathered(("step_10", ["step_2", "step_9", "step_10"]))
    assert _agree_on_checkpoint(same, _cfg(tmp_path), newest, mine) == (newest, mine)  # all agree: unchanged
    behind = _Gathered(("step_9", ["step_9", "step_2"]), ("step_10", ["step_10", "step_9", "step_2"]))
    ckpt, existing = _agree_on_checkpoint(behind, _cfg(tmp_path), newest, mine)
    assert ckpt == tmp_path / "checkpoints" / "step_9" and existing == mine
    both = _Gathered(("step_10", ["step_2", "step_10"]))  # common: 2 and 10 (10 is newer by number, older by name)
    assert _agree_on_checkpoint(both, _cfg(tmp_path), newest, mine)[0].name == "step_10"
    with pytest.raises(SetupError, match="no checkpoint in common"):
        _agree_on_checkpoint(_Gathered(("step_11", ["step_11"])), _cfg(tmp_path), newest, mine)
    with pytest.raises(SetupError, match="no checkpoint in common"):  # this rank resumes, the other starts fresh
        _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), newest, mine)


def test_a_fresh_start_is_refused_when_any_node_holds_checkpoints(tmp_path):
    from grpo.trainer.checkpoint import _agree_on_checkpoint

    other = _Gathered((None, ["step_4"]))
    ckpt, existing = _agree_on_checkpoint(other, _cfg(tmp_path), None, [])
    assert ckpt is None and existing == [tmp_path / "checkpoints" / "step_4"]  # restore refuses, naming it
    mine = [tmp_path / "checkpoints" / "step_3"]
    assert _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), None, mine) == (None, mine)
    assert _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), None, []) == (None, [])  # all fresh


# ------------------------------------------------------------------------- a run saved and restored
# A run's checkpointed parts, built as grpo.trainer.build builds them (a local runtime, AdamW, LambdaLR with the
# configured schedule, the prompt sampler) around a two-layer model with a frozen part: no tokenizer or data needed.
@pytest.fixture
def built(tmp_path):
    from types import SimpleNamespace

    from grpo.config.schema import Config
    from grpo.data import PromptSampler
    from grpo.runtime.local import LocalRuntime
    from grpo.trainer.build import lr_lambda

    cfg = Config()
    cfg = _with(cfg, output_dir=str(tmp_path / "run"), max_steps=8, warmup_steps=4, lr_schedule="cosine")
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    policy[0].weight.requires_grad_(False)
    t = cfg.trainer
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=t.lr,
                                  betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    rt = LocalRuntime("cpu")
    rt.setup(policy, optimizer, scheduler)
    run = SimpleNamespace(runtime=rt, policy=policy, optimizer=optimizer, scheduler=scheduler,
                          sampler=SimpleNamespace(prompts=PromptSampler(10, seed=t.seed)), owns_output_dir=True)
    return run, cfg


def _with(cfg, section="trainer", **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def _train_step(run):
    """What a step leaves behind: moved weights, Adam moments, a scheduler and a sampler one step on."""
    for p in run.policy.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.scheduler.step()
    run.sampler.prompts.next(2)


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _trainable(run):
    return {n: p.detach().clone() for n, p in run.policy.named_parameters() if p.requires_grad}


def test_a_checkpoint_restores_weights_optimizer_schedule_sampler_rng_and_the_loop_state(built, tmp_path, capsys):
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    _train_step(run)
    state = LoopState(step=3, buffer={"rollouts": [1, 2]}, bad_steps=1, skipped_steps=2,
                      failed_reward_steps={"acc": 4})
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = checkpoint.save_checkpoint(run, state, cfg)
    assert path == tmp_path / "checkpoints" / "step_3" and (path / checkpoint.MARKER).read_text() == "3\n"
    expected = _draws()  # what the RNGs give next, as saved
    saved = checkpoint.load_state(path)
    assert saved["schedule"] == checkpoint.schedule(cfg) and saved["fingerprint"] == checkpoint.fingerprint(cfg)
    assert saved["config_hash"] == checkpoint._hash(checkpoint.fingerprint(cfg)) and len(saved["config_hash"]) == 12
    weights, moments = _trainable(run), copy.deepcopy(run.optimizer.state_dict()["state"])
    epoch, sampler = run.scheduler.last_epoch, run.sampler.prompts.state_dict()
    _train_step(run)  # the run moves on after the save: a restore must undo all of it
    _draws()
    resumed = checkpoint.restore(run, _with(cfg, resume="auto"))
    assert resumed == state and resumed.buffer == {"rollouts": [1, 2]}
    assert all(torch.equal(weights[n], p) for n, p in _trainable(run).items())
    now = run.optimizer.state_dict()["state"]
    assert now.keys() == moments.keys() and all(torch.equal(now[k]["exp_avg"], moments[k]["exp_avg"]) and
                                                torch.equal(now[k]["exp_avg_sq"], moments[k]["exp_avg_sq"])
                                                for k in now)
    assert run.scheduler.last_epoch == epoch and run.sampler.prompts.state_dict() == sampler
    assert _draws() == expected
    err = capsys.readouterr().err
    assert f"[grpo] resumed from {path} (step 3)" in err and "changed since" not in err


def test_a_resume_puts_the_configured_schedule_in_place_and_says_what_changed(built, tmp_path, capsys):
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    _train_step(run)
    checkpoint.save_checkpoint(run, LoopState(step=2), cfg)
    t = cfg.trainer
    new = _with(cfg, resume="auto", lr=t.lr * 3, weight_decay=0.25, adam_betas=[0.8, 0.95], max_steps=t.max_steps + 4)
    checkpoint.restore(run, new)
    sch, lr = run.scheduler, t.lr * 3
    assert sch.base_lrs == [lr] * len(run.optimizer.param_groups)
    for group, fn in zip(run.optimizer.param_groups, sch.lr_lambdas):  # LambdaLR's lr: base_lr * lambda(epoch)
        assert group["lr"] == pytest.approx(lr * fn(sch.last_epoch)) and group["initial_lr"] == lr
        assert group["weight_decay"] == 0.25 and group["betas"] == (0.8, 0.95)
    assert fn(sch.last_epoch) != fn(sch.last_epoch + 1)  # in the warmup: the step the lr is for matters
    assert sch.get_last_lr() == [g["lr"] for g in run.optimizer.param_groups]
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "changed since the checkpoint" in x)
    assert line == (f"[grpo] changed since the checkpoint, in effect from step 3: trainer.lr {t.lr} -> {lr}, "
                    f"trainer.max_steps {t.max_steps} -> {t.max_steps + 4}, trainer.weight_decay 0.0 -> 0.25, "
                    "trainer.adam_betas [0.9, 0.99] -> [0.8, 0.95]")
    # a checkpoint that did not record its schedule: the learning rate, read from the saved scheduler
    old = {"scheduler": {"base_lrs": [t.lr]}}
    assert checkpoint.apply_schedule(run, new, old) == [f"trainer.lr {t.lr} -> {lr}"]
    assert checkpoint.apply_schedule(run, new, {"scheduler": {"base_lrs": [lr]}, "schedule": None}) == []


def test_a_resume_with_a_run_defining_key_changed_is_refused_unless_forced(built, tmp_path):
    from grpo.errors import SetupError

    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    path = checkpoint.save_checkpoint(run, LoopState(step=1), cfg)
    other = _with(_with(cfg, resume="auto"), "data", seed=cfg.data.seed + 1)
    with pytest.raises(SetupError) as e:
        checkpoint.restore(run, other)
    assert str(e.value) == (f"cannot resume from {path}: data.seed changed ({cfg.data.seed!r} -> "
                            f"{cfg.data.seed + 1!r}); set trainer.force_resume=true to resume anyway, or use a new "
                            "trainer.output_dir")
    assert checkpoint.restore(run, _with(other, force_resume=True)).step == 1
    saved = checkpoint.load_state(path)
    del saved["fingerprint"]["data.seed"]  # a checkpoint from a version that did not record the key: not compared
    checkpoint._check_fingerprint(saved, other, path)
    with pytest.raises(SetupError, match="trainer.output_dir=.* already holds checkpoints of another run "
                                         r"\(newest step_1\); continue it with trainer.resume=auto"):
        checkpoint.restore(run, cfg)  # no resume asked, but the directory holds a run
    with pytest.raises(SetupError, match="no such checkpoint directory"):
        checkpoint.restore(run, _with(cfg, resume=str(tmp_path / "nowhere")))
    fresh = checkpoint.restore(run, _with(cfg, output_dir=str(tmp_path / "new"), resume="auto"))
    assert fresh == LoopState()


def test_fingerprint_holds_every_run_defining_key_as_json():
    from grpo.config.schema import Config

    cfg = Config()
    fp = checkpoint.fingerprint(cfg)
    assert list(fp) == checkpoint.RUN_DEFINING
    assert fp["trainer.seed"] == cfg.trainer.seed and fp["algorithm.group_size"] == cfg.algorithm.group_size
    assert fp["model.lora"] == json.loads(json.dumps(dataclasses.asdict(cfg.model.lora), sort_keys=True))
    changed = _with(cfg, "data", task_kwargs={"b": Path("x"), "a": 1})
    assert checkpoint.fingerprint(changed)["data.task_kwargs"] == {"a": 1, "b": "x"}  # str() for what JSON lacks
    assert checkpoint._hash({"a": 1, "b": 2}) == checkpoint._hash({"b": 2, "a": 1}) != checkpoint._hash({"a": 2})


class _Log:
    def __init__(self, lines):
        self.lines, self.asked = lines, []

    def truncate_after(self, step):
        self.asked.append(step)
        return self.lines


def _fake_run(owner=True, main=True):
    from types import SimpleNamespace

    calls = []
    rt = SimpleNamespace(is_main=main, barrier=lambda: calls.append("barrier"))
    return SimpleNamespace(owns_output_dir=owner, runtime=rt), calls


def test_a_resume_that_trains_abandons_the_later_steps_and_their_final(tmp_path, capsys):
    for step in (2, 4, 10):
        _save(tmp_path, step, keep_last=5)
    (tmp_path / "final").mkdir()
    run, calls = _fake_run()
    log = _Log(7)
    checkpoint.abandon_after(run, _cfg(tmp_path), log, 2)
    assert _names(tmp_path) == ["step_2"] and not (tmp_path / "final").exists() and log.asked == [2]
    assert calls == ["barrier"]
    assert capsys.readouterr().err == ("[grpo] resuming from step 2 abandons the later steps of this directory: "
                                       "removed step_4, step_10, 7 metrics lines, final/\n")
    (tmp_path / "final").mkdir()
    checkpoint.abandon_after(run, _cfg(tmp_path), _Log(0), 2)  # nothing later: final/ is this run's, kept
    assert (tmp_path / "final").is_dir() and capsys.readouterr().err == ""


def test_only_the_directorys_owner_removes_and_only_the_main_rank_says_so(tmp_path, capsys):
    for step in (2, 4):
        _save(tmp_path, step, keep_last=5)
    (tmp_path / "final").mkdir()
    run, calls = _fake_run(owner=False)
    checkpoint.abandon_after(run, _cfg(tmp_path), _Log(0), 2)
    assert _names(tmp_path) == ["step_2", "step_4"] and (tmp_path / "final").is_dir() and calls == ["barrier"]
    assert capsys.readouterr().err.startswith("[grpo] resuming from step 2 abandons")
    run, _ = _fake_run(owner=True, main=False)  # another node's first rank: its checkpoints, not final/'s message
    checkpoint.abandon_after(run, _cfg(tmp_path), _Log(3), 2)
    assert _names(tmp_path) == ["step_2"] and (tmp_path / "final").is_dir() and capsys.readouterr().err == ""


@pytest.mark.parametrize("enabled,merge,main", [(True, True, True), (True, False, True), (False, True, False)])
def test_save_final_replaces_final_with_what_the_runtime_wrote(tmp_path, enabled, merge, main):
    from types import SimpleNamespace

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "old").write_text("old")
    seen = []

    def save_final(tmp, tokenizer, merge_lora):
        seen.append((tmp, tokenizer, merge_lora))
        tmp.mkdir()
        (tmp / "model").write_text("new")

    rt = SimpleNamespace(is_main=main, save_final=save_final, barrier=lambda: seen.append("barrier"))
    run = SimpleNamespace(runtime=rt, tokenizer="tok", image_processor=None)
    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(tmp_path)),
                          model=SimpleNamespace(lora=SimpleNamespace(enabled=enabled, merge_on_save=merge)))
    out = checkpoint.save_final(run, cfg)
    assert out == tmp_path / "final" and seen == [(tmp_path / ".tmp-final", "tok", enabled and merge), "barrier"]
    if main:  # the main rank moves it in place
        assert sorted(p.name for p in out.iterdir()) == [manifest.NAME, "model"]
        assert not (tmp_path / ".tmp-final").exists() and manifest.problem(out) is None
    else:
        assert (out / "old").exists()


def test_with_many_processes_each_rank_resumes_its_own_rollouts_and_sampling_stream(built):
    """Rank 1 of 2, first rank of its node (it owns that node's copy): its rank file holds its own RNG, rollouts and
    in-flight batches (asynchronous GRPO), which the restore takes over those every rank's copy of the loop state
    holds (rank 0's)."""
    run, cfg = built
    rt = run.runtime
    rt.rank, rt.world_size = 1, 2
    rt.gather = lambda obj: [obj, obj]  # both ranks see the same checkpoints
    path = checkpoint.save_checkpoint(run, LoopState(step=2, buffer="shared", in_flight={"batches": ["b0"]}), cfg)
    own = checkpoint.load_state(path, "rank_1")
    assert own["buffer"] == "shared" and set(own["rng"]) >= {"python", "numpy", "torch"}
    assert own["in_flight"] == {"batches": ["b0"]}
    random.seed(11)
    own["rng"] = checkpoint.rng_state()
    expected = random.random()
    checkpoint.save_state(path, {**own, "buffer": "rank 1's", "in_flight": {"batches": ["b1"]}}, "rank_1")
    manifest.write(path)  # as the owner writes it once every rank's files are there
    random.seed(12)
    state = checkpoint.restore(run, _with(cfg, resume="auto"))
    assert state.buffer == "rank 1's" and state.step == 2 and random.random() == expected
    assert state.in_flight == {"batches": ["b1"]}  # this rank's share, not rank 0's in trainer_state.pt


def test_a_vision_language_models_final_holds_its_image_processor_under_the_manifest(tmp_path):
    from types import SimpleNamespace

    class Processor:
        def save_pretrained(self, directory):
            (Path(directory) / "preprocessor_config.json").write_text("{}")

    def save_final(tmp, tokenizer, merge_lora):
        tmp.mkdir()
        (tmp / "model").write_text("new")

    rt = SimpleNamespace(is_main=True, save_final=save_final, barrier=lambda: None)
    run = SimpleNamespace(runtime=rt, tokenizer="tok", image_processor=Processor())
    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(tmp_path)),
                          model=SimpleNamespace(lora=SimpleNamespace(enabled=False, merge_on_save=True)))
    out = checkpoint.save_final(run, cfg)
    assert sorted(p.name for p in out.iterdir()) == [manifest.NAME, "model", "preprocessor_config.json"]
    assert manifest.problem(out) is None  # the processor's file is written before the manifest, and in it


def test_the_agreed_step_is_in_the_named_checkpoints_folder_or_else_the_runs(tmp_path):
    """trainer.resume=<path> in another run's folder: the step every rank holds is taken from that folder; a rank
    that found no checkpoint of its own (while another did) takes it from its own trainer.output_dir."""
    from grpo.trainer.checkpoint import _agree_on_checkpoint

    elsewhere = tmp_path / "elsewhere"
    for step in (2, 9, 10):
        _save(elsewhere, step, keep_last=5)
    mine = checkpoint.complete_checkpoints(elsewhere)
    behind = _Gathered(("step_9", ["step_9", "step_2"]))
    ckpt, _ = _agree_on_checkpoint(behind, _cfg(tmp_path / "run"), checkpoint.latest(elsewhere), mine)
    assert ckpt == elsewhere / "checkpoints" / "step_9"
    ckpt, _ = _agree_on_checkpoint(_Gathered(("step_9", ["step_9"])), _cfg(tmp_path / "run"), None,
                                   [tmp_path / "run" / "checkpoints" / "step_9"])
    assert ckpt == tmp_path / "run" / "checkpoints" / "step_9"


class _TwoRanks:
    world_size = 2

    def gather(self, obj):  # the other rank sees what this one sees
        return [obj, obj]


def test_with_many_processes_each_damaged_checkpoint_is_passed_over_newest_first_and_a_named_one_stops_all(tmp_path):
    """An older damaged checkpoint is passed over too (no rank may agree on it), each listed once, newest first; a
    checkpoint whose bytes changed but not its size is found by its checksum on a rank that owns the directory; a
    damaged trainer.resume=<path> is the same one line on every rank."""
    from types import SimpleNamespace

    from grpo.errors import SetupError

    for step in (1, 2, 4, 6):
        _save(tmp_path, step, keep_last=5)
    ck = tmp_path / "checkpoints"
    (ck / "step_1" / "w").write_text("xx")  # another size
    (ck / "step_4" / "w").write_text("5")  # the same size, another checksum
    (ck / "step_6" / "w").write_text("")
    run = SimpleNamespace(runtime=_TwoRanks(), owns_output_dir=True)
    cfg = SimpleNamespace(trainer=SimpleNamespace(resume="auto", output_dir=str(tmp_path)))
    ckpt, skipped, existing = checkpoint._decide(run, cfg)
    assert ckpt == ck / "step_2" and existing == [ck / "step_2"]
    assert [p.name for p, _ in skipped] == ["step_6", "step_4", "step_1"] and all("w" in why for _, why in skipped)
    cfg.trainer.resume = str(ck / "step_4")
    with pytest.raises(SetupError, match=r"step_4.*\bw\b"):
        checkpoint._decide(run, cfg)
    cfg.trainer.resume = "auto"
    reader = SimpleNamespace(runtime=_TwoRanks(), owns_output_dir=False)  # checks sizes only: reads no file
    ckpt, _, existing = checkpoint._decide(reader, cfg)
    assert ckpt == ck / "step_4" and existing == [ck / "step_2", ck / "step_4"]
    fresh = SimpleNamespace(trainer=SimpleNamespace(resume="auto", output_dir=str(tmp_path / "fresh")))
    other = SimpleNamespace(world_size=2, gather=lambda obj: [obj, (None, ["step_4"], None)])  # it holds one
    got = checkpoint._decide(SimpleNamespace(runtime=other, owns_output_dir=True), fresh)
    assert got[::2] == (None, [tmp_path / "fresh" / "checkpoints" / "step_4"])  # named in this rank's directory
