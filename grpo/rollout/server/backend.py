"""``rollout.backend=server``: the completions come from vLLM's own OpenAI-compatible servers (`grpo-serve`).

1. **Connect** (at the first rollout): wait for every server's ``/health``; ask each what it serves
   (``/collective_rpc`` -> `GRPOWorkerExtension.grpo_model_info`) and refuse, in one line, a server of another
   model or a shorter max length; join the weight channel; push the trainer's weights.
2. **Generate**: each group is one ``/v1/completions`` request (``n = G`` samples of one prompt given as token
   ids), sent concurrently, a whole group on one server (`ServerPool.pick`); token ids and the sampler's
   log-probs come back. Every group records the weight version that produced it (`Completions.versions`).
3. **Sync** after every optimizer step (or every ``sync_every``): rank 0 streams the weights (each gathered on
   its own under ZeRO-3, LoRA merged: `grpo.rollout.weights.hf_weights`; or the base weights once and then each
   version's adapters: `grpo.rollout.server.adapters`) through the gloo channel
   (`grpo.runtime.transfer`) into the server's in-place ``reload_weights`` (``grpo_receive``), or vLLM's nccl
   transfer on GPUs (`grpo.rollout.server.nccl`); then ``/reset_prefix_cache`` and ``/update_weight_version``.
4. **Check** the sync: the server's prompt log-probs of a fixed sequence against the trainer's own; a gap above
   ``sync_check_tol`` stops the run with one line (a server sampling from stale weights would look plausible).
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from grpo.rollout.base import Completions, Sampling, cut_at_eos, trainer_logprobs
from grpo.rollout.lora_sync import Adapter, adapter_state
from grpo.rollout.server.adapters import ServerAdapters, connect_adapters
from grpo.rollout.server.client import ServerError, ServerPool, group_request, parse_group, prompt_logprobs
from grpo.rollout.weights import hf_weights

MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")


def model_facts(config) -> dict:
    """What a server must agree on with the trainer's model (its config), compared at connect."""
    return {k: getattr(config, k, None) for k in MODEL_KEYS}


class ServerBackend:
    def __init__(self, model, pool: ServerPool, *, model_name: str, facts: dict, eos_ids: list[int],
                 max_model_len: int, check_ids: list[int], tol: float = 1e-3, sync_every: int = 1,
                 transfer=None, full_weights=None, rank: int = 0, barrier=None, all_max=None, device="cpu",
                 lora_sync: str = "auto", lora_keep: int = 1):
        """``transfer``: the weight sender (`GlooTransfer`, `grpo.rollout.server.nccl.NCCLTransfer`), None on a
        rank that does not send. ``barrier``/``all_max``: the runtime's collectives (several training processes:
        every rank syncs, rank 0 sends); ``facts``: `model_facts` of the trainer's model; ``lora_sync``,
        ``lora_keep``: LoRA's sync (rollout.vllm.lora_sync) and the adapter versions kept resident."""
        self.pool, self.model_name, self.eos_ids = pool, model_name, list(eos_ids)
        self.check_ids, self.tol, self.sync_every = list(check_ids), tol, sync_every
        self.transfer, self.full_weights, self.rank = transfer, full_weights, rank
        self.barrier, self.all_max, self.device = barrier or (lambda: None), all_max, device
        self.version: int | None = None     # the weight version the servers hold (None: not pushed yet)
        self.metrics: dict[str, float] = {}  # this step's sync: its time, the version lag, the check's gap
        pool.wait_until_up()
        for s in pool.servers:
            check_server(s, model_name, facts, max_model_len)
        self.adapters: ServerAdapters | None = connect_adapters(
            model, pool.servers, lora_sync, lora_keep, gloo=isinstance(transfer, GlooTransfer) or transfer is None,
            say=pool.say)
        if transfer is not None:
            transfer.connect(pool.servers)

    # ------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync_weights(self, model, version: int) -> None:
        """Push the weights, labelled ``version`` (the trainer's optimizer step count), when ``sync_every`` steps
        have passed since the last push (always the first time), then check the sync. Every training rank calls it
        at the same point."""
        v = int(version)
        self.metrics["server/version_lag"] = float(v - (self.version if self.version is not None else v))
        if self.version is not None and v - self.version < self.sync_every:
            self.metrics["time/sync_s"] = 0.0
            return
        t0 = time.time()
        self.push(self.weights(model), v)
        self.metrics.update({"time/sync_s": time.time() - t0, "server/version_lag": 0.0})
        self.check(model)

    def weights(self, model):
        """What a push of ``model`` sends: its adapter (`Adapter`), after the base weights have gone once (pushed
        here), or every weight (LoRA merged) as a stream."""
        kw = {"full_weights": self.full_weights} if self.full_weights else {}
        if self.adapters is None:
            return hf_weights(model, **kw)
        if not self.adapters.base_loaded:
            self.push(hf_weights(model, merge=False, **kw), self.version if self.version is not None else -1)
            self.adapters.base_loaded = True
        return adapter_state(model, self.full_weights or _whole)

    def served(self) -> str:
        """The model name requests give: the adapter of the version the servers hold, or the base model."""
        if self.adapters is None or self.version is None:
            return self.model_name
        return self.adapters.served(self.model_name, self.version)

    def stats(self) -> dict[str, float]:
        """This step's sync (`sync_weights`: its time and version lag) and the last sync check's gap."""
        return dict(self.metrics)

    def push(self, weights, version: int) -> None:
        """Stream ``weights`` ((HF name, tensor) pairs) into every server and label them ``version``. The
        asynchronous generator (`grpo.rollout.server.generator_thread`) calls it with a snapshot, then `check` with the
        trainer's log-probs of that snapshot."""
        if isinstance(weights, Adapter):
            self.metrics.update({"sync/bytes": float(weights.nbytes), "sync/adapters": 1.0})
            if self.transfer is not None:
                self.adapters.push(weights, version, self.transfer, self.pool.servers, self.model_name)
                for s in self.pool.servers:
                    s.post("/update_weight_version", {"new_version": str(version)})
            self.barrier()
            self.version = version
            return
        weights = _counted(weights, self.metrics)
        try:
            if self.transfer is not None:
                self.transfer.send(weights, self.pool.servers)
                for s in self.pool.servers:
                    s.post("/reset_prefix_cache")  # cached prompt K/V belong to the old weights
                    s.post("/update_weight_version", {"new_version": str(version)})
            else:  # another rank sends; ZeRO-3 gathers each weight on every rank together
                for _ in weights:
                    pass
        finally:
            if hasattr(weights, "close"):
                weights.close()
        self.barrier()  # no rank samples before rank 0's push is done
        self.version = version

    def check(self, model=None, mine: torch.Tensor | None = None) -> float:
        """The largest |log p_server - log p_trainer| over the check sequence's tokens and every server; above
        ``tol``: `ServerError` (the run stops with one line). ``mine``: the trainer's log-probs of the pushed
        weights (`trainer_logprobs`) when ``model`` no longer holds them."""
        ids = self.check_ids
        mine = trainer_logprobs(model, ids, self.device) if mine is None else mine
        gap, worst = 0.0, self.pool.servers[0].url
        for s in self.pool.servers:
            body = {"model": self.served(), "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                    "prompt_logprobs": 0, "return_token_ids": True}
            theirs = torch.tensor(prompt_logprobs(s.post("/v1/completions", body), ids))
            g = float((theirs - mine).abs().max()) if len(theirs) else 0.0
            if g != g or g > gap:  # NaN counts as the worst
                gap, worst = (float("inf") if g != g else g), s.url
        if self.all_max is not None:
            gap = self.all_max({"gap": gap})["gap"]
        self.metrics["server/sync_logprob_gap"] = gap
        if gap > self.tol:
            raise ServerError(f"weight sync check failed: rollout server {worst} scores the check sequence "
                              f"{gap:.3g} away from the trainer (rollout.server.sync_check_tol={self.tol:g}) after "
                              f"pushing weight version {self.version}: it does not sample from the trainer's "
                              "policy")
        return gap

    # ------------------------------------------------------------------------------------ sampling
    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from grpo.rollout.hf import flatten, regroup

        if suffixes is not None:  # each prompt + suffix is a one-sample request
            out = self.generate(flatten(prompt_ids, suffixes), 1, sampling, seed)
            flat = [[g[0] for g in x] for x in (out.ids, out.truncated, out.logprobs)]
            return Completions(*(regroup(x, suffixes) for x in flat), versions=[self.version] * len(prompt_ids))
        # one seed per group: the server seeds a group's G samples seed, seed + 1, ...
        bodies = [group_request(self.served(), p, group_size, sampling, self.eos_ids,
                                None if seed is None else seed + i * group_size) for i, p in enumerate(prompt_ids)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), 64))) as ex:
            answers = list(ex.map(self._one_group, bodies))
        ids, truncated, logps = [], [], []
        for toks, lps in answers:
            gi, gt, gl = [], [], []
            for t, lp in zip(toks, lps):
                kept, cut = cut_at_eos(t, self.eos_ids, sampling.max_new_tokens)
                gi.append(kept)
                gt.append(cut)
                gl.append(torch.tensor(lp[:len(kept)], dtype=torch.float32))
            ids.append(gi)
            truncated.append(gt)
            logps.append(gl)
        return Completions(ids, truncated, logps, versions=[self.version] * len(prompt_ids))

    def _one_group(self, body: dict):
        s = self.pool.pick()
        try:
            return parse_group(s.post("/v1/completions", body))
        finally:
            self.pool.done(s)

    def sleep(self) -> None:  # the servers keep their memory
        pass

    def close(self) -> None:
        """Leave the servers running (another trainer may take them over); drop the weight channel."""
        if self.transfer is not None:
            self.transfer.close()


def check_server(server, model_name: str, facts: dict, max_model_len: int) -> None:
    """Refuse, in one line, a server that serves another model or a shorter max length than the run needs."""
    models = server.get("/v1/models")["data"]
    served = {m["id"]: m for m in models}
    if model_name not in served:
        raise ServerError(f"rollout server {server.url} serves {', '.join(served) or 'nothing'}, not {model_name!r}; "
                          "start it with grpo-serve and the run's recipe")
    info = (server.post("/collective_rpc", {"method": "grpo_model_info"}) or {}).get("results") or [{}]
    theirs = info[0] or {}
    differ = [f"{k}={theirs.get(k)!r} (the trainer's {v!r})" for k, v in facts.items() if theirs.get(k) != v]
    if differ:
        raise ServerError(f"rollout server {server.url} serves another model than the trainer's: {differ[0]}; "
                          "start it with grpo-serve and the run's recipe")
    length = served[model_name].get("max_model_len") or theirs.get("max_model_len") or 0
    if length < max_model_len:
        raise ServerError(f"rollout server {server.url} has max_model_len={length}, the run needs {max_model_len} "
                          "(its longest prompt + rollout.max_new_tokens); start it with grpo-serve and the run's "
                          "recipe or a larger rollout.vllm.max_model_len")


class GlooTransfer:
    """The CPU path: rank 0's gloo channel with every server's worker (`grpo.runtime.transfer.WeightChannel`);
    ``host``: the address the servers reach this process at."""

    def __init__(self, host: str, timeout_s: float = 300.0):
        self.host, self.timeout_s, self.channel = host, timeout_s, None

    def _all(self, servers, call):
        """``call(server)`` on every server in its own thread (each blocks until the channel's collective ends)
        while this thread takes part; the first error (naming its server) is raised after all have ended."""
        errors: list[BaseException] = []
        threads = [threading.Thread(target=lambda s=s: _keep_error(errors, call, s), daemon=True) for s in servers]
        for t in threads:
            t.start()
        return threads, errors

    def connect(self, servers) -> None:
        import json

        from grpo.runtime.transfer import WeightChannel, free_port

        port = free_port(self.host)
        spec = {"host": self.host, "port": port, "world_size": 1 + len(servers), "timeout_s": self.timeout_s}
        threads, errors = self._all(servers, lambda s: s.post("/collective_rpc", {
            "method": "grpo_join", "args": [json.dumps({**spec, "rank": 1 + servers.index(s)})]}))
        try:
            self.channel = WeightChannel(self.host, port, 0, 1 + len(servers), self.timeout_s)
        except RuntimeError as e:
            _join(threads, errors)
            raise ServerError(f"rollout servers {', '.join(s.url for s in servers)} could not join the trainer's "
                              f"weight channel at {self.host}:{port} ({str(e).splitlines()[0][:120]}); set "
                              "rollout.server.trainer_host to an address they reach") from None
        _join(threads, errors)

    def send(self, weights, servers, method: str = "grpo_receive", args: list[str] = ()) -> None:
        """``weights`` into every server's ``method`` (the worker extension's; ``args``: its string arguments)."""
        body = {"method": method, "args": list(args)}
        threads, errors = self._all(servers, lambda s: _received(s.post("/collective_rpc", body), s.url))
        try:
            self.channel.send(weights)
        except RuntimeError as e:
            _join(threads, errors, timeout=10)
            raise ServerError(f"rollout server {servers[0].url if len(servers) == 1 else 'of ' + str(len(servers))} "
                              f"lost the weight channel ({str(e).splitlines()[0][:120]}); restart it and resume "
                              "with trainer.resume=auto") from None
        _join(threads, errors)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def _keep_error(errors: list, call, s) -> None:
    try:
        call(s)
    except BaseException as e:  # noqa: BLE001 - raised in the calling thread
        errors.append(e)


def _join(threads, errors, timeout: float | None = None) -> None:
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]


def _received(answer, url: str) -> None:
    r = ((answer or {}).get("results") or [{}])[0] or {}
    if r.get("missing"):
        raise ServerError(f"rollout server {url}: vLLM parameters the trainer's weights did not fill: "
                          f"{r['missing'][0][:200]}")
    if not r.get("received"):
        raise ServerError(f"rollout server {url} received no weights from the trainer")


def _counted(weights, metrics: dict):
    """``weights`` streamed on, their bytes counted into ``metrics`` (sync/bytes) as they pass."""
    metrics.update({"sync/bytes": 0.0, "sync/adapters": 0.0})
    try:
        for name, t in weights:
            metrics["sync/bytes"] += t.numel() * t.element_size()
            yield name, t
    finally:
        if hasattr(weights, "close"):
            weights.close()


@contextlib.contextmanager
def _whole(params):
    yield False
