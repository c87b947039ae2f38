"""grpo/rollout/registry.py: a backend is one class and one registration (docs/architecture.md, "A rollout backend"):
the toy backend below trains a run of the smoke recipe with ``rollout.backend=toy``, synced and seeded as its
capabilities say; ``auto`` picks by device and installed packages; an unknown name or a second, different
registration is one line."""
import json

import pytest

from grpo.errors import ConfigError
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
