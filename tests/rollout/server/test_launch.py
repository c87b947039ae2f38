"""grpo-serve: the vLLM command line a recipe gives (printed with --print; no vLLM needed)."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.rollout.server.launch import ServeSettings, serve_command
from tests.helpers import ROOT, VLLM_TINY

TINY = [f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()]


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _settings(**kw):
    base = dict(model="tiny:llama", tiny=dict(VLLM_TINY), dtype="float32", max_model_len=300, host="127.0.0.1",
                port=8100, seed=3, device="cpu", kv_cache_gib=0.5, enforce_eager=True)
    return ServeSettings(**{**base, **kw})


def test_a_tiny_model_is_served_from_its_config_and_tokenizer_with_dummy_weights(tmp_path):
    argv, env = serve_command(_settings(), tmp_path)
    folder = _flag(argv, "--model")
    config = json.loads((tmp_path / "serve" / folder.rsplit("/", 1)[1] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == VLLM_TINY["hidden_size"]
    from transformers import AutoTokenizer

    from grpo.models import char_tokenizer
    assert AutoTokenizer.from_pretrained(folder)("3+4=")["input_ids"] == char_tokenizer()("3+4=")["input_ids"]
    assert _flag(argv, "--load-format") == "dummy" and _flag(argv, "--served-model-name") == "tiny:llama"
    assert (_flag(argv, "--port"), _flag(argv, "--max-model-len"), _flag(argv, "--seed")) == ("8100", "300", "3")
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs" and "--enable-prefix-caching" in argv
    assert _flag(argv, "--worker-extension-cls") == "grpo.rollout.server.worker.GRPOWorkerExtension"
    assert "--no-enable-chunked-prefill" in argv and int(_flag(argv, "--max-num-batched-tokens")) >= 8192
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "0.5"}
    again, _ = serve_command(_settings(), tmp_path)
    assert _flag(again, "--model") == folder  # written once, found again
    other, _ = serve_command(_settings(tiny={**VLLM_TINY, "intermediate_size": 512}), tmp_path)
    assert _flag(other, "--model") != folder


def test_servers_started_at_once_share_the_tiny_models_folder(tmp_path, monkeypatch):
    """Two grpo-serve processes for one tiny model (several servers, or test workers) both find no folder and write
    one: the second keeps the first's, and leaves no temporary folder behind."""
    import tempfile

    from grpo import models
    from grpo.rollout.server import launch

    real, calls = tempfile.mkdtemp, []

    def another_server_first(**kw):  # the other server writes the whole folder while this one is writing its own
        calls.append(1)
        if len(calls) == 1:
            launch.model_dir(_settings(), tmp_path)
        return real(**kw)

    monkeypatch.setattr(models.tempfile, "mkdtemp", another_server_first)
    path, dummy = launch.model_dir(_settings(), tmp_path)
    assert len(calls) == 2 and dummy and (Path(path) / "config.json").exists()
    assert [p.name for p in (tmp_path / "serve").iterdir()] == [Path(path).name]


def test_on_cuda_the_server_gets_its_devices_and_vllms_nccl_transfer(tmp_path):
    argv, env = serve_command(_settings(device="cuda", tensor_parallel_size=2,
                                        weight_transfer="nccl"), tmp_path, ["--max-num-seqs", "64"])
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert _flag(argv, "--tensor-parallel-size") == "2" and "--no-enable-chunked-prefill" not in argv
    assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert argv[-2:] == ["--max-num-seqs", "64"]


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "grpo.serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("recipe,served,length", [("quickstart", "embedded:smollm2-135m-instruct", 512 + 16)])
def test_grpo_serve_derives_the_command_from_the_recipe(recipe, served, length):
    p = _serve(f"recipe={recipe}", "rollout.server.port=8123", "rollout.max_new_tokens=16", "--print", "--",
               "--max-num-seqs", "8")
    assert p.returncode == 0, p.stderr
    words = shlex.split(p.stdout)
    argv = words[words.index(sys.executable):]
    assert words[0] == "VLLM_SERVER_DEV_MODE=1"
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (_flag(argv, "--served-model-name"), _flag(argv, "--port")) == (served, "8123")
    assert _flag(argv, "--max-model-len") == str(length) and _flag(argv, "--dtype") == "float32"
    assert argv[-2:] == ["--max-num-seqs", "8"]


def test_grpo_serve_mistakes_are_one_line():
    p = _serve("recipe=smoke", "rollout.server.port=0", "--print")
    assert p.returncode == 2 and p.stderr.strip() == \
        "error: rollout.server.port=0 is out of range; allowed: a TCP port in 1..65535"
    p = _serve("recipe=smoke", "rollout.server.prot=1", "--print")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "rollout.server.port" in p.stderr


def test_grpo_serve_refuses_what_its_vllm_cannot_serve_before_starting_it(monkeypatch, capsys):
    """The in-process backend's check (vLLM on CPU has no attention kernel for head_dim 16, recipe=smoke's tiny model)
    made before vLLM starts, not as an HTTP 500 from a dead server; the fix it names is served."""
    import importlib.util

    from grpo import serve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(serve.os, "execve", lambda *a: pytest.fail("vLLM started"))
    with pytest.raises(SystemExit) as e:
        serve.main(["recipe=smoke", "trainer.device=cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: grpo-serve on CPU: vLLM has no CPU attention kernel for "
                                                "head_dim=16 (tiny:llama;") and err.count("\n") == 1
    fix = err.split("or '")[1].split("'")[0]
    serve.main(["recipe=smoke", "trainer.device=cpu", fix, "--print"])
    assert "--served-model-name tiny:llama" in capsys.readouterr().out


def test_grpo_serve_says_once_what_vllms_log_shows_on_a_healthy_server(monkeypatch, capsys):
    import importlib.util

    from grpo import serve

    real, started = importlib.util.find_spec, []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(serve.os, "execve", lambda *a: started.append(a[1]))
    serve.main(["recipe=smoke", "trainer.device=cpu", *TINY])
    err = capsys.readouterr().err
    assert started and started[0][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert err.count(serve.EXPECTED_IN_VLLM_LOG) == 1 and "Chat template warmup failed" in serve.EXPECTED_IN_VLLM_LOG


def test_the_api_key_reaches_vllm_in_its_environment_and_the_guard_on_every_route(tmp_path):
    argv, env = serve_command(_settings(api_key="s3cret"), tmp_path)
    assert env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(argv)  # no process listing shows it
    assert _flag(argv, "--middleware") == "grpo.rollout.server.guard.RequireKey"
    assert "VLLM_API_KEY" not in serve_command(_settings(), tmp_path)[1]


def _ask(key, path, auth=None):
    """What `RequireKey(key)` does with one request: "passed" to vLLM's app, or the status it answered."""
    import asyncio

    from grpo.rollout.server.guard import RequireKey

    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", auth.encode())] if auth else []
    asyncio.run(RequireKey(app, key=key)({"type": "http", "method": "POST", "path": path, "headers": headers},
                                         None, send))
    return "passed" if reached else sent[0]["status"]


def test_the_guard_wants_the_key_on_every_route_but_health():
    for path in ("/collective_rpc", "/init_weight_transfer_engine", "/update_weight_version", "/v1/completions"):
        assert _ask("k", path) == _ask("k", path, "Bearer wrong") == _ask("k", path, "Basic k") == 401, path
        assert _ask("k", path, "Bearer k") == _ask("", path) == "passed"  # no key: vLLM's own behaviour
    assert _ask("k", "/health") == "passed"


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("0.0.0.0", "s3cr3t-key", False),
                                             ("127.0.0.1", None, False)])
def test_grpo_serve_warns_when_it_listens_beyond_loopback_without_a_key(monkeypatch, capsys, host, key, warned):
    from grpo import serve

    monkeypatch.delenv("GRPO_SERVER_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("GRPO_SERVER_API_KEY", key)
    serve.main(["recipe=smoke", "trainer.device=cpu", *TINY, f"rollout.server.host={host}", "--print"])
    out, err = capsys.readouterr()
    assert ("without an API key" in err) == warned and (not warned or "$GRPO_SERVER_API_KEY" in err)
    assert "VLLM_API_KEY='***'" in out if key else "VLLM_API_KEY" not in out  # --print never shows the key
    assert (key or "never-shown") not in out


def test_grpo_serve_refuses_the_key_on_its_command_line(capsys):
    from grpo import serve

    with pytest.raises(SystemExit):
        serve.main(["recipe=smoke", "trainer.device=cpu", *TINY, "--print", "--", "--api-key", "k"])
    assert "not as vLLM's --api-key" in capsys.readouterr().err


# ------------------------------------------------------------------ over stand-ins (no tiny model built, no files but
# the stand-ins' own): the mutation tests' selection (`make mutate`)
class _Config(dict):
    def save_pretrained(self, folder):
        (Path(folder) / "config.json").write_text(json.dumps({**self, "architectures": self.architectures}))


class StandInForCausalLM:
    def __init__(self, family, vocab, **kw):
        self.config, self.made = _Config(family=family, vocab=vocab, **kw), (family, vocab, kw)
        self.config.architectures = None


class _Tok:
    def __len__(self):
        return 77

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{}")


def _stand_ins(monkeypatch, images=None):
    """grpo.models' loaders and folder publisher replaced: what `model_dir` asked of each is recorded."""
    from grpo import models
    from grpo.rollout import vllm_images

    asked = {"built": [], "published": [], "processor": []}
    monkeypatch.setattr(models, "load_tokenizer", lambda name: asked.setdefault("tokenizer", name) and _Tok())
    monkeypatch.setattr(models, "load_image_processor", lambda name: asked.setdefault("images", name) and images)

    def build(family, vocab, **kw):
        asked["built"].append(StandInForCausalLM(family, vocab, **kw))
        return asked["built"][-1]

    def publish(out, write, complete):
        tmp = out.parent / (out.name + ".tmp")
        tmp.mkdir(parents=True)
        assert not complete(tmp)
        write(tmp)
        assert complete(tmp)
        tmp.rename(out)
        asked["published"].append(out)
        return out

    monkeypatch.setattr(models, "tiny_model", build)
    monkeypatch.setattr(models, "publish_folder", publish)
    monkeypatch.setattr(models, "resolve_path", lambda name: f"/resolved/{name}")
    monkeypatch.setattr(vllm_images, "save_processor", lambda path, tok, img: asked["processor"].append(
        (path, tok, img)) or (Path(path) / "processor.json").write_text("{}"))
    return asked


def test_model_dir_of_a_checkpoint_is_its_resolved_path_with_its_own_weights(tmp_path, monkeypatch):
    from grpo.rollout.server.launch import model_dir

    asked = _stand_ins(monkeypatch)
    assert model_dir(_settings(model="embedded:smollm2-135m-instruct"), tmp_path) == \
        ("/resolved/embedded:smollm2-135m-instruct", False)
    assert model_dir(_settings(model="/ckpt/tiny:x"), tmp_path) == ("/resolved//ckpt/tiny:x", False)
    assert asked["built"] == [] and not (tmp_path / "serve").exists()


def test_model_dir_of_a_tiny_model_is_written_once_under_a_name_of_its_shape(tmp_path, monkeypatch):
    import hashlib

    from grpo.rollout.server.launch import model_dir

    asked = _stand_ins(monkeypatch)
    tiny = {"num_hidden_layers": 2, "hidden_size": 64}
    key = hashlib.sha256(json.dumps(["tiny:llama", tiny], sort_keys=True).encode()).hexdigest()[:12]
    want = tmp_path / "serve" / f"tiny-llama-{key}"
    assert model_dir(_settings(tiny=tiny), tmp_path) == (str(want), True)
    assert asked["tokenizer"] == asked["images"] == "tiny:llama" and asked["published"] == [want]
    (model,) = asked["built"]
    assert model.made == ("llama", 77, tiny)
    assert json.loads((want / "config.json").read_text())["architectures"] == ["StandInForCausalLM"]
    assert sorted(p.name for p in want.iterdir()) == ["config.json", "tokenizer.json"] and asked["processor"] == []
    # the same shape in another key order: the same folder, found again, nothing built
    assert model_dir(_settings(tiny={"hidden_size": 64, "num_hidden_layers": 2}), tmp_path) == (str(want), True)
    assert len(asked["built"]) == 1 and asked["published"] == [want]
    # another shape or family: another folder
    other, _ = model_dir(_settings(tiny={**tiny, "hidden_size": 32}), tmp_path)
    qwen, _ = model_dir(_settings(model="tiny:qwen2", tiny=tiny), tmp_path)
    assert len({other, qwen, str(want)}) == 3 and Path(qwen).name.startswith("tiny-qwen2-")
    assert [m.made[0] for m in asked["built"]] == ["llama", "llama", "qwen2"]


def test_model_dir_of_a_tiny_vision_model_writes_its_processor_with_the_tokenizer(tmp_path, monkeypatch):
    from grpo.rollout.server.launch import model_dir

    images = object()
    asked = _stand_ins(monkeypatch, images=images)
    path, dummy = model_dir(_settings(model="tiny:qwen2_5_vl", tiny={}), tmp_path)
    ((written, tok, given),) = asked["processor"]
    assert dummy and written == str(Path(path).parent / (Path(path).name + ".tmp")) and given is images
    assert isinstance(tok, _Tok)
    assert sorted(p.name for p in Path(path).iterdir()) == ["config.json", "processor.json"]
    assert asked["built"][0].made == ("qwen2_5_vl", 77, {})


def _command(monkeypatch, dummy=False, extra=(), **kw):
    from grpo.rollout.server import launch

    seen = []
    monkeypatch.setattr(launch, "model_dir", lambda s, cache: seen.append((s, cache)) or ("/m", dummy))
    argv, env = launch.serve_command(_settings(**kw), Path("/cache"), list(extra))
    assert seen == [(_settings(**kw), Path("/cache"))]
    return argv, env


BASE_ARGV = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name",
             "tiny:llama", "--host", "127.0.0.1", "--port", "8100", "--dtype", "float32", "--max-model-len", "300",
             "--seed", "3", "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--generation-config",
             "vllm", "--worker-extension-cls", "grpo.rollout.server.worker.GRPOWorkerExtension",
             "--tensor-parallel-size", "1", "--middleware", "grpo.rollout.server.guard.RequireKey"]


def test_the_cpu_command_line_is_vllms_whole_with_every_prompt_prefilled_at_once(monkeypatch):
    argv, env = _command(monkeypatch)
    assert argv == BASE_ARGV + ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "0.5"}
    argv, env = _command(monkeypatch, dummy=True, enforce_eager=False, max_model_len=9000, kv_cache_gib=2.25,
                         extra=["--max-num-seqs", "4"])
    assert argv == [*BASE_ARGV[:14], "9000", *BASE_ARGV[15:], "--load-format", "dummy", "--no-enable-chunked-prefill",
                    "--max-num-batched-tokens", "9000", "--max-num-seqs", "4"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2.25"}
    assert _command(monkeypatch, max_model_len=8192)[0][-1] == "8192"
    assert _command(monkeypatch, max_model_len=8193)[0][-1] == "8193"


def test_the_cuda_command_line_its_nccl_transfer_images_lora_and_key(monkeypatch):
    argv, env = _command(monkeypatch, device="cuda", enforce_eager=False, tensor_parallel_size=2,
                         weight_transfer="nccl", vision=True, lora_rank=8, max_loras=3, api_key="k3y")
    tp = BASE_ARGV.index("--tensor-parallel-size") + 1
    assert argv == [*BASE_ARGV[:tp], "2", *BASE_ARGV[tp + 1:], "--gpu-memory-utilization", "0.9",
                    "--weight-transfer-config", '{"backend": "nccl"}', "--enable-scale-out", "--enable-mm-embeds",
                    "--limit-mm-per-prompt", '{"image": 8, "video": 0}', "--enable-lora", "--max-lora-rank", "8",
                    "--max-loras", "3"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "k3y", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    argv, env = _command(monkeypatch, device="cuda", api_key="")
    assert argv == BASE_ARGV + ["--enforce-eager", "--gpu-memory-utilization", "0.9"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
