"""rollout.backend=server with prompts with images, against a real `grpo-serve` (vLLM's server on 127.0.0.1, started
with docs/vision-language.md's command: the tiny Qwen2.5-VL widened for vLLM's CPU attention; no mocks): each group
goes to vLLM's tokens-in route with the trainer's prompt ids and its pictures' tower features
(grpo/rollout/server/images.py), and vLLM samples with the log-probs the trainer computes
(grpo/engine/vision_logprobs.py) for prompts with 0, 1 and 2 pictures, after a push of changed weights too; dropped or
swapped pictures make them differ; with the tower frozen a push leaves it out. Last, the docs' grpo-train command
trains against the same server.

One server for the module (about a minute to start); skipped where vLLM does not import (``make test-vllm``)."""
import pytest
import torch

from grpo.rollout.base import Sampling
from tests.helpers import vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

SECTION = ("vision-language.md", "- `server` (`grpo-serve`", "## Time and memory")


def _commands(port: int) -> dict[str, list[str]]:
    """docs/vision-language.md's grpo-serve and grpo-train overrides, on ``port``."""
    from tests.e2e.test_server import docs_commands

    url = f"rollout.server.urls=[http://127.0.0.1:{port}]"
    return {name: [f"rollout.server.port={port}" if w.startswith("rollout.server.port=") else
                   url if w.startswith("rollout.server.urls=") else w for w in words[1:]]
            for name, words in docs_commands(*SECTION).items()}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from grpo.rollout.server.backend import ServerBackend
    from grpo.rollout.server.client import ServerPool
    from grpo.rollout.server.facts import model_facts
    from grpo.rollout.server.gloo import GlooTransfer
    from tests.e2e.test_server import Server, _free_port
    from tests.helpers import compose_recipe, vision_setup

    tmp, port = tmp_path_factory.mktemp("server-vision"), _free_port()
    commands = _commands(port)
    server = Server(port, tmp / "server.log", commands["grpo-serve"]).start()
    tiny = dict(compose_recipe("vlm-smoke", commands["grpo-serve"][1:]).model.tiny)  # the server's model, as built
    model, tok, _, prompts = vision_setup(tiny)
    server.wait()
    backend = ServerBackend(model, ServerPool([server.url], timeout_s=300), model_name="tiny:qwen2_5_vl",
                            facts=model_facts(model.config), eos_ids=[tok.eos_token_id], max_model_len=64,
                            check_ids=list(prompts[0][:40]), transfer=GlooTransfer("127.0.0.1", timeout_s=300))
    yield {"tmp": tmp, "server": server, "model": model, "prompts": prompts, "backend": backend, "commands": commands}
    backend.close()
    server.kill()


def _worst(model, prompts, out) -> float:
    from grpo.engine.vision_logprobs import vision_token_logprobs

    with torch.no_grad():
        ours = vision_token_logprobs(model, prompts, out.ids)
    return max(float((a - b).abs().max()) for ga, gb in zip(ours, out.logprobs) for a, b in zip(ga, gb))


def test_the_server_samples_with_the_trainers_log_probs_for_0_1_2_pictures(ctx):
    model, prompts, b = ctx["model"], ctx["prompts"], ctx["backend"]
    b.sync_weights(model, 0)
    assert b.stats()["server/sync_logprob_gap"] < 1e-3
    assert model.config.image_token_id not in b.check_ids and len(b.check_ids) > 10  # the check scores text only
    out = b.generate(prompts, 3, Sampling(max_new_tokens=8), seed=1)
    assert [len(g) for g in out.ids] == [3] * len(prompts) and all(len(r) for g in out.ids for r in g)
    assert [p.n_images for p in prompts] == [1, 1, 1, 2, 0]
    assert _worst(model, prompts, out) < 1e-4


def test_a_push_of_changed_weights_tower_included_reaches_the_server(ctx):
    model, prompts, b = ctx["model"], ctx["prompts"], ctx["backend"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = b.generate(prompts[:2], 2, Sampling(max_new_tokens=6), seed=2)
    assert _worst(model, prompts[:2], stale) > 1e-3  # the server still holds version 0's language model
    b.sync_weights(model, 1)  # every vLLM parameter filled (the worker refuses a push that leaves one), tower too
    assert b.stats()["server/sync_logprob_gap"] < 1e-3
    out = b.generate([prompts[0], prompts[3], prompts[4]], 2, Sampling(max_new_tokens=6), seed=2)
    assert _worst(model, [prompts[0], prompts[3], prompts[4]], out) < 1e-4


def test_with_the_tower_frozen_a_push_sends_the_language_model_only(ctx):
    model, prompts, b = ctx["model"], ctx["prompts"], ctx["backend"]
    b.sync_weights(model, 10)  # a full push first (this test does not rely on the others having pushed)
    full = b.stats()["sync/bytes"]
    model.model.visual.requires_grad_(False)  # model.freeze_vision_tower=true
    try:
        with torch.no_grad():
            for p in model.model.language_model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        b.sync_weights(model, 11)  # the server accepts a stream without its tower (it keeps what it holds)
        tower = sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
        assert b.stats()["sync/bytes"] == full - tower and b.stats()["server/sync_logprob_gap"] < 1e-3
        out = b.generate(prompts[2:4], 2, Sampling(max_new_tokens=6), seed=4)
        assert _worst(model, prompts[2:4], out) < 1e-4
    finally:
        model.model.visual.requires_grad_(True)


def test_dropped_or_swapped_pictures_are_caught(ctx, monkeypatch):
    """Planted bugs: the pictures not sent (the expanded ids as text, through /v1/completions), or each prompt sent
    the next prompt's picture: the server's log-probs then differ from the trainer's."""
    import grpo.rollout.server.backend as sb
    from grpo.rollout.server.images import image_request

    model, prompts, b = ctx["model"], ctx["prompts"][:3], ctx["backend"]
    monkeypatch.setattr(sb.ServerBackend, "_request", lambda self, p, body: ("/v1/completions", body, None))
    dropped = b.generate(prompts, 2, Sampling(max_new_tokens=6), seed=3)
    assert _worst(model, prompts, dropped) > 1e-3
    monkeypatch.undo()
    nxt = {tuple(p): q for p, q in zip(prompts, prompts[1:] + prompts[:1])}  # 32x32 pictures: same token count

    def swapped(body, p, image_id, tower, merge):
        return {**image_request(body, p, image_id, tower, merge),
                "features": image_request(body, nxt[tuple(p)], image_id, tower, merge)["features"]}

    monkeypatch.setattr(sb, "image_request", swapped)
    out = b.generate(prompts, 2, Sampling(max_new_tokens=6), seed=3)
    assert _worst(model, prompts, out) > 1e-3


def test_the_documented_command_trains_vlm_smoke_against_the_server(ctx):
    """docs/vision-language.md's grpo-train command (a new trainer takes the server over); each step's sampled
    log-probs are the trainer's."""
    import json

    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.trainer.loop import fit
    from tests.helpers import compose_recipe

    words = ctx["commands"]["grpo-train"]
    assert words[:2] == ["recipe=vlm-smoke", "rollout.backend=server"], words
    ctx["backend"].close()
    out = ctx["tmp"] / "run"
    cfg = compose_recipe("vlm-smoke", [*words[1:], f"trainer.output_dir={out}"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert all(r["server/sync_logprob_gap"] < 1e-3 and r["rollout_is/logp_diff_abs_max"] < 1e-4 for r in rows)
