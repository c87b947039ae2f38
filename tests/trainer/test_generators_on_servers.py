"""Asynchronous GRPO on the server backend (grpo/trainer/generators.py): whole training runs in process against two
fake servers that hold a real tiny model (the pushed weights go through the real gloo channel; completions are
canned by seed, their log-probs the held model's). K = 1 logs its staleness, the servers' version lag and the sync
check's gap every step; the servers are asked for the same prompts with the same seeds as the synchronous server
run (refill rounds included); a checkpoint stores the batch in flight and a resume from it gives the uninterrupted
run's metrics."""
import shutil
from collections import Counter

import pytest

from grpo.models import load_model, load_tokenizer
from grpo.trainer import checkpoint
from grpo.trainer.loop import fit
from grpo.trainer.pipeline import sampled_with
from tests.e2e.test_async import same_numbers, steps
from tests.rollout.server.conftest import fakes  # noqa: F401  (the fixture)

ENV = '''
def flat_or_first(prompts, completions, **columns):
    """0 for every sample of a prompt of even length (a zero-std group: refilled), else the first character's code."""
    return [0.0 if len(str(p)) % 2 == 0 else float(ord(str(c)[:1] or " ") % 7) for p, c in zip(prompts, completions)]
'''


@pytest.fixture
def setup(cfg_factory, fakes, tmp_path, monkeypatch):  # noqa: F811
    (tmp_path / "srv_env.py").write_text(ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    servers = []

    def make(out, K, **trainer):
        if not servers:
            cfg = cfg_factory()
            vocab = len(load_tokenizer(cfg.model.name_or_path))
            for seed in (5, 6):  # other weights than the trainer's until its first push
                model = load_model(cfg.model, vocab, seed=seed)
                servers.append(fakes(model=model, name=cfg.model.name_or_path, max_model_len=1024, vocab=vocab))
        return cfg_factory({
            "rollout": {"backend": "server", "max_staleness": K,
                        "server": {"urls": [s.url for s in servers], "connect_timeout_s": 10}},
            "reward": {"functions": {"first": {"fn": "srv_env:flat_or_first"}, "accuracy": {"weight": 0.0},
                                     "format": {"weight": 0.0}}},
            "algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 2},
            "data": {"num_eval": 0}, "logging": {"sample_every": 0},
            "trainer": {"max_steps": 4, "save_every": 2, "keep_last": 3, "output_dir": str(out), **trainer}})

    return make, servers


def _asked(servers) -> Counter:
    """(prompt, seed) of every generation request the servers got (the sync check's requests left out)."""
    return Counter((tuple(body["prompt"]), body["seed"]) for s in servers for path, body in s.requests
                   if path == "/v1/completions" and "n" in body)


def _clear(servers) -> None:
    for s in servers:
        s.requests.clear()
        s.received = 0


def test_k1_on_two_servers_logs_staleness_and_the_sync_gap_and_asks_what_the_sync_run_asks(setup, tmp_path,
                                                                                            capfd):
    make, servers = setup
    fit(make(tmp_path / "k0", 0))
    sync = _asked(servers)
    _clear(servers)
    fit(make(tmp_path / "k1", 1))
    assert "is the bottleneck" in capfd.readouterr().err
    got, plain = steps(tmp_path / "k1"), steps(tmp_path / "k0")
    for t, m in got.items():
        assert m["async/staleness_max"] == m["server/version_lag"] == min(1, t - 1)
        assert m["async/version"] == sampled_with(t, 1)
        assert m["server/sync_logprob_gap"] < 1e-5  # the servers hold exactly the version published
        assert m["time/trainer_wait_s"] >= 0 and m["time/generator_wait_s"] >= 0
        pushed = t == 1 or sampled_with(t, 1) != sampled_with(t - 1, 1)  # a push came before this batch's requests
        assert (m["time/weights_load_s"] > 0) == pushed, t
    assert sum(m["resample_rounds"] for m in got.values()) > 0  # refill rounds ran, on the servers
    assert all(s.received == 3 for s in servers)  # versions 0, 1, 2: each pushed once, to every server
    assert _asked(servers) == sync  # the same prompts with the same seeds as the synchronous run
    same_numbers({1: plain[1]}, {1: got[1]}, keys=("loss", "reward_mean", "grad_norm", "resample_rounds"))
    # the behaviour log-probs are the servers' on the version they sampled with: the trainer's own at K = 0 and at
    # step 1; a step behind from step 2 (the correction acts)
    assert all(m["rollout_is/logp_diff_abs_max"] < 1e-4 for m in plain.values())
    assert got[1]["rollout_is/logp_diff_abs_max"] < 1e-4
    assert all(got[t]["rollout_is/logp_diff_abs_max"] > 1e-3 for t in (2, 3, 4))


def test_a_checkpoint_stores_the_batch_in_flight_and_a_resume_continues_exactly(setup, tmp_path):
    make, servers = setup
    out = tmp_path / "k1"
    fit(make(out, 1))
    everything = _asked(servers)
    ckpt = tmp_path / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", ckpt)
    saved = checkpoint.load_state(ckpt)["in_flight"]
    assert saved["lag"] == 1 and {s: g.version for s, g in saved["batches"].items()} == {3: 1}
    _clear(servers)
    fit(make(tmp_path / "resumed", 1, resume=str(ckpt)))
    got = steps(tmp_path / "resumed")
    assert sorted(got) == [3, 4]
    same_numbers({t: steps(out)[t] for t in got}, got)
    again = _asked(servers)
    assert again and not again - everything  # only step 4 is asked again: step 3's batch came from the checkpoint
    assert sum(again.values()) < sum(everything.values()) / 2


@pytest.mark.parametrize("name,extra", [
    ("lora", {"model": {"lora": {"enabled": True, "r": 4, "alpha": 8}}}),
    ("multi-turn", {"rollout": {"environment": "tests.tool_fixtures:TwoTurns", "max_turns": 2, "max_new_tokens": 8}}),
])
def test_lora_and_multi_turn_episodes_run_on_the_servers_at_a_lag(setup, tmp_path, name, extra):
    """LoRA: the servers get the merged weights of each version (the check passes against the snapshot's
    log-probs); multi-turn: the episodes run on the generator's thread with its own tool worker."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load

    make, servers = setup
    out = tmp_path / name
    base = OmegaConf.structured(make(out, 1, max_steps=3, save_every=0))
    fit(load(OmegaConf.to_container(OmegaConf.merge(base, extra), resolve=True)))
    got = steps(out)
    assert [m["async/staleness_max"] for m in got.values()] == [0, 1, 1]
    assert all(m["server/sync_logprob_gap"] < 1e-5 for m in got.values())
    assert got[1]["rollout_is/logp_diff_abs_max"] < 1e-4  # the servers' log-probs: the trainer's own weights
    if name == "multi-turn":
        assert all(m["episode/turns_mean"] > 1 for m in got.values())


def test_several_passes_per_batch_lag_by_batches_and_resume_mid_batch_exactly(setup, tmp_path):
    """``algorithm.num_iterations=2`` at K = 1: a batch at steps 1, 3, 5, sampled with versions 0, 0, 2 (the lag
    counts batches); both passes log the batch's staleness and the servers' lag; only versions 0 and 2 are pushed.
    A checkpoint after step 3 (between the two passes over its batch) holds that batch and the one in flight (step
    5, version 2): the resume trains steps 4-6 as the uninterrupted run did."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load

    make, servers = setup
    out = tmp_path / "mu2"

    def passes(out, **trainer):
        base = OmegaConf.structured(make(out, 1, max_steps=6, save_every=3, **trainer))
        return load(OmegaConf.to_container(OmegaConf.merge(base, {"algorithm": {"num_iterations": 2}}), resolve=True))

    fit(passes(out))
    got = steps(out)
    first = {t: t - (t - 1) % 2 for t in got}  # the step a batch's first pass trains at
    assert [m["async/version"] for m in got.values()] == [sampled_with(first[t], 1, 2) for t in got] == [0, 0, 0, 0,
                                                                                                           2, 2]
    for t, m in got.items():
        assert m["async/staleness_max"] == m["server/version_lag"] == first[t] - 1 - m["async/version"], t
        assert m["server/sync_logprob_gap"] < 1e-5
    assert all(s.received == 2 for s in servers)  # versions 0 and 2, each pushed once
    ckpt = tmp_path / "step_3"
    shutil.copytree(out / "checkpoints" / "step_3", ckpt)
    assert {s: g.version for s, g in checkpoint.load_state(ckpt)["in_flight"]["batches"].items()} == {5: 2}
    _clear(servers)
    fit(passes(tmp_path / "resumed", resume=str(ckpt)))
    resumed = steps(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    same_numbers({t: got[t] for t in resumed}, resumed)
    assert not _asked(servers)  # step 4 is the checkpoint's batch's second pass, step 5's batch was in flight
