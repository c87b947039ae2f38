"""The vLLM rollout backend: an engine in this process, colocated with training (TRL's colocate mode).

- Created once per process from the policy's config only (``load_format="dummy"``, no tokenizer: prompts go in
  as token ids), then the policy's weights are copied in from memory; no checkpoint goes to disk.
- ``sync_weights(model)`` before every rollout after an optimizer step: the trainer's parameters, under their
  Hugging Face names, through the model runner's in-place ``reload_weights`` (vLLM maps q/k/v and gate/up onto
  its fused layers and re-packs the CPU kernels' weights). A name vLLM does not know is an error (ValueError
  from vLLM); a vLLM parameter that received nothing is an error too (`WeightSyncError`). LoRA
  (``rollout.vllm.lora_sync``, `grpo.rollout.lora_sync`): the base weights once, then each version's adapters
  only (a new vLLM adapter per version, the requests naming it); where vLLM cannot serve the adapter, the merged
  weights W + scale * B A per layer (the trainer's own weights are never merged in place). Every sync's bytes and
  seconds are in `stats`, with the sync check: the engine's log-probs of a fixed sequence against the trainer's.
- ``generate``: ``n = G`` samples per prompt with prefix caching (the prompt's KV blocks prefilled once), the
  temperature / top-p / top-k of the rollout config, EOS as stop tokens, a per-call seed, and vLLM's own
  log-prob of every sampled token (``logprobs_mode="processed_logprobs"``: after the temperature, as the
  trainer's log-probs).
- Prompts with images (a vision-language model, ``VLLM_VISION_FAMILIES``): sent with their images as vLLM's multimodal
  inputs, in its embedding form: the trainer's vision tower encodes each prompt's images once (grpo/rollout/
  vllm_images.py says why not vLLM's tower).

vLLM must run in-process for the weight copy: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set here before the engine
starts. On CPU the KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` GiB (``rollout.vllm.kv_cache_gib``).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
import time

import torch

from grpo.engine.unwrap import unwrap_model
from grpo.errors import SetupError
from grpo.rollout.base import Completions, Sampling, cut_at_eos, eos_ids, trainer_logprobs
from grpo.rollout.lora_sync import AdapterSlots, active_adapter, adapter_state, choose, served_rank
from grpo.rollout.vllm_images import (
    MAX_IMAGES_PER_PROMPT,
    VLLM_VISION_FAMILIES,
    check_expanded,
    save_processor,
    tower_features,
    vllm_prompt,
)
from grpo.rollout.weights import as_they_are, counted, hf_weights

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # the model_types tested against our decode loop


class WeightSyncError(RuntimeError):
    """The trainer's weights could not be copied into the vLLM engine exactly."""


class VLLMBackend:
    def __init__(self, model, *, eos_ids: list[int], max_model_len: int, seed: int = 0, device: str = "cpu",
                 gpu_memory_utilization: float = 0.3, kv_cache_gib: float = 1.0, enforce_eager: bool = True,
                 enable_prefix_caching: bool = True, sleep: bool = False, full_weights=None,
                 process_group: tuple[int, int] | None = None, tokenizer=None, image_processor=None,
                 lora_sync: str = "auto", lora_keep: int = 1, check_ids: list[int] | None = None):
        """``tokenizer`` and ``image_processor``: a vision-language model's, which vLLM's input processing loads; a
        text model needs neither. ``full_weights(params)``: the runtime's context manager in which ``params`` hold
        their full values (`grpo.runtime.base.Runtime.full_weights`; ZeRO-3 gathers them). ``process_group``:
        (rank, local_rank) when this process is one of several training processes (DeepSpeed): vLLM then joins the
        runtime's process group as an external launcher (one engine per rank, tensor-parallel 1, each sampling its
        own prompts) and leaves that group alone when it closes. ``lora_sync``: auto | adapters | merged
        (`grpo.rollout.lora_sync`); ``lora_keep``: the adapter versions kept resident; ``check_ids``: the sync
        check's sequence (None: none)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model must live in this process for the sync
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
        self.full_weights = full_weights or as_they_are
        self.shares_process_group = process_group is not None
        from vllm import LLM

        from grpo.rollout.vllm_log import quiet_expected

        quiet_expected()  # the lines every healthy engine of ours prints (grpo/rollout/vllm_log.py)
        base = unwrap_model(model)
        family = getattr(base.config, "model_type", None)
        if family not in FAMILIES + VLLM_VISION_FAMILIES:
            raise ValueError("rollout.backend=vllm supports the model families "
                             f"{', '.join(FAMILIES + VLLM_VISION_FAMILIES)} "
                             f"(this model is {family!r}); use rollout.backend=hf")
        self.eos_ids = list(eos_ids)
        self.sleep_enabled = bool(sleep) and device == "cuda"
        vision = family in VLLM_VISION_FAMILIES
        self.image_token_id = base.config.image_token_id if vision else None
        self._dir = _engine_dir(base, vision, tokenizer, image_processor)
        dtype = str(next(base.parameters()).dtype).replace("torch.", "")
        kwargs = dict(model=self._dir, load_format="dummy", skip_tokenizer_init=not vision, dtype=dtype,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                      enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
                      generation_config="vllm", tensor_parallel_size=1)
        if vision:
            kwargs.update(limit_mm_per_prompt={"image": MAX_IMAGES_PER_PROMPT, "video": 0}, enable_mm_embeds=True)
        if device == "cuda":
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled)
        # the sync check scores text: a prompt's image tokens have no pixels there
        self.adapters, self.metrics = None, {}
        self.check_ids = [t for t in check_ids or [] if t != self.image_token_id]
        if choose(lora_sync, model):
            rank = served_rank(active_adapter(model)[1].r)
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=lora_keep)
        if process_group is not None:  # vLLM reads the rank and the device index (LOCAL_RANK) from the environment
            os.environ["RANK"], os.environ["LOCAL_RANK"] = (str(r) for r in process_group)
            kwargs.update(distributed_executor_backend="external_launcher")
        with _keep_global_rng():  # vLLM seeds python/numpy/torch at start; the trainer's checkpointed streams stay
            self.llm = LLM(**kwargs)
        self.asleep = False
        if kwargs.get("enable_lora"):
            self.adapters = AdapterSlots(self._load_adapter, self.llm.llm_engine.remove_lora, keep=lora_keep)
        self.base_loaded = False
        self.sync_weights(model)

    @classmethod
    def for_runtime(cls, runtime, tokenizer, v, max_model_len: int, seed: int, image_processor=None,
                    **lora) -> "VLLMBackend":
        """One engine for this run's ``runtime``. ``v``: the run's `VLLMConfig` section (rollout.vllm);
        ``max_model_len``: the longest prompt of the data + rollout.max_new_tokens unless rollout.vllm says;
        ``image_processor``: a vision-language model's; ``lora``: lora_keep and check_ids (`__init__`)."""
        rt = runtime
        device = torch.device(rt.device).type
        try:
            return cls(rt.model, eos_ids=eos_ids(unwrap_model(rt.model), tokenizer), max_model_len=max_model_len,
                       seed=seed, device=device, gpu_memory_utilization=v.gpu_memory_utilization,
                       kv_cache_gib=v.kv_cache_gib, enforce_eager=v.enforce_eager,
                       enable_prefix_caching=v.enable_prefix_caching, sleep=v.sleep, full_weights=rt.full_weights,
                       lora_sync=v.lora_sync,
                       process_group=(rt.rank, rt.local_rank) if rt.process_group else None, tokenizer=tokenizer,
                       image_processor=image_processor, **lora)
        except ValueError as e:
            raise SetupError(str(e).splitlines()[0]) from None

    # ------------------------------------------------------------------------------------ weights
    def _runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    @torch.no_grad()
    def sync_weights(self, model, version: int = 0) -> None:
        """Copy the trainer's current weights into the engine (in memory): with adapters, the base weights the first
        time and this version's adapter every time; else every weight (LoRA merged), then drop the prefix cache.
        Then the sync check (`check`)."""
        self.wake()
        self.image_features = tower_features(model) if self.image_token_id is not None else None
        t0, sent = time.perf_counter(), 0
        if self.adapters is None or not self.base_loaded:
            sent += self._reload(model, merge=self.adapters is None)
            self.base_loaded = True
        if self.adapters is not None:
            adapter = adapter_state(model, self.full_weights)
            self.adapters.add(int(version), adapter)
            sent += adapter.nbytes
        self.metrics = {"time/sync_s": time.perf_counter() - t0, "sync/bytes": float(sent),
                        "sync/adapters": float(self.adapters is not None)}
        if self.check_ids:
            self.check(model)

    def _reload(self, model, merge: bool) -> int:
        """Every weight through vLLM's in-place reload; the bytes sent."""
        sent: dict = {}
        weights = counted(hf_weights(model, self.full_weights, merge=merge), sent)
        try:
            with CaptureNotLoaded() as missing:
                self._runner().reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        finally:  # a sync vLLM stopped (a name it refused) releases a gathered weight now, not when collected
            weights.close()
        if missing.messages:
            raise WeightSyncError("vLLM parameters that the trainer's weights did not fill: "
                                  + missing.messages[0][:300])
        if not sent["tensors"]:
            raise WeightSyncError("the trainer's model has no weights to copy into vLLM")
        self.llm.reset_prefix_cache()  # cached prompt K/V belong to the old weights
        return sent["bytes"]

    def _load_adapter(self, path, lora_id: int) -> None:
        from vllm.lora.request import LoRARequest

        self.llm.llm_engine.add_lora(LoRARequest(f"v{lora_id - 1}", lora_id, str(path)))

    def check(self, model) -> float:
        """The sync check: the largest |log p_engine - log p_trainer| over ``check_ids`` (temperature 1), in the
        metrics as vllm/sync_logprob_gap (every rank: the trainer's forward is a collective under ZeRO-3)."""
        mine = trainer_logprobs(model, self.check_ids, next(model.parameters()).device)
        gap = float((self.prompt_logprobs(self.check_ids) - mine).abs().max()) if len(mine) else 0.0
        self.metrics["vllm/sync_logprob_gap"] = gap
        return gap

    def prompt_logprobs(self, ids: list[int], version: int | None = None) -> torch.Tensor:
        """The engine's log-prob of each token of ``ids`` after the first, at temperature 1, with the adapter of
        ``version`` (default: the newest) when adapters are synced."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False,
                                lora_request=self.lora_request(version))[0]
        return torch.tensor([row[t].logprob for t, row in zip(ids[1:], out.prompt_logprobs[1:])])

    def lora_request(self, version: int | None = None):
        """The vLLM LoRARequest of the adapter of ``version`` (default: the newest); None with merged weights."""
        return self.adapters.request(version) if self.adapters is not None else None

    # ------------------------------------------------------------------------------------ sampling
    def sampling_params(self, sampling: Sampling, group_size: int, seed: int | None):
        from vllm import SamplingParams

        greedy = sampling.greedy
        if not greedy and sampling.temperature > 2.0:
            raise ValueError(f"rollout.temperature={sampling.temperature}: vLLM accepts temperatures in [0, 2]; "
                             "use rollout.backend=hf for a higher one")
        return SamplingParams(n=1 if greedy else group_size, temperature=0.0 if greedy else sampling.temperature,
                              top_p=1.0 if greedy else sampling.top_p,
                              top_k=-1 if greedy or sampling.top_k <= 0 else sampling.top_k,
                              max_tokens=sampling.max_new_tokens, stop_token_ids=self.eos_ids, ignore_eos=False,
                              logprobs=0, seed=seed, detokenize=False, skip_special_tokens=False)

    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from vllm.inputs import TokensPrompt

        from grpo.rollout.hf import flatten, regroup

        if suffixes is not None:  # each prompt + suffix is a one-sample request; prefix caching shares the prompt
            out = self.generate(flatten(prompt_ids, suffixes), 1, sampling, seed)
            flat = [[g[0] for g in x] for x in (out.ids, out.truncated, out.logprobs)]
            return Completions(*(regroup(x, suffixes) for x in flat))
        self.wake()
        # one SamplingParams per prompt: vLLM seeds a prompt's G samples seed, seed + 1, ..., so one seed for the
        # whole call would give every prompt's j-th sample the same random stream
        params = [self.sampling_params(sampling, group_size, None if seed is None else seed + i * group_size)
                  for i in range(len(prompt_ids))]
        prompts = [TokensPrompt(**vllm_prompt(p, self.image_token_id, self.image_features)) for p in prompt_ids]
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request())
        ids, truncated, logps = [], [], []
        for out, p in zip(outs, prompt_ids):
            if self.image_token_id is not None:
                check_expanded(out.prompt_token_ids, p)
            gi, gt, gl = [], [], []
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks, cut = cut_at_eos(list(c.token_ids), self.eos_ids, sampling.max_new_tokens)
                lp = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                      for d, t in zip(c.logprobs or [], toks)]
                gi.append(toks)
                gt.append(cut)
                gl.append(torch.tensor(lp, dtype=torch.float32))
            ids.append(gi)
            truncated.append(gt)
            logps.append(gl)
        return Completions(ids, truncated, logps)

    def stats(self) -> dict[str, float]:
        """The last sync: its seconds, bytes, whether it sent adapters, the sync check's gap."""
        return dict(self.metrics)

    # ------------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """CUDA with rollout.vllm.sleep: free the KV cache and offload the weights while the policy updates."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                _shutdown(llm, keep_process_group=self.shares_process_group)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            del llm
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)


def make(ctx) -> VLLMBackend:
    """``rollout.backend=vllm`` (`grpo.rollout.registry`): ``ctx`` a `BackendContext`; the engine's max length is
    rollout.vllm.max_model_len, or the data's longest prompt + rollout.max_new_tokens."""
    r = ctx.rollout
    from grpo.models import load_image_processor

    max_len = r.vllm.max_model_len or ctx.longest_prompt + r.max_new_tokens
    return VLLMBackend.for_runtime(ctx.runtime, ctx.tokenizer, r.vllm, max_len, ctx.seed,
                                   image_processor=load_image_processor(ctx.model_name),
                                   lora_keep=r.max_staleness + 1, check_ids=ctx.check_ids)


def _engine_dir(base, vision: bool, tokenizer, image_processor) -> str:
    """A new folder vLLM builds its engine from: ``base``'s config (the weights are copied from memory), and for a
    vision-language model its tokenizer and image processor, which vLLM's input processing loads."""
    path = tempfile.mkdtemp(prefix="grpo-vllm-")
    config = copy.deepcopy(base.config)
    # the class vLLM must build; a model made from a config (not a checkpoint) has none recorded, and vLLM
    # would then guess (a tiny qwen3 became a pooling model)
    config.architectures = [type(base).__name__]
    config.save_pretrained(path)
    if vision:
        if tokenizer is None or image_processor is None:
            raise ValueError(f"a {base.config.model_type} model needs its tokenizer and image processor for vLLM")
        save_processor(path, tokenizer, image_processor)
    return path


def _shutdown(llm, keep_process_group: bool) -> None:
    """Stop the in-process engine. Its own shutdown (also run when the engine is garbage-collected) destroys
    torch's default process group; with a training runtime's group that would end the run's collectives, so then
    the engine's finaliser is detached and only the engine and vLLM's own groups are torn down."""
    client = llm.llm_engine.engine_core  # vLLM's in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    if not keep_process_group:
        client.shutdown()
        return
    client._finalizer.detach()
    core = client.engine_core
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    from vllm.distributed import destroy_model_parallel

    destroy_model_parallel()  # vLLM's tensor/pipeline groups; its world group stays for a later engine


@contextlib.contextmanager
def _keep_global_rng():
    import random

    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


class CaptureNotLoaded(logging.Handler):
    """Collects vLLM's "weights were not loaded" warning during a reload (vLLM only logs it)."""

    LOGGER = "vllm.model_executor.model_loader.reload.inplace"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "not loaded" in msg:
            self.messages.append(msg)

    def __enter__(self):
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)
        return False
