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
    order = [list(p) for p in prompts[:2]]  # the groups go at once: read in the prompts' order, whatever came first
    sent = sorted(_generated(fake), key=lambda s: order.index(s["token_ids"]) if s["token_ids"] in order else 2)
    assert [s["token_ids"] for s in sent] == order  # the trainer's ids, images expanded
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


# the request's parts function by function, read back with msgpack (no server, no model)
def _raw(text):
    import base64

    return msgpack.unpackb(base64.b64decode(text), ext_hook=msgpack.ExtType, strict_map_key=False)


def test_image_runs_are_one_per_run_of_the_image_token():
    assert image_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], 9) == [{"offset": 1, "length": 2}, {"offset": 4, "length": 1},
                                                          {"offset": 6, "length": 3}]
    assert image_runs([9, 1], 9) == [{"offset": 0, "length": 1}] and image_runs([1, 2], 9) == []


def test_per_image_cuts_the_features_by_each_images_merged_tokens():
    from grpo.rollout.server.images import per_image

    feats = torch.arange(10.0)[:, None]
    parts = per_image(feats, torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4]]), 2)
    assert [p[:, 0].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    with pytest.raises(ServerError, match="the vision tower gave 10 image features for images of 9 tokens"):
        per_image(feats, torch.tensor([[1, 6, 6]]), 2)


def test_a_kwargs_item_is_vllms_flat_embeds_and_batched_grid_with_raw_bytes():
    from grpo.rollout.server.images import kwargs_item

    embeds = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2).t().t()
    item = _raw(kwargs_item(embeds, torch.tensor([1, 2, 6])))
    data = item["image_embeds"]["data"]
    assert data[:2] == ["bfloat16", [3, 2]] and data[2] == msgpack.ExtType(3, embeds.view(torch.uint8).numpy()
                                                                            .tobytes())
    assert item["image_embeds"]["field"] == ["flat", {"keep_on_cpu": False, "slices": [[0, 3, None]], "dim": 0}]
    assert item["image_grid_thw"] == {"data": ["int64", [3], msgpack.ExtType(3, torch.tensor([1, 2, 6]).numpy()
                                                                             .tobytes())],
                                      "field": ["batched", {"keep_on_cpu": True}]}
    strided = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: written in its own order
    assert _raw(kwargs_item(strided, torch.tensor([1, 1, 3])))["image_embeds"]["data"][2].data == \
        strided.contiguous().numpy().tobytes()


def test_features_place_each_image_and_digest_its_features_and_grid():
    import hashlib

    from grpo.rollout.server.images import features, kwargs_item

    embeds = [torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(1, 3, dtype=torch.bfloat16)]
    grids = torch.tensor([[1, 2, 4], [1, 2, 2]], dtype=torch.int32)
    out = features([5, 7, 7, 5, 7], 7, embeds, grids)
    assert out["mm_placeholders"] == {"image": [{"offset": 1, "length": 2}, {"offset": 4, "length": 1}]}
    want = [hashlib.sha256(e.float().numpy().tobytes() + g.to(torch.int64).numpy().tobytes()).hexdigest()
            for e, g in zip(embeds, grids)]
    assert out["mm_hashes"] == {"image": want} and len(set(want)) == 2
    assert out["kwargs_data"] == {"image": [kwargs_item(e, g.to(torch.int64)) for e, g in zip(embeds, grids)]}
    with pytest.raises(ServerError, match=r"image tokens \(\[2\] per image\) do not match its images' features "
                                          r"\(\[2, 1\]\)"):
        features([7, 7], 7, embeds, grids)


def test_an_image_request_is_the_groups_sampling_with_the_prompts_ids_and_features():
    from grpo.rollout.server.images import features, image_request

    class Prompt(list):
        pass

    prompt = Prompt([5, 7, 7, 7, 7, 6])
    prompt.pixel_values, prompt.image_grid_thw = "pixels", torch.tensor([[1, 4, 4]])
    seen = []
    feats = torch.arange(8.0).reshape(4, 2)

    def tower(pixels, grid):
        seen.append((pixels, grid.tolist()))
        return feats

    body = {"model": "m", "prompt": [1], "return_token_ids": False, "n": 3, "temperature": 0.5}
    req = image_request(body, prompt, 7, tower, 2)
    assert seen == [("pixels", [[1, 4, 4]])]
    assert req == {"model": "m", "token_ids": [5, 7, 7, 7, 7, 6], "sampling_params": {"n": 3, "temperature": 0.5},
                   "return_token_ids": True, "features": features(list(prompt), 7, [feats], prompt.image_grid_thw)}
    assert type(req["token_ids"]) is list


def test_parse_generate_orders_the_samples_and_checks_the_prompt_and_the_log_probs():
    from grpo.rollout.server.images import parse_generate

    answer = {"prompt_token_ids": [1, 2], "choices": [
        {"index": 1, "token_ids": [5], "logprobs": {"content": [{"logprob": -1}]}},
        {"index": 0, "token_ids": [3, 4], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -2}]}},
        {"index": 2, "token_ids": None, "logprobs": None}]}
    ids, logps = parse_generate(answer, (1, 2))
    assert ids == [[3, 4], [5], []] and logps == [[-0.5, -2.0], [-1.0], []]
    assert all(type(x) is float for x in logps[1])
    assert parse_generate({"choices": [{"index": 0, "token_ids": [3], "logprobs": {"content": [
        {"logprob": 0}]}}]}, [9]) == ([[3]], [[0.0]])  # an answer without the prompt: not checked
    with pytest.raises(ServerError, match="ran a prompt of 3 tokens for the trainer's 2: it expanded the images"):
        parse_generate({"prompt_token_ids": [1, 2, 2], "choices": []}, [1, 2])
    with pytest.raises(ServerError, match="returned 2 tokens but 1 log-probs"):
        parse_generate({"choices": [{"index": 0, "token_ids": [3, 4], "logprobs": {"content": [{"logprob": 0}]}}]},
                       [1])


def test_vision_inputs_are_the_image_token_the_merge_and_the_tower_of_a_served_family(monkeypatch):
    from types import SimpleNamespace

    from grpo.rollout import vllm_images
    from grpo.rollout.server.images import frozen_tower, vision_inputs

    monkeypatch.setattr(vllm_images, "tower_features", lambda model: ("tower of", model))
    cfg = SimpleNamespace(model_type="qwen2_5_vl", image_token_id=7,
                          vision_config=SimpleNamespace(spatial_merge_size=2))
    model = SimpleNamespace(config=cfg)
    assert vision_inputs(model) == (7, 2, ("tower of", model))
    assert vision_inputs(SimpleNamespace(config=SimpleNamespace(model_type="llama"))) is None
    assert vision_inputs(SimpleNamespace(config=SimpleNamespace())) is None
    visual = torch.nn.Linear(2, 2)
    tower = SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(visual=visual)))
    assert not frozen_tower((7, 2, tower))
    visual.weight.requires_grad_(False)
    assert not frozen_tower((7, 2, tower))
    visual.bias.requires_grad_(False)
    assert frozen_tower((7, 2, tower))


def test_pack_writes_each_size_class_and_refuses_what_it_cannot_write():
    from grpo.rollout.server.images import _Ext

    assert pack(None) == b"\xc0" and pack(True) == b"\xc3" and pack(False) == b"\xc2"
    assert pack(0) == b"\x00" and pack(127) == b"\x7f" and pack(128) == b"\xcf" + (128).to_bytes(8, "big")
    assert pack(2 ** 64 - 1) == b"\xcf" + b"\xff" * 8
    assert pack("a" * 31) == bytes([0xbf]) + b"a" * 31 and pack("a" * 32) == b"\xdb\x00\x00\x00\x20" + b"a" * 32
    assert pack("é") == b"\xa2\xc3\xa9"
    assert pack([0] * 15) == bytes([0x9f]) + b"\x00" * 15 and pack((0,) * 16) == b"\xdd\x00\x00\x00\x10" + b"\x00" * 16
    assert pack({str(i): 0 for i in range(15)})[:1] == bytes([0x8f])
    assert pack({chr(65 + i): 0 for i in range(16)})[:5] == b"\xdf\x00\x00\x00\x10"
    assert pack(_Ext(3, b"xy")) == b"\xc9\x00\x00\x00\x02\x03xy"
    for bad in (-1, 2 ** 64):
        with pytest.raises(ValueError, match=f"not {bad}"):
            pack(bad)
    with pytest.raises(TypeError, match="does not pack float"):
        pack(1.5)
