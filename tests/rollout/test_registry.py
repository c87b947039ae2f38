"""grpo/rollout/registry.py: a backend is one class and one registration (docs/architecture.md, "A rollout backend"):
the toy backend below trains a run of the smoke recipe with ``rollout.backend=toy``, synced and seeded as its
capabilities say; ``auto`` picks by device and installed packages; an unknown name or a second, different
registration is one line."""
import json
from types import SimpleNamespace

import pytest

import grpo.models  # noqa: F401 - check_vllm_cpu imports it on its first call: here, once, not in every mutant
from grpo.errors import ConfigError, SetupError
from grpo.registry import Registry
from grpo.rollout import registry
from grpo.rollout.base import Completions, Sampling


class ToyBackend:
    """Every sample of a prompt is ``k`` times its last token, then EOS (sample j: k = j + 1), up to
    ``max_new_tokens``. It holds weights of its own: the trainer syncs it after every optimizer step."""

    def __init__(self, ctx: registry.BackendContext):
        self.eos, self.calls, self.synced = ctx.tokenizer.eos_token_id, [], []
        made.append(self)

    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        self.calls.append((len(prompt_ids), group_size, sampling.max_new_tokens, seed))
        n = sampling.max_new_tokens
        ids = [[([p[-1]] * (j + 1) + [self.eos])[:n] for j in range(group_size)] for p in prompt_ids]
        return Completions(ids, [[self.eos not in c for c in g] for g in ids])

    def sync_weights(self, model, version: int) -> None:
        self.synced.append(version)

    def stats(self) -> dict[str, float]:
        return {"toy/synced": float(len(self.synced))}

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


made: list[ToyBackend] = []
registry.register_backend("toy", registry.Capabilities(), ToyBackend)  # the one registration


def test_a_registered_backend_trains_a_run(cfg_factory, tmp_path):
    """Two steps of the smoke recipe sampled by the toy backend: synced before its first rollout (the weights after
    0 optimizer steps) and after the step (1), seeded every rollout, its metrics logged, closed at the end."""
    from grpo.trainer.loop import fit

    made.clear()
    out = tmp_path / "toy"
    cfg = cfg_factory({"rollout": {"backend": "toy"}, "trainer": {"max_steps": 2, "output_dir": str(out)},
                       "data": {"num_eval": 0}})
    summary = fit(cfg)
    toy, = made
    assert summary["steps"] == 2 and toy.synced == [0, 1] and toy.closed
    r = cfg.rollout
    assert [c[:3] for c in toy.calls] == [(r.prompts_per_step, cfg.algorithm.group_size, r.max_new_tokens)] * 2
    assert all(isinstance(c[3], int) for c in toy.calls) and toy.calls[0][3] != toy.calls[1][3]
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [m["toy/synced"] for m in steps] == [1.0, 2.0]
    G = cfg.algorithm.group_size  # sample j has j + 2 tokens (its last token, j + 1 times, then EOS)
    assert [m["completion_len_mean"] for m in steps] == [min(sum(j + 2 for j in range(G)) / G, r.max_new_tokens)] * 2


def test_auto_picks_by_device_and_installed_packages(monkeypatch):
    monkeypatch.setattr(registry, "vllm_available", lambda: True)
    assert (registry.pick("auto", "cuda"), registry.pick("auto", "cpu"), registry.pick("toy", "cpu")) == \
        ("vllm", "hf", "toy")
    monkeypatch.setattr(registry, "vllm_available", lambda: False)
    assert registry.pick("auto", "cuda") == "hf" and registry.pick("vllm", "cpu") == "vllm"
    with pytest.raises(Exception, match=r"^rollout.backend=vllm needs vLLM: pip install .*, or use "
                                        r"rollout.backend=hf$"):
        registry.resolve("vllm", "cpu")
    caps = registry.capabilities
    assert caps("hf").live_weights and not caps("hf").seeded and caps("vllm").starts_synced and caps("toy").seeded
    assert (caps("hf").ahead, caps("server").ahead, caps("vllm").ahead) == ("process", "thread", None)


def test_an_unknown_name_and_a_conflicting_registration_are_one_line():
    with pytest.raises(ConfigError, match=r"^rollout.backend='nope' is not a registered backend; one of auto, vllm, "
                                          r"hf, server, toy$"):
        registry.capabilities("nope")
    with pytest.raises(ValueError, match=r"^rollout backend 'toy' is registered twice: .* and .*; give one of them "
                                         r"another name$"):
        registry.register_backend("toy", registry.Capabilities(seeded=False), ToyBackend)
    assert registry.register_backend("toy", registry.Capabilities(), ToyBackend) is registry.backend("toy")


# ------------------------------------------------------------------ unit-level: each function of the registry
@pytest.fixture
def own_registry(monkeypatch):
    """The built-ins and toy, and whatever a test registers, in a registry of the test's own (others see none)."""
    mine = Registry("rollout backend")
    for name in registry.BACKENDS:
        mine.add(name, registry.BACKENDS[name])
    monkeypatch.setattr(registry, "BACKENDS", mine)
    return mine


def test_a_registration_keeps_every_field_where_it_belongs(own_registry):
    def available():
        return False

    def check(r, m, d):
        return None

    def refuse(r, d):
        return None

    b = registry.register_backend("x", registry.Capabilities(images=True), "m:f", available=available,
                                  install="pip install x", check=check, refuse_ahead=refuse)
    assert b == registry.Backend("x", registry.Capabilities(images=True), "m:f", available, "pip install x", check,
                                 refuse)
    assert registry.backend("x") is b and registry.capabilities("x").images
    plain = registry.register_backend("y", registry.Capabilities(), "m:f")
    assert (plain.available, plain.install, plain.check, plain.refuse_ahead) == (None, "", None, None)


def test_auto_picks_the_first_registered_for_the_device_whose_packages_are_there(own_registry, monkeypatch):
    monkeypatch.setattr(registry, "vllm_available", lambda: False)
    registry.register_backend("tpu1", registry.Capabilities(auto=("tpu",)), "m:f", available=lambda: False)
    registry.register_backend("tpu2", registry.Capabilities(auto=("tpu",)), "m:f")
    registry.register_backend("tpu3", registry.Capabilities(auto=("tpu",)), "m:f", available=lambda: True)
    assert registry.pick("auto", "tpu") == registry.resolve("auto", "tpu") == "tpu2"
    assert registry.resolve("tpu3", "tpu") == "tpu3" and registry.resolve("hf", "cpu") == "hf"
    with pytest.raises(SetupError, match=r"^rollout.backend=tpu1 needs , or use rollout.backend=hf$"):
        registry.resolve("tpu1", "tpu")
    with pytest.raises(ConfigError, match="not a registered backend"):
        registry.resolve("nope", "cpu")


def test_vllm_is_available_when_its_package_can_be_found(monkeypatch):
    import importlib.util

    asked = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: asked.append(name) or object())
    assert registry.vllm_available() is True
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: asked.append(name))
    assert registry.vllm_available() is False and asked == ["vllm", "vllm"]


def _rollout(backend="hf", urls=("http://h:1",), sync_every=1, max_staleness=0):
    return SimpleNamespace(backend=backend, vllm="the vllm section", max_staleness=max_staleness,
                           server=SimpleNamespace(urls=list(urls), sync_every=sync_every))


def test_check_runs_the_backends_own_check_and_the_adapter_check_of_a_lora_backend(own_registry, monkeypatch):
    import grpo.rollout.lora_sync as lora_sync

    seen = []
    monkeypatch.setattr(lora_sync, "check_config", lambda v, lora: seen.append(("lora", v, lora)))
    registry.register_backend("c", registry.Capabilities(), "m:f", check=lambda r, m, d: seen.append(("c", r, m, d)))
    registry.register_backend("a", registry.Capabilities(lora_adapters=True), "m:f")
    model = SimpleNamespace(lora="the lora section")
    r = _rollout("c")
    assert registry.check(r, model, "cpu") == "c" and seen == [("c", r, model, "cpu")]
    seen.clear()
    assert registry.check(_rollout("a"), model, "cpu") == "a"
    assert seen == [("lora", "the vllm section", "the lora section")]
    seen.clear()
    assert registry.check(_rollout("hf"), model, "cpu") == "hf" and seen == []
    assert registry.check(_rollout("auto"), model, "cpu") == "hf"  # resolved for the device


def test_the_server_needs_urls_and_samples_ahead_only_pushing_every_version():
    model = SimpleNamespace(lora=None)
    with pytest.raises(ConfigError, match=r"^rollout.backend=server needs rollout.server.urls"):
        registry.check(_rollout("server", urls=()), model, "cpu")
    refuse = registry.backend("server").refuse_ahead
    assert registry.server_refusal(_rollout().server, "cpu") is None and refuse(_rollout(), "cpu") is None
    assert registry.server_refusal(_rollout(sync_every=3).server, "cpu") == (
        "pushes every version the schedule samples with (rollout.server.sync_every=3); the lag is "
        "rollout.max_staleness: use rollout.server.sync_every=1")


def test_vllm_on_cpu_refuses_a_head_size_without_a_kernel(monkeypatch):
    sizes = {}
    monkeypatch.setattr(grpo.models, "head_dim", lambda name, tiny: sizes[name])
    sizes.update({"tiny:qwen2": 16, "/ckpt": 48, "hub/id": None, "tiny:llama": 64, "/big": 256, "/small": 32})
    for name in ("hub/id", "tiny:llama", "/big", "/small"):
        registry.check_vllm_cpu(name, {})
    with pytest.raises(SetupError, match=r"^rollout.backend=vllm on CPU: vLLM has no CPU attention kernel for "
                                         r"head_dim=16 \(tiny:qwen2; it supports 32, 64, .*, 256\); use "
                                         r"rollout.backend=hf, or 'model.tiny=\{hidden_size: 128"):
        registry.check_vllm_cpu("tiny:qwen2", {})
    with pytest.raises(SetupError, match=r"^grpo-serve on CPU: .*head_dim=48 .*; use another model, or a model "
                                         r"with one of those$"):
        registry.check_vllm_cpu("/ckpt", {}, who="grpo-serve")
    vllm_check = registry.backend("vllm").check
    vllm_check(None, SimpleNamespace(name_or_path="tiny:qwen2", tiny={}), "cuda")  # CUDA: every size
    with pytest.raises(SetupError, match="head_dim=16"):
        vllm_check(None, SimpleNamespace(name_or_path="tiny:qwen2", tiny={}), "cpu")


def test_vllm_on_cpu_reads_the_head_size_of_the_tiny_model_it_is_given():
    with pytest.raises(SetupError, match="head_dim=8 "):
        registry.check_vllm_cpu("tiny:qwen2", {"hidden_size": 16, "num_attention_heads": 2})
    head_64 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    registry.check_vllm_cpu("tiny:qwen2", head_64)
    registry.backend("vllm").check(None, SimpleNamespace(name_or_path="tiny:qwen2", tiny=head_64), "cpu")  # model.tiny


def _rows(*n_images):
    return [{"prompt_ids": SimpleNamespace(n_images=n) if n is not None else [1, 2]} for n in n_images]


def test_check_images_refuses_only_prompts_with_images(own_registry):
    registry.register_backend("text", registry.Capabilities(), "m:f")
    registry.check_images("text", "text", _rows(None, 0), zero3=True, rollout=_rollout(max_staleness=2))
    with pytest.raises(SetupError, match=r"^rollout.backend=auto \(text\) does not take images yet; prompts with "
                                         r"images need rollout.backend=vllm or hf or server \(docs/vision"):
        registry.check_images("auto", "text", _rows(0, 2))
    for name in ("hf", "vllm", "server"):
        registry.check_images(name, name, _rows(1), rollout=_rollout())
    with pytest.raises(SetupError, match="not supported under ZeRO-3"):
        registry.check_images("hf", "hf", _rows(1), zero3=True)


def test_servers_that_lag_need_a_frozen_vision_tower():
    for lag in ({"max_staleness": 1}, {"sync_every": 2}):
        with pytest.raises(SetupError, match="set model.freeze_vision_tower=true"):
            registry.check_images("server", "server", _rows(1), rollout=_rollout(**lag))
        registry.check_images("server", "server", _rows(1), rollout=_rollout(**lag), frozen_tower=True)
        registry.check_images("hf", "hf", _rows(1), rollout=_rollout(**lag))  # samples with the tower of now
    registry.check_images("server", "server", _rows(1))  # no rollout section: nothing lags


def test_make_calls_the_maker_or_imports_it_by_name(own_registry):
    registry.register_backend("f", registry.Capabilities(), lambda ctx: ("made", ctx))
    registry.register_backend("s", registry.Capabilities(), "grpo.rollout.base:cut_at_eos")
    assert registry.make("f", "ctx") == ("made", "ctx")
    with pytest.raises(TypeError):  # cut_at_eos(ctx) was called: it takes three arguments
        registry.make("s", "ctx")
    registry.register_backend("t", registry.Capabilities(), "builtins:sorted")
    assert registry.make("t", [3, 1, 2]) == [1, 2, 3]
