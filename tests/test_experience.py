"""grpo/experience.py: collect(sampler, ...) with a backend injected in the run's sampler (no module global patched):
the batch's rewards are those of the completions the backend returned, its advantages group-normalised; `finish`'s
statistics (reduced over every rank once), log-prob passes, KL and advantages (the engine's log-probs replaced by fixed
ones); the batch-wide std; the rows shown."""
import pytest
import torch

from grpo import experience
from grpo.rollout.base import Completions
from grpo.trainer.build import build_run


def collect(run):
    return experience.collect(run.sampler, run.runtime, run.settings.collect, run)


class FixedBackend:
    """Every group gets the same completions: the digit strings in ``texts``, tokenized."""

    def __init__(self, tokenizer, texts):
        self.ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.calls = 0

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.calls += 1
        return Completions([[list(c) for c in self.ids[:group_size]] for _ in prompt_ids],
                           [[False] * group_size for _ in prompt_ids])

    def sync_weights(self, model, version):
        pass

    def stats(self):
        return {}

    def sleep(self):
        pass

    def close(self):
        pass


def test_collect_scores_what_the_injected_backend_returned(cfg_factory):
    run = build_run(cfg_factory({"reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0},
                                                          "accuracy": {"fn": "arithmetic", "weight": 0.0}}}}))
    try:
        run.sampler.backend.backend = fake = FixedBackend(run.tokenizer, ["1", "x", "22", "yy"])
        batch = collect(run)
        assert fake.calls == 1 and batch.group_sizes == [4, 4]
        assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] * 2  # number_only: bare numbers score 1
        assert torch.allclose(batch.advantages[:4].sum(), torch.tensor(0.0), atol=1e-5)
        assert batch.advantages[0] > 0 > batch.advantages[1]
    finally:
        run.close()


class _Tok:
    """Decodes ids as their digits; 0 is a special token (left out with skip_special_tokens)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(str(i) for i in ids if not (skip_special_tokens and i == 0))


class _Sampler:
    tokenizer = _Tok()
    rewards = [type("R", (), {"name": n})() for n in ("fmt", "acc")]
    reward_names = ["fmt", "acc"]


def _two_groups(**extra):
    from grpo.batch import Batch

    return Batch([{"prompt": "x" * 250 + "P", "answer": 7}, {"prompt": ["turn"]}], [[9], [8]],
                 [[[1, 0], [2]], [[5], [6, 0]]], [[False] * 2] * 2, torch.tensor([0.25, 0.5, 0.75, 1.5]),
                 torch.tensor([-1.0, 1.0, -2.0, 2.0]), **extra)


def test_sample_rows_take_the_first_of_each_group_then_the_second_and_keep_the_prompts_end():
    from grpo.experience import sample_rows

    eps = [[{"turns": "a0"}, {"turns": "a1"}], [{"turns": "b0"}, {"turns": "b1"}]]
    rows = sample_rows(_Sampler(), _two_groups(episodes=eps), 3)
    assert [r["completion"] for r in rows] == ["1", "5", "2"]  # special tokens skipped
    assert [r["reward"] for r in rows] == [0.25, 0.75, 0.5] and all(type(r["reward"]) is float for r in rows)
    assert rows[0]["prompt"] == ("x" * 250 + "P")[-200:] and rows[0]["answer"] == 7 and rows[1]["answer"] is None
    assert [r["episode"] for r in rows] == [{"turns": "a0"}, {"turns": "b0"}, {"turns": "a1"}]
    assert "episode" not in sample_rows(_Sampler(), _two_groups(), 1)[0]  # single-turn: no episode key
    assert len(sample_rows(_Sampler(), _two_groups(), 9)) == 4
    from grpo.batch import Batch

    one = Batch([{"prompt": "p"}], [[9]], [[[1], [2], [3]]], [[False] * 3], torch.zeros(3), torch.zeros(3))
    assert [r["completion"] for r in sample_rows(_Sampler(), one, 2)] == ["1", "2"]  # a rank holding one group


def test_completion_rows_list_every_completion_with_each_functions_score():
    from grpo.experience import completion_rows

    scores = [[{"fmt": 1.0, "acc": None}, {"fmt": 0.0, "acc": 1.0}], [{"fmt": 0.5}, {"acc": 0.25}]]
    rows = completion_rows(_Sampler(), _two_groups(scores=scores))
    assert [r["completion"] for r in rows] == ["1", "2", "5", "6"]
    assert [r["prompt"] for r in rows] == ["x" * 250 + "P"] * 2 + ["['turn']"] * 2  # whole; a list as text
    assert [(r["reward/fmt"], r["reward/acc"]) for r in rows] == [(1.0, None), (0.0, 1.0), (0.5, None), (None, 0.25)]
    assert [r["reward"] for r in rows] == [0.25, 0.5, 0.75, 1.5] and [r["advantage"] for r in rows] == [-1, 1, -2, 2]
    assert all(type(r["reward"]) is float and type(r["advantage"]) is float for r in rows)
    bare = completion_rows(_Sampler(), _two_groups())  # no per-function scores recorded
    assert [(r["reward/fmt"], r["reward/acc"]) for r in bare] == [(None, None)] * 4
    assert list(bare[0]) == ["prompt", "completion", "reward/fmt", "reward/acc", "reward", "advantage"]


def test_batch_std_is_the_unbiased_std_of_every_reward_and_zero_for_one():
    from grpo.experience import _batch_std, _std
    from grpo.runtime.base import Runtime

    rt = Runtime()
    assert _batch_std(rt, torch.tensor([2.0])) == 0.0  # one reward: no spread
    assert _batch_std(rt, torch.tensor([1.0, 3.0])) == pytest.approx(2 ** 0.5)
    assert _batch_std(rt, torch.tensor([1.0, 2.0, 6.0])) == pytest.approx(float(torch.tensor([1.0, 2.0, 6.0]).std()))
    assert _std(2.5, 3.25, 2) == pytest.approx(0.125 ** 0.5) and _std(1.0, 1.0, 1) == 0.0  # 1 and 1.5


def test_a_refill_takes_only_the_groups_that_fit():
    from grpo.batch import Batch
    from grpo.experience import _concat

    one = Batch([{"prompt": "a"}], [[1]], [[[1]]], [[False]], torch.ones(1), torch.zeros(1))
    assert _concat(one, _two_groups(), 2).completion_ids == [[[1]], [[1, 0], [2]]]  # room for one more
    assert _concat(one, _two_groups(), 1).completion_ids == [[[1]]]  # full: none taken
    assert len(_concat(one, _two_groups(), 5).completion_ids) == 3  # room for more than there is


class _FinishRun:
    """What `finish` reads of a run, with `nested_logprobs` answering -1 per token for the reference and -2 for the
    policy (monkeypatched by the tests below)."""

    def __init__(self, **algorithm):
        from types import SimpleNamespace

        from grpo.config.schema import AlgorithmConfig, EngineConfig
        from grpo.runtime.base import Runtime

        self.runtime, self.runtime.model = Runtime(), "policy"
        self.settings = SimpleNamespace(collect=SimpleNamespace(
            algorithm=AlgorithmConfig(**algorithm), engine=EngineConfig(), sampling=SimpleNamespace(temperature=1.0)))
        self.passes = []

    def reference_context(self):
        import contextlib

        return contextlib.nullcontext()

    def reference_model(self):
        return "reference"

    def logprobs(self, rt, model, batch, ecfg, temperature):
        self.passes.append(model)
        lp = -1.0 if model == "reference" else -2.0
        return [[torch.full((len(c),), lp) for c in g] for g in batch.completion_ids]


def _finish(monkeypatch, batch, **algorithm):
    import grpo.experience as experience

    run = _FinishRun(**algorithm)
    monkeypatch.setattr(experience, "nested_logprobs", run.logprobs)
    return experience.finish(batch, run.runtime, run.settings.collect, run), run.passes


def _one_token():
    from grpo.batch import Batch

    return Batch([{"prompt": "p"}], [[9]], [[[4]]], [[False]], torch.tensor([1.0]), torch.zeros(1))


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_finish_runs_only_the_log_prob_passes_its_settings_need(monkeypatch, kl_in_reward):
    batch, passes = _finish(monkeypatch, _one_token(), beta=0.0, kl_in_reward=kl_in_reward)
    assert passes == [] and batch.ref_logps is None and batch.old_logps is None and "kl" not in batch.stats
    batch, passes = _finish(monkeypatch, _one_token(), beta=0.04, kl_in_reward=False)
    assert passes == ["reference"] and batch.old_logps is None  # the update measures the KL itself
    assert "kl" not in batch.stats and batch.rewards.tolist() == [1.0]
    batch, passes = _finish(monkeypatch, _one_token(), beta=0.04, num_iterations=2)
    assert passes == ["reference", "policy"] and batch.old_logps[0][0].tolist() == [-2.0]


def test_the_kl_in_the_reward_lowers_each_reward_by_beta_times_its_sequence_kl(monkeypatch):
    """One token, log pi = -2, log pi_ref = -1: k2 = (log pi_ref - log pi)^2 / 2 = 0.5 (k3 would be e - 2)."""
    batch, passes = _finish(monkeypatch, _one_token(), beta=0.5, kl_in_reward=True, kl_estimator="k2")
    assert passes == ["reference", "policy"] and batch.old_logps is None  # one pass over the batch: ratio 1
    assert batch.stats["kl"] == pytest.approx(0.5) and batch.rewards.tolist() == [pytest.approx(1.0 - 0.5 * 0.5)]


def test_finish_scales_the_advantages_with_the_configured_eps(monkeypatch):
    from grpo.batch import Batch

    two = Batch([{"prompt": "p"}], [[9]], [[[4], [5]]], [[False] * 2], torch.tensor([0.0, 1.0]), torch.zeros(2))
    batch, _ = _finish(monkeypatch, two, adv_eps=1.0)
    std = 0.5 ** 0.5
    assert batch.advantages.tolist() == pytest.approx([-0.5 / (std + 1.0), 0.5 / (std + 1.0)])


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_finish_asks_the_ranks_for_the_batch_std_only_when_the_batch_scales_the_advantages(monkeypatch, scale):
    """With beta = 0 the only collectives of `finish` are the batch std's two (the sum and count, then the squared
    deviations): ranks not scaling by the batch send none."""
    import grpo.experience as experience
    from grpo.batch import Batch

    run = _FinishRun(beta=0.0, scale_rewards=scale)
    sent = []
    run.runtime.all_reduce = lambda values: sent.append(sorted(values)) or dict(values)
    monkeypatch.setattr(experience, "nested_logprobs", run.logprobs)
    two = Batch([{"prompt": "p"}], [[9]], [[[4], [5]]], [[False] * 2], torch.tensor([0.0, 1.0]), torch.zeros(2))
    experience.finish(two, run.runtime, run.settings.collect, run)
    assert sent == ([["n", "sum"], ["dev2"]] if scale == "batch" else [])


class RecordingBackend(FixedBackend):
    """FixedBackend with the sampler's own log-probs and truncation flags, recording the seed of every call."""

    def __init__(self, tokenizer, texts):
        super().__init__(tokenizer, texts)
        self.seeds = []

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.seeds.append(seed)
        out = super().generate(prompt_ids, group_size, sampling)
        self.logprobs = [[torch.full((len(c),), -0.5 - i) for i, c in enumerate(g)] for g in out.ids]
        return Completions(out.ids, [[False, True] * (group_size // 2) for _ in prompt_ids], self.logprobs)


@pytest.mark.parametrize("seeded", [True, False])
def test_collect_seeds_a_seeded_sampler_per_step_and_keeps_what_it_returned(cfg_factory, seeded):
    from grpo.rollout.backends import step_seed

    run = build_run(cfg_factory({"reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0}}}}))
    try:
        assert run.sampler.seeded is False  # hf in the trainer: torch's own RNG, which the checkpoint holds
        run.sampler.seeded = seeded  # a backend with a generator of its own (vLLM), or a sampler ahead of the trainer
        run.sampler.backend.backend = fake = RecordingBackend(run.tokenizer, ["1", "x", "22", "yy"])
        batch = collect(run)
        p = run.sampler.prompts
        want = step_seed(run.settings.collect.seed, 0, p.epoch, p.position)
        assert fake.seeds == [want if seeded else None]
        assert batch.truncated == [[False, True, False, True]] * 2 and batch.sampling_logps is fake.logprobs
        assert batch.episodes is None and batch.completion_masks is None
        assert batch.scores == [[{"accuracy": 0.0, "format": v} for v in (1.0, 0.0, 1.0, 0.0)]] * 2
        lens = [len(c) for c in fake.ids]
        assert batch.stats["completion_len_mean"] == pytest.approx(sum(lens) / 4)
        assert batch.stats["truncated_frac"] == 0.5
        assert 0 <= batch.stats["time/rollout_s"] < 60 and 0 <= batch.stats["time/reward_s"] < 60
    finally:
        run.close()


def test_the_reward_functions_get_the_rows_columns_but_the_prompts_own(monkeypatch):
    """The prompt in its forms (text, ids, messages, turns) reaches a reward function as its prompt argument, not
    again as a column; every other column of the row, the completion ids, the truncation flags and the extra ones
    do, and the run's completion_format picks the completions' form."""
    import grpo.experience as experience
    from grpo.rewards.score import Scores
    from grpo.runtime.base import Runtime

    seen = {}
    monkeypatch.setattr(experience, "reward_inputs", lambda rows, texts, g, fmt: seen.update(fmt=fmt) or (["p"] * 2,
                                                                                                        texts))

    def score(functions, prompts, completions, columns):
        seen["columns"] = columns
        return Scores([1.0, 0.0], {"fmt": [1.0, 0.0], "acc": [None, None]}, {"fmt": 0, "acc": 0})

    monkeypatch.setattr(experience, "score", score)
    sampler = _Sampler()
    sampler.runtime, sampler.completion_format = Runtime(), "messages"
    row = {"prompt": "p", "prompt_ids": [9], "prompt_messages": [], "prompt_turns": [], "answer": 7, "level": 2}
    experience.score_groups(sampler, [row], [[[1], [2]]], [[False, True]], {"turns": [1, 2]})
    assert seen["fmt"] == "messages"
    assert seen["columns"] == {"answer": [7, 7], "level": [2, 2], "completion_ids": [[1], [2]],
                               "truncated": [False, True], "turns": [1, 2]}


class _RefillRun(_FinishRun):
    """A run whose rollouts come from ``rounds`` (each a Batch), for sample's filtering and refill."""

    def __init__(self, rounds, **algorithm):
        super().__init__(**algorithm)
        self.rounds = list(rounds)


def test_sample_reports_the_zero_std_share_and_sums_the_refill_rounds_times(monkeypatch):
    import grpo.experience as experience
    from grpo.batch import Batch

    def group(rewards):
        return Batch([{"prompt": "p"}], [[9]], [[[1]] * len(rewards)], [[False] * len(rewards)],
                     torch.tensor(rewards), torch.zeros(len(rewards)), stats={"time/rollout_s": 2.0,
                                                                               "time/reward_s": 0.5}, sums={})

    run = _RefillRun([group([1.0, 1.0]), group([0.0, 0.0]), group([0.0, 1.0])], filter_zero_std_groups=True,
                     resample_zero_std=3)
    monkeypatch.setattr(experience, "_rollout", lambda sampler, s: sampler.rounds.pop(0))
    batch = experience.sample(run, run.settings.collect)  # one group of no signal, refilled in two more rounds
    assert batch.sums["zero_std"] == {"zero_std": 1.0, "groups": 1.0} and batch.stats["resample_rounds"] == 2
    assert batch.sums["refill"] == {"dropped": 2.0, "groups": 1.0}
    assert batch.stats["time/rollout_s"] == 6.0 and batch.stats["time/reward_s"] == 1.5
    assert batch.rewards.tolist() == [0.0, 1.0]


def test_sampling_leaves_the_statistics_to_finish_which_reduces_them_over_every_rank_once(cfg_factory):
    """`sample` keeps this rank's sums of its statistics (a generator apart from the trainer's collectives samples
    the same way); `finish` makes them over every rank in one collective: with one process the numbers of the
    batch, with two ranks that sampled alike the counts double and the means stay."""
    from grpo.experience import sample, sampling_stats
    from grpo.runtime.local import LocalRuntime

    class TwoAlike(LocalRuntime):
        seen: list = []

        def all_reduce(self, values):
            self.seen.append(sorted(values))
            return {k: 2 * v for k, v in values.items()}

    run = build_run(cfg_factory({"algorithm": {"filter_zero_std_groups": True},
                                 "reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0},
                                                          "accuracy": {"fn": "arithmetic", "weight": 0.0}}}}))
    try:
        run.sampler.backend.backend = FixedBackend(run.tokenizer, ["1", "1", "22", "22"])  # every group: zero std
        batch = sample(run.sampler, run.settings.collect)
        assert "reward_mean" not in batch.stats and set(batch.sums) == {"score", "zero_std", "refill"}
        local = sampling_stats(run.runtime, batch.sums)
        assert local["dropped_groups"] == 2 and local["num_groups"] == 0 and local["zero_std_frac"] == 1.0
        assert local["reward_mean"] == 1.0 and local["reward/format"] == 1.0 and local["reward_std"] == 0.0
        twice = TwoAlike("cpu")
        both = sampling_stats(twice, batch.sums)
        assert len(twice.seen) == 1 and "score:fn/format/sum" in twice.seen[0]  # every kind in one collective
        doubled = {"dropped_groups", "num_groups", "reward/format_errors", "reward/accuracy_errors"}
        assert {k: both[k] for k in doubled} == {k: 2 * local[k] for k in doubled}
        for k in ("reward_mean", "zero_std_frac", "completion_len_mean", "truncated_frac", "reward/format"):
            assert both[k] == local[k], k
        assert both["reward_std"] == 0.0
        finished = experience.finish(batch, run.runtime, run.settings.collect, run)
        assert {k: finished.stats[k] for k in local} == local and "time/rollout_s" in finished.stats
    finally:
        run.close()


def test_sampling_stats_makes_each_kind_of_sums_into_its_metrics():
    """Each kind of kept sums (the rewards, a multi-turn batch's episodes, the zero-std share, the refill) is summed
    over the ranks in one collective and made into its metrics: counts double over two ranks that sampled alike,
    means stay; kinds the batch did not keep add no metric; no sums call no collective."""
    from grpo.experience import sampling_stats

    class Twice:
        def __init__(self):
            self.seen = []

        def all_reduce(self, values):
            self.seen.append(dict(values))
            return {k: 2 * v for k, v in values.items()}

    score = {"reward": 3.0, "reward2": 5.0, "n": 4.0, "len": 10.0, "truncated": 1.0, "fn/acc/sum": 2.0,
             "fn/acc/sum2": 2.0, "fn/acc/count": 3.0, "fn/acc/errors": 1.0}
    episode = {"episodes": 4.0, "turns": 6.0, "tool_calls": 3.0, "tool_failures": 1.0, "tool_timeouts": 1.0,
               "tool_time": 0.5, "used_tool": 2.0, "hit_max_turns": 1.0, "over_length": 0.0, "tool_tokens": 8.0}
    sums = {"score": score, "episode": episode, "zero_std": {"zero_std": 1.0, "groups": 1.0},
            "refill": {"dropped": 1.0, "groups": 2.0}}
    rt = Twice()
    s = sampling_stats(rt, sums)
    assert rt.seen == [{f"{kind}:{k}": v for kind, part in sums.items() for k, v in part.items()}]
    assert (s["reward_mean"], s["completion_len_mean"], s["truncated_frac"]) == (0.75, 2.5, 0.25)
    assert s["reward_std"] == pytest.approx(((10 - 36 / 8) / 7) ** 0.5)  # over the 8 rewards of both ranks
    assert (s["reward/acc"], s["reward/acc_errors"]) == (pytest.approx(2 / 3), 2)
    assert (s["episode/turns_mean"], s["episode/tool_use_rate"], s["episode/tool_failures"]) == (1.5, 0.5, 2)
    assert (s["episode/tool_tokens_mean"], s["episode/tool_time_s"]) == (2.0, 1.0)
    assert (s["zero_std_frac"], s["dropped_groups"], s["num_groups"]) == (1.0, 2, 4)

    one = sampling_stats(type("One", (), {"all_reduce": staticmethod(dict)})(),
                         {"score": score, "zero_std": {"zero_std": 1.0, "groups": 1.0}})
    assert not [k for k in one if k.startswith("episode/") or "groups" in k]
    assert one["zero_std_frac"] == 1.0 and one["reward_mean"] == 0.75
    rt.seen.clear()
    assert sampling_stats(rt, {}) == {} and rt.seen == []
