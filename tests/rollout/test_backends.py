"""The rollout backend interface with our decode loop behind it (no vLLM needed)."""
import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.backends import HFBackend, Sampling, step_seed
from grpo.rollout.hf import generate
from grpo.rollout.registry import resolve, vllm_available


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
