"""engine.max_tokens_per_micro_batch: auto sizing, its estimate against measured activations, the start-up refusals,
and the grouped kernel's memory-saving completion attention."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from grpo.engine import memory, token_logprobs
from grpo.engine.memory import Estimate, activation_bytes_per_token, choose_budget, estimate
from tests.engine.test_logprobs import (
    ROOT,
    assert_grads_close,
    grads,
    make_data,
    make_model,
    max_err,
    reference_with_grads,
)
from tests.helpers import in_one_process

GiB = 2**30


# ------------------------------------------------------------------------------------------- the choice
def test_auto_fills_the_free_memory_up_to_the_cap():
    est = Estimate(per_token=1 << 20, fixed=GiB, transient=GiB // 2)
    tokens, note = choose_budget("auto", est, 8 * GiB, longest=300, on_gpu=True)
    assert tokens == int((8 * GiB * memory.MARGIN - 1.5 * GiB) // ((1 << 20) * memory.OVERHEAD))
    assert est.bytes_for(tokens) <= 8 * GiB * memory.MARGIN < est.bytes_for(tokens + 1)
    assert "auto -> " in note and "\n" not in note
    assert choose_budget("auto", est, 64 * GiB, longest=300, on_gpu=False)[0] == memory.CPU_CAP
    # a sequence longer than the CPU cap still gets one micro-batch of its own when it fits
    assert choose_budget("auto", est, 64 * GiB, longest=9000, on_gpu=False)[0] == 9000


def test_explicit_budget_wins_and_warns_when_too_big():
    est = Estimate(per_token=1 << 20, fixed=0, transient=0)
    tokens, note = choose_budget(8192, est, GiB, longest=100, on_gpu=False)
    assert tokens == 8192 and "may run out of memory" in note
    # the hint names what auto would really pick: the memory fit capped for the device (issue 27, item 9)
    note = choose_budget(10**6, est, 64 * GiB, longest=100, on_gpu=False)[1]
    assert est.tokens_within(64 * GiB) > memory.CPU_CAP
    assert note.endswith(f"auto would pick {memory.CPU_CAP}")
    assert choose_budget("auto", est, 64 * GiB, longest=100, on_gpu=False)[0] == memory.CPU_CAP
    huge = choose_budget(10**7, est, 256 * GiB, longest=100, on_gpu=True)[1]
    assert huge.endswith(f"auto would pick {memory.GPU_CAP}")
    assert "auto cannot fit" in choose_budget(8192, est, 64 * 2**20, longest=100, on_gpu=False)[1]
    as_text = choose_budget("512", est, 8 * GiB, longest=100, on_gpu=False)
    assert as_text == (512, choose_budget(512, est, 8 * GiB, 100, False)[1])


def test_refusals_are_one_line_and_say_what_to_change():
    est = Estimate(per_token=1 << 20, fixed=0, transient=0)
    with pytest.raises(ValueError) as e:
        choose_budget(64, est, 64 * GiB, longest=100, on_gpu=False)
    assert "engine.max_tokens_per_micro_batch=64" in str(e.value) and "at least 100" in str(e.value)
    with pytest.raises(ValueError) as e:
        choose_budget("auto", est, GiB // 4, longest=1000, on_gpu=False)
    msg = str(e.value)
    assert "\n" not in msg and "1000 tokens" in msg
    for hint in ("rollout.max_new_tokens", "model.gradient_checkpointing=true", "model.lora.enabled=true",
                 "model.dtype=bfloat16"):
        assert hint in msg


def test_checkpointing_lora_and_bf16_lower_the_estimate():
    model = make_model(num_hidden_layers=4, hidden_size=64, intermediate_size=256)
    base = activation_bytes_per_token(model.config, torch.float32, False)
    assert activation_bytes_per_token(model.config, torch.float32, True) < base / 2
    assert activation_bytes_per_token(model.config, torch.bfloat16, False) < base * 0.7
    full = estimate(model)
    for n, p in model.named_parameters():
        p.requires_grad_("q_proj" in n)  # only a few trainable weights, as with LoRA
    assert estimate(model).fixed < full.fixed / 5


# ------------------------------------------------------------------------------- estimate vs measurement
def _saved_activation_bytes(model, prompts, comps):
    """Bytes of the tensors autograd keeps for backward, parameters excluded (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lps, _ = token_logprobs(model, prompts, comps, return_entropy=True)
    return sum(seen.values()), sum(l.sum() for g in lps for l in g)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_bounds_the_measured_saved_activations(checkpointing):
    """The per-token estimate is an upper bound of what a micro-batch really keeps for backward, and not a loose
    one; and no score matrix of the completion attention (G*S x S or x P per head) is kept."""
    model = make_model(num_hidden_layers=3, hidden_size=64, intermediate_size=192, vocab_size=128).train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, comps = make_data([24, 40], [[48] * 8, [32] * 6])
    tokens = sum(len(p) for p in prompts) + sum(len(r) for cs in comps for r in cs)
    saved, loss = _saved_activation_bytes(model, prompts, comps)
    loss.backward()
    est = estimate(model)
    assert est.per_token * tokens >= saved
    if not checkpointing:  # (with checkpointing the estimate adds the layer recomputed in backward: not saved)
        assert est.per_token * tokens <= 2.0 * saved


def test_completion_attention_keeps_no_scores():
    model = make_model(hidden_size=48, intermediate_size=64, vocab_size=128).train()
    S, G, P = 40, 8, 20  # no weight or head dimension has these sizes
    prompts, comps = make_data([P], [[S] * G])
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        token_logprobs(model, prompts, comps)
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] in ((S, S), (S, P))], shapes


# --------------------------------------------------------------------------- the memory-saving kernel is exact
@pytest.mark.parametrize("chunk", [1, 2000, 5000])  # one completion at a time; 4 of 5 completions; 2 groups
def test_chunked_completion_attention_matches_reference(monkeypatch, chunk):
    """Forward and gradients equal the per-sequence forward also when the kernel works one group at a time."""
    import grpo.engine.completion_attention as ca
    import grpo.engine.grouped_attention as ga

    monkeypatch.setattr(ca, "CHUNK_SCORES", chunk)
    monkeypatch.setattr(ga, "merged_attention_available", lambda q, v: False)  # the chunked kernel, also on CPU
    model = make_model("qwen2").train()
    prompts, comps = make_data()
    ref, w, want = reference_with_grads(model, prompts, comps)
    out = token_logprobs(model, prompts, comps)
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), want)


def test_attention_dropout_still_trains():
    model = make_model(attention_dropout=0.5).train()
    prompts, comps = make_data()
    torch.manual_seed(0)
    a = token_logprobs(model, prompts, comps)
    model.eval()
    b = token_logprobs(model, prompts, comps)
    assert max_err(a, b) > 1e-3  # dropout was applied in training mode
    sum(x.sum() for g in a for x in g).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_attention_dropout_path_values_match_the_reference(family, monkeypatch):
    """The training-with-dropout path (the joint softmax recorded by autograd, SDPA with dropout_p for the prompts)
    at a dropout rate that drops nothing in practice: its log-probs and gradients are the per-sequence forward's in
    eval mode (a wrong causal mask, a mis-ordered head or group, or the prompt block left out shows here)."""
    import grpo.engine.grouped_attention as ga

    model = make_model(family, attention_dropout=1e-9)
    prompts, comps = make_data()
    ref, w, want = reference_with_grads(model, prompts, comps)  # eval: no dropout anywhere
    seen = []
    real = ga._completion_attention_with_dropout
    monkeypatch.setattr(ga, "_completion_attention_with_dropout", lambda *a: seen.append(a[-1]) or real(*a))
    out = token_logprobs(model.train(), prompts, comps)
    assert seen and all(p == 1e-9 for p in seen)  # the dropout path ran, once per layer
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), want)


def test_attention_dropout_drops_both_the_prompt_and_the_own_block():
    """The dropout path's joint softmax: dropout applies to the weights on the prompt's keys and to those on the
    completion's own keys (each shown alone by zeroing the other block's values), scaled so the expectation holds;
    with a rate of ~0 it is the plain joint softmax."""
    from grpo.engine.grouped_attention import _completion_attention_with_dropout as attend

    g = torch.Generator().manual_seed(0)
    Hkv, rep, B, G, S, P, D = 1, 2, 1, 2, 3, 4, 8
    qc = torch.randn(Hkv, rep, B, G, S, D, generator=g)
    kp, vp = torch.randn(B, Hkv, P, D, generator=g), torch.randn(B, Hkv, P, D, generator=g)
    kc, vc = torch.randn(Hkv, B, G, S, D, generator=g), torch.randn(Hkv, B, G, S, D, generator=g)
    for name, args in {"prompt": (qc, kp, vp, kc, torch.zeros_like(vc)),
                       "own": (qc, kp, torch.zeros_like(vp), kc, vc)}.items():
        plain = attend(*args, None, 0.125, 1e-12)
        torch.manual_seed(0)
        dropped = torch.stack([attend(*args, None, 0.125, 0.5) for _ in range(200)])
        assert not torch.allclose(dropped[0], plain, atol=1e-3), name  # dropped weights
        assert torch.allclose(dropped.mean(0), plain, atol=0.1), name  # rescaled by 1 / (1 - p)


def test_attention_dropout_path_in_bfloat16():
    """bf16 weights: the joint softmax's weights come back in the values' dtype (a float32 weight times bf16 values
    fails), and the result is close to the eval-mode forward."""
    model = make_model(dtype=torch.bfloat16, attention_dropout=1e-9)
    prompts, comps = make_data()
    with torch.no_grad():
        want = token_logprobs(model, prompts, comps)
        got = token_logprobs(model.train(), prompts, comps)
    assert max_err(got, want) <= 5e-2


# ------------------------------------------------------------------------------------ in the trainer
def test_auto_budget_splits_the_batch_and_keeps_the_gradient(cfg_factory, monkeypatch):
    """auto with little memory plans several micro-batches; the gradient equals one micro-batch's."""
    import dataclasses

    from grpo import experience
    from grpo.engine.batch_logprobs import plan as _plan
    from grpo.trainer.build import build_run
    from grpo.update import policy_update

    cfg = cfg_factory({"engine": {"max_tokens_per_micro_batch": "auto"}, "rollout": {"prompts_per_step": 4}})
    run = build_run(cfg)
    try:
        # resolved at start, into the run's settings: the checked config is left as it was
        assert isinstance(run.settings.update.engine.max_tokens_per_micro_batch, int)
        assert run.settings.collect.engine == run.settings.update.engine
        assert cfg.engine.max_tokens_per_micro_batch == "auto"
        batch = experience.collect(run.sampler, run.runtime, run.settings.collect, run)
        est = memory.estimate(run.model)
        longest = max(len(p) + max(len(c) for c in g) for p, g in zip(batch.prompt_ids, batch.completion_ids))
        free = int((est.bytes_for(longest + 4)) / memory.MARGIN)  # room for about one sequence
        tight = dataclasses.replace(cfg.engine, max_tokens_per_micro_batch="auto", memory_limit_gib=free / GiB)
        whole = dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=100_000)
        assert len(_plan(batch, tight, run.model)) > 2 and len(_plan(batch, whole, run.model)) == 1
        state = {k: v.clone() for k, v in run.model.state_dict().items()}
        got = []

        def capture(max_grad_norm):  # the accumulated gradient, instead of an optimizer step
            got.append({n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})
            run.optimizer.zero_grad(set_to_none=True)
            return 0.0, True

        monkeypatch.setattr(run.runtime, "step", capture)
        for ecfg in (whole, tight):
            run.model.load_state_dict(state)
            settings = dataclasses.replace(run.settings.update, engine=ecfg, mask_truncated=False,
                                           max_grad_norm=1.0)
            policy_update(run.runtime, batch, settings)
        assert got[0].keys() == got[1].keys() and got[0]
        for n in got[0]:
            torch.testing.assert_close(got[0][n], got[1][n], rtol=1e-4, atol=1e-6)
    finally:
        run.close()


IMPOSSIBLE = [
    (["engine.max_tokens_per_micro_batch=20"], "engine.max_tokens_per_micro_batch=20 is smaller than the longest"),
    (["engine.max_tokens_per_micro_batch=auto", "engine.memory_limit_gib=0.01"], "model.gradient_checkpointing=true"),
]
AUTO = ["engine.max_tokens_per_micro_batch=auto", "trainer.max_steps=1", "data.num_eval=0"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """``grpo-train recipe=smoke`` with each `IMPOSSIBLE` case's arguments and with `AUTO`, all in one process
    (tests/helpers.py `in_one_process`; conftest.py's TOGETHER runs this file's tests of it on one worker): arguments
    -> (its output directory, what it gave)."""
    root = tmp_path_factory.mktemp("cli")
    cases = [tuple(args) for args, _ in IMPOSSIBLE] + [tuple(AUTO)]
    runs = in_one_process([(ROOT, ["grpo.train", "recipe=smoke", f"trainer.output_dir={root / str(i)}", *args])
                           for i, args in enumerate(cases)])
    return {args: (root / str(i), p) for i, (args, p) in enumerate(zip(cases, runs))}


@pytest.mark.parametrize("args, fragment", IMPOSSIBLE)
def test_impossible_fit_fails_at_start_in_one_line(cli, args, fragment):
    out, r = cli[tuple(args)]
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (out / "metrics.jsonl").exists()


def test_auto_is_the_default_and_is_resolved_at_start(cli):
    from grpo.config.schema import load

    assert load({}).engine.max_tokens_per_micro_batch == "auto"
    r = cli[tuple(AUTO)][1]
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if "engine.max_tokens_per_micro_batch=auto -> " in x)
    assert int(line.split("-> ")[1].split()[0]) == memory.CPU_CAP  # a tiny model: the CPU cap, not memory, limits


def test_bench_update_step_quick_runs():
    r = subprocess.run([sys.executable, "scripts/bench_update_step.py", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    cells = [c.strip() for c in r.stdout.strip().splitlines()[-1].strip("|").split("|")]
    # saved MiB with one decimal
    assert cells[0] == "quick" and float(cells[4]) > 0 and float(cells[5]) >= 0 and float(cells[6]) > 0


# ------------------------------------------------------------------ the pieces, by hand (fast: no model forward)
class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


_LLAMA_LIKE = dict(hidden_size=64, num_attention_heads=4, head_dim=32, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=3)


def test_activation_bytes_per_token_is_the_documented_count():
    cfg = _Cfg(**_LLAMA_LIKE)
    # per layer: 4 x 96 + 5 x 64 + 4 x (4 x 32) + 6 x (2 x 32) = 1600 elements; the head 3 x 64 x 4 bytes
    assert activation_bytes_per_token(cfg, torch.float32, False) == 3 * 1600 * 4 + 768
    # bfloat16: 2 bytes an element, plus the norms' fp32 copies (4 x hidden x 4 bytes)
    assert activation_bytes_per_token(cfg, torch.bfloat16, False) == 3 * (1600 * 2 + 1024) + 768
    assert activation_bytes_per_token(cfg, torch.float64, False) == 3 * 1600 * 8 + 768
    # checkpointing: each layer's input plus one layer being recomputed
    assert activation_bytes_per_token(cfg, torch.float32, True) == 3 * 64 * 4 + 1600 * 4 + 768
    assert activation_bytes_per_token(cfg, torch.int8, False) == 3 * 1600 * 4 + 768  # not floating: 4 bytes
    assert type(activation_bytes_per_token(cfg, torch.bfloat16, False)) is int


def test_the_shape_read_from_configs_of_every_kind():
    assert memory._shape(_Cfg(**_LLAMA_LIKE)) == (64, 128, 64, 96, 3)
    # no head_dim: hidden / heads; no kv heads: as many as heads; no intermediate size: 4 x hidden
    bare = _Cfg(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert memory._shape(bare) == (64, 64, 64, 256, 2)
    nulls = _Cfg(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, head_dim=None, num_key_value_heads=None,
                 intermediate_size=None)
    assert memory._shape(nulls) == (64, 64, 64, 256, 2)
    mamba = _Cfg(hidden_size=64, num_heads=8, num_hidden_layers=2, num_attention_heads=None)  # SSM heads
    assert memory._shape(mamba) == (64, 64, 64, 256, 2)
    assert memory._shape(_Cfg(hidden_size=64, num_heads=8, num_hidden_layers=2)) == (64, 64, 64, 256, 2)
    assert all(type(n) is int for n in memory._shape(bare))
    composite = _Cfg(get_text_config=lambda: _Cfg(**_LLAMA_LIKE))
    assert memory._shape(composite) == (64, 128, 64, 96, 3)


class _Model(torch.nn.Module):
    def __init__(self, dtype=torch.float32, frozen=False, checkpointing=False):
        super().__init__()
        self.config = _Cfg(**_LLAMA_LIKE)
        self.a = torch.nn.Linear(4, 5).to(dtype)  # 25 parameters
        self.b = torch.nn.Linear(2, 1).to(dtype)  # 3
        if frozen:
            self.a.requires_grad_(False)
        self.b.gradient_checkpointing = checkpointing


def test_the_estimate_of_a_model_takes_its_dtype_checkpointing_and_trainable_parameters():
    e = estimate(_Model())
    assert e == Estimate(activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.float32, False), 3 * 28 * 4,
                         memory.TRANSIENT)
    e = estimate(_Model(torch.bfloat16, frozen=True, checkpointing=True))
    assert e == Estimate(activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.bfloat16, True), 3 * 3 * 2,
                         memory.TRANSIENT)
    assert estimate(_Model(), dtype=torch.bfloat16, checkpointing=True).per_token == \
        activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.bfloat16, True)
    assert estimate(_Model(checkpointing=True), checkpointing=False).per_token == e.__class__(
        activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.float32, False), 0, 0).per_token
    only_ints = torch.nn.Module()
    only_ints.config = _Cfg(**_LLAMA_LIKE)
    only_ints.p = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    assert estimate(only_ints).per_token == activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.float32, False)
    assert estimate(only_ints).fixed == 0
    first_float = torch.nn.Module()
    first_float.config = _Cfg(**_LLAMA_LIKE)
    first_float.i = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    first_float.h = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    assert estimate(first_float).per_token == activation_bytes_per_token(_Cfg(**_LLAMA_LIKE), torch.bfloat16, False)


def test_tokens_within_and_bytes_for_round_as_documented():
    est = Estimate(per_token=100, fixed=1000, transient=500)
    # usable = 10000 x 0.75 - 1500 = 6000 bytes; 130 bytes a token with the overhead: 46 tokens
    assert est.tokens_within(10_000) == 46 and est.bytes_for(46) == int(1500 + 46 * 130) == 7480
    assert est.tokens_within(2000) == 0 and est.tokens_within(0) == 0  # never negative
    assert Estimate(per_token=10, fixed=0, transient=0).tokens_within(13 * 4 // 3 + 1) == 1  # 13 x 0.75 / 13


def test_free_memory_on_cpu_is_the_smaller_of_available_and_the_cgroup_shared_by_the_nodes_processes(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 12 * GiB)
    monkeypatch.setattr(memory, "_cgroup_remaining", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert memory.free_bytes(torch.device("cpu")) == 12 * GiB
    monkeypatch.setattr(memory, "_cgroup_remaining", lambda: 8 * GiB)
    assert memory.free_bytes(torch.device("cpu")) == 8 * GiB
    monkeypatch.setattr(memory, "_cgroup_remaining", lambda: 16 * GiB)
    assert memory.free_bytes(torch.device("cpu")) == 12 * GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.free_bytes(torch.device("cpu")) == 3 * GiB and type(memory.free_bytes(torch.device("cpu"))) is int
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    assert memory.free_bytes(torch.device("cpu")) == 12 * GiB


def test_free_memory_on_a_gpu_counts_what_the_cache_holds_unused(monkeypatch):
    gpu = torch.device("cuda", 1)
    of = lambda n: (lambda d: n if d == gpu else None)  # noqa: E731 - answers for the device asked about only
    monkeypatch.setattr(torch.cuda, "mem_get_info", of((5 * GiB, 80 * GiB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", of(3 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", of(1 * GiB))
    assert memory.free_bytes(gpu) == 7 * GiB


def test_meminfo_and_the_cgroup_files(monkeypatch, tmp_path):
    real = memory.Path
    monkeypatch.setattr(memory, "Path", lambda p: real(str(tmp_path) + p))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 5 kB\nMemAvailable:   40 kB\n")
    assert memory._meminfo_available() == 40 * 1024
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 100 kB\n")  # no MemAvailable: the sysconf figure
    sysconf = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    assert abs(memory._meminfo_available() - sysconf) < 2**30
    (tmp_path / "proc" / "meminfo").unlink()
    assert abs(memory._meminfo_available() - sysconf) < 2**30
    cg = tmp_path / "sys" / "fs" / "cgroup"
    assert memory._cgroup_remaining() is None  # no cgroup files
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")
    assert memory._cgroup_remaining() is None
    (cg / "memory.max").write_text("1000\n")
    (cg / "memory.current").write_text("300\n")
    assert memory._cgroup_remaining() == 700
    (cg / "memory.current").write_text("lots\n")
    assert memory._cgroup_remaining() is None


def test_the_notes_read_exactly():
    est = Estimate(per_token=1 << 20, fixed=0, transient=0)
    assert choose_budget(100, est, 64 * GiB, longest=100, on_gpu=False) == (
        100, "engine.max_tokens_per_micro_batch=100: the update needs about 0.1 GiB")
    tokens, note = choose_budget("auto", est, 4 * GiB, longest=100, on_gpu=False)
    assert (tokens, note) == (2363, "engine.max_tokens_per_micro_batch=auto -> 2363 tokens (about 3.0 GiB for the "
                                    "update; 4.0 GiB free, 1.00 MiB of activations per token)")
    assert choose_budget(3000, est, 4 * GiB, longest=100, on_gpu=False)[1] == (
        "engine.max_tokens_per_micro_batch=3000: the update needs about 3.8 GiB, more than 75% of the 4.0 GiB free: "
        "it may run out of memory; auto would pick 2363")
    assert choose_budget(2363, est, 4 * GiB, longest=100, on_gpu=False)[1].endswith("about 3.0 GiB")  # fits exactly
    assert choose_budget("auto", est, 4 * GiB, longest=2363, on_gpu=False)[0] == 2363  # the longest fits exactly
    with pytest.raises(ValueError, match=r"\(2364 tokens\) needs about 3\.0 GiB for the update, more than 75% of "
                                         r"the 4\.0 GiB free; lower"):
        choose_budget("auto", est, 4 * GiB, longest=2364, on_gpu=False)
    assert choose_budget(3000, est, 4 * GiB, longest=2363, on_gpu=False)[1].endswith("auto would pick 2363")
    assert choose_budget(3000, est, 4 * GiB, longest=3000, on_gpu=False)[1].endswith(
        "auto cannot fit the longest prompt + completion (3000 tokens) either")
    assert choose_budget(100, est, 4 * GiB, longest=100, on_gpu=False)[0] == 100  # explicit = longest
    # an explicit budget that needs exactly the planned share of the free memory fits: no warning
    exact = Estimate(per_token=10, fixed=0, transient=0)
    assert exact.bytes_for(30) == 390 == 520 * memory.MARGIN
    assert choose_budget(30, exact, 520, longest=1, on_gpu=False)[1] == ("engine.max_tokens_per_micro_batch=30: "
                                                                          "the update needs about 0.0 GiB")
    assert choose_budget("auto", est, 64 * GiB, longest=100, on_gpu=True)[0] == int(48 * 1024 // 1.3)
    assert memory.parse_budget("auto") is None and memory.parse_budget("12") == 12 and memory.parse_budget(7) == 7


def test_auto_picks_within_the_devices_cap_but_never_below_the_longest():
    assert memory._auto_tokens(10**6, 10, on_gpu=True) == memory.GPU_CAP == 65536
    assert memory._auto_tokens(10**6, 10, on_gpu=False) == memory.CPU_CAP == 4096
    assert memory._auto_tokens(300, 10, on_gpu=True) == 300 and memory._auto_tokens(300, 500, on_gpu=False) == 500


def test_the_grouped_kernels_score_memory():
    cfg = _Cfg(num_attention_heads=4)
    one = 4 * 10 * (20 + 10)  # heads x completion x (prompt + completion)
    assert memory.group_score_bytes(cfg, 3, 20, 10) == 12 * 3 * one  # the whole group within a chunk
    big = _Cfg(num_attention_heads=10**4)
    chunk = memory.completion_attention.CHUNK_SCORES
    assert memory.group_score_bytes(big, 64, 200, 100) == 12 * max(chunk, 10**4 * 100 * 300)
    assert memory.group_score_bytes(_Cfg(), 3, 20, 10) == 0  # no attention heads (Mamba2)
    assert memory.group_score_bytes(_Cfg(get_text_config=lambda: cfg), 3, 20, 10) == 12 * 3 * one
    mid = _Cfg(num_attention_heads=1)
    per = 1000 * 2000
    n = chunk // per + 5  # a group larger than a chunk, each completion smaller: one chunk
    assert memory.group_score_bytes(mid, n, 1000, 1000) == 12 * min(chunk, per * n)


def test_free_for_and_the_cached_auto_budget(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 8 * GiB if device == cpu else None)
    assert memory.free_for(torch.device("cpu"), None) == 8 * GiB
    assert memory.free_for(torch.device("cpu"), _Cfg(memory_limit_gib=2)) == 2 * GiB
    assert memory.free_for(torch.device("cpu"), _Cfg(memory_limit_gib=20)) == 8 * GiB
    assert memory.free_for(torch.device("cpu"), _Cfg(memory_limit_gib=None)) == 8 * GiB
    assert memory.budget_for(None, 64) == 64 and memory.budget_for(None, "128") == 128
    with pytest.raises(ValueError, match="needs the model"):
        memory.budget_for(None, "auto")
    model = _Model()
    est = estimate(model)
    assert est.tokens_within(int(0.8 * GiB)) == 0 < est.tokens_within(int(1.05 * GiB)) < memory.CPU_CAP
    assert memory.budget_for(model, "auto", _Cfg(memory_limit_gib=0.8)) == 1  # nothing fits: still one token
    assert memory.budget_for(model, "auto", _Cfg(memory_limit_gib=1.05)) == est.tokens_within(int(1.05 * GiB))
    assert memory.budget_for(model, "auto") == memory.CPU_CAP
    monkeypatch.setattr(memory, "free_bytes", lambda device: 0)  # cached per model and limit: not sized again
    assert memory.budget_for(model, "auto", _Cfg(memory_limit_gib=1.05)) == est.tokens_within(int(1.05 * GiB))
    assert memory.budget_for(model, "auto", _Cfg(memory_limit_gib=0.8)) == 1


def test_the_auto_budget_of_a_model_on_a_gpu_is_capped_at_the_gpu_cap(monkeypatch):
    class OnGpu:  # a stand-in: its one parameter's device is all budget_for reads of it
        def parameters(self):
            return iter([_Cfg(device=torch.device("cuda", 0))])

    monkeypatch.setattr(memory, "estimate", lambda model: Estimate(per_token=1, fixed=0, transient=0))
    monkeypatch.setattr(memory, "free_for", lambda device, ecfg: 10**9 if device.type == "cuda" else 0)
    assert memory.budget_for(OnGpu(), "auto") == memory.GPU_CAP
