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
    """make(out, K, servers=[{kill_after: N}, ...], server={rollout.server keys}, **trainer) -> (config, fakes)"""
    cfg = cfg_factory()
    vocab = len(load_tokenizer(cfg.model.name_or_path))

    def build(out, K, servers, server=None, **trainer):
        made = [fakes(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                      vocab=vocab, **kw) for kw in servers]
        return cfg_factory({
            "rollout": {"backend": "server", "max_staleness": K,
                        "server": {"urls": [s.url for s in made], "connect_timeout_s": 10, "retries": 0,
                                   **(server or {})}},
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



def _generations(fake) -> list[str]:
    """The weight label ``fake`` held at the start of each generation request it answered."""
    return [held for path, body, _, _, held in fake.spans if path == "/v1/completions" and "n" in body]


@pytest.mark.parametrize("K", [0, 2])
def test_a_restarted_server_rejoins_at_the_next_version_and_the_run_goes_on_exactly(make, tmp_path, capfd, K):
    """Server a dies under its third group and is up again at once, fresh (its first weights, no label): it is
    dropped, then probed before the next push, checked, pushed the version and taken back, while (K = 2) two batches
    are in flight; every group it answered was sampled with this run's weights, and the metrics are the uninterrupted
    run's (the same prompts and seeds, whichever server answers)."""
    whole, _ = make(tmp_path / "whole", K, [{}, {}])
    fit(whole)
    cut, (a, b) = make(tmp_path / "cut", K, [{"restart_after": 2}, {}], server={"rejoin_every_s": 0})
    fit(cut)
    err = capfd.readouterr().err
    assert a.restarts == 1 and f"carrying on with 1 of 2 rollout servers ({b.url})" in err
    assert err.count(f"rollout server {a.url} rejoined at version") == 1, err
    got = steps(tmp_path / "cut")
    same_numbers(steps(tmp_path / "whole"), got)
    up = [got[t]["server/servers_up"] for t in sorted(got)]
    assert min(up) == 1 and up[0] == up[-1] == 2, up
    held = _generations(a)
    assert len(held) > 2 and all(h is not None and h.endswith("@" + held[0].split("@")[1]) for h in held), held


def test_a_server_another_run_took_over_never_rejoins(make, tmp_path, capfd):
    whole, _ = make(tmp_path / "whole", 1, [{}, {}])
    fit(whole)
    other = "7@00000000beef"  # what the server says after its restart: another trainer's weights
    cut, (a, b) = make(tmp_path / "cut", 1, [{"restart_after": 2, "restart_label": other}, {}],
                       server={"rejoin_every_s": 0})
    fit(cut)
    err = capfd.readouterr().err
    assert a.restarts == 1 and "rejoined" not in err
    assert err.count(f"rollout server {a.url} is up again but holds another run's weights ('{other}')") == 1
    got = steps(tmp_path / "cut")
    same_numbers(steps(tmp_path / "whole"), got)
    assert got[max(got)]["server/servers_up"] == 1 and a.version == other  # never pushed to again
    assert other not in _generations(a)


def _cluster_commands() -> list[list[str]]:
    """The command lines of docs/async.md's cluster launch, each as words."""
    import re
    import shlex

    from tests.helpers import ROOT

    text = (ROOT / "docs" / "async.md").read_text().split("## Cluster launch")[1].split("\n## ")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [shlex.split(ln) for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_the_cluster_launch_of_docs_async_md(cfg_factory, fakes, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The two commands of docs/async.md#cluster-launch, scaled down: grpo-serve's (printed, as it would start vLLM:
    the key in vLLM's environment and never shown, the guard, tensor parallel 2, beyond loopback without a warning;
    a warning without the key) and the trainers' overrides against two keyed fake servers in this process, one killed
    mid-run: the run goes on and says so. (One process: the ZeRO-3 trainers of the server generator are issue 39's
    multi-rank part; scripts/bench_gpu.sh cluster launches them with torchrun.)"""
    from grpo import serve
    from grpo.config.compose import compose
    from grpo.config.schema import load
    from tests.e2e.test_docs_commands import SCALE
    from tests.helpers import VLLM_TINY

    server, trainers = _cluster_commands()
    assert server[:3] == ["GRPO_SERVER_API_KEY=$KEY", "CUDA_VISIBLE_DEVICES=0,1", ".venv-vllm/bin/grpo-serve"]
    tiny = ["model=tiny", *(f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()), "trainer.device=cpu"]
    monkeypatch.setenv("GRPO_SERVER_API_KEY", "the-key")
    serve.main([*server[3:], *tiny, "--print"])
    out, err = capsys.readouterr()
    assert "VLLM_API_KEY='***'" in out and "the-key" not in out and "without an API key" not in err
    assert "--host 0.0.0.0 --port 8000" in out and "--tensor-parallel-size 2" in out and "guard.RequireKey" in out
    monkeypatch.delenv("GRPO_SERVER_API_KEY")
    serve.main([*server[3:], *tiny, "--print"])
    assert "listens on 0.0.0.0, beyond this machine, without an API key" in capsys.readouterr().err

    assert trainers[:6] == ["GRPO_SERVER_API_KEY=$KEY", "torchrun", "--nproc_per_node", "8", "-m", "grpo.train"]
    given = dict(w.split("=", 1) for w in trainers[6:])
    assert given["distributed"] == "zero3" and given["rollout.max_staleness"] == "1"
    assert len(given["rollout.server.urls"].split(",")) == 4
    monkeypatch.setenv("GRPO_SERVER_API_KEY", "the-key")
    cfg = cfg_factory()
    vocab = len(load_tokenizer(cfg.model.name_or_path))
    made = [fakes(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                  vocab=vocab, api_key="the-key", **kw) for kw in ({"kill_after": 2}, {})]
    args = {**given, **SCALE, "trainer.max_steps": "3", "trainer.save_every": "1", "distributed": "none",
            "rollout.server.urls": "[" + ",".join(s.url for s in made) + "]",
            "rollout.server.trainer_host": "127.0.0.1", "rollout.server.retries": "0",
            "trainer.output_dir": str(tmp_path / "run"), "logging.sample_every": "0"}
    raw = compose([f"{k}={v}" for k, v in args.items()])
    fit(load(raw))  # the fakes answer 401 to a request without the key, and refuse a channel without it
    got = steps(tmp_path / "run")
    assert sorted(got) == [1, 2, 3] and got[3]["server/servers_up"] == 1 and made[0].dead
    assert f"carrying on with 1 of 2 rollout servers ({made[1].url})" in capsys.readouterr().err
