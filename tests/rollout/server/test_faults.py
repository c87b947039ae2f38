"""Faults of the server backend against in-process fake servers (real gloo channels): a server that dies between
steps, mid-request, mid-push, hangs or restarts is dropped with one line and its groups asked again of the others
(the same answers: the same seeds), or, when it was the only one, stops the run in one line naming it; a restarted
server's samples are never used; the API key is sent, and a server or a channel peer without it is refused."""
import copy

import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.base import Sampling
from grpo.rollout.server.backend import ServerBackend
from grpo.rollout.server.client import ServerDown, ServerError, ServerPool
from grpo.rollout.server.facts import model_facts
from grpo.rollout.server.gloo import GlooTransfer

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
CHECK = [1, 40, 41, 42, 43, 44, 45]
PROMPTS = [[1, 3, 4], [1, 5], [1, 6, 7], [1, 8]]


@pytest.fixture
def trainer():
    return tiny_model("llama", len(char_tokenizer()), seed=1, **TINY)


def _backend(model, servers, key=None, said=None):
    pool = ServerPool([s.url for s in servers], retries=0, api_key=key, say=None if said is None else said.append)
    return ServerBackend(model, pool, model_name="tiny:llama", facts=model_facts(model.config), eos_ids=[2],
                         max_model_len=128, check_ids=CHECK, transfer=GlooTransfer("127.0.0.1", 30, api_key=key))


def _two(fakes, trainer, **kw):
    return [fakes(model=copy.deepcopy(trainer), **kw) for _ in range(2)]


def _generate(b):
    return b.generate(PROMPTS, 3, Sampling(8, temperature=0.7), seed=10)


def test_a_server_killed_between_steps_is_dropped_and_the_other_answers_the_same(fakes, trainer):
    said = []
    a, b_ = _two(fakes, trainer)
    b = _backend(trainer, [a, b_], said=said)
    b.sync_weights(trainer, 0)
    both = _generate(b)
    a.kill()
    out = _generate(b)  # every group of the dead one asked again of the other, with its seed
    assert out.ids == both.ids and all(torch.equal(x, y) for g, h in zip(out.logprobs, both.logprobs)
                                       for x, y in zip(g, h))
    assert [s.url for s in b.pool.servers] == [b_.url] and b.stats()["server/servers_up"] == 1
    assert len(said) == 1 and said[0].startswith(f"rollout server {a.url} stopped answering")
    assert said[0].endswith(f"carrying on with 1 of 2 rollout servers ({b_.url})")
    b.sync_weights(trainer, 1)  # the push goes on into the live one
    assert b_.received == 2 and a.received == 1 and b_.version == b.label(1)


def test_the_last_server_lost_stops_the_run_in_one_line_naming_it(fakes, trainer):
    (a,) = [fakes(model=copy.deepcopy(trainer))]
    b = _backend(trainer, [a])
    b.sync_weights(trainer, 0)
    a.kill()
    with pytest.raises(ServerDown) as e:
        _generate(b)
    msg = str(e.value)
    assert msg.startswith(f"rollout server {a.url} stopped answering (/v1/completions: ") and "\n" not in msg
    assert msg.endswith("resume the run with trainer.resume=auto")
    with pytest.raises(ServerDown, match="lost its weight channel|stopped answering"):
        b.sync_weights(trainer, 1)


def test_a_server_dying_mid_run_or_mid_push_is_dropped(fakes, trainer):
    a, b_ = _two(fakes, trainer)
    b = _backend(trainer, [a, b_])
    b.sync_weights(trainer, 0)
    a.kill_after = 1  # answers one group, then dies under the others
    ref = _backend(trainer, [fakes(model=copy.deepcopy(trainer))])
    ref.sync_weights(trainer, 0)
    assert _generate(b).ids == _generate(ref).ids and b.stats()["server/servers_up"] == 1
    c, d = _two(fakes, trainer)
    pushed = _backend(trainer, [c, d])
    pushed.sync_weights(trainer, 0)
    c.die_after = 3  # three tensors into the next push
    with torch.no_grad():
        next(trainer.parameters()).add_(0.1)
    pushed.sync_weights(trainer, 1)
    assert [s.url for s in pushed.pool.servers] == [d.url] and d.received == 2 and c.received == 1
    assert pushed.stats()["server/sync_logprob_gap"] < 1e-5  # the survivor holds the new weights


def test_a_hung_server_is_dropped_after_its_timeout(fakes, trainer):
    a, b_ = _two(fakes, trainer)
    b = _backend(trainer, [a, b_])
    b.sync_weights(trainer, 0)
    a.delay_s = 3.0
    for s in b.pool.servers:
        s.timeout_s = 0.5
    out = _generate(b)
    assert len(out.ids) == 4 and [s.url for s in b.pool.servers] == [b_.url]


def test_a_restarted_server_is_never_trained_against(fakes, trainer):
    """It answers again at its URL, with other weights and no label: the groups it answered are thrown away."""
    said = []
    a, b_ = _two(fakes, trainer, vocab=len(char_tokenizer()))  # log-probs of the weights each holds
    b = _backend(trainer, [a, b_], said=said)
    b.sync_weights(trainer, 0)
    both = _generate(b)
    a.restart(tiny_model("llama", len(char_tokenizer()), seed=9, **TINY))
    before = len([p for p, body in a.requests if p == "/v1/completions"])
    out = _generate(b)
    assert len([p for p, body in a.requests if p == "/v1/completions"]) > before  # it did answer some groups
    assert out.ids == both.ids and [s.url for s in b.pool.servers] == [b_.url]
    assert all(torch.equal(x, y) for g, h in zip(out.logprobs, both.logprobs) for x, y in zip(g, h))
    assert said[0].startswith(f"rollout server {a.url} restarted or was taken over: it holds weights None")
    (alone,) = [fakes(model=copy.deepcopy(trainer))]
    one = _backend(trainer, [alone])
    one.sync_weights(trainer, 0)
    alone.version = "0@another-trainer"  # another trainer took it over
    with pytest.raises(ServerDown, match=f"rollout server {alone.url} restarted or was taken over: it holds "
                                         "weights '0@another-trainer'"):
        _generate(one)


def test_the_api_key_is_sent_and_a_server_or_channel_without_it_is_refused(fakes, trainer):
    keyed = fakes(model=copy.deepcopy(trainer), api_key="k1")
    b = _backend(trainer, [keyed], key="k1")
    b.sync_weights(trainer, 0)  # the HTTP calls and the channel's handshake both pass
    assert keyed.received == 1 and len(_generate(b).ids) == 4
    with pytest.raises(ServerError, match=f"rollout server {keyed.url} refused /v1/models: wrong or missing API "
                                          "key"):
        _backend(trainer, [keyed], key="wrong")
    peer = fakes(model=copy.deepcopy(trainer), channel_key="other")  # its HTTP open, its channel keyed otherwise
    with pytest.raises(ServerError, match=f"rollout server {peer.url} joined the weight channel at .* without the "
                                          "trainer's API key: refused"):
        _backend(trainer, [peer], key=None)
    assert peer.channel is None  # the server side refused the trainer too


def test_every_rank_labels_with_one_run_id_the_largest_draw(fakes, trainer):
    """Each training process has a backend of its own; rank 1 checks the label rank 0 pushed, so their ids agree:
    the largest of every rank's draw (here the collective answers 7 to each)."""
    fake = fakes(model=copy.deepcopy(trainer))
    ranks = [ServerBackend(trainer, ServerPool([fake.url], retries=0), model_name="tiny:llama",
                           facts=model_facts(trainer.config), eos_ids=[2], max_model_len=128, check_ids=CHECK,
                           all_max=lambda d: {k: 7.0 if k == "run_id" else v for k, v in d.items()})
             for _ in range(2)]
    assert ranks[0].label(3) == ranks[1].label(3) == "3@000000000007"
