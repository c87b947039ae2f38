"""The rollout backend interface with our decode loop behind it (no vLLM needed)."""
from types import SimpleNamespace

import pytest
import torch

import grpo.rollout.vision  # noqa: F401 - imported by the backend on its first image rollout: here, once
from grpo.engine.vision_logprobs import VISION_FAMILIES
from grpo.errors import SetupError
from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.backends import Completions, HFBackend, Sampling, SyncedBackend, make_hf, step_seed
from grpo.rollout.hf import generate
from grpo.rollout.registry import Capabilities, resolve, vllm_available
from grpo.rollout.turn_cache import TurnCache


def test_hf_backend_is_our_decode_loop():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"], tok("Hi")["input_ids"]]
    backend = HFBackend(model, tok, batch_size=2)
    torch.manual_seed(5)
    got = backend.generate(prompts, 3, Sampling(max_new_tokens=8, temperature=0.8))
    torch.manual_seed(5)
    want = generate(model, tok, prompts, Sampling(max_new_tokens=8, temperature=0.8), group_size=3, batch_size=2,
                    progress=False)
    assert (got.ids, got.truncated) == want and got.logprobs is None
    greedy = backend.generate(prompts, 3, Sampling(max_new_tokens=8, greedy=True))
    assert greedy.ids == generate(model, tok, prompts, Sampling(max_new_tokens=8, greedy=True), group_size=3,
                                  progress=False)[0]


def test_hf_backend_seed_is_reproducible_and_leaves_the_global_stream_alone():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("abc")["input_ids"]]
    backend = HFBackend(lambda: model, tok)  # a getter: the runtime's model, looked up at each call
    s = Sampling(max_new_tokens=8)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = backend.generate(prompts, 4, s, seed=7)
    assert torch.equal(state, torch.get_rng_state())
    assert a.ids == backend.generate(prompts, 4, s, seed=7).ids != backend.generate(prompts, 4, s, seed=8).ids


def test_backend_choice():
    assert resolve("hf", "cuda") == "hf"
    assert resolve("auto", "cpu") == "hf"
    assert resolve("auto", "cuda") == ("vllm" if vllm_available() else "hf")
    if not vllm_available():
        from grpo.errors import SetupError

        with pytest.raises(SetupError, match=r"pip install -e '\.\[vllm\]' on CUDA.*rollout.backend=hf"):
            resolve("vllm", "cpu")


def test_step_seed_depends_on_every_part():
    s = step_seed(0, 0, 1, 16)
    assert s == step_seed(0, 0, 1, 16) and 0 <= s < 2**31
    # the same seeds in every version: a run resumed with a newer grpo samples what it would have
    assert (s, step_seed(1234, 3, 7, 2)) == (698827043, 1264945635)
    assert len({s, step_seed(1, 0, 1, 16), step_seed(0, 1, 1, 16), step_seed(0, 0, 2, 16), step_seed(0, 0, 1, 18)}) == 5


def test_config_choices(cfg_factory):
    from grpo.config.schema import ConfigError

    assert cfg_factory().rollout.backend == "auto" and cfg_factory().algorithm.rollout_is == "token_truncate"
    from grpo.rollout import registry

    sglang = cfg_factory({"rollout": {"backend": "sglang"}})  # a name is checked against the registry, before a model
    with pytest.raises(ConfigError, match=r"^rollout.backend='sglang' is not a registered backend; one of auto, vllm, "
                                          r"hf, server"):
        registry.check(sglang.rollout, sglang.model, "cpu")
    with pytest.raises(ConfigError, match="algorithm.rollout_is"):
        cfg_factory({"algorithm": {"rollout_is": "tis"}})
    with pytest.raises(ConfigError, match="rollout_is_cap"):
        cfg_factory({"algorithm": {"rollout_is_cap": 0.5}})


def test_the_documented_vllm_commands_are_what_make_test_vllm_runs():
    """docs/rollout.md's install steps and test command are the ones `make test-vllm` runs (`make -n`: printed, not
    run; -q aside, and the Makefile's own `test -x ... ||` guard that makes it idempotent)."""
    import re
    import shlex
    import shutil
    import subprocess

    from tests.helpers import ROOT

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # run by make too
    made = subprocess.run(["make", "--no-print-directory", "-n", "-B", "test-vllm", "TEST_WORKERS=2"], cwd=ROOT,
                          capture_output=True, text=True, check=True, env=env).stdout
    made = [[w for w in shlex.split(line) if w != "-q"] for line in made.splitlines()]
    text = (ROOT / "docs" / "rollout.md").read_text()
    install = re.search(r"```bash\n(python3 -m venv \.venv-vllm\n.*?)```", text, re.S).group(1)
    documented = [shlex.split(line, comments=True) for line in install.splitlines()]
    test_block = re.search(r"```bash\nmake test-vllm\n(.*?)```", text, re.S).group(1).replace("\\\n", " ")
    documented += [[w for w in shlex.split(line) if w != "-q"] for line in test_block.splitlines()
                   if not line.startswith("#")]
    assert len(documented) == 7
    for words in documented:
        if words[:3] == ["python3", "-m", "venv"]:  # the Makefile: test -x .venv-vllm/bin/pip || python3 -m venv ...
            assert [w for w in made[0][made[0].index("||") + 1:] if w != "--clear"] == words, made[0]
        else:
            assert words in made, (words, made)


# ------------------------------------------------------------------ unit-level: a stand-in decode loop and runtime
class _Model(torch.nn.Module):
    def __init__(self, model_type="llama", eos=None):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type) if model_type else SimpleNamespace()
        self.generation_config = SimpleNamespace(eos_token_id=eos)


def _decode(calls):
    def fn(model, tok, prompts, sampling, **kw):
        calls.append((model, tok, prompts, sampling, kw))
        draws = [[[int(torch.randint(0, 1000, ()))] for _ in range(kw["group_size"])] for _ in prompts]
        return draws, [[False] * kw["group_size"] for _ in prompts]
    return fn


def test_the_backend_hands_its_settings_to_the_decode_loop():
    calls, model, ctx = [], _Model(), object()
    b = HFBackend(model, "tok", batch_size=3, share_prompt=False, progress=True, context=ctx,
                  generate_fn=_decode(calls),
                  desc="eval")
    s = Sampling(max_new_tokens=4)
    out = b.generate([[1], [2]], 2, s, suffixes="sfx")
    assert isinstance(out, Completions) and len(out.ids) == 2 and out.truncated == [[False, False]] * 2
    (m, tok, prompts, sampling, kw), = calls
    assert (m, tok, prompts, sampling) == (model, "tok", [[1], [2]], s)
    assert kw == dict(group_size=2, batch_size=3, progress=True, share_prompt=False, context=ctx, desc="eval",
                      suffixes="sfx", turns=None)
    calls.clear()
    HFBackend(model, "tok", generate_fn=_decode(calls)).generate([[1]], 1, s)
    assert calls[0][4] == dict(group_size=1, batch_size=8, progress=False, share_prompt=True, context=None,
                               desc="rollout", suffixes=None, turns=None)


def test_a_model_getter_is_called_at_each_rollout_and_a_module_is_used_as_it_is():
    calls, models = [], [_Model(), _Model()]
    b = HFBackend(lambda: models[-1], "tok", generate_fn=_decode(calls))
    b.generate([[1]], 1, Sampling(2))
    models.append(_Model())
    b.generate([[1]], 1, Sampling(2))
    assert calls[0][0] is models[1] and calls[1][0] is models[2]
    HFBackend(models[0], "tok", generate_fn=_decode(calls)).generate([[1]], 1, Sampling(2))  # a Module is callable too
    assert calls[2][0] is models[0]
    untyped = _Model(model_type=None)  # a config without model_type: a text model
    HFBackend(untyped, "tok", generate_fn=_decode(calls)).generate([[1]], 1, Sampling(2))
    assert calls[3][0] is untyped


def test_a_seed_makes_the_draws_and_leaves_the_global_stream_where_it_was():
    b = HFBackend(_Model(), "tok", generate_fn=_decode([]))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = b.generate([[1]], 4, Sampling(2), seed=7).ids
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(7)
    assert a == [[[int(torch.randint(0, 1000, ()))] for _ in range(4)]]
    torch.manual_seed(3)
    unseeded = b.generate([[1]], 4, Sampling(2)).ids  # the process's stream, which moves on
    after = torch.rand(1)
    torch.manual_seed(3)
    assert unseeded == [[[int(torch.randint(0, 1000, ()))] for _ in range(4)]]
    assert torch.equal(after, torch.rand(1))


def test_a_vision_language_model_samples_through_the_image_rollout(monkeypatch):
    seen = []

    def with_images(model, prompts, group_size, sampling, eos, seed):
        seen.append((model, prompts, group_size, sampling, eos, seed))
        return SimpleNamespace(ids=[[[5]]], truncated=[[True]], logprobs="not passed on")

    monkeypatch.setattr(grpo.rollout.vision, "generate_with_images", with_images)
    model = _Model(VISION_FAMILIES[0], eos=[9])
    b = HFBackend(model, SimpleNamespace(eos_token_id=2), generate_fn=lambda *a, **k: pytest.fail("text loop"))
    out = b.generate(["p"], 3, Sampling(4), seed=11)
    assert (out.ids, out.truncated, out.logprobs) == ([[[5]]], [[True]], None)
    assert seen == [(model, ["p"], 3, Sampling(4), [9, 2], 11)]
    with pytest.raises(SetupError, match="multi-turn episodes .* do not take image prompts yet"):
        b.generate(["p"], 1, Sampling(4), suffixes=[[[1]]])


def test_multi_turn_keeps_a_turn_cache_that_each_sleep_clears():
    calls = []
    b = HFBackend(_Model(), "tok", generate_fn=_decode(calls), keep_turns=True)
    assert isinstance(b.turns, TurnCache)
    b.generate([[1]], 1, Sampling(2))
    assert calls[0][4]["turns"] is b.turns
    cleared = []
    b.turns = SimpleNamespace(clear=lambda: cleared.append(1))
    b.sleep()
    assert cleared == [1]
    plain = HFBackend(_Model(), "tok")
    assert plain.turns is None and plain.sleep() is None and plain.stats() == {} and plain.close() is None
    assert plain.sync_weights(None, 3) is None


def test_make_hf_samples_the_runtimes_model_of_the_moment():
    calls = []
    rt = SimpleNamespace(model=_Model(), generation_context="ctx")
    rollout = SimpleNamespace(batch_size=5, share_prompt=False)
    ctx = SimpleNamespace(runtime=rt, rollout=rollout, tokenizer="tok", progress=True, multi_turn=True)
    b = make_hf(ctx)
    assert (b.tokenizer, b.batch_size, b.share_prompt, b.progress, b.context, b.desc) == (
        "tok", 5, False, True, "ctx", "rollout") and isinstance(b.turns, TurnCache)
    b._generate = _decode(calls)
    rt.model = _Model()
    b.generate([[1]], 1, Sampling(2))
    assert calls[0][0] is rt.model
    assert make_hf(SimpleNamespace(**(ctx.__dict__ | {"multi_turn": False}))).turns is None


class _Inner:
    def __init__(self):
        self.synced, self.slept, self.closed = [], 0, 0

    def sync_weights(self, model, version):
        self.synced.append((model, version))

    def sleep(self):
        self.slept += 1

    def stats(self):
        return {"x": 1.0}

    def close(self):
        self.closed += 1


def _rt(step=None, last_epoch=0):
    state = {} if step is None else {"p0": {"exp_avg": 0}, "p": {"step": torch.tensor(float(step))}}
    return SimpleNamespace(model="the model", optimizer=SimpleNamespace(state=state),
                           scheduler=SimpleNamespace(last_epoch=last_epoch))


def test_the_synced_backend_is_made_at_its_first_rollout_and_synced_whenever_the_optimizer_steps():
    made = []
    rt = _rt()
    sb = SyncedBackend(lambda: made.append(_Inner()) or made[-1], rt)
    assert sb.synced_at is None and sb.backend is None
    assert made == [] and sb.stats() == {} and sb.sleep() is None and sb.close() is None
    inner = sb.ready()
    assert made == [inner] and inner.synced == [("the model", 0)]  # it holds nothing yet: synced before the first
    assert sb.ready() is inner and inner.synced == [("the model", 0)]  # nothing moved: no sync
    rt.optimizer.state = {"p0": {"exp_avg": 0}, "p": {"step": torch.tensor(2.0)}}
    assert sb.ready() is inner and inner.synced[-1] == ("the model", 2)
    rt.scheduler.last_epoch = 1  # the scheduler alone moving is enough
    sb.ready()
    assert inner.synced[-1] == ("the model", 2) and len(inner.synced) == 3
    sb.sleep()
    assert inner.slept == 1 and sb.stats() == {"x": 1.0}
    sb.close()
    assert inner.closed == 1 and sb.backend is None
    sb.close()
    assert inner.closed == 1


def test_a_backend_that_starts_synced_or_samples_the_live_model_or_is_not_followed_is_not_synced():
    started = SyncedBackend(_Inner, _rt(step=4), Capabilities(starts_synced=True))
    inner = started.ready()
    assert inner.synced == [] and started.synced_at == (4, 0)
    live = SyncedBackend(_Inner, _rt(step=4), Capabilities(live_weights=True))
    assert live.follow is False and live.ready().synced == []
    rt = _rt()
    lead = SyncedBackend(_Inner, rt, follow=False)
    inner = lead.ready()
    rt.scheduler.last_epoch = 5
    assert lead.ready() is inner and inner.synced == [] and lead.follow is False
    assert SyncedBackend(_Inner, rt).follow is True


def test_the_weights_version_is_the_first_step_count_and_the_schedulers():
    sb = SyncedBackend(_Inner, _rt(step=3, last_epoch=7))
    assert sb._weights_version() == (3, 7)
    sb.runtime.optimizer.state = {"a": {"step": 5}, "b": {"step": 9}}
    assert sb._weights_version() == (5, 7)
    sb.runtime.optimizer.state = {"a": "not a dict", "b": {"exp_avg": 1}}
    assert sb._weights_version() == (0, 7)
    assert SyncedBackend(_Inner, SimpleNamespace(optimizer=None, scheduler=None))._weights_version() == (0, None)
