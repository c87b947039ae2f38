"""Prompts with images through the server backend, against the in-process fake server (no vLLM): each group with
images is one request to vLLM's tokens-in route carrying the trainer's exact prompt ids, one placeholder per image
and each image's tower features in vLLM's wire form, read back here with the `msgpack` package (an independent
decoder of what `grpo.rollout.server.images.pack` writes); text prompts still go to ``/v1/completions``."""
import msgpack
import pytest
import torch

from grpo.errors import SetupError
from grpo.models import load_image_processor, load_tokenizer, tiny_model
from grpo.rollout.base import Sampling
from grpo.rollout.server.backend import ServerBackend
from grpo.rollout.server.client import ServerError, ServerPool, group_request
from grpo.rollout.server.facts import model_facts
from grpo.rollout.server.gloo import GlooTransfer
from grpo.rollout.server.images import GENERATE, image_runs, pack

CHECK = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def vlm():
    from grpo.tasks import get_task
    from grpo.vision.images import encode

    tok, proc = load_tokenizer("tiny:qwen2_5_vl"), load_image_processor("tiny:qwen2_5_vl")
    model = tiny_model("qwen2_5_vl", len(tok), seed=0)
    rows = get_task("shapes")(2, seed=0)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    prompts = [encode(rows[0]["prompt"], rows[0]["images"], tok, proc),
               encode(two, rows[0]["images"] + rows[1]["images"], tok, proc),
               encode([{"role": "user", "content": "text only"}], [], tok, proc)]
    return model, prompts, model.config.image_token_id


def _backend(model, fake):
    return ServerBackend(model, ServerPool([fake.url], retries=0), model_name="tiny:qwen2_5_vl",
                         facts=model_facts(model.config), eos_ids=[2], max_model_len=256,
                         check_ids=CHECK + [model.config.image_token_id] * 4,
                         transfer=GlooTransfer("127.0.0.1", timeout_s=30))


def _unpack(b64: str) -> dict:
    """A kwargs item, its tensors as torch tensors (vLLM's layout: [dtype, shape, Ext(3, raw bytes)])."""
    import base64

    def tensor(x):
        dtype, shape, ext = x
        return torch.frombuffer(bytearray(ext.data), dtype=getattr(torch, dtype)).view(shape)

    item = msgpack.unpackb(base64.b64decode(b64), ext_hook=msgpack.ExtType, strict_map_key=False)
    assert all(v["data"][2].code == 3 for v in item.values())  # vLLM's CUSTOM_TYPE_RAW_VIEW
    return {k: (tensor(v["data"]), v["field"]) for k, v in item.items()}


def _features(model, prompt):
    """The trainer's tower features of each image of ``prompt`` (the reference: the model's own call)."""
    with torch.no_grad():
        out = model.model.get_image_features(prompt.pixel_values, prompt.image_grid_thw, return_dict=True)
    return [f.float() for f in out.pooler_output]


def _generated(fake):
    return [b for p, b in fake.requests if p == GENERATE]


def test_each_image_group_goes_with_its_exact_ids_placeholders_and_tower_features(vlm, fakes):
    model, prompts, image_id = vlm
    fake = fakes(model=tiny_model("qwen2_5_vl", len(load_tokenizer("tiny:qwen2_5_vl")), seed=1), tokens=(5, 6),
                 name="tiny:qwen2_5_vl")
    b = _backend(model, fake)
    b.sync_weights(model, 0)
    assert b.stats()["server/sync_logprob_gap"] < 1e-5  # the pushed weights score the check sequence as ours
    sampling = Sampling(8, temperature=0.7)
    out = b.generate(prompts, 3, sampling, seed=10)
    sent = _generated(fake)
    assert [s["token_ids"] for s in sent] == [list(p) for p in prompts[:2]]  # the trainer's ids, images expanded
    text = [body for p, body in fake.requests if p == "/v1/completions" and "n" in body]
    assert [t["prompt"] for t in text] == [list(prompts[2])]  # the text prompt: the completions route, as before
    for i, (body, prompt) in enumerate(zip(sent, prompts)):
        ref = group_request("tiny:qwen2_5_vl", prompt, 3, sampling, [2], 10 + 3 * i)
        assert body["sampling_params"] == {k: v for k, v in ref.items() if k not in ("model", "prompt",
                                                                                       "return_token_ids")}
        f = body["features"]
        runs = f["mm_placeholders"]["image"]
        assert len(runs) == prompt.n_images and runs == image_runs(list(prompt), image_id)
        assert all(set(prompt[r["offset"]:r["offset"] + r["length"]]) == {image_id} for r in runs)
        assert sum(r["length"] for r in runs) == list(prompt).count(image_id)
        for run, item, want, grid in zip(runs, f["kwargs_data"]["image"], _features(model, prompt),
                                         prompt.image_grid_thw):
            got = _unpack(item)
            assert torch.equal(got["image_embeds"][0], want) and got["image_embeds"][0].shape[0] == run["length"]
            assert got["image_embeds"][1] == ["flat", {"keep_on_cpu": False, "slices": [[0, run["length"], None]],
                                                       "dim": 0}]
            assert torch.equal(got["image_grid_thw"][0], grid.to(torch.int64))
            assert got["image_grid_thw"][1] == ["batched", {"keep_on_cpu": True}]
    hashes = [h for s in sent for h in s["features"]["mm_hashes"]["image"]]
    assert hashes[0] == hashes[1] != hashes[2]  # a digest per picture: the first is in both prompts
    assert out.ids[0] == [[15, 6], [16, 6], [17, 6]] and out.versions == [0, 0, 0]
    assert all(torch.equal(lp, torch.full((2,), -0.25)) for g in out.logprobs[:2] for lp in g)


def test_a_trained_tower_sends_new_features_under_new_digests(vlm, fakes):
    model, prompts, _ = vlm
    fake = fakes(model=model, name="tiny:qwen2_5_vl")
    b = _backend(model, fake)
    b.sync_weights(model, 0)
    b.generate(prompts[:1], 2, Sampling(4), seed=0)
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    b.sync_weights(model, 1)
    assert [p for p, _ in fake.requests].count("/reset_encoder_cache") == 2  # after each push, with the prefix cache
    b.generate(prompts[:1], 2, Sampling(4), seed=0)
    first, second = _generated(fake)
    assert first["token_ids"] == second["token_ids"]
    assert first["features"]["mm_hashes"] != second["features"]["mm_hashes"]  # never the old features' cache
    new = _unpack(second["features"]["kwargs_data"]["image"][0])["image_embeds"][0]
    assert torch.equal(new, _features(model, prompts[0])[0])


def test_the_sync_check_scores_text_only(vlm, fakes):
    model, _, image_id = vlm
    fake = fakes(model=model, name="tiny:qwen2_5_vl")
    b = _backend(model, fake)
    assert b.check_ids == CHECK
    b.sync_weights(model, 0)
    checked = [body["prompt"] for p, body in fake.requests if p == "/v1/completions" and "prompt_logprobs" in body]
    assert checked == [CHECK]


def test_a_server_that_ran_other_ids_is_refused_in_one_line(vlm, fakes, monkeypatch):
    model, prompts, _ = vlm
    fake = fakes(model=model, name="tiny:qwen2_5_vl")
    b = _backend(model, fake)
    b.sync_weights(model, 0)
    answer = fake._generate
    monkeypatch.setattr(fake, "_generate", lambda body: {**answer(body), "prompt_token_ids": body["token_ids"][:-1]})
    with pytest.raises(ServerError, match="ran a prompt of .* tokens for the trainer's"):
        b.generate(prompts[:1], 2, Sampling(4), seed=0)


def test_multi_turn_episodes_with_images_are_refused(vlm, fakes):
    model, prompts, _ = vlm
    b = _backend(model, fakes(model=model, name="tiny:qwen2_5_vl"))
    with pytest.raises(SetupError, match="multi-turn episodes"):
        b.generate(prompts[:1], 1, Sampling(4), suffixes=[[[1, 2]]])


@pytest.mark.parametrize("staleness,every,frozen,refused", [(1, 1, False, True), (0, 2, False, True),
                                                            (1, 1, True, False), (0, 1, False, False)])
def test_servers_sampling_another_version_than_the_tower_are_refused(vlm, staleness, every, frozen, refused):
    from types import SimpleNamespace

    from grpo.rollout.registry import check_images

    rollout = SimpleNamespace(max_staleness=staleness, server=SimpleNamespace(sync_every=every))
    rows = [{"prompt_ids": vlm[1][0]}]
    if refused:
        with pytest.raises(SetupError, match="model.freeze_vision_tower=true"):
            check_images("server", "server", rows, rollout=rollout, frozen_tower=frozen)
    else:
        check_images("server", "server", rows, rollout=rollout, frozen_tower=frozen)


def test_pack_writes_what_msgpack_reads():
    obj = {"s" * 40: [None, True, False, 0, 127, 128, 2 ** 40], "d": {str(i): list(range(20)) for i in range(17)},
           "e": msgpack.ExtType(3, b"\x00\x01" * 100)}
    from grpo.rollout.server.images import _Ext

    ours = pack({**obj, "e": _Ext(3, obj["e"].data)})
    assert msgpack.unpackb(ours, ext_hook=msgpack.ExtType, strict_map_key=False) == obj


def test_a_frozen_tower_goes_in_the_first_push_only(fakes):
    tok = load_tokenizer("tiny:qwen2_5_vl")
    model = tiny_model("qwen2_5_vl", len(tok), seed=0)
    model.model.visual.requires_grad_(False)  # model.freeze_vision_tower=true
    fake = fakes(model=tiny_model("qwen2_5_vl", len(tok), seed=1), name="tiny:qwen2_5_vl")
    b = _backend(model, fake)
    b.sync_weights(model, 0)
    full = b.stats()["sync/bytes"]
    assert fake.left_out == () and torch.equal(fake.model.model.visual.patch_embed.proj.weight,
                                               model.model.visual.patch_embed.proj.weight)
    tower = sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.add_(0.01)
    b.sync_weights(model, 1)
    assert fake.left_out == ("visual.",) and b.stats()["sync/bytes"] == full - tower
    assert b.stats()["server/sync_logprob_gap"] < 1e-5  # the language model arrived
    model.model.visual.requires_grad_(True)  # a trained tower: every push carries it
    b.sync_weights(model, 2)
    assert fake.left_out == () and b.stats()["sync/bytes"] == full
