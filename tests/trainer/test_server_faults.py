"""Faults of whole training runs on fake servers (in process; the weights through real gloo channels): with two
servers one dies mid-run and the run carries on with the other, saying so, with the uninterrupted run's metrics
(synchronous and K = 1); with one server its death stops the run in one line naming it, and a resume against a
fresh server continues exactly."""
import pytest

from grpo.models import load_model, load_tokenizer
from grpo.rollout.server.client import ServerDown
from grpo.trainer.loop import fit
from tests.e2e.test_async import same_numbers, steps
from tests.rollout.server.conftest import fakes  # noqa: F401  (the fixture)


@pytest.fixture
def make(cfg_factory, fakes):  # noqa: F811
    """make(out, K, servers=[{kill_after: N}, ...], **trainer) -> (config, fake servers)"""
    cfg = cfg_factory()
    vocab = len(load_tokenizer(cfg.model.name_or_path))

    def build(out, K, servers, **trainer):
        made = [fakes(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                      vocab=vocab, **kw) for kw in servers]
        return cfg_factory({
            "rollout": {"backend": "server", "max_staleness": K,
                        "server": {"urls": [s.url for s in made], "connect_timeout_s": 10, "retries": 0}},
            "data": {"num_eval": 0}, "logging": {"sample_every": 0},
            "trainer": {"max_steps": 4, "save_every": 2, "output_dir": str(out), **trainer}}), made

    return build


@pytest.mark.parametrize("K", [0, 1])
def test_a_server_killed_mid_run_is_dropped_and_the_run_goes_on_exactly(make, tmp_path, capfd, K):
    whole, _ = make(tmp_path / "whole", K, [{}, {}])
    fit(whole)
    cut, (a, b) = make(tmp_path / "cut", K, [{"kill_after": 2}, {}])  # dies in step 3
    fit(cut)
    err = capfd.readouterr().err
    assert a.dead and err.count(f"rollout server {a.url} stopped answering") == 1
    assert f"carrying on with 1 of 2 rollout servers ({b.url})" in err
    got = steps(tmp_path / "cut")
    same_numbers(steps(tmp_path / "whole"), got)  # the lost groups were asked again with their seeds
    up = [got[t]["server/servers_up"] for t in sorted(got)]
    assert up[0] == 2 and up[-1] == 1 and up == sorted(up, reverse=True)


def test_the_only_server_killed_stops_the_run_in_one_line_and_a_resume_is_exact(make, tmp_path):
    whole, _ = make(tmp_path / "whole", 1, [{}])
    fit(whole)
    out = tmp_path / "cut"
    cut, (a,) = make(out, 1, [{"kill_after": 6}])  # answers steps 1-3 (the checkpoint at 2 waits for 3), dies in 4
    with pytest.raises(ServerDown) as e:
        fit(cut)
    msg = str(e.value)
    assert msg.startswith(f"rollout server {a.url} stopped answering") and "\n" not in msg
    assert "trainer.resume=auto" in msg
    assert (out / "checkpoints" / "step_2").is_dir()
    again, (fresh,) = make(out, 1, [{}], resume="auto")  # a fresh server at another URL
    fit(again)
    got = steps(out)
    same_numbers({t: steps(tmp_path / "whole")[t] for t in (3, 4)}, {t: got[t] for t in (3, 4)})
    assert fresh.received >= 1  # the checkpoint's weights were pushed to it before it sampled
