"""LoRA (`model.lora`, peft): the reference is the base model with the adapter disabled (no second copy),
training changes only the adapter, checkpoints hold only the adapter, and the final output is a merged
model (`merge_on_save: true`) or an adapter that peft loads onto the same base.

`tiny:` models are rebuilt from `trainer.seed`, so the base for an adapter is `grpo.models.tiny_model`
with the same family, vocabulary, seed and `model.tiny` overrides.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

LORA = {"model": {"lora": {"enabled": True, "r": 4, "alpha": 8}},
        "data": {"num_eval": 0}, "logging": {"sample_every": 0, "plot": False}, "rollout": {"max_new_tokens": 8},
        "algorithm": {"beta": 0.1}, "trainer": {"lr": 0.05, "max_steps": 2}}


def _cfg(cfg_factory, *extra):
    from omegaconf import OmegaConf

    return cfg_factory(OmegaConf.to_container(OmegaConf.merge(LORA, *extra)))


def _base(run, cfg):
    from grpo.models import tiny_model

    family = cfg.model.name_or_path.split(":", 1)[1]
    return tiny_model(family, len(run.tokenizer), seed=cfg.trainer.seed, **dict(cfg.model.tiny)).eval()


def _is_lora(name: str) -> bool:
    return "lora_" in name


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ids(run) -> torch.Tensor:
    return torch.tensor([run.splits.train[0]["prompt_ids"] + [5, 6, 7, 8]])


@pytest.fixture
def spy(monkeypatch):
    """Keeps the Run that fit() builds, its initial weights, and the policy's logits just before save_final."""
    import grpo.trainer.loop

    s = SimpleNamespace(run=None, initial=None, logits=None)
    build, final = grpo.trainer.loop.build_run, grpo.trainer.loop.save_final

    def build_run(cfg):
        s.run = build(cfg)
        s.initial = _snapshot(s.run.policy)
        return s.run

    def save_final(run, cfg):
        with torch.no_grad():
            s.logits = run.model(_ids(run)).logits.clone()
        return final(run, cfg)

    monkeypatch.setattr(grpo.trainer.loop, "build_run", build_run)
    monkeypatch.setattr(grpo.trainer.loop, "save_final", save_final)
    return s


def test_lora_reference_is_the_base_model_with_the_adapter_disabled(cfg_factory):
    from peft import PeftModel

    from grpo import experience
    from grpo.engine.batch_logprobs import nested_logprobs
    from grpo.trainer.build import build_run
    from grpo.trainer.settings import derive
    from grpo.update import policy_update

    cfg = _cfg(cfg_factory)
    run = build_run(cfg)
    assert isinstance(run.policy, PeftModel)
    assert run.reference is None  # no second copy: the reference is the policy with the adapter off
    trainable = [n for n, p in run.policy.named_parameters() if p.requires_grad]
    assert trainable and all(_is_lora(n) for n in trainable)
    initial = _snapshot(run.policy)
    for _ in range(2):
        batch = experience.collect(run.sampler, run.runtime, run.settings.collect, run)
        settings = dataclasses.replace(derive(cfg).update, mask_truncated=False, max_grad_norm=1.0)
        stats = policy_update(run.runtime, batch, settings)
        assert not stats["skipped"]
    assert stats["kl"] > 0  # the adapter moved the policy away from the reference
    for n, p in run.policy.named_parameters():
        if _is_lora(n) and "lora_B" in n:
            assert not torch.equal(p, initial[n]), n  # the adapter was trained
        elif not _is_lora(n):
            assert torch.equal(p, initial[n]), n      # the base was not
    base = _base(run, cfg)
    for shared in (True, False):  # the shared-prefix engine and the standard layout
        ecfg = dataclasses.replace(cfg.engine, shared_prefix=shared)
        with run.reference_context():
            ref = nested_logprobs(run.runtime, run.reference_model(), batch, ecfg, cfg.rollout.temperature)
        want = nested_logprobs(run.runtime, base, batch, ecfg, cfg.rollout.temperature)
        policy = nested_logprobs(run.runtime, run.model, batch, ecfg, cfg.rollout.temperature)
        ref, want, policy = (torch.cat([t for g in x for t in g]) for x in (ref, want, policy))
        assert torch.allclose(ref, want, atol=1e-5), (ref - want).abs().max()
        assert (policy - want).abs().max() > 1e-3
    # the batch's reference log-probs (computed by collect) are the base model's too
    got = torch.cat([t for g in batch.ref_logps for t in g])
    base_lps = nested_logprobs(run.runtime, base, batch, cfg.engine, cfg.rollout.temperature)
    assert torch.allclose(got, torch.cat([t for g in base_lps for t in g]), atol=1e-5)


def test_lora_run_saves_the_adapter_only_and_it_loads_with_peft(cfg_factory, spy, monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file

    from grpo.trainer.loop import fit

    cfg = _cfg(cfg_factory, {"model": {"lora": {"merge_on_save": False}}})
    fit(cfg)
    run, out = spy.run, Path(cfg.trainer.output_dir)
    for n, p in run.policy.named_parameters():  # only adapter weights changed
        if not _is_lora(n):
            assert torch.equal(p, spy.initial[n]), n
    assert any(not torch.equal(p, spy.initial[n]) for n, p in run.policy.named_parameters() if _is_lora(n))
    state = load_file(str(out / "checkpoints" / "step_2" / "trainable.safetensors"))
    lora = {n for n, _ in run.policy.named_parameters() if _is_lora(n)}
    assert set(state) == lora  # the checkpoint holds the adapter only
    final = out / "final"
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    assert not (final / "model.safetensors").exists()
    base = _base(run, cfg)
    with torch.no_grad():
        base_logits = base(_ids(run)).logits
        loaded = PeftModel.from_pretrained(_base(run, cfg), final).eval()
        logits = loaded(_ids(run)).logits
    assert torch.allclose(logits, spy.logits, atol=1e-5)
    assert (logits - base_logits).abs().max() > 1e-3
    # resuming a LoRA run loads the adapter back into a freshly built model
    import grpo.trainer.loop

    restored = {}
    restore = grpo.trainer.loop.restore

    def spy_restore(run, cfg):
        step = restore(run, cfg)
        restored.update({n: p.detach().clone() for n, p in run.policy.named_parameters() if _is_lora(n)})
        return step

    monkeypatch.setattr(grpo.trainer.loop, "restore", spy_restore)
    more = _cfg(cfg_factory, {"model": {"lora": {"merge_on_save": False}},
                              "trainer": {"max_steps": 3, "resume": "auto"}})
    assert fit(more)["steps"] == 3
    assert restored.keys() == state.keys() and all(torch.equal(restored[n], state[n]) for n in state)


def test_lora_final_model_is_merged_and_loads_without_peft(cfg_factory, spy):
    from transformers import AutoModelForCausalLM

    from grpo.trainer.loop import fit

    cfg = _cfg(cfg_factory, {"model": {"lora": {"merge_on_save": True}}})
    fit(cfg)
    final = Path(cfg.trainer.output_dir) / "final"
    assert not (final / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        logits = merged(_ids(spy.run)).logits
    assert torch.allclose(logits, spy.logits, atol=1e-4)
    base = _base(spy.run, cfg).state_dict()
    changed = {n for n, t in merged.state_dict().items() if not torch.equal(t, base[n])}
    assert changed, "the adapter was not merged"
    targets = tuple(cfg.model.lora.target_modules)
    assert all(n.split(".")[-2] in targets for n in changed), changed  # only the adapted projections
